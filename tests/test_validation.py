"""Every bad reply is rejected with a reason while good replies in the same round aggregate."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord

from fedge import wire
from fedge.strategies import FedAvg, LinearRule
from fedge.strategies.validation import ReplyValidator
from replies import global_arrays, good_arrays, instruction, train_reply

BAD = 99


def _nan() -> Message:
    arrays = good_arrays(1.0)
    arrays["w"][0, 0] = np.nan
    return train_reply(BAD, arrays)


def _inf() -> Message:
    arrays = good_arrays(1.0)
    arrays["b"][1] = -np.inf
    return train_reply(BAD, arrays)


def _with(**changes: np.ndarray | None) -> Callable[[], Message]:
    def make() -> Message:
        arrays: dict[str, np.ndarray] = good_arrays(1.0)
        for name, value in changes.items():
            if value is None:
                del arrays[name]
            else:
                arrays[name] = value
        return train_reply(BAD, arrays)
    return make


def _two_array_records() -> Message:
    message = train_reply(BAD, good_arrays(1.0))
    message.content["more"] = ArrayRecord({"w": Array(np.zeros((2, 3), np.float32))})
    return message


def _no_num_examples() -> Message:
    message = train_reply(BAD, good_arrays(1.0))
    message.content[wire.METRICS] = MetricRecord({"train-loss": 0.1})
    return message


def _nan_metric() -> Message:
    message = train_reply(BAD, good_arrays(1.0))
    message.content[wire.METRICS] = MetricRecord({"train-loss": float("nan"), wire.NUM_EXAMPLES: 5})
    return message


def _foreign_stype() -> Message:
    message = train_reply(BAD, good_arrays(1.0))
    array = message.content[wire.ARRAYS]["w"]
    message.content[wire.ARRAYS]["w"] = Array(dtype=array.dtype, shape=array.shape,
                                              stype="fedge.int8", data=array.data)
    return message


def _garbage_bytes() -> Message:
    message = train_reply(BAD, good_arrays(1.0))
    array = message.content[wire.ARRAYS]["w"]
    message.content[wire.ARRAYS]["w"] = Array(dtype=array.dtype, shape=array.shape,
                                              stype=array.stype, data=b"\x93NUMPY garbage")
    return message


def _lying_header() -> Message:
    message = train_reply(BAD, good_arrays(1.0))
    real = Array(np.zeros((3, 2), np.float32))  # bytes say (3, 2); header says (2, 3)
    message.content[wire.ARRAYS]["w"] = Array(dtype="float32", shape=(2, 3), stype=real.stype,
                                              data=real.data)
    return message


BAD_REPLIES: list[tuple[str, Callable[[], Message], str]] = [
    ("nan", _nan, "NaN or Inf"),
    ("inf", _inf, "NaN or Inf"),
    ("wrong shape", _with(w=np.zeros((3, 2), np.float32)), "shape"),
    ("wrong dtype", _with(b=np.zeros(3, np.float64)), "dtype"),
    ("missing key", _with(b=None), "missing \\['b'\\]"),
    ("extra key", _with(extra=np.zeros(1, np.float32)), "extra \\['extra'\\]"),
    ("zero num-examples", lambda: train_reply(BAD, good_arrays(1.0), 0), "outside"),
    ("negative num-examples", lambda: train_reply(BAD, good_arrays(1.0), -5), "outside"),
    ("huge num-examples", lambda: train_reply(BAD, good_arrays(1.0), 10**9), "outside"),
    ("fractional num-examples", lambda: train_reply(BAD, good_arrays(1.0), 3.5), "must be a whole number"),
    ("missing num-examples", _no_num_examples, "no 'num-examples'"),
    ("non-finite metric", _nan_metric, "not finite"),
    ("wrong round", lambda: train_reply(BAD, good_arrays(1.0), server_round=0), "round 0"),
    ("no round tag", lambda: train_reply(BAD, good_arrays(1.0), meta=False), "naming its round"),
    ("two ArrayRecords", _two_array_records, "exactly one ArrayRecord"),
    ("foreign stype", _foreign_stype, "does not decode"),
    ("garbage bytes", _garbage_bytes, "does not decode"),
    ("header disagrees with bytes", _lying_header, "bytes hold shape \\(3, 2\\)"),
]


def _strategy(**kwargs: object) -> FedAvg:
    strategy = FedAvg(validator=ReplyValidator(max_num_examples=1000), **kwargs)  # type: ignore[arg-type]
    strategy.global_arrays = global_arrays()
    return strategy


@pytest.mark.parametrize(("name", "make_bad", "reason"), BAD_REPLIES, ids=[b[0] for b in BAD_REPLIES])
def test_bad_reply_rejected_and_good_replies_still_aggregate(
    name: str, make_bad: Callable[[], Message], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: two good replies (values 1 and 4, weights 10 and 30) and one bad one
    strategy = _strategy()
    replies = [train_reply(11, good_arrays(1.0), 10), make_bad(), train_reply(12, good_arrays(4.0), 30)]
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedge.strategies.validation"):
        arrays, metrics = strategy.aggregate_train(1, replies)
    # Assert: (10*1 + 30*4) / 40 = 3.25, the bad reply counted and logged with its node id
    assert arrays is not None
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((2, 3), 3.25))
    assert metrics is not None and strategy.reports[-1].accepted == 2
    (rejection,) = strategy.reports[-1].rejected
    assert rejection.node_id == BAD
    assert re.search(reason, rejection.reason), rejection.reason
    assert f"node {BAD}" in caplog.text


def test_too_few_accepted_keeps_the_global_model() -> None:
    # Prepare: need 2 accepted, get 1 good + 1 NaN
    strategy = _strategy(min_train_replies=2)
    replies = [train_reply(11, good_arrays(1.0)), _nan()]
    # Execute
    arrays, metrics = strategy.aggregate_train(1, replies)
    # Assert: no new arrays -> Flower's Strategy.start keeps the previous global model
    assert arrays is None
    report = strategy.reports[-1]
    assert metrics is not None and report.accepted == 1 and len(report.rejected) == 1
    assert report.aggregated is False


def test_error_replies_are_counted_as_failures_not_rejections() -> None:
    strategy = _strategy()
    failed = Message(Error(code=2, reason="out of memory"), reply_to=instruction(13))
    arrays, metrics = strategy.aggregate_train(1, [train_reply(11, good_arrays(2.0)), failed])
    assert arrays is not None and metrics is not None
    assert len(strategy.reports[-1].failed) == 1 and not strategy.reports[-1].rejected
    assert "out of memory" in strategy.reports[-1].failed[0].reason


def test_metrics_are_weighted_by_num_examples() -> None:
    strategy = _strategy()
    first, second = train_reply(11, good_arrays(1.0), 10), train_reply(12, good_arrays(1.0), 30)
    first.content[wire.METRICS]["train-loss"] = 1.0
    second.content[wire.METRICS]["train-loss"] = 3.0
    _, metrics = strategy.aggregate_train(1, [first, second])
    assert metrics is not None and metrics["train-loss"] == pytest.approx(2.5)  # (10*1+30*3)/40


def test_a_diverged_aggregate_keeps_the_global_model() -> None:
    # Prepare: a strategy whose aggregation rule overflows (as an unstable server step can)
    class Overflowing(LinearRule):
        def step(self, mean):  # type: ignore[no-untyped-def]
            return {k: v * np.float32(1e38) * np.float32(1e38) for k, v in mean.items()}

    strategy = FedAvg(rule=Overflowing(), validator=ReplyValidator(max_num_examples=1000))
    strategy.global_arrays = global_arrays()
    # Execute
    with np.errstate(over="ignore"):
        arrays, metrics = strategy.aggregate_train(1, [train_reply(11, good_arrays(1.0)),
                                                       train_reply(12, good_arrays(2.0))])
    # Assert: no new arrays, so Strategy.start keeps the previous global model
    assert arrays is None and metrics is not None and strategy.reports[-1].accepted == 2
    assert strategy.reports[-1].aggregated is False


def test_a_fortran_ordered_update_decodes_to_its_values() -> None:
    # Prepare: a standard Flower client may send a transposed (F-contiguous) weight
    strategy = _strategy()
    fortran = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    reply = train_reply(11, {"w": fortran, "b": np.zeros(3, np.float32)})
    # Execute
    arrays, metrics = strategy.aggregate_train(1, [reply])
    # Assert: the same values as the C-ordered array, row by row
    assert arrays is not None and strategy.reports[-1].accepted == 1
    np.testing.assert_array_equal(arrays["w"].numpy(), [[0, 1, 2], [3, 4, 5]])
