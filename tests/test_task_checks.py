"""Task mistakes a new user made are refused at start, by method and with the fix (issue 25 item 2).

Before, each passed the start-up check: torch broadcast the shapes, or the check looked only
at ``central_data()`` while devices train on ``train_data()``; the run then died at round 0
with a traceback, or every device failed every round with the reason only in devices.jsonl.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedge.config import resolve_run_config
from fedge.errors import ConfigError
from fedge.task.api import TaskData
from fedge.task.builtin.diabetes import Diabetes
from fedge.task.loading import check_task

CONFIG = resolve_run_config({"task": "diabetes", "partitioner": "iid"})


class TwoOutputs(Diabetes):
    """A head of 2 values for a target of 1: mse_loss broadcasts [batch, 2] against [batch]."""

    def build_model(self) -> nn.Module:  # noqa: D102
        return nn.Sequential(nn.Linear(10, 2))


class Float64Training(Diabetes):
    """train_data() in float64 (central_data() is float32, which the old check looked at)."""

    def train_data(self) -> TaskData:  # noqa: D102
        data = super().train_data()
        return TaskData((data.inputs[0].astype(np.float64),), data.targets)


class IntegerTargets(Diabetes):
    """int64 targets for a regression task (target_dtype float32)."""

    def train_data(self) -> TaskData:  # noqa: D102
        data = super().train_data()
        return TaskData(data.inputs, np.rint(data.targets).astype(np.int64))


class BroadcastingLoss(Diabetes):
    """mse_loss([batch, 1], [batch]): torch only warns, and the loss is over a [batch, batch] grid."""

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return nn.functional.mse_loss(outputs, targets)


@pytest.mark.parametrize(("task_class", "message"), [
    (TwoOutputs, r"train_data\(\): the model gives outputs \[2, 2\] for targets \[2\].*build_model\(\)'s head "
                 r"give 1 value"),
    (Float64Training, r"train_data\(\): input 'features' has shape \(2, 10\) float64; the task declares "
                      r"features\[batch, 10\] float32"),
    (IntegerTargets, r"train_data\(\): targets are int64, the task declares target_dtype 'float32': return "
                     r"y.astype\(np.float32\)"),
    (BroadcastingLoss, r"train_data\(\): the model's output does not fit the loss.*target size"),
], ids=["[batch, 2] head for [batch] targets", "float64 train_data", "int64 targets for MSE",
        "mse_loss broadcasting"])
def test_a_task_mistake_is_refused_at_start_naming_the_method(task_class: type[Diabetes], message: str) -> None:
    # Prepare
    task = task_class(CONFIG)
    # Execute / Assert
    with pytest.raises(ConfigError, match=message):
        check_task(task, CONFIG)


def test_the_built_in_regression_task_passes_the_check() -> None:
    # Execute / Assert: nothing refused
    assert check_task(Diabetes(CONFIG), CONFIG) is None
