"""``fedge simulate --backend ray --ray-address``: a run joins an existing two-node Ray cluster (slow).

The cluster is two Ray nodes on this machine, on loopback: a head (``ray start --head``, 1 CPU)
and a second node with its own resources (1 CPU and a custom ``second`` resource). Each device
call records the Ray node it ran on; the run must have used both nodes.

Teardown stops only this test's Ray processes, by pid (those whose command line names the
test's own Ray temp dir or its head's port, and their children): ``ray stop --force`` would also
stop any other Ray instance on the machine.

Loopback: both nodes are started with ``--node-ip-address 127.0.0.1``, but Ray on Linux
replaces a loopback node address by the machine's own interface address
(``ray._private.services.resolve_ip_for_localhost``) as soon as more than one node may join, so
the cluster listens on this machine's address; keep it on a machine without untrusted neighbours.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from fedge.simulation.runner import simulate

RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    from fedge.simulation.loopback import free_port

    return free_port(1)  # a port of this xdist worker's own


def _ray(*args: str, temp_dir: str) -> None:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([RAY, "start", *args, "--node-ip-address", "127.0.0.1", "--temp-dir", temp_dir,
                           "--disable-usage-stats"], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _stop_cluster(temp_dir: str, port: int) -> None:
    """Terminate this cluster's processes (and their children) by pid; kill what lingers."""
    ours: dict[int, psutil.Process] = {}
    marks = (temp_dir, f":{port} ", f":{port}\0")
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            line = " ".join(proc.info["cmdline"] or []) + "\0"
            if any(mark in line for mark in marks):
                for member in [proc, *proc.children(recursive=True)]:
                    ours[member.pid] = member
    ours.pop(os.getpid(), None)
    for proc in ours.values():
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(list(ours.values()), timeout=10)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()


@pytest.fixture
def two_node_cluster() -> Iterator[str]:
    """A Ray head plus a second node on 127.0.0.1; yields the head's address."""
    temp_dir = tempfile.mkdtemp(prefix="fedge-ray-")  # short: Ray's socket paths live under it
    port = _free_port()
    try:
        _ray("--head", "--port", str(port), "--num-cpus", "1", "--include-dashboard", "false", temp_dir=temp_dir)
        _ray("--address", f"127.0.0.1:{port}", "--num-cpus", "1", "--resources", json.dumps({"second": 1}),
             temp_dir=temp_dir)
        yield f"127.0.0.1:{port}"
    finally:
        _stop_cluster(temp_dir, port)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _recording(inner: Any, record_dir: str) -> Any:
    """fedge's ClientApp, wrapped to write the Ray node id of every call into ``record_dir``."""
    from flwr.clientapp import ClientApp  # noqa: PLC0415 - the wrapper is pickled by value to Ray's workers

    app = ClientApp()

    def note() -> None:
        import uuid  # noqa: PLC0415

        import ray  # noqa: PLC0415

        node = ray.get_runtime_context().get_node_id()
        (Path(record_dir) / f"{node}.{uuid.uuid4().hex}").write_text(node)

    @app.train()
    def train(msg: Any, context: Any) -> Any:
        note()
        return inner(message=msg, context=context)

    @app.evaluate()
    def evaluate(msg: Any, context: Any) -> Any:
        note()
        return inner(message=msg, context=context)

    return app


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # a local Ray instance started meanwhile would join this cluster
def test_a_run_joins_a_two_node_ray_cluster_and_uses_both_nodes(
        two_node_cluster: str, fast_config: dict[str, Any], tmp_path: Path) -> None:
    # Prepare: fedge's own device app, wrapped to record where each call ran
    from fedge.clients.app import make_client_app  # noqa: PLC0415
    from fedge.config import resolve_run_config  # noqa: PLC0415

    fast_config.update({"num-rounds": 2, "export-onnx": False})
    record_dir = tmp_path / "nodes"
    record_dir.mkdir()
    app = _recording(make_client_app(config_defaults=resolve_run_config(fast_config)), str(record_dir))
    # Execute
    run_dir, summary = simulate(fast_config, backend="ray", progress=False, ray_address=two_node_cluster,
                                client_app=app)
    # Assert: every round trained 4 devices, and devices ran on both of the cluster's nodes
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds"] == 2 and [row["participants"] for row in rows[1:]] == [4, 4]
    nodes = {path.read_text() for path in record_dir.iterdir()}
    assert len(list(record_dir.iterdir())) >= 8
    assert len(nodes) == 2, nodes


def test_ray_address_needs_the_ray_backend(fast_config: dict[str, Any]) -> None:
    from fedge.errors import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError, match="needs --backend ray"):
        simulate(fast_config, backend="inline", ray_address="127.0.0.1:6379", progress=False)
