"""Coordinator integration and the edge CLIs: export, verify, predict, keys."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedge.cli.main import main
from fedge.edge import EdgeModel
from fedge.edge.bundle import parse_time
from fedge.simulation.runner import simulate


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A 3-round simulation exporting a signed bundle every 2 rounds (and at the end)."""
    config = {"fleet": "phone=6,laptop=3,gpu-box=1", "clients-per-round": 4, "num-rounds": 3,
              "model": "mlp", "local-epochs": 2, "export-every": 2,
              "run-dir": str(tmp_path_factory.mktemp("edge") / "run")}
    return simulate(config, progress=False)


def test_coordinator_exports_every_n_rounds_and_at_the_end(run: tuple[Path, dict[str, Any]]) -> None:
    run_dir, summary = run
    assert summary["bundles"] == ["bundles/round-0002", "bundles/round-0003"]
    assert summary["latest_bundle"] == "bundles/round-0003"
    model = EdgeModel.load(run_dir / summary["latest_bundle"], trusted_keys=[run_dir / "keys/signing.pub"])
    assert model.manifest["round"] == 3 and model.manifest["source_run"] == "run"
    assert (model.manifest["model_id"], model.manifest["version"]) == ("run/digits-mlp", 3)
    assert summary["edge"]["fp32_accuracy"] == pytest.approx(summary["final_accuracy"])
    assert (run_dir / "model.onnx").read_bytes() == (run_dir / "bundles/round-0003/model.onnx").read_bytes()


