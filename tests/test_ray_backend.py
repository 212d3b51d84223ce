"""The same apps on Flower's Ray simulation engine (slow: Ray start-up)."""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path
from typing import Any

import pytest

from fedge.simulation.runner import simulate


def _noting_listeners(inner: Any, driver_pid: int, record_dir: str) -> Any:
    """fedge's ClientApp, wrapped to write, from Ray's worker during each call, every TCP socket
    that a process of the driver's tree (the driver, Ray's GCS, raylet, agents, workers) listens on."""
    from flwr.clientapp import ClientApp  # noqa: PLC0415 - the wrapper is pickled by value to Ray's workers

    app = ClientApp()

    def note() -> None:
        import contextlib  # noqa: PLC0415
        import uuid  # noqa: PLC0415

        import psutil  # noqa: PLC0415

        driver = psutil.Process(driver_pid)
        seen = []
        for proc in [driver, *driver.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                seen += [[proc.name(), sock.laddr.ip, sock.laddr.port] for sock in proc.net_connections("tcp")
                         if sock.status == psutil.CONN_LISTEN]
        (Path(record_dir) / uuid.uuid4().hex).write_text(json.dumps(seen))

    @app.train()
    def train(msg: Any, context: Any) -> Any:
        note()
        return inner(message=msg, context=context)

    return app


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one local Ray instance at a time: a new one joins one already running
def test_ray_backend_runs_the_same_apps_for_two_rounds(fast_config: dict[str, Any], tmp_path: Path) -> None:
    # Prepare: fedge's device app, wrapped to note the sockets Ray's processes listen on mid-run
    from fedge.clients.app import make_client_app  # noqa: PLC0415
    from fedge.config import resolve_run_config  # noqa: PLC0415

    fast_config.update({"num-rounds": 2, "export-onnx": False})
    pythonpath = os.environ.get("PYTHONPATH")
    record_dir = tmp_path / "listeners"
    record_dir.mkdir()
    app = _noting_listeners(make_client_app(config_defaults=resolve_run_config(fast_config)), os.getpid(),
                            str(record_dir))
    # Execute
    run_dir, summary = simulate(fast_config, backend="ray", progress=False, client_app=app)
    # Assert: the local Ray instance (GCS, raylet, workers) listened on loopback only; no peer could join
    listening = [entry for path in record_dir.iterdir() for entry in json.loads(path.read_text())]
    assert {"gcs_server", "raylet"} <= {name for name, _, _ in listening}, listening
    assert [entry for entry in listening if not _loopback(entry[1])] == []
    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") is None  # a later run may join a cluster
    # Flower's Ray backend puts this process's sys.path on PYTHONPATH; fedge puts it back
    assert os.environ.get("PYTHONPATH") == pythonpath
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds"] == 2
    assert [row["participants"] for row in rows[1:]] == [4, 4]
    assert rows[-1]["accuracy"] > rows[0]["accuracy"]
    assert rows[-1]["sim_time_s"] > 0  # profiles resolved from the fleet by partition id


USER_TASK = '''
import numpy as np
from torch import nn
from fedge.signature import InputSpec
from fedge.task.api import Task, TaskData


class Wave(Task):
    """Regression of sin(3x) on x: a user's task, on Ray's workers too."""

    name, headline, higher_is_better = "wave", "mse", False
    inputs, labels, target_dtype = (InputSpec("x", ("batch", 1)),), None, "float32"

    def __init__(self):
        x = np.linspace(-1, 1, 400, dtype=np.float32)[:, None]
        self.data = TaskData.from_xy(x, np.sin(3 * x[:, 0]).astype(np.float32))

    def build_model(self):
        return nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))

    def train_data(self):
        return self.data

    def central_data(self):
        return self.data.take(slice(0, 400, 4))

    def loss(self, outputs, targets):
        return nn.functional.mse_loss(outputs.squeeze(-1), targets)

    def metrics(self, outputs, targets):
        return {"mse": float(self.loss(outputs, targets))}
'''


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_a_task_outside_fedge_runs_on_ray(fast_config: dict[str, Any], tmp_path: Any,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the user's module, importable by the driver and by Ray's workers (PYTHONPATH)
    code = tmp_path / "code"
    code.mkdir()
    (code / "user_wave.py").write_text(USER_TASK)
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.setenv("PYTHONPATH", str(code))
    fast_config.update({"num-rounds": 2, "export-onnx": False, "task": "user_wave:Wave", "partitioner": "iid",
                        "learning-rate": 0.1})
    # Execute
    run_dir, summary = simulate(fast_config, backend="ray", progress=False)
    # Assert: the user's headline went down on Ray's workers
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["task"] == "wave" and summary["headline"] == "mse"
    assert [row["participants"] for row in rows[1:]] == [4, 4] and rows[-1]["mse"] < rows[0]["mse"]


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_ray_backend_runs_a_fleet_of_torch_and_onnx_devices(tmp_path: Any) -> None:
    # Prepare: 3 onnx phones and 3 torch laptops, every device every round, on Ray's workers
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[profiles.phone-onnx]\ncompute-rate = 200.0\nuplink-mbps = 2.0\ndownlink-mbps = 10.0\n'
                     'memory-mb = 2048\nruntime = "onnx"\n\n[fleet]\nphone-onnx = 3\nlaptop = 3\n')
    overrides = {"fleet-file": str(fleet), "clients-per-round": 6, "num-rounds": 2, "model": "mlp",
                 "local-epochs": 1, "export-onnx": False, "run-dir": str(tmp_path / "run")}
    # Execute
    run_dir, summary = simulate(overrides, backend="ray", progress=False)
    # Assert: both runtimes' updates accepted each round
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds"] == 2 and summary["failed"] == 0
    for row in rows[1:]:
        assert row["participants_by_profile"] == {"phone-onnx": 3, "laptop": 3}
    assert rows[-1]["accuracy"] > rows[0]["accuracy"]
