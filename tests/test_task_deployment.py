"""A user's task defined outside fedge runs in deployment: real SuperLink and SuperNodes on
127.0.0.1 with TLS and device auth; the operator names the task, each device chose it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from fedge.simulation.loopback import LoopbackFederation

pytestmark = pytest.mark.slow

USER_TASK = '''
"""An app developer's task: their own two-layer model on 8x8 digit images, lower loss headline."""

import numpy as np
from torch import nn

from fedge.signature import InputSpec
from fedge.task.api import Task, TaskData
from fedge.task.data import load_digits_arrays


class Pixels(Task):
    name = "pixels"
    headline, higher_is_better = "loss", False
    inputs = (InputSpec("input", ("batch", 64)),)

    def build_model(self):
        return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))

    def train_data(self):
        x, y = load_digits_arrays()
        return TaskData.from_xy(x[:1400], y[:1400])

    def central_data(self):
        x, y = load_digits_arrays()
        return TaskData.from_xy(x[1400:], y[1400:])
'''


@pytest.mark.deployment
def test_a_task_outside_fedge_trains_in_deployment(tmp_path: Path) -> None:
    # Prepare: the task's module lives in the user's folder, importable on both sides
    code = tmp_path / "code"
    code.mkdir()
    (code / "user_pixels.py").write_text(textwrap.dedent(USER_TASK))
    federation = LoopbackFederation(tmp_path / "fed", num_devices=3, env={"PYTHONPATH": str(code)})
    try:
        # Execute: 2 rounds of the user's task; every device started with --task
        federation.start_coordinator("--rounds", "2", "--clients-per-round", "3", "--run-config",
                                     "task='user_pixels:Pixels' local-epochs=2 export-every=0 round-timeout=900.0")
        for index in range(3):
            federation.start_device(index, None, "--task", "user_pixels:Pixels")
        federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 900, "the summary")
        # Assert: the user's headline (loss, lower is better) went down with all three devices
        rows = federation.rows()
        assert [row["metric"] for row in rows] == ["loss"] * 3
        assert all(row["participants"] == 3 and row["aggregated"] for row in rows[1:])
        assert rows[-1]["headline"] < rows[0]["headline"]
        assert (federation.run_dir / "bundles" / "round-0002" / "manifest.sig").exists()
    finally:
        federation.close()
