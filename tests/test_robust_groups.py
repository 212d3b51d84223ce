"""Robust rules over group means (issue 42 §1): median, trimmed mean, Krum/Multi-Krum and Bulyan run over
groups' means (a gateway's reply, or one secure-aggregation group of ``secure-groups = K``) as SHARE does
(Velicheti, Xia and Koyejo 2021), and are refused at start when the groups cannot meet the rule's own bound.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge import wire
from fedge.clients.secure import add_secure_handlers
from fedge.config import resolve_run_config
from fedge.errors import ConfigError
from fedge.server.app import build_strategy
from fedge.simulation.grid import InlineGrid
from fedge.simulation.runner import simulate
from fedge.strategies.bulyan import BulyanSelection
from fedge.strategies.drivers.secure import SecureAggregation
from fedge.strategies.drivers.secure_groups import SecureGroups, split_groups
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.krum import KrumSelection
from fedge.strategies.median import CoordinateMedian, Median
from fedge.strategies.rule import RoundContext, Rule, Update
from fedge.strategies.selection import RandomSelector
from fedge.strategies.trimmed_mean import Trimmed
from tests.replies import global_arrays, good_arrays, train_reply

# Hand-built group means (x, y): four honest groups and one hostile group, and two more honest ones for Bulyan
HONEST = [(1.0, 10.0), (2.0, 20.0), (3.0, 30.0), (7.0, 40.0)]
HOSTILE = (100.0, -100.0)
MORE_HONEST = [(5.0, 50.0), (4.0, 35.0)]


def _over_groups(rule: Rule, means: list[tuple[float, float]]) -> np.ndarray:
    """``rule``'s result over ``means`` (one update per group, each weighing 100 examples), from a zero model."""
    rule.begin(RoundContext({"w": np.zeros(2)}))
    for index, mean in enumerate(means):
        rule.fold(Update(index, {"w": np.array(mean)}, 100.0))
    result = rule.result()
    assert result is not None
    return result["w"]


def test_the_median_over_five_group_means_ignores_the_hostile_group() -> None:
    # Prepare: x = 1, 2, 3, 7, 100 and y = 10, 20, 30, 40, -100
    rule = CoordinateMedian()
    # Execute
    result = _over_groups(rule, [*HONEST, HOSTILE])
    # Assert: the middle of each coordinate, 3 and 20; each group's update norm is kept (its distance from 0)
    np.testing.assert_allclose(result, [3.0, 20.0])
    assert rule.norms[1] == pytest.approx(np.hypot(2.0, 20.0)) and rule.norms[4] == pytest.approx(np.hypot(100, 100))


def test_the_trimmed_mean_over_five_group_means_cuts_one_group_at_each_end() -> None:
    # Prepare: trim-fraction 0.2 over 5 groups cuts floor(0.2 x 5) = 1 value at each end of each coordinate
    rule = Trimmed(trim_fraction=0.2)
    # Execute
    result = _over_groups(rule, [*HONEST, HOSTILE])
    # Assert: x keeps 2, 3, 7 (mean 4); y keeps 10, 20, 30 (mean 20)
    np.testing.assert_allclose(result, [4.0, 20.0])


def test_krum_over_five_group_means_picks_the_group_closest_to_its_neighbours() -> None:
    # Prepare: f = 1, so each score sums the squared distances to the n - f - 2 = 2 nearest groups:
    # (1,10): 101 + 404 = 505; (2,20): 101 + 101 = 202; (3,30): 101 + 116 = 217; (7,40): 116 + 425 = 541;
    # the hostile group is ~10^4 away from every other
    krum, multi = KrumSelection(num_byzantine=1, num_selected=1), KrumSelection(num_byzantine=1, num_selected=2)
    # Execute
    picked, averaged = _over_groups(krum, [*HONEST, HOSTILE]), _over_groups(multi, [*HONEST, HOSTILE])
    # Assert: Krum keeps (2, 20); Multi-Krum with m = 2 averages (2, 20) and (3, 30)
    np.testing.assert_allclose(picked, [2.0, 20.0])
    np.testing.assert_allclose(averaged, [2.5, 25.0])


