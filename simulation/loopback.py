"""A real deployment on one machine: coordinator and devices as processes on 127.0.0.1.

Used by the deployment tests and ``bench/deploy_latency.py``: keys from
``fedge keys init``, IID digits shards as each device's data file, ``fedge
coordinator start`` and ``fedge device`` as subprocesses, and clean-up that
also reaches the helpers Flower starts in sessions of their own.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from fedge import knobs
from fedge.config import resolve_run_config
from fedge.server.pki import add_device, init_keys
from fedge.server.report import read_jsonl
from fedge.task.loading import load_task

FEDGE = str(Path(sys.executable).with_name("fedge"))


COORDINATOR_PORTS = 3  # a coordinator at port P takes P (devices), P + 1 (bundles) and P + 2 (health, metrics)

# Ports are chosen below the kernel's ephemeral range (32768-60999 on Linux), which bind(("", 0)) and
# every outgoing connection draw from: a port handed out here is not taken by some client socket
# between the check and the coordinator's bind. Each pytest-xdist worker (PYTEST_XDIST_WORKER=gwN)
# walks a slice of its own, so two workers of a run never hand out the same port; a process outside
# xdist has slice 0. The walk starts at a random place in the slice (two separate runs at once rarely
# meet) and moves on with every call (a port handed out is not handed out again before its slice wraps).
PORT_BASE, PORT_SLICE, PORT_SLICES = 20000, 800, 16  # 20000 .. 32799: above Ray's worker ports (10002-19999)
_next_offset: int | None = None


def _port_slice() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        return 1 + int(worker[2:]) % (PORT_SLICES - 1)
    return 0


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere the bind check below still holds


def free_port(span: int = COORDINATOR_PORTS) -> int:
    """A TCP port P on 127.0.0.1 such that nothing is bound to P .. P + span - 1 right now (by default the
    ports a coordinator at P takes: a free P whose P + 1 was taken made a test's bundle service fail),
    from this process's slice of the ports below the ephemeral range (see ``PORT_BASE``)."""
    global _next_offset
    low = PORT_BASE + _port_slice() * PORT_SLICE
    if low + PORT_SLICE > min(_ephemeral_low(), 65536):  # a machine whose ephemeral range starts low
        return _any_free_port(span)
    if _next_offset is None:
        _next_offset = random.randrange(PORT_SLICE)
    for _ in range(PORT_SLICE):
        if _next_offset + span > PORT_SLICE:
            _next_offset = 0
        port, _next_offset = low + _next_offset, _next_offset + span
        if all(_bindable(port + step) for step in range(span)):
            return port
    raise RuntimeError(f"no {span} consecutive free ports on 127.0.0.1 in {low} .. {low + PORT_SLICE - 1}")


def _any_free_port(span: int) -> int:
    """A free P .. P + span - 1 starting at a port the kernel hands out (the ephemeral range)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port + span <= 65536 and all(_bindable(port + step) for step in range(1, span)):
            return port
    raise RuntimeError(f"no {span} consecutive free ports on 127.0.0.1 in 200 tries")


def _bindable(port: int) -> bool:
    """Whether a listener could bind ``port`` on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT does not count
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class LoopbackFederation:
    """Keys, device data, one coordinator and N devices, all under ``root``; :meth:`close` cleans up.

    Parameters
    ----------
    root : Path
        Everything (keys, data, state, logs, the run) goes here.
    num_devices : int
        Devices with keys and data (started with :meth:`start_device`).
    env : dict, optional
        Extra environment for every process (e.g. Flower's poll intervals).
    """

    def __init__(self, root: Path, num_devices: int, env: dict[str, str] | None = None) -> None:
        self.root, self.port, self.extra_env = root, free_port(), dict(env or {})
        self.keys = init_keys(root / "keys")
        config = resolve_run_config({knobs.PARTITIONER: "iid"})
        task = load_task(config)
        for index in range(num_devices):
            shard = task.partition(index, num_devices, config)
            add_device(root / "keys", f"dev{index}")
            np.savez(root / f"dev{index}.npz", x=shard.inputs[0], y=shard.targets)
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.devices: dict[int, subprocess.Popen[bytes]] = {}
        self.run_dir = root / "run"

    def spawn(self, argv: list[str], log: str, fedge: str = FEDGE) -> subprocess.Popen[bytes]:
        """Run ``fedge`` (this environment's, unless another install's is given) with ``argv``."""
        env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", **self.extra_env}
        if fedge != FEDGE:  # another virtualenv: its own bin first, nothing of this one's
            env["PATH"] = f"{Path(fedge).parent}{os.pathsep}{env.get('PATH', '')}"
            for leaky in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):  # nothing of this install may leak in
                env.pop(leaky, None)
        with (self.root / log).open("ab") as out:
            return subprocess.Popen([fedge, *argv], stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)

    def start_coordinator(self, *extra: str, resume: bool = False) -> None:
        """``fedge coordinator start`` with TLS + auth on this federation's port."""
        where = ["--resume", str(self.run_dir)] if resume else ["--run-dir", str(self.run_dir)]
        self.coordinator = self.spawn(
            ["coordinator", "start", "--keys", str(self.keys.directory),
             "--state-dir", str(self.root / "state"), "--port", str(self.port), *where, *extra],
            "coordinator.log")

    @property
    def bundle_signing_key(self) -> Path:
        """The public key the coordinator signs bundles with (made at its first start)."""
        return self.keys.directory / "bundle-signing" / "signing.pub"

    def start_device(self, index: int, key: Path | None = None, *extra: str,
                     fedge: str = FEDGE) -> subprocess.Popen[bytes]:
        """``fedge device`` number ``index`` (its own key unless ``key`` is given; ``fedge``: which install)."""
        self.devices[index] = self.spawn(
            ["device", "--coordinator", f"127.0.0.1:{self.port}", "--profile", "laptop",
             "--data", str(self.root / f"dev{index}.npz"),
             "--key", str(key or self.root / "keys" / "devices" / f"dev{index}.key"),
             "--ca", str(self.keys.ca_cert), "--state-dir", str(self.root / f"device{index}"), *extra],
            f"device{index}.log", fedge)
        return self.devices[index]

    def rows(self) -> list[dict[str, Any]]:
        """The run's metrics so far (a partial last line is skipped)."""
        path = self.run_dir / "metrics.jsonl"
        return read_jsonl(path) if path.exists() else []

    def wait_for(self, condition: Any, timeout: float, what: str) -> None:
        """Poll ``condition`` until true; raise with the coordinator's log on timeout or crash."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            if self.coordinator is not None and self.coordinator.poll() not in (None, 0):
                code = self.coordinator.returncode
                raise AssertionError(f"coordinator exited {code}:\n{self.log('coordinator')}")
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}\n{self.log('coordinator')}")

    def log(self, name: str) -> str:
        """A process's log (``coordinator``, ``device0``, ...), whole: a line looked for may be early."""
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill_coordinator_hard(self) -> None:
        """SIGKILL the coordinator and every Flower process it started, as a host crash would."""
        assert self.coordinator is not None
        os.killpg(self.coordinator.pid, signal.SIGKILL)
        self.coordinator.wait()
        self._kill_marked(str(self.root / "state"))

    def kill_device(self, index: int) -> None:
        """SIGKILL device ``index`` and its Flower helpers."""
        os.killpg(self.devices[index].pid, signal.SIGKILL)
        self.devices[index].wait()
        self._kill_marked(str(self.root / f"device{index}"))

    def stop(self, process: subprocess.Popen[bytes], signum: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Send ``signum`` to ``process`` alone (as a supervisor does) and return its exit status."""
        process.send_signal(signum)
        return process.wait(timeout)

    def leftovers(self, marker: Path | None = None) -> list[str]:
        """``pid name`` of live processes whose FLWR_HOME lies under ``marker`` (default: this federation)."""
        found = []
        for proc in psutil.process_iter(["pid", "name"]):
            try:
                if proc.status() != psutil.STATUS_ZOMBIE and \
                        proc.environ().get("FLWR_HOME", "").startswith(str(marker or self.root)):
                    found.append(f"{proc.pid} {proc.info['name']}")
            except (psutil.Error, OSError):
                continue
        return found

    @staticmethod
    def _kill_marked(marker: str) -> None:
        """Kill processes whose FLWR_HOME lies under ``marker`` (Flower detaches some helpers)."""
        for proc in psutil.process_iter(["pid"]):
            try:
                if proc.environ().get("FLWR_HOME", "").startswith(marker):
                    proc.kill()
            except (psutil.Error, OSError):
                continue

    def close(self) -> None:
        """Kill every process this federation started."""
        for proc in [self.coordinator, *self.devices.values()]:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._kill_marked(str(self.root))
