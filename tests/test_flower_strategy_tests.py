"""Flower's own strategy tests, run on fedge's classes and Flower's side by side (issue 39, item 3).

Part 1 ports the tests Flower ships for the strategies fedge also offers (``fedavgm_test.py``,
``fedopt_test.py``, ``fedmedian_test.py``, ``fedtrimmedavg_test.py``, ``multikrum_test.py``
in ``flwr/serverapp/strategy``): the same arrays, calls and expected values, each test run
with ``fedge.strategies``' class and with Flower's. Replies are real Flower Messages (Flower's
tests use a ``Mock(spec=Message)``, whose node id is a Mock). Where fedge differs on purpose
(docs/flower-dropin.md: its adaptive steps are the paper's; a reply that does not match the
global model is rejected, not an error) the expected value is written for each.

Part 2 checks Flower's public attributes: ``current_arrays`` (the global model a server
step starts from), settings changed after construction, ``weighted_by_key``, the optimisers' state.
"""

from __future__ import annotations

from typing import Any

import flwr.serverapp.strategy as flower_strategies
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.exception import AggregationError

import fedge.strategies as fedge_strategies

IMPLEMENTATIONS = ["fedge", "flower"]


def build(implementation: str, name: str, **kwargs: Any) -> Any:
    """``name`` (a Flower strategy name) from fedge or from Flower, built with Flower's call."""
    module = fedge_strategies if implementation == "fedge" else flower_strategies
    return getattr(module, name)(**kwargs)


def reply(node: int, arrays: list[np.ndarray], num_examples: float, **metrics: float) -> Message:
    """A standard Flower train reply from ``node``: ``arrays`` (named "0", "1", ... as Flower's
    ``ArrayRecord(list)`` names them) and ``num-examples``."""
    instruction = Message(RecordDict(), dst_node_id=node, message_type="train")
    instruction.metadata.__dict__["_message_id"] = instruction.object_id
    content = RecordDict({"arrays": ArrayRecord(arrays),
                          "metrics": MetricRecord({"num-examples": num_examples, **metrics})})
    message = Message(content, reply_to=instruction)
    message.metadata.__dict__["_src_node_id"] = node
    return message


def numpy(record: ArrayRecord | None) -> list[np.ndarray]:
    assert record is not None
    return record.to_numpy_ndarrays()


# --- Part 1: Flower's tests ---------------------------------------------------------------------

