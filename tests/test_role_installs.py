"""Installs that fit each role, in clean virtualenvs: `fedge[edge]` and `fedge[device]` have no torch.

Each test creates a fresh venv and pip-installs this checkout with one extra (from the
package registry, as a device would), then runs that role's path in it:

* ``edge``: verify a signed bundle and predict with onnxruntime, and ``fedge pull``'s CLI;
* ``device``: a torch-free onnx device joins a real deployment on 127.0.0.1 (TLS and
  device authentication on) beside torch devices, pulls the signed training graph and
  trains every round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedge.server.pki import add_device
from fedge.simulation.loopback import LoopbackFederation

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


# What would let another install's packages leak into a fresh venv: an earlier test in the same
# process may have put this checkout's environment on PYTHONPATH (fedge's CLI adds the working
# directory for package.module:object tasks, and Ray passes paths on to its workers).
LEAKY = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PIP_TARGET", "PIP_PREFIX")


def _clean_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key not in LEAKY}


def _venv(root: Path, extra: str) -> Path:
    """A fresh venv with ``fedge[extra]`` from this checkout; its bin directory."""
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=300, env=_clean_env())
    install = subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "--quiet",
                              f"{REPO}[{extra}]"], capture_output=True, text=True, timeout=1200, env=_clean_env())
    assert install.returncode == 0, install.stderr[-3000:]
    return root / "bin"


def _run(python: Path, code: str, *args: str) -> str:
    result = subprocess.run([str(python), "-c", code, *args], capture_output=True, text=True, timeout=300,
                            env=_clean_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


NOTHING_HEAVY = """
import importlib.util, json
print(json.dumps({name: importlib.util.find_spec(name) is not None
                  for name in ("torch", "flwr", "ray", "sklearn", "matplotlib", "onnxruntime")}))
"""

PREDICT = """
import json, sys
import numpy as np
from fedge.edge import EdgeModel
model = EdgeModel.load(sys.argv[1], trusted_keys=[sys.argv[2]])
prediction = model.predict(np.load(sys.argv[3]))
print(json.dumps({"classes": prediction.labels.tolist(), "torch": "torch" in sys.modules}))
"""


def test_the_edge_install_verifies_and_runs_a_bundle_without_torch_or_flower(tmp_path: Path) -> None:
    # Prepare: a signed bundle of a trained digits model, made by the full install
    from fedge.simulation.runner import simulate

    run_dir, _ = simulate({"fleet": "laptop=4", "clients-per-round": 4, "num-rounds": 2, "model": "mlp",
                           "run-dir": str(tmp_path / "run")}, progress=False)
    bundle = run_dir / "bundles" / "round-0002"
    from fedge.edge import EdgeModel

    expected = EdgeModel.load(bundle, trusted_keys=[run_dir / "keys" / "signing.pub"])
    images = np.random.default_rng(0).uniform(0, 16, size=(5, 64)).astype(np.float32)
    np.save(tmp_path / "images.npy", images)
    # Execute: the edge role's install, then its path
    bin_dir = _venv(tmp_path / "edge-venv", "edge")
    present = json.loads(_run(bin_dir / "python", NOTHING_HEAVY))
    got = json.loads(_run(bin_dir / "python", PREDICT, str(bundle), str(run_dir / "keys" / "signing.pub"),
                          str(tmp_path / "images.npy")))
    verify = subprocess.run([str(bin_dir / "fedge"), "verify", str(bundle), "--trusted",
                             str(run_dir / "keys" / "signing.pub")], capture_output=True, text=True, timeout=120,
                            env=_clean_env())
    # Assert: no torch, no Flower, the same predictions as the full install
    assert present == {"torch": False, "flwr": False, "ray": False, "sklearn": False, "matplotlib": False,
                       "onnxruntime": True}
    assert got == {"classes": expected.predict(images).labels.tolist(), "torch": False}
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.fixture
def device_role(tmp_path: Path) -> Path:
    """The device role's install (no torch) in a fresh venv: its bin directory (built outside the deployment slot)."""
    return _venv(tmp_path / "device-venv", "device")


@pytest.mark.deployment(slot="call")
def test_an_onnx_device_without_torch_trains_in_a_deployment(device_role: Path, tmp_path: Path) -> None:
    # Prepare: the device role's install (no torch), a coordinator and 3 devices: two torch, one onnx
    bin_dir = device_role
    present = json.loads(_run(bin_dir / "python", NOTHING_HEAVY))
    federation = LoopbackFederation(tmp_path / "fleet", num_devices=3)
    try:
        federation.start_coordinator("--rounds", "2", "--clients-per-round", "3",
                                     "--run-config", "model='mlp' local-epochs=2 export-onnx=false")
        federation.wait_for(federation.bundle_signing_key.exists, 900, "the bundle signing key")
        # Execute
        federation.start_device(0)
        federation.start_device(1)
        # the onnx device once the run's graph is published (a loaded machine takes longer to export it
        # than the device waits for a graph that is not there: it then stops, as it should)
        federation.wait_for((federation.root / "state" / "published" / "training.zip").exists, 900,
                            "the published training graph")
        federation.start_device(2, None, "--runtime", "onnx", "--trust", str(federation.bundle_signing_key),
                                fedge=str(bin_dir / "fedge"))
        federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 900, "the summary")
        rows = federation.rows()
        device_log = federation.log("device2")
    finally:
        federation.close()
    # Assert: the onnx device had no torch, pulled the signed graph, and every round took all 3 updates
    assert present["torch"] is False and present["flwr"] is True
    assert "training graph updated" in device_log, device_log
    assert [row["round"] for row in rows] == [0, 1, 2]
    assert all(row["aggregated"] and row["participants"] == 3 and row["rejected"] == 0 for row in rows[1:])
    assert rows[2]["accuracy"] > rows[0]["accuracy"] + 0.3


def test_an_onnx_device_refuses_to_start_without_the_signing_key(tmp_path: Path) -> None:
    # Prepare: keys and data, no coordinator needed (the check comes first)
    from fedge.server.pki import init_keys

    keys = init_keys(tmp_path / "keys")
    add_device(tmp_path / "keys", "dev0")
    np.savez(tmp_path / "dev0.npz", x=np.zeros((4, 64), np.float32), y=np.zeros(4, np.int64))
    # Execute
    result = subprocess.run([str(Path(sys.executable).with_name("fedge")), "device", "--coordinator",
                             "127.0.0.1:1", "--data", str(tmp_path / "dev0.npz"), "--runtime", "onnx",
                             "--key", str(tmp_path / "keys" / "devices" / "dev0.key"), "--ca", str(keys.ca_cert)],
                            capture_output=True, text=True, timeout=120)
    # Assert: one line naming the fix, exit 2
    assert result.returncode == 2
    assert "--runtime onnx needs --trust" in result.stderr