def test_bulyan_over_seven_group_means_selects_five_then_averages_three_around_the_median() -> None:
    # Prepare: f = 1, n = 7 = 4f + 3. Scores (4 nearest, squared): (4,35) 515, (3,30) 647, (7,40) 679,
    # (2,20) 856, (5,50) 1643, (1,10) 2075, the hostile one ~10^5: the 5 = n - 2f lowest are kept;
    # per coordinate the 3 = 5 - 2f values closest to the median: x 4, 3, 5 (of 2, 3, 4, 5, 7), y 35, 30, 40
    rule = BulyanSelection(num_byzantine=1)
    # Execute
    result = _over_groups(rule, [*HONEST, *MORE_HONEST, HOSTILE])
    # Assert
    np.testing.assert_allclose(result, [4.0, 35.0])


def test_the_rules_take_group_means_unweighted() -> None:
    # Prepare: the hostile group claims a million examples (a gateway's size is its own claim)
    rule = CoordinateMedian()
    rule.begin(RoundContext({"w": np.zeros(2)}))
    for index, mean in enumerate([*HONEST, HOSTILE]):
        rule.fold(Update(index, {"w": np.array(mean)}, 1e6 if mean == HOSTILE else 100.0))
    # Execute / Assert: the same median as with equal sizes
    result = rule.result()
    assert result is not None
    np.testing.assert_allclose(result["w"], [3.0, 20.0])


# --------------------------------------------------------------------------- refused at start, or taken
REFUSED = [
    ({"gateways": True, "strategy": "median", "clients-per-round": 2}, "n >= 3 for one"),
    ({"gateways": True, "strategy": "trimmed-mean", "clients-per-round": 4}, "trim-fraction = 0.2: n >= 5"),
    ({"gateways": True, "strategy": "trimmed-mean", "trim-fraction": 0.0, "clients-per-round": 20},
     "trim-fraction = 0 cuts nothing"),
    ({"gateways": True, "strategy": "krum", "num-byzantine": 2, "clients-per-round": 6}, "n > 2f + 2 = 6"),
    ({"gateways": True, "strategy": "krum", "num-byzantine": 1, "krum-select": 5, "clients-per-round": 5},
     "n >= m + f = 6"),
    ({"gateways": True, "strategy": "bulyan", "num-byzantine": 1, "clients-per-round": 6}, "4f + 3 = 7"),
    ({"secure-aggregation": True, "secure-groups": 2, "strategy": "median", "clients-per-round": 12},
     "n >= 3 for one, but there are 2 secure groups"),
    ({"secure-aggregation": True, "secure-groups": 6, "strategy": "krum", "num-byzantine": 2,
      "clients-per-round": 30}, "n > 2f + 2 = 6"),
    ({"secure-aggregation": True, "secure-groups": 10, "strategy": "bulyan", "num-byzantine": 2,
      "clients-per-round": 40}, "n >= 4f + 3 = 11"),
    ({"secure-aggregation": True, "secure-groups": 4, "strategy": "median", "clients-per-round": 10},
     "each group needs at least 3 devices"),
    ({"secure-aggregation": True, "secure-groups": 3, "strategy": "fednova", "clients-per-round": 12},
     "FedNova's NormalisedMean is neither"),
    ({"secure-groups": 3, "strategy": "median", "clients-per-round": 12}, "needs secure-aggregation = true"),
    ({"gateways": True, "secure-aggregation": True, "secure-groups": 3, "strategy": "median",
      "clients-per-round": 12}, "no gateways"),
    ({"secure-aggregation": True, "strategy": "median", "clients-per-round": 12},
     "run it over the means of secure groups: secure-groups = K (K >= 3"),
]
TAKEN = [
    ({"gateways": True, "strategy": "median", "clients-per-round": 3}, "SyncDriver"),
    ({"gateways": True, "secure-aggregation": True, "strategy": "trimmed-mean", "clients-per-round": 5}, "SyncDriver"),
    ({"gateways": True, "strategy": "krum", "num-byzantine": 1, "clients-per-round": 5}, "SyncDriver"),
    ({"gateways": True, "strategy": "krum", "num-byzantine": 1, "krum-select": 3, "clients-per-round": 5},
     "SyncDriver"),
    ({"gateways": True, "secure-aggregation": True, "strategy": "bulyan", "num-byzantine": 1,
      "clients-per-round": 7}, "SyncDriver"),
    ({"secure-aggregation": True, "secure-groups": 3, "strategy": "median", "clients-per-round": 9}, "SecureGroups"),
    ({"secure-aggregation": True, "secure-groups": 7, "strategy": "bulyan", "num-byzantine": 1,
      "clients-per-round": 21}, "SecureGroups"),
    ({"secure-aggregation": True, "secure-groups": 3, "strategy": "fedavg", "clients-per-round": 9}, "SecureGroups"),
]


