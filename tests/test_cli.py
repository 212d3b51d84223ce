"""The ``fedge`` command line: refused input exits 2 with one clear line and writes nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedge.cli.main import main
from fedge.server.checkpoint import Checkpoint, save_checkpoint

SMALL = ["--fleet", "phone=3,laptop=2", "--clients-per-round", "2", "--rounds", "1", "--quiet"]


def _bad_checkpoint(tmp_path: Path) -> str:
    import numpy as np

    path = tmp_path / "other-model.npz"
    save_checkpoint(path, Checkpoint(1, {"linear.weight": np.zeros((10, 64), np.float32)}, "x"))
    return str(path)


CASES = [
    (["--run-config", "num-round=3"], "unknown run-config key 'num-round' (did you mean 'num-rounds'?)"),
    (["--run-config", "learning-rate='fast'"], "run-config 'learning-rate' = 'fast'"),
    (["--fleet", "phone=3,toaster=2"], "fleet names unknown profile 'toaster'"),
    (["--fleet", "phone=2000"], "cannot partition 1438 training samples across 2000 devices"),
    (["--clients-per-round", "9"], "clients-per-round = 9 exceeds the fleet's 5 devices"),
    (["--model", "resnet"], "'model' = 'resnet' is not a registered model; use one of: logreg, mlp, cnn"),
    (["--run-config", "init-checkpoint='CKPT'"], "do not match the model"),
]


@pytest.mark.parametrize(("extra", "message"), CASES, ids=[c[1][:40] for c in CASES])
def test_bad_input_exits_2_with_message_and_writes_nothing(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = [arg.replace("CKPT", _bad_checkpoint(tmp_path)) for arg in extra]
    run_dir = tmp_path / "run"
    # Execute: later flags override SMALL's
    code = main(["simulate", *SMALL, "--run-dir", str(run_dir), *extra])
    # Assert
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("fedge: error: ") and len(err.splitlines()) == 1
    assert message in err
    assert not run_dir.exists()


def test_console_script_runs_a_simulation_and_ends_with_final_accuracy(tmp_path: Path) -> None:
    fedge = Path(sys.executable).with_name("fedge")
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    done = subprocess.run([str(fedge), "simulate", *SMALL, "--run-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"final accuracy: 0\.\d{4}", done.stdout.strip().splitlines()[-1])
    assert (tmp_path / "r" / "summary.json").exists()
