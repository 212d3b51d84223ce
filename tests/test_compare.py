"""``fedge compare``: runs side by side, from run directories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fedge.cli.main import main
from fedge.errors import ConfigError
from fedge.server.compare import compare, format_table, load_runs


def _run_dir(root: Path, name: str, headlines: list[float | None], *, headline: str = "accuracy",
             higher: bool = True, finished: bool = True) -> Path:
    path = root / name
    path.mkdir()
    rows = [{"round": i, "headline": value, "metric": headline, "higher_is_better": higher,
             "sim_time_s": 2.0 * i, "wall_time_s": 0.5 * i, "bytes_up": 1_000_000 * (i > 0),
             "bytes_down": 2_000_000 * (i > 0), "rejected": i % 2} for i, value in enumerate(headlines)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if finished:
        (path / "summary.json").write_text(json.dumps({"headline": headline, "higher_is_better": higher}))
    return path


def test_table_rows_hold_final_best_and_totals(tmp_path: Path) -> None:
    # Prepare: two runs, one still going (no summary), round 0 without a value in the second
    a = _run_dir(tmp_path, "fedavg", [0.1, 0.5, 0.7, 0.6])
    b = _run_dir(tmp_path, "fedprox", [None, 0.4, 0.8], finished=False)
    # Execute
    rows, png, record = compare([a, b], tmp_path / "out" / "cmp")
    # Assert: hand-computed values
    assert rows[0]["final"] == 0.6 and rows[0]["best"] == 0.7
    assert rows[0]["best_round"] == 2 and rows[0]["rounds"] == 3 and rows[0]["sim_time_s"] == 6.0
    assert rows[0]["mb_up"] == 3.0 and rows[0]["mb_down"] == 6.0 and rows[0]["rejected"] == 2
    assert rows[1]["final"] == 0.8 and rows[1]["best_round"] == 2 and rows[1]["finished"] is False
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["run"] for r in json.loads(record.read_text())["runs"]] == ["fedavg", "fedprox"]


def test_lower_is_better_picks_the_smallest(tmp_path: Path) -> None:
    # Prepare
    run = _run_dir(tmp_path, "houses", [9.0, 3.0, 4.0], headline="mse", higher=False)
    # Execute
    rows, _, _ = compare([run], tmp_path / "cmp")
    # Assert
    assert rows[0]["best"] == 3.0 and rows[0]["best_round"] == 1 and rows[0]["final"] == 4.0


@pytest.mark.parametrize(("make", "message"), [
    (lambda root: [root], "not a run directory"),
    (lambda root: [_run_dir(root, "a", [0.1]), _run_dir(root, "b", [1.0], headline="mse", higher=False)],
     "different headline metrics"),
])
def test_bad_run_lists_are_refused_by_name(tmp_path: Path, make: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_runs(make(tmp_path))


def test_format_table_aligns_and_shows_missing_values_as_dash() -> None:
    # Prepare
    row = {"run": "r", "rounds": 0, "final": None, "best": None, "best_round": None, "sim_time_s": 0.0,
           "wall_time_s": 0.0, "mb_up": 0.0, "mb_down": 0.0, "rejected": 0}
    # Execute
    lines = format_table([row]).splitlines()
    # Assert
    assert lines[0].split()[:3] == ["run", "rounds", "final"] and lines[1].split()[:3] == ["r", "0", "-"]


def test_compare_command_on_two_real_runs(tmp_path: Path, fast_config: dict[str, Any],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: two real (tiny) runs that differ in their strategy
    from fedge.simulation.runner import simulate

    quick = {**fast_config, "num-rounds": 2, "export-onnx": False}
    first, _ = simulate({**quick, "run-dir": str(tmp_path / "fedavg")}, progress=False)
    second, _ = simulate({**quick, "run-dir": str(tmp_path / "fedprox"), "strategy": "fedprox"}, progress=False)
    # Execute
    code = main(["compare", str(first), str(second), "--out", str(tmp_path / "cmp")])
    # Assert
    out = capsys.readouterr().out
    assert code == 0 and "fedavg" in out and "fedprox" in out and "plot:" in out
    record = json.loads((tmp_path / "cmp.json").read_text())
    assert [row["rounds"] for row in record["runs"]] == [2, 2] and (tmp_path / "cmp.png").stat().st_size > 0
