"""The pure aggregation math: hand-computed cases and streaming == batch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedge.aggregate import WeightedMeanAccumulator, weighted_mean, weighted_mean_metrics


def test_weighted_mean_hand_computed() -> None:
    # Prepare: (1*[1,2] + 3*[5,6]) / 4 = [4, 5]; scalar (1*10 + 3*2)/4 = 4
    updates = [{"a": np.array([1.0, 2.0], np.float32), "s": np.array(10.0)},
               {"a": np.array([5.0, 6.0], np.float32), "s": np.array(2.0)}]
    # Execute
    result = weighted_mean(updates, [1.0, 3.0])
    # Assert
    np.testing.assert_allclose(result["a"], [4.0, 5.0])
    assert result["a"].dtype == np.float32
    assert float(result["s"]) == pytest.approx(4.0)


def test_integer_tensors_are_rounded_back_to_their_dtype() -> None:
    result = weighted_mean([{"n": np.array([1, 2], np.int64)}, {"n": np.array([2, 4], np.int64)}], [1, 1])
    assert result["n"].dtype == np.int64
    np.testing.assert_array_equal(result["n"], [2, 3])  # 1.5 -> 2 (banker's), 3 -> 3


@pytest.mark.parametrize(
    ("second", "weight", "message"),
    [
        ({"a": np.zeros(2)}, 0.0, "positive"),
        ({"a": np.zeros(2)}, float("nan"), "positive"),
        ({"a": np.zeros(2)}, -1.0, "positive"),
        ({"b": np.zeros(2)}, 1.0, "names"),
        ({"a": np.zeros(3)}, 1.0, "shape"),
    ],
)
def test_accumulator_refuses_bad_input(second: dict[str, np.ndarray], weight: float, message: str) -> None:
    accumulator = WeightedMeanAccumulator()
    accumulator.add({"a": np.ones(2)}, 1.0)
    with pytest.raises(ValueError, match=message):
        accumulator.add(second, weight)


def test_empty_accumulator_has_no_result() -> None:
    with pytest.raises(ValueError, match="no updates"):
        WeightedMeanAccumulator().result()


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    shape=hnp.array_shapes(max_dims=3, max_side=4),
    count=st.integers(1, 8),
)
def test_streaming_equals_batch_weighted_mean(
    data: st.DataObject, shape: tuple[int, ...], count: int
) -> None:
    # Prepare: random updates and positive weights
    elements = st.floats(-1e3, 1e3, allow_nan=False, width=32)
    updates = [{"x": data.draw(hnp.arrays(np.float32, shape, elements=elements))} for _ in range(count)]
    weights = [data.draw(st.floats(0.01, 1e4)) for _ in range(count)]
    # Execute: one at a time vs the textbook formula
    accumulator = WeightedMeanAccumulator()
    for update, weight in zip(updates, weights, strict=True):
        accumulator.add(update, weight)
    streamed = accumulator.result()["x"]
    batch = sum(w * u["x"].astype(np.float64) for u, w in zip(updates, weights, strict=True)) / sum(weights)
    # Assert
    np.testing.assert_allclose(streamed, batch.astype(np.float32), rtol=1e-5, atol=1e-3)


def test_accumulator_memory_does_not_grow_with_updates() -> None:
    accumulator = WeightedMeanAccumulator()
    for i in range(50):
        accumulator.add({"x": np.full(1000, float(i), np.float32)}, 1.0)
    assert accumulator.count == 50
    assert sum(buffer.nbytes for buffer in accumulator._sums.values()) == 1000 * 8
    assert float(accumulator.result()["x"][0]) == pytest.approx(24.5)


def test_weighted_mean_metrics_keeps_common_keys() -> None:
    result = weighted_mean_metrics([{"loss": 1.0, "x": 5.0}, {"loss": 3.0}], [3.0, 1.0])
    assert result == {"loss": pytest.approx(1.5)}