def _fedavgm_case(implementation: str) -> tuple[Any, list[Message], list[np.ndarray]]:
    """fedavgm_test's ``_prepare_strategy``: two replies weighted 1 and 2, the global model at 0."""
    replies = [reply(1, [np.array([[1, 2, 3], [4, 5, 6]], np.float32), np.array([7, 8, 9, 10], np.float32)], 1),
               reply(2, [np.array([[29, 23, 19], [17, 13, 11]], np.float32), np.array([7, 5, 3, 2], np.float32)], 2)]
    expected = [np.array([[59, 48, 41], [38, 31, 28]]) / 3,  # (1 * first + 2 * second) / 3
                np.array([21, 18, 15, 14]) / 3]
    strategy = build(implementation, "FedAvgM")
    strategy.current_arrays = ArrayRecord([np.zeros((2, 3), np.float32), np.zeros(4, np.float32)])
    return strategy, replies, expected


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fedavgm_aggregate_fit_using_near_one_server_lr_and_no_momentum(implementation: str) -> None:
    # Prepare
    strategy, replies, expected = _fedavgm_case(implementation)
    strategy.server_learning_rate = 1.0 + 1e-9
    # Execute
    actual, _ = strategy.aggregate_train(1, replies)
    # Assert
    for got, want in zip(numpy(actual), expected, strict=True):
        np.testing.assert_almost_equal(got, want, decimal=5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fedavgm_aggregate_fit_server_learning_rate_and_momentum(implementation: str) -> None:
    # Prepare
    strategy, replies, expected = _fedavgm_case(implementation)
    strategy.server_learning_rate, strategy.server_momentum = 1.0 + 1e-9, 1e-9
    # Execute: two rounds (the second updates the momentum)
    strategy.aggregate_train(1, replies)
    actual, _ = strategy.aggregate_train(2, replies)
    # Assert
    for got, want in zip(numpy(actual), expected, strict=True):
        np.testing.assert_almost_equal(got, want, decimal=5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fedavgm_aggregate_fit_with_scalar_weights(implementation: str) -> None:
    # Prepare: a server learning rate other than 1 (a step from current_arrays), 0-d arrays
    strategy = build(implementation, "FedAvgM", server_learning_rate=1.0 + 1e-9)
    strategy.current_arrays = ArrayRecord([np.array(0.0)])
    replies = [reply(1, [np.array(1.0)], 1), reply(2, [np.array(3.0)], 2)]
    # Execute
    actual, _ = strategy.aggregate_train(1, replies)
    # Assert: (1 * 1 + 2 * 3) / 3, still 0-d
    (scalar,) = numpy(actual)
    assert scalar.shape == ()
    np.testing.assert_allclose(scalar, 7.0 / 3.0, rtol=1e-6)


# One step of each adaptive rule from current_arrays = 1 towards a reply of 2 (delta = 1 everywhere), with
# Flower's defaults. fedge's is the paper's (v starts at tau^2, no bias correction); Flower's starts v at 0
# and FedAdam corrects the bias (round 1: eta * sqrt(1 - beta_2^2) / (1 - beta_1^2)).
ADAPTIVE_STEP = {
    ("fedge", "FedAdam"): 1 + 0.1 * 0.1 / (np.sqrt(0.99 * 1e-6 + 0.01) + 1e-3),
    ("flower", "FedAdam"): 1 + 0.1 * np.sqrt(1 - 0.99**2) / (1 - 0.9**2) * 0.1 / (np.sqrt(0.01) + 1e-3),
    ("fedge", "FedYogi"): 1 + 0.01 * 0.1 / (np.sqrt(1e-6 + 0.01) + 1e-3),  # v = tau^2 - 0.01 sign(tau^2 - 1)
    ("flower", "FedYogi"): 1 + 0.01 * 0.1 / (np.sqrt(0.01) + 1e-3),
    ("fedge", "FedAdagrad"): 1 + 0.1 * 1 / (np.sqrt(1e-6 + 1) + 1e-3),  # beta_1 = 0: m = delta
    ("flower", "FedAdagrad"): 1 + 0.1 * 1 / (np.sqrt(1) + 1e-3),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", ["FedAdam", "FedYogi", "FedAdagrad"])
@pytest.mark.parametrize(("case", "aggregated"), [
    ("same names and shapes", [np.full((7, 3), 2.0) for _ in range(4)]),
    ("one array more", [np.full((7, 3), 2.0) for _ in range(5)]),
    ("other shapes", [np.full((7, 5), 2.0) for _ in range(4)]),
])
def test_fedopt_steps_from_current_arrays_and_refuses_what_does_not_match(
        implementation: str, name: str, case: str, aggregated: list[np.ndarray]) -> None:
    # Prepare: fedopt_test's cases, through aggregate_train (the aggregate is the one reply's arrays)
    strategy = build(implementation, name)
    strategy.current_arrays = {key: array.numpy()
                               for key, array in ArrayRecord([np.ones((7, 3)) for _ in range(4)]).items()}
    replies = [reply(1, aggregated, 3)]
    if case == "same names and shapes":
        # Execute
        actual, _ = strategy.aggregate_train(1, replies)
        # Assert: a step from current_arrays (1), not the replies' mean (2)
        for array in numpy(actual):
            np.testing.assert_allclose(array, np.full((7, 3), ADAPTIVE_STEP[implementation, name]), rtol=1e-12)
    elif implementation == "flower":
        # Execute / Assert: Flower stops the round
        with pytest.raises(AggregationError):
            strategy.aggregate_train(1, replies)
    else:
        # Execute
        actual, _ = strategy.aggregate_train(1, replies)
        # Assert: fedge rejects the reply that does not match the global model, named, and keeps the model
        assert actual is None
        (rejected,) = strategy.reports[-1].rejected
        assert rejected.node_id == 1
        assert ("extra ['4']" if case == "one array more" else "shape") in rejected.reason


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fedmedian_aggregate_fit(implementation: str) -> None:
    # Prepare
    strategy = build(implementation, "FedMedian")
    replies = [reply(1, [np.array([1.0, 0.2, 0.5, 1.0])], 5), reply(2, [np.array([0.2, 0.5, 1.0, 0.2])], 2),
               reply(3, [np.array([0.5, 1.0, 0.2, 0.5])], 9)]
    # Execute
    actual, _ = strategy.aggregate_train(1, replies)
    # Assert: the coordinate-wise median
    np.testing.assert_equal(numpy(actual)[0], np.array([0.5, 0.5, 0.5, 0.5]))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fedtrimmedavg_aggregate_fit(implementation: str) -> None:
    # Prepare
    strategy = build(implementation, "FedTrimmedAvg", beta=0.25)
    replies = [reply(1, [np.array([0.5, 0.5, 0.5, 0.5])], 1), reply(2, [np.array([1.0, 0.2, 0.5, 1.0])], 5),
               reply(3, [np.array([0.2, 0.5, 1.0, 0.2])], 2), reply(4, [np.array([0.5, 1.0, 0.2, 0.5])], 9)]
    # Execute
    actual, _ = strategy.aggregate_train(1, replies)
    # Assert: one value cut from each end of every coordinate, the middle two averaged
    np.testing.assert_equal(numpy(actual)[0], np.array([0.5, 0.5, 0.5, 0.5]))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fedtrimmedavg_aggregate_fit_with_scalar_weights(implementation: str) -> None:
    # Prepare
    strategy = build(implementation, "FedTrimmedAvg", beta=0.25)
    replies = [reply(node, [np.array(value)], 1) for node, value in enumerate([0.5, 1.0, 2.0, 100.0], start=1)]
    # Execute
    actual, _ = strategy.aggregate_train(1, replies)
    # Assert: (1.0 + 2.0) / 2, still 0-d
    (scalar,) = numpy(actual)
    assert scalar.shape == ()
    np.testing.assert_equal(scalar, np.array(1.5))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_krum_aggregate_train(implementation: str) -> None:
    # Prepare
    strategy = build(implementation, "Krum", num_malicious_nodes=1)
    replies = [reply(node, [np.full(4, value)], 5) for node, value in enumerate([0.2, 0.7, 1.0], start=1)]
    # Execute
    actual, _ = strategy.aggregate_train(server_round=1, replies=replies)
    # Assert: 0.7, the reply closest to its nearest neighbour (0.5 away at most; 0.2 and 1.0 are 0.8 apart)
    assert actual is not None and actual.object_id == ArrayRecord([np.full(4, 0.7)]).object_id


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_multikrum_aggregate_train(implementation: str) -> None:
    # Prepare
    strategy = build(implementation, "MultiKrum", num_malicious_nodes=1, num_nodes_to_select=2)
    replies = [reply(node, [np.full(4, value)], 5) for node, value in enumerate([0.2, 0.5, 1.0], start=1)]
    # Execute
    actual, _ = strategy.aggregate_train(server_round=1, replies=replies)
    # Assert: the two best scored (0.2 and 0.5) averaged
    assert actual is not None and actual.object_id == ArrayRecord([np.full(4, 0.35)]).object_id


# --- Part 2: Flower's public attributes ----------------------------------------------------------

class _TwoNodes:
    """The one Grid call configure_train makes, for Flower's class and fedge's."""

    def get_node_ids(self) -> list[int]:
        return [1, 2]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("name", "kwargs"), [("FedAvgM", {"server_momentum": 0.9}), ("FedAdam", {}),
                                              ("FedYogi", {}), ("FedAdagrad", {}),
                                              ("QFedAvg", {"client_learning_rate": 0.1})])
def test_current_arrays_reads_back_the_model_configure_train_sent(implementation: str, name: str,
                                                                  kwargs: dict[str, Any]) -> None:
    # Prepare
    strategy = build(implementation, name, **kwargs)
    sent = ArrayRecord({"w": Array(np.array([1.0, 2.0], np.float32))})
    # Execute
    strategy.configure_train(1, sent, ConfigRecord(), _TwoNodes())
    # Assert: as Flower keeps it: a dict of numpy arrays for the FedOpt family, an ArrayRecord otherwise
    current = strategy.current_arrays
    if name in {"FedAdam", "FedYogi", "FedAdagrad"}:
        assert isinstance(current, dict) and list(current) == ["w"]
        np.testing.assert_array_equal(current["w"], [1.0, 2.0])
    else:
        assert isinstance(current, ArrayRecord)
        np.testing.assert_array_equal(current["w"].numpy(), [1.0, 2.0])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fedavgm_steps_on_from_its_own_result_and_keeps_flowers_momentum_buffer(implementation: str) -> None:
    # Prepare: the global model at 0, both rounds' replies at 1; momentum 0.5, learning rate 1
    strategy = build(implementation, "FedAvgM", server_momentum=0.5)
    strategy.current_arrays = ArrayRecord([np.array([0.0])])
    replies = [reply(1, [np.array([1.0])], 4)]
    # Execute: two aggregate_train calls, no configure_train between them
    first, _ = strategy.aggregate_train(1, replies)
    second, _ = strategy.aggregate_train(2, replies)
    # Assert: round 1 moves 0 -> 1 (buffer 0 - 1 = -1); round 2 starts from 1, where the replies add
    # nothing: buffer 0.5 * -1 + 0 = -0.5, 1 - (-0.5) = 1.5; current_arrays is that model
    assert first is not None and second is not None
    np.testing.assert_allclose(numpy(first)[0], [1.0])
    np.testing.assert_allclose(numpy(second)[0], [1.5])
    np.testing.assert_allclose(numpy(strategy.current_arrays)[0], [1.5])
    np.testing.assert_allclose(strategy.momentum_vector[0], [-0.5])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_qfedavg_steps_from_current_arrays(implementation: str) -> None:
    # Prepare: q = 1, L = 1 / 1; the global model at 0, one reply at 1 with loss 1
    strategy = build(implementation, "QFedAvg", client_learning_rate=1.0, q=1.0)
    strategy.current_arrays = ArrayRecord([np.array([0.0])])
    replies = [reply(1, [np.array([1.0])], 4, train_loss=1.0)]
    # Execute
    actual, _ = strategy.aggregate_train(1, replies)
    # Assert: Delta = L (0 - 1) = -1, h = q ||Delta||^2 + L = 2: 0 - (-1) / 2 = 0.5 (the reply alone: 1)
    np.testing.assert_allclose(numpy(actual)[0], [0.5], rtol=1e-9)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("name", "kwargs", "change", "values", "expected"), [
    # FedAvgM from 0 towards 2 with momentum 0.9: the first buffer is 0 - 2 = -2; lr 0.5: 0 + 0.5 * 2 = 1
    ("FedAvgM", {"server_momentum": 0.9}, {"server_learning_rate": 0.5}, [2.0, 2.0], 1.0),
    # MultiKrum keeping 2 of 0.2, 0.5, 1.0: (0.2 + 0.5) / 2 (Flower's default keeps 1: 0.2)
    ("MultiKrum", {"num_malicious_nodes": 1}, {"num_nodes_to_select": 2}, [0.2, 0.5, 1.0], 0.35),
    # one of four cut from each end: (1 + 2) / 2 (beta 0: the mean, 25.875)
    ("FedTrimmedAvg", {"beta": 0.0}, {"beta": 0.25}, [0.5, 1.0, 2.0, 100.0], 1.5),
])
def test_a_setting_changed_after_construction_is_used(implementation: str, name: str, kwargs: dict[str, Any],
                                                      change: dict[str, float], values: list[float],
                                                      expected: float) -> None:
    # Prepare
    strategy = build(implementation, name, **kwargs)
    strategy.current_arrays = ArrayRecord([np.array([0.0])])
    for attribute, value in change.items():
        setattr(strategy, attribute, value)
    replies = [reply(node, [np.array([value])], 1) for node, value in enumerate(values, start=1)]
    # Execute
    actual, _ = strategy.aggregate_train(1, replies)
    # Assert
    np.testing.assert_allclose(numpy(actual)[0], [expected], rtol=1e-9)


def test_flowers_names_for_fedges_settings_are_one_value() -> None:
    # Prepare
    adam = fedge_strategies.FedAdam(eta=0.3, beta_1=0.8)
    krum = fedge_strategies.Krum(num_malicious_nodes=1)
    # Execute: one name written, the other read
    adam.beta_2, adam.server_learning_rate, krum.num_byzantine = 0.5, 0.2, 2
    # Assert: both names, and the rule that steps, hold the one value
    assert (adam.eta, adam.beta1, adam.beta2, adam.rule.server_learning_rate, adam.rule.beta2) == (0.2, 0.8, 0.5,
                                                                                                  0.2, 0.5)
    assert (krum.num_malicious_nodes, krum.rule.num_byzantine) == (2, 2)


def test_fedadam_settings_and_moments_under_flowers_names_are_the_step_it_takes() -> None:
    # Prepare: eta 1, beta_1 0 (m = delta), tau 0; moments given as Flower keeps them (v from a round before)
    strategy = fedge_strategies.FedAdam()
    strategy.eta, strategy.beta_1, strategy.tau = 1.0, 0.0, 0.0
    strategy.current_arrays = {"0": np.array([0.0])}
    strategy.v_t = {"0": np.array([4.0])}
    # Execute: the reply at 1: delta = 1
    actual, _ = strategy.aggregate_train(1, [reply(1, [np.array([1.0])], 5)])
    # Assert: v = 0.99 * 4 + 0.01 * 1 = 3.97; w = 0 + 1 * 1 / sqrt(3.97); m_t, v_t read back
    np.testing.assert_allclose(numpy(actual)[0], [1 / np.sqrt(3.97)], rtol=1e-9)
    np.testing.assert_allclose(strategy.m_t["0"], [1.0])
    np.testing.assert_allclose(strategy.v_t["0"], [3.97])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_weighted_by_key_set_after_construction_weights_the_replies(implementation: str) -> None:
    # Prepare: weights under "n", set after construction
    strategy = build(implementation, "FedAvg")
    strategy.weighted_by_key = "n"
    replies = [reply(1, [np.array([1.0])], 4, n=1), reply(2, [np.array([5.0])], 8, n=3)]
    # Execute
    actual, metrics = strategy.aggregate_train(1, replies)
    # Assert: (1 * 1 + 3 * 5) / 4 = 4 (by num-examples: 44 / 12); the metrics weighted by n: (4 + 3 * 8) / 4
    np.testing.assert_allclose(numpy(actual)[0], [4.0])
    assert metrics is not None and dict(metrics) == {"num-examples": 7.0}
