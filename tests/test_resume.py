"""Checkpoint/resume: a resumed or crashed-and-resumed run ends where an uninterrupted one does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fedge.cli.main import main
from fedge.simulation.runner import simulate


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _same_run(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert [r["round"] for r in a] == [r["round"] for r in b]
    assert [r["accuracy"] for r in a] == [r["accuracy"] for r in b]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b])
    assert a[-1]["sim_time_s"] == pytest.approx(b[-1]["sim_time_s"])


@pytest.fixture
def config(fast_config: dict[str, Any]) -> dict[str, Any]:
    return {**fast_config, "num-rounds": 5, "export-onnx": False}


def test_resume_continues_to_the_same_result(config: dict[str, Any], tmp_path: Path) -> None:
    # Prepare: an uninterrupted 5-round run, and a 3-round run of the same config
    _, straight = simulate({**config, "run-dir": str(tmp_path / "straight")}, progress=False)
    simulate({**config, "num-rounds": 3, "run-dir": str(tmp_path / "split")}, progress=False)
    # Execute: continue the 3-round run to 5 rounds
    _, resumed = simulate({**config, "run-dir": str(tmp_path / "split"), "resume": True}, progress=False)
    # Assert
    _same_run(_rows(tmp_path / "split"), _rows(tmp_path / "straight"))
    assert resumed["final_accuracy"] == straight["final_accuracy"] and resumed["rounds"] == 5


def test_crashed_run_resumes_losing_at_most_the_round_in_progress(
    config: dict[str, Any], tmp_path: Path
) -> None:
    # Prepare: a 30-round reference run, then the same run in a process we SIGKILL mid-run
    config = {**config, "num-rounds": 30}
    simulate({**config, "run-dir": str(tmp_path / "straight")}, progress=False)
    crashed = tmp_path / "crashed"
    overrides = " ".join(f"{k}={json.dumps(v)}" for k, v in config.items() if k != "run-dir")
    fedge = Path(sys.executable).with_name("fedge")
    proc = subprocess.Popen(
        [str(fedge), "simulate", "--quiet", "--run-dir", str(crashed), "--run-config", overrides],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (crashed / "checkpoints" / "round-0002.npz").exists():
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    completed = len(_rows(crashed)) - 1
    assert 2 <= completed < 30, "the kill should land mid-run"
    # Execute
    code = main(["simulate", "--quiet", "--resume", str(crashed)])
    # Assert: every round exactly once, and the same trajectory as the uninterrupted run
    assert code == 0
    _same_run(_rows(crashed), _rows(tmp_path / "straight"))


def test_resume_refuses_a_checkpoint_of_another_model(
    config: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    simulate({**config, "num-rounds": 1, "run-dir": str(tmp_path / "r")}, progress=False)
    code = main(["simulate", "--quiet", "--resume", str(tmp_path / "r"), "--model", "cnn"])
    err = capsys.readouterr().err
    assert code == 2 and "its checkpoint was made with" in err and "'model': 'mlp'" in err


def test_a_fresh_run_will_not_overwrite_an_existing_one(
    config: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    simulate({**config, "num-rounds": 1, "run-dir": str(tmp_path / "r")}, progress=False)
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    code = main(["simulate", "--quiet", "--run-dir", str(tmp_path / "r"), "--rounds", "1",
                 "--fleet", "phone=6,laptop=3,gpu-box=1", "--clients-per-round", "4"])
    assert code == 2 and "already holds a run" in capsys.readouterr().err
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before


def test_a_resumed_oort_run_selects_as_an_uninterrupted_one(config: dict[str, Any], tmp_path: Path) -> None:
    # Prepare: Oort ranks devices by what it learned from their replies; an uninterrupted 5-round run,
    # and a 3-round run of the same config
    oort = {**config, "selector": "oort", "fleet": "phone=8,laptop=4", "clients-per-round": 3}
    simulate({**oort, "run-dir": str(tmp_path / "straight")}, progress=False)
    simulate({**oort, "num-rounds": 3, "run-dir": str(tmp_path / "split")}, progress=False)
    # Execute: continue the 3-round run to 5 rounds
    simulate({**oort, "run-dir": str(tmp_path / "split"), "resume": True}, progress=False)
    # Assert: the same devices in rounds 4 and 5 (a selector that forgot its records explores all over again)
    straight, split = _rows(tmp_path / "straight"), _rows(tmp_path / "split")
    assert [r["participants_by_profile"] for r in split] == [r["participants_by_profile"] for r in straight]
    _same_run(split, straight)