def test_export_verify_predict_from_the_command_line(
    run: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = run
    assert main(["keys", "signing", "init", str(tmp_path / "k")]) == 0
    assert main(["export", str(run_dir), "--round", "1", "--key", str(tmp_path / "k/signing.key"),
                 "-o", str(tmp_path / "b1"), "--zip", "--valid-days", "2"]) == 0
    exported = capsys.readouterr().out
    assert re.search(r"round 1: fp32 accuracy 0\.\d{4}, int8 0\.\d{4}, agreement [01]\.\d{4}, torch/onnx max diff",
                     exported), exported
    assert main(["verify", str(tmp_path / "b1.zip"), "--trusted", str(tmp_path / "k/signing.pub")]) == 0
    np.save(tmp_path / "x.npy", np.eye(3, 64, dtype=np.float32))
    capsys.readouterr()
    assert main(["predict", str(tmp_path / "b1"), str(tmp_path / "x.npy"),
                 "--trusted", str(tmp_path / "k/signing.pub"), "--variant", "fp32"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and all(line.split("\t")[0] in {str(i) for i in range(10)} for line in lines)
    manifest = json.loads((tmp_path / "b1/manifest.json").read_text())
    assert manifest["round"] == 1
    # the same lineage as the coordinator's bundles of the run, version = the round, expiring in 2 days
    assert (manifest["model_id"], manifest["version"]) == ("run/digits-mlp", 1)
    expires, issued = parse_time(manifest["expires_at"], "e"), parse_time(manifest["issued_at"], "i")
    assert expires - issued == dt.timedelta(days=2)


def test_state_dir_refuses_a_rollback_from_the_command_line(
    run: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: the coordinator's bundles of rounds 2 and 3, and a device state directory
    run_dir, _ = run
    trusted, state = ["--trusted", str(run_dir / "keys/signing.pub")], ["--state-dir", str(tmp_path / "state")]
    np.save(tmp_path / "x.npy", np.zeros((1, 64), np.float32))
    # Execute: run round 3, check it again (same version), then get round 2 replayed
    ran = main(["predict", str(run_dir / "bundles/round-0003"), str(tmp_path / "x.npy"), *trusted, *state])
    again = main(["verify", str(run_dir / "bundles/round-0003"), *trusted, *state])
    capsys.readouterr()
    replayed = main(["verify", str(run_dir / "bundles/round-0002"), *trusted, *state])
    err = capsys.readouterr().err
    # Assert
    assert (ran, again, replayed) == (0, 0, 2)
    assert "bundle 'run/digits-mlp' version 2 is older than version 3 this device already accepted" in err
    assert main(["verify", str(run_dir / "bundles/round-0002"), *trusted]) == 0  # no store: no memory


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["verify", "{run}/bundles/round-0003", "--trusted", "{keys}/signing.pub"], "untrusted key"),
        (["export", "{run}", "--round", "99", "--key", "{keys}/signing.key", "-o", "{tmp}/o"],
         "no checkpoint for round 99; rounds: 0..3"),
        (["export", "{tmp}", "--key", "{keys}/signing.key", "-o", "{tmp}/o"], "not a fedge run directory"),
        (["export", "{run}", "--key", "{tmp}/nokey", "-o", "{tmp}/o"], "does not exist"),
        (["keys", "signing", "init", "{keys}"], "already exists; pass --force"),
        (["predict", "{run}/bundles/round-0003", "{tmp}/bad.npy", "--trusted", "{run}/keys/signing.pub"],
         "input 'input' has shape \\(2, 5\\) float32; .*a single example is \\(64,\\)"),
        (["predict", "{run}/bundles/round-0003", "{tmp}/bad.npy"], "give --trusted"),
        (["predict", "{run}/bundles/round-0003", "{tmp}/damaged.npy", "--trusted", "{run}/keys/signing.pub"],
         "cannot read '.*damaged.npy' as .npy or .npz \\(SyntaxError"),
        (["verify", "{run}/bundles/round-0003", "--trusted", "{run}/keys/signing.pub", "--model-id", "x"],
         "bundle is of model 'run/digits-mlp', not 'x' that this device runs"),
        (["export", "{run}", "--key", "{keys}/signing.key", "-o", "{tmp}/o", "--valid-days", "0"],
         "--valid-days 0.0 must be more than 0"),
    ],
)
def test_edge_cli_errors_exit_2(run: tuple[Path, dict[str, Any]], tmp_path: Path, argv: list[str],
                                message: str, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, _ = run
    main(["keys", "signing", "init", str(tmp_path / "keys")])
    np.save(tmp_path / "bad.npy", np.zeros((2, 5), np.float32))
    damaged = (tmp_path / "bad.npy").read_bytes().replace(b"'descr': '<f4'", b"'descr': ','  ")
    (tmp_path / "damaged.npy").write_bytes(damaged)  # numpy's dtype parser raises SyntaxError on ','
    capsys.readouterr()
    filled = [a.format(run=run_dir, keys=tmp_path / "keys", tmp=tmp_path) for a in argv]
    assert main(filled) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedge: error: ") and re.search(message, err), err


@pytest.mark.parametrize("dtype", [np.float32, np.uint8])
def test_predict_refuses_unscaled_inputs_and_points_to_raw(
    run: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: Any
) -> None:
    # Prepare: three digits as the 0..16 grey levels scikit-learn ships (the bundle expects x / 16)
    from sklearn.datasets import load_digits

    run_dir, _ = run
    np.save(tmp_path / "x.npy", load_digits().data[:3].astype(dtype))
    command = ["predict", str(run_dir / "bundles/round-0003"), str(tmp_path / "x.npy"),
               "--trusted", str(run_dir / "keys/signing.pub")]
    # Execute
    refused = main(command)
    err = capsys.readouterr().err
    scaled = main([*command, "--raw"])
    # Assert: refused with the fix named (it printed a confident wrong answer before), fine with --raw
    assert refused == 2 and "look unscaled (whole numbers up to 16)" in err and "--raw" in err
    assert scaled == 0 and len(capsys.readouterr().out.strip().splitlines()) == 3


MY_TASK = '''
from fedge.task.builtin.digits import Digits


class Mine(Digits):
    """The user's own task (here: digits under another class)."""
'''


def test_export_imports_a_task_from_the_working_directory_as_simulate_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a run of a package.module:object task that lives in the working directory
    import os
    import subprocess

    from fedge.edge.signing import generate_signing_key
    from fedge.simulation.loopback import FEDGE

    (tmp_path / "my_task.py").write_text(MY_TASK)
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--task", "my_task:Mine", "--fleet", "laptop=2", "--clients-per-round", "2",
                 "--rounds", "1", "--run-dir", "run", "--quiet", "--run-config",
                 "export-onnx=false local-epochs=1"]) == 0
    key, _ = generate_signing_key(tmp_path / "keys")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user's shell: nothing set
    # Execute: a fresh process in the same directory (it needed PYTHONPATH=. before)
    done = subprocess.run([FEDGE, "export", "run", "--key", str(key), "-o", "bundle"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    # Assert: the bundle of the custom task was signed
    assert done.returncode == 0, done.stderr
    task = json.loads((tmp_path / "run" / "summary.json").read_text())["task"]
    assert json.loads((tmp_path / "bundle" / "manifest.json").read_text())["model_id"] == f"run/{task}"
