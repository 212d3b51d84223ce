"""The ``npz`` and ``csv`` tasks: classification of a user's own file of flat features (``data-path``)."""

from __future__ import annotations

from functools import cached_property

from fedge import knobs
from fedge.errors import ConfigError
from fedge.task.api import TaskData
from fedge.task.builtin.flat import FlatClassification
from fedge.task.data import holdout, load_csv, load_npz
from fedge.task.registry import register_task


class UserFile(FlatClassification):
    """Examples from ``data-path``: ``x`` (n, features) and integer ``y``; ``test-fraction`` held out."""

    @cached_property
    def split(self) -> tuple[TaskData, TaskData]:  # noqa: D102
        kind, path = self.config.text(knobs.DATASET), self.config.text(knobs.DATA_PATH)
        if not path:
            raise ConfigError(f"dataset '{kind}' needs run-config 'data-path' (a .{kind} file)")
        x, y = load_npz(path) if kind == "npz" else load_csv(path)
        x_train, y_train, (x_test, y_test) = holdout(x, y, self.config.number(knobs.TEST_FRACTION),
                                                     self.config.integer(knobs.SEED))
        return TaskData.from_xy(x_train, y_train), TaskData.from_xy(x_test, y_test)


register_task("npz")(UserFile)
register_task("csv")(UserFile)
