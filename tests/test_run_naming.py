"""Run directories and plot titles name the task and what the run did (issue 26 items 4-5);
the console gets a short config line, the run directory the whole config."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from fedge.config import resolve_run_config
from fedge.server.report import config_summary, run_dir_for, run_title, task_label


@pytest.mark.parametrize(("overrides", "label", "task"), [
    ({}, "fedavg", "digits-cnn"),
    ({"task": "houses.task:HousesTask", "round-policy": "deadline"}, "fedavg-deadline", "houses"),
    ({"task": "images", "strategy": "fedprox", "secure-aggregation": True}, "fedprox-secure", "images"),
    ({"dataset": "synthetic", "model": "logreg", "strategy": "median"}, "median", "synthetic-logreg"),
])
def test_run_directory_and_title_name_the_task_and_the_run(overrides: dict[str, Any], label: str,
                                                           task: str) -> None:
    # Prepare
    config = resolve_run_config(overrides)
    # Execute
    name = run_dir_for(config).name
    # Assert
    assert task_label(config) == task
    assert name.startswith(f"{label}-{task}-") and run_title(config, task) == f"{label} on {task}"


def test_an_explicit_run_dir_or_name_wins(tmp_path: Path) -> None:
    assert run_dir_for(resolve_run_config({"run-dir": str(tmp_path / "x")})) == tmp_path / "x"
    assert run_dir_for(resolve_run_config({"run-name": "mine"})) == Path("runs") / "mine"


def test_config_summary_is_one_short_line_of_what_changed(tmp_path: Path) -> None:
    # Prepare
    config = resolve_run_config({"num-rounds": 3, "strategy": "fedprox", "run-dir": str(tmp_path)})
    # Execute
    line = config_summary(config, tmp_path)
    # Assert: the changed keys, not the ~90 defaults; the full config's path
    assert line == (f"run config: num-rounds=3, strategy='fedprox' (every key: {tmp_path / 'config.json'})")


def test_quiet_simulation_prints_only_the_final_lines(tmp_path: Path, fast_config: dict[str, Any],
                                                     capsys: pytest.CaptureFixture[str],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    # Prepare
    from fedge.cli.main import main

    run_dir = tmp_path / "run"
    argv = ["simulate", "--quiet", "--rounds", "1", "--fleet", "phone=4", "--clients-per-round", "2",
            "--model", "logreg", "--run-dir", str(run_dir), "--run-config", "export-onnx=false"]
    # Execute
    try:
        with caplog.at_level(logging.INFO):
            code = main(argv)
    finally:
        logging.getLogger("fedge").setLevel(logging.NOTSET)  # main() quietened it for this process
    # Assert: no config line (nor any other INFO line of fedge's), the config in the run directory
    assert code == 0 and "final accuracy" in capsys.readouterr().out
    assert not [r for r in caplog.records if r.name.startswith("fedge") and r.levelno < logging.WARNING]
    assert json.loads((run_dir / "config.json").read_text())["num-rounds"] == 1


def test_console_shows_small_uplinks_and_epsilon(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: a logistic regression of 650 parameters, 2 devices, 1 round, central DP
    from fedge.cli.main import main

    argv = ["simulate", "--quiet", "--rounds", "1", "--fleet", "phone=2", "--clients-per-round", "2", "--model",
            "logreg", "--run-dir", str(tmp_path / "run"), "--run-config",
            "export-onnx=false dp='server-fixed' dp-noise-multiplier=1.0"]
    # Execute
    try:
        code = main(argv)
    finally:
        logging.getLogger("fedge").setLevel(logging.NOTSET)
    out = capsys.readouterr().out
    # Assert: 2 x 650 float32 = 5.2 kB up (it printed "0.0 MB"), and epsilon on the console (issue 25 item 3)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert code == 0 and f"uplink: {summary['bytes_up'] / 1e3:.1f} kB" in out
    assert f"epsilon {summary['dp']['epsilon']:.2f}" in out
