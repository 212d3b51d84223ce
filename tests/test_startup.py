"""``fedge simulate`` loads only what a run uses: no onnx unless it exports, matplotlib only in
the plotting helper, and the command's process ends without tearing torch down.

Start-up is most of a small simulation's wall time (issue 16, item 2); each check runs in a
fresh interpreter, since this test process has long imported everything. No timings here:
bench/sim_vs_flower.py measures them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fedge.server import report

SMALL = ["simulate", "--fleet", "phone=3,laptop=2", "--clients-per-round", "2", "--rounds", "2", "--quiet",
         "--run-config", "export-onnx=false"]
ENV = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=ENV, timeout=300)


def test_the_simulate_path_imports_neither_onnx_nor_matplotlib() -> None:
    # Execute: everything `fedge simulate` imports before its run starts
    done = _python("""
        import sys
        import fedge.cli.main, fedge.simulation.runner
        print(sorted({name.split(".")[0] for name in sys.modules} & {"onnx", "onnxruntime", "matplotlib"}))
    """)
    # Assert
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_run_without_onnx_devices_loads_no_onnx_up_to_its_last_round(tmp_path: Path) -> None:
    # Arrange: note what is loaded when the last round is recorded
    code = f"""
        import sys
        from fedge.cli.main import main
        from fedge.server.recorder import RoundRecorder

        record = RoundRecorder.on_round_end
        seen = set()
        def on_round_end(self, server_round, arrays):
            seen.update(name.split(".")[0] for name in sys.modules)
            return record(self, server_round, arrays)
        RoundRecorder.on_round_end = on_round_end
        assert main({[*SMALL, "--run-dir", str(tmp_path / "r")]!r}) == 0
        print(sorted(seen & {{"onnx", "onnxruntime"}}))
    """
    # Execute
    done = _python(code)
    # Assert
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_simulate_plots_in_a_helper_process_and_the_png_exists_on_return(tmp_path: Path) -> None:
    # Execute: the command, in a process that never imported matplotlib
    done = _python(f"""
        import sys
        from fedge.cli.main import main
        code = main({[*SMALL, "--run-dir", str(tmp_path / "r")]!r})
        print(code, "matplotlib" in sys.modules)
    """)
    # Assert: the PNG was drawn (by the helper), this process never loaded matplotlib
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "0 False"
    assert (tmp_path / "r" / "headline.png").stat().st_size > 0


def test_the_helper_draws_the_same_png_as_this_process(tmp_path: Path) -> None:
    # Arrange
    rows = [{"round": 0, "headline": 0.1, "sim_time_s": 0.0, "other": [1]},
            {"round": 1, "headline": None, "sim_time_s": 2.5},
            {"round": 2, "headline": 0.7, "sim_time_s": 4.0}]
    # Execute
    report.draw_headline(rows, tmp_path / "here.png", "fedavg on digits", "accuracy")
    with report.plotting_process():
        report.plot_headline(rows, tmp_path / "helper.png", "fedavg on digits", "accuracy")
        helped = report._helper is not None and report._helper.process.poll() is None
    # Assert: byte for byte, and it was the helper that drew it
    assert helped
    assert (tmp_path / "helper.png").read_bytes() == (tmp_path / "here.png").read_bytes()
    assert report._helper is None


def test_a_failed_helper_leaves_the_plot_to_this_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: a helper that dies at once
    start = report._PlotHelper.start

    def dead_helper() -> report._PlotHelper | None:
        helper = start()
        assert helper is not None
        helper.process.kill()
        helper.process.wait()
        return helper

    monkeypatch.setattr(report._PlotHelper, "start", staticmethod(dead_helper))
    rows = [{"round": 0, "headline": 0.1, "sim_time_s": 0.0}, {"round": 1, "headline": 0.5, "sim_time_s": 1.0}]
    # Execute
    with report.plotting_process():
        report.plot_headline(rows, tmp_path / "p.png", "t")
    # Assert
    assert (tmp_path / "p.png").stat().st_size > 0


def test_the_console_command_runs_atexit_handlers_and_keeps_its_exit_status(tmp_path: Path) -> None:
    # Execute: `fedge simulate` as the console script runs it (argv from sys.argv), refused and accepted
    results: list[subprocess.CompletedProcess[str]] = []
    for extra in (["--clients-per-round", "9"], []):
        argv = ["fedge", *SMALL, "--run-dir", str(tmp_path / f"r{len(results)}"), *extra]
        results.append(_python(f"""
            import atexit, sys
            atexit.register(lambda: print("atexit ran", flush=True))
            sys.argv = {argv!r}
            from fedge.cli.main import main
            sys.exit(main())
        """))
    # Assert: the refusal's line and status, the run's summary, and the handlers ran in both
    refused, ran = results
    assert refused.returncode == 2 and "fedge: error: clients-per-round = 9" in refused.stderr
    assert ran.returncode == 0, ran.stderr
    assert json.loads((tmp_path / "r1" / "summary.json").read_text())["rounds"] == 2
    assert (tmp_path / "r1" / "headline.png").exists()
    for done in results:
        assert done.stdout.strip().splitlines()[-1] == "atexit ran"