@pytest.mark.parametrize(("overrides", "reason"), REFUSED, ids=[str(o) for o, _ in REFUSED])
def test_groups_that_cannot_meet_the_rules_bound_are_refused_at_start_naming_it(overrides: dict[str, Any],
                                                                                 reason: str) -> None:
    # Prepare
    config = resolve_run_config(overrides)
    # Execute / Assert: one line, naming the bound
    with pytest.raises(ConfigError, match=re.escape(reason)) as refused:
        build_strategy(config, 50)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(("overrides", "driver"), TAKEN, ids=[str(o) for o, _ in TAKEN])
def test_robust_rules_compose_with_gateways_and_secure_groups(overrides: dict[str, Any], driver: str) -> None:
    # Execute
    strategy = build_strategy(resolve_run_config(overrides), 50)
    # Assert
    assert type(strategy.driver).__name__ == driver


def test_random_groups_have_at_least_three_devices_and_cover_the_round() -> None:
    # Execute
    groups = split_groups(list(range(20)), 6, seed=1)
    few = split_groups(list(range(7)), 6, seed=1)
    # Assert: 20 devices in 6 groups of 3 or 4; 7 devices make 2 groups (of 3 and 4), not 6
    assert sorted(len(group) for group in groups) == [3, 3, 3, 3, 4, 4]
    assert sorted(node for group in groups for node in group) == list(range(20))
    assert sorted(len(group) for group in few) == [3, 4]
    assert split_groups(list(range(20)), 6, seed=1) == groups and split_groups(list(range(20)), 6, seed=2) != groups


# --------------------------------------------------------------------------- through gateways
def _gateway_reply(node: int, value: float, devices: int) -> Message:
    """A gateway's secure pool sum: the mean of ``devices`` devices' models, all entries ``value``."""
    reply = train_reply(node, good_arrays(value), num_examples=100 * devices)
    meta = reply.content[wire.REPLY_META]
    assert isinstance(meta, ConfigRecord)
    meta[wire.AGGREGATE_OF] = meta[wire.SECURE_POOL] = devices
    reply.metadata.__dict__["_src_node_id"] = node
    return reply


@pytest.mark.parametrize(("strategy", "moved"), [("median", False), ("fedavg", True)])
def test_one_hostile_gateway_is_bounded_by_the_median_over_gateways(strategy: str, moved: bool) -> None:
    # Prepare: five gateways' secure pools of 4 devices, four honest (entries 0.1 .. 0.4), one whose pool
    # holds a boosted update (entries 2.0, under max-update-norm's 10 for the 9-entry model: 6.0)
    config = resolve_run_config({"gateways": True, "secure-aggregation": True, "strategy": strategy,
                                 "clients-per-round": 5, "min-train-replies": 1})
    coordinator = build_strategy(config)
    coordinator.current_arrays = global_arrays()
    replies = [_gateway_reply(node, value, 4) for node, value in [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 2.0)]]
    # Execute
    new, _ = coordinator.aggregate_train(1, replies)
    # Assert: the median over gateways is 0.3, within the honest gateways' range; FedAvg over the same
    # gateways moves to (0.1 + 0.2 + 0.3 + 0.4 + 2.0) / 5 = 0.6, beyond every honest gateway
    assert new is not None
    entries = new["w"].numpy()
    if moved:
        np.testing.assert_allclose(entries, 0.6, rtol=1e-6)
    else:
        np.testing.assert_allclose(entries, 0.3, rtol=1e-6)
        assert coordinator.rule.norms[5] == pytest.approx(2.0 * 3)  # each gateway's update norm: sqrt(9) x 2
        # ... in the round's report (metrics.jsonl's group_norms): 0.3, 0.6, 0.9, 1.2 and 6.0
        assert coordinator.reports[-1].group_norms == pytest.approx([0.3, 0.6, 0.9, 1.2, 6.0])


