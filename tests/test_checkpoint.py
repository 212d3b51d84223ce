"""Atomic checkpoints and starting from one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedge.errors import CheckpointMismatch
from fedge.server.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fedge.simulation.runner import simulate


def test_roundtrip_and_no_temporary_files_left(tmp_path: Path) -> None:
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array(4, np.int64)}
    save_checkpoint(tmp_path / "c.npz", Checkpoint(3, arrays, "abc", [{"round": 3}]))
    save_checkpoint(tmp_path / "c.npz", Checkpoint(4, arrays, "abc", [{"round": 4}]))
    loaded = load_checkpoint(tmp_path / "c.npz")
    assert (loaded.server_round, loaded.fingerprint, loaded.history) == (4, "abc", [{"round": 4}])
    np.testing.assert_array_equal(loaded.arrays["w"], arrays["w"])
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]


def test_a_failed_write_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_checkpoint(tmp_path / "c.npz", Checkpoint(1, {"w": np.zeros(2)}, "f"))

    def disk_error(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("fedge.files.os.fsync", disk_error)  # the atomic write checkpoints use
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path / "c.npz", Checkpoint(2, {"w": np.ones(2)}, "f"))
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "c.npz").server_round == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]


@pytest.mark.parametrize("content", [b"not a zip", None])
def test_unreadable_checkpoints_are_refused(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "c.npz"
    if content is None:
        np.savez(path, w=np.zeros(2))  # an .npz, but not a fedge checkpoint
    else:
        path.write_bytes(content)
    with pytest.raises(CheckpointMismatch):
        load_checkpoint(path)


def test_a_run_can_start_from_a_checkpoint(fast_config: dict[str, Any], tmp_path: Path) -> None:
    fast_config["export-onnx"] = False
    first_dir, first = simulate(fast_config, progress=False)
    _, second = simulate({**fast_config, "run-dir": str(tmp_path / "next"), "num-rounds": 1,
                          "init-checkpoint": str(first_dir / "checkpoint.npz")}, progress=False)
    # round 0 of the second run evaluates exactly the first run's final model
    initial = json.loads((tmp_path / "next" / "metrics.jsonl").read_text().splitlines()[0])
    assert initial["round"] == 0 and initial["accuracy"] == pytest.approx(first["final_accuracy"])
    assert second["rounds"] == 1
