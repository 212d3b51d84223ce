"""The ``digits`` task: scikit-learn's bundled 8x8 handwritten digits, 10 classes."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from fedge import knobs
from fedge.task.api import TaskData
from fedge.task.builtin.flat import FlatClassification
from fedge.task.data import holdout, load_digits_arrays
from fedge.task.registry import register_task


@register_task("digits")
class Digits(FlatClassification):
    """1797 images of 64 grey levels (pixels scaled to [0, 1]); ``test-fraction`` of every class held out.
    Models: ``cnn`` (default), ``mlp``, ``logreg``."""

    preprocessing: dict[str, Any] = {"kind": "affine", "scale": 1.0 / 16.0, "offset": 0.0, "raw-range": [0, 16],
                                     "description": "8x8 grey-level pixels in 0..16, row-major, times 1/16"}

    @cached_property
    def split(self) -> tuple[TaskData, TaskData]:  # noqa: D102
        x, y = load_digits_arrays()
        x_train, y_train, (x_test, y_test) = holdout(x, y, self.config.number(knobs.TEST_FRACTION),
                                                     self.config.integer(knobs.SEED))
        return TaskData.from_xy(x_train, y_train), TaskData.from_xy(x_test, y_test)