# --------------------------------------------------------------------------- secure groups, in process
class StubFleet:
    """Devices running fedge's own secure-aggregation handlers whose training returns a known update (100
    examples each); the global model is zero (as tests/test_secagg_clipping.py drives the secure driver)."""

    def __init__(self, deltas: list[list[float]]) -> None:
        self.deltas = deltas
        self.app = ClientApp()
        add_secure_handlers(self.app, self._train)

    def _train(self, msg: Message, context: Context) -> RecordDict:
        delta = self.deltas[int(context.node_config["partition-id"])]
        return RecordDict({wire.ARRAYS: ArrayRecord({"w": Array(np.array(delta))}),
                           wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: 100}),
                           wire.REPLY_META: ConfigRecord({wire.SERVER_ROUND: 1, wire.PROFILE: "laptop"})})

    def round(self, strategy: FedAvg) -> np.ndarray:
        """One round of ``strategy`` (its driver: secure groups) over every device: the new model."""
        count = len(self.deltas)
        nodes = [{"partition-id": i, "num-partitions": count, "profile": "laptop"} for i in range(count)]
        grid = InlineGrid(self.app, nodes, {})
        new, metrics = strategy.driver.train_round(strategy.rounds, grid, 1,  # type: ignore[attr-defined]
                                                   ArrayRecord({"w": Array(np.zeros(2))}), ConfigRecord({}), 60.0)
        assert new is not None and metrics is not None and metrics["groups"] == 3
        return new["w"].numpy()


def _grouped(strategy: type[FedAvg], count: int) -> tuple[FedAvg, SecureGroups]:
    driver = SecureGroups(3, SecureAggregation(clip=1000.0, precision=1e-4, bits=32, weight_clip=1000.0))
    return strategy(driver=driver, clients_per_round=count, min_train_replies=3, fraction_train=1.0,
                    min_train_nodes=count, min_available_nodes=count, wait_for_nodes_s=0.0, flower_lines=False,
                    fraction_evaluate=0.0, selector=RandomSelector(0)), driver


def test_one_boosted_device_is_bounded_by_the_median_over_secure_groups_and_moves_fedavg() -> None:
    # Prepare: 9 devices in 3 secure groups of 3; eight honest updates within [0.1, 0.3] x [0.2, 0.4], one
    # boosted 9 times towards (50, -50) (model replacement: it scales by the devices a round)
    honest = [[0.1 + 0.025 * i, 0.2 + 0.025 * i] for i in range(8)]
    deltas = [[50.0, -50.0], *honest]
    median, median_driver = _grouped(Median, 9)
    fedavg, _ = _grouped(FedAvg, 9)
    # Execute: the same devices, the same groups (seeded by the selector), two rules
    robust, plain = StubFleet(deltas).round(median), StubFleet(deltas).round(fedavg)
    # Assert: the median over groups stays within the honest devices' range (the hostile group's mean is
    # the largest and is outvoted 2 to 1), while FedAvg over the same groups is moved by 50 / 9 in each entry
    low, high = np.min(honest, axis=0), np.max(honest, axis=0)
    assert np.all(robust >= low - 1e-3) and np.all(robust <= high + 1e-3)
    honest_mean = np.mean(honest, axis=0)
    np.testing.assert_allclose(plain, (np.sum(honest, axis=0) + [50.0, -50.0]) / 9, atol=1e-3)
    assert np.all(np.abs(plain - honest_mean) > 5.0)
    norms = median_driver.group_norms[1]
    assert len(norms) == 3 and max(norms.values()) > 10 * sorted(norms.values())[1]  # the hostile group shows
    assert sum(median_driver.group_sizes[1].values()) == 9


def test_stragglers_are_left_out_before_the_groups_are_formed(tmp_path: Path) -> None:
    # Prepare: 12 devices a round in 3 secure groups; a quarter are simulated stragglers FedAvg leaves out
    config = {"fleet": "laptop=12", "clients-per-round": 12, "num-rounds": 1, "model": "mlp", "export-onnx": False,
              "secure-aggregation": True, "secure-groups": 3, "strategy": "median", "straggler-fraction": 0.25,
              "min-train-replies": 3, "run-dir": str(tmp_path / "run")}
    # Execute
    run_dir, _ = simulate(config, progress=False)
    # Assert: the 3 stragglers count as late and the other 9 form 3 groups of 3, so the round aggregates (formed
    # first, a group could keep only 2 devices and fail)
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["aggregated"] and row["late"] == 3
    assert len(row["group_norms"]) == 3 and all(norm > 0 for norm in row["group_norms"])  # each group's norm
