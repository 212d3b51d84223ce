"""Width-scaled sub-models, the numpy math: windows, their consistency, and the per-entry mean (hand-computed)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.errors import ConfigError
from fedge.submodels import CoverageMean, Offset, Segment, WidthPlan, as_fraction, covered_within, rolling_offset

ROWS = WidthPlan({"w": (4, 2)}, {"w": (0,)})  # 4 hidden units (rows), 2 fixed inputs (columns)


@pytest.mark.parametrize(("width", "offset", "rows"), [
    (1, Fraction(0), [0, 1, 2, 3]),
    (0.5, Fraction(0), [0, 1]),  # HeteroFL: the leading half
    (0.5, Fraction(1, 2), [2, 3]),
    (0.75, Fraction(1, 2), [2, 3, 0]),  # wraps around
    (0.25, Fraction(3, 4), [3]),
])
def test_a_window_holds_consecutive_rows_from_its_offset(width: float, offset: Fraction, rows: list[int]) -> None:
    # Prepare
    full = np.arange(8.0).reshape(4, 2)
    # Execute
    cut = ROWS.window(width, offset).take({"w": full})["w"]
    # Assert: the rows, and the fixed axis whole
    np.testing.assert_array_equal(cut, full[rows])


def test_the_per_entry_mean_weighs_each_entry_over_the_devices_that_held_it() -> None:
    # Prepare: one whole device (weight 1), the leading half (weight 3), the trailing half (weight 1)
    plan = WidthPlan({"b": (4,)}, {"b": (0,)})
    mean = CoverageMean(plan.shapes)
    # Execute
    mean.add({"b": np.array([1.0, 2.0, 3.0, 4.0], np.float32)}, plan.window(1), 1.0)
    mean.add({"b": np.array([5.0, 6.0], np.float32)}, plan.window(0.5), 3.0)
    mean.add({"b": np.array([7.0, 8.0], np.float32)}, plan.window(0.5, Fraction(1, 2)), 1.0)
    result = mean.result({"b": np.zeros(4, np.float32)})["b"]
    # Assert: (1 + 3*5)/4, (2 + 3*6)/4, (3 + 7)/2, (4 + 8)/2
    np.testing.assert_allclose(result, [4.0, 5.0, 5.0, 6.0])
    assert result.dtype == np.float32


def test_entries_no_device_held_keep_the_global_value() -> None:
    # Prepare
    plan = WidthPlan({"w": (2, 2), "steps": ()}, {"w": (0, 1), "steps": ()})
    mean = CoverageMean(plan.shapes)
    base = {"w": np.full((2, 2), 9.0), "steps": np.array(5, np.int64)}
    # Execute: one quarter-device trains w[0, 0] and the whole (unscaled) counter
    mean.add({"w": np.array([[1.0]]), "steps": np.array(7, np.int64)}, plan.window(0.5), 2.0)
    result = mean.result(base)
    # Assert
    np.testing.assert_array_equal(result["w"], [[1.0, 9.0], [9.0, 9.0]])
    assert result["steps"].dtype == np.int64 and int(result["steps"]) == 7


def test_a_flattened_axis_takes_exactly_the_features_of_its_channels_window() -> None:
    # Prepare: a conv of 4 channels feeding a linear layer through a channel-major flatten of 3 pixels each
    plan = WidthPlan({"conv": (4, 1), "linear": (2, 12)}, {"conv": (0,), "linear": (1,)})
    # Execute
    window = plan.window(0.5, rolling_offset(0.5, 2))  # round 2 of FedRolex at half width: channels 2, 3
    conv = window.take({"conv": np.arange(4.0).reshape(4, 1), "linear": np.zeros((2, 12))})["conv"]
    linear = window.take({"conv": np.zeros((4, 1)), "linear": np.tile(np.arange(12.0), (2, 1))})["linear"]
    # Assert: channels 2 and 3 are features 6..11
    np.testing.assert_array_equal(conv.ravel(), [2.0, 3.0])
    np.testing.assert_array_equal(linear[0], np.arange(6.0, 12.0))


@pytest.mark.parametrize(("width", "problem"), [
    (0.0, "in \\(0, 1\\]"), (1.5, "in \\(0, 1\\]"), (True, "in \\(0, 1\\]"), ("0.5", "in \\(0, 1\\]"),
    (1 / 3, "1.33333 of the 4 entries of axis 0 of 'w'"),
])
def test_a_width_that_cannot_cut_the_model_is_refused_naming_the_array(width: object, problem: str) -> None:
    # Execute / Assert
    with pytest.raises(ConfigError, match=problem):
        ROWS.check_width(width)  # type: ignore[arg-type]


def test_fractions_are_the_simple_ones_a_float_stands_for() -> None:
    # Assert
    assert as_fraction(0.25) == Fraction(1, 4)
    assert as_fraction(0.3) == Fraction(3, 10)
    assert rolling_offset(0.25, 1, stride=0) == Offset() and rolling_offset(0.25, 4, stride=0) == Offset(Fraction(3, 4))
    assert rolling_offset(0.25, 5, stride=0) == Offset()  # round 5 starts the second lap


@pytest.mark.parametrize(("server_round", "stride", "rows"), [
    (1, 1, [0, 1]),   # FedRolex's Algorithm 1: round t's window starts at unit t mod K
    (2, 1, [1, 2]),
    (4, 1, [3, 0]),   # wraps around
    (5, 1, [0, 1]),   # K = 4 rounds make a lap
    (2, 3, [3, 0]),   # stride 3
    (2, 0, [2, 3]),   # stride 0: by its own length
])
def test_the_papers_rolling_window_moves_one_unit_a_round(server_round: int, stride: int, rows: list[int]) -> None:
    # Prepare
    full = np.arange(8.0).reshape(4, 2)
    # Execute
    cut = ROWS.window(0.5, rolling_offset(0.5, server_round, stride)).take({"w": full})["w"]
    # Assert
    np.testing.assert_array_equal(cut, full[rows])


def test_a_rolled_flattened_axis_moves_by_whole_channels() -> None:
    # Prepare: 4 channels of 3 pixels each, flattened channel-major into a linear layer's 12 inputs
    plan = WidthPlan({"conv": (4, 1), "linear": (2, 12)}, {"conv": (0,), "linear": (1,)},
                     {"linear": {1: (Segment(12, 4),)}})
    # Execute: round 4 at half width, one unit a round: channels 3 and 0
    window = plan.window(0.5, rolling_offset(0.5, 4, stride=1))
    linear = window.take({"conv": np.zeros((4, 1)), "linear": np.tile(np.arange(12.0), (2, 1))})["linear"]
    # Assert: channel 3's pixels 9..11, then channel 0's 0..2
    np.testing.assert_array_equal(linear[0], [9.0, 10.0, 11.0, 0.0, 1.0, 2.0])


def test_a_concatenated_axis_windows_each_segment_at_its_own_columns() -> None:
    # Prepare: a head reading [4 conv features (2 channels of 2 pixels) | 2 raw inputs | 4 hidden units]
    segments = (Segment(4, 2), Segment(2, 2, fixed=True), Segment(4, 4))
    plan = WidthPlan({"head": (1, 10)}, {"head": (1,)}, {"head": {1: segments}})
    head = {"head": np.arange(10.0).reshape(1, 10)}
    # Execute
    leading = plan.window(0.5).take(head)["head"]
    rolled = plan.window(0.5, Offset(index=1)).take(head)["head"]
    # Assert: channel 0 (0, 1), the raw inputs whole (4, 5), units 0-1 (6, 7); rolled: channel 1, units 1-2
    np.testing.assert_array_equal(leading[0], [0.0, 1.0, 4.0, 5.0, 6.0, 7.0])
    np.testing.assert_array_equal(rolled[0], [2.0, 3.0, 4.0, 5.0, 7.0, 8.0])
    assert plan.sub_shapes(0.5) == {"head": (1, 6)}


@settings(max_examples=60, deadline=None)
@given(exponent=st.integers(1, 4), units=st.integers(1, 6), lap=st.integers(1, 3))
def test_the_rolling_window_trains_every_entry_within_ceil_one_over_r_rounds(exponent: int, units: int,
                                                                              lap: int) -> None:
    # Prepare: a hidden axis of units * 2^exponent entries, width 1 / 2^exponent
    width = 1 / 2**exponent
    size = units * 2**exponent
    plan = WidthPlan({"a": (size, 3)}, {"a": (0,)})
    first = (lap - 1) * math.ceil(1 / width) + 1
    # Execute
    laps = covered_within(plan, width, range(first, first + math.ceil(1 / width)), stride=0)
    short = covered_within(plan, width, range(first, first + math.ceil(1 / width) - 1), stride=0)
    # Assert: one lap covers everything, one round less does not
    assert laps["a"].all()
    assert not short["a"].all()
