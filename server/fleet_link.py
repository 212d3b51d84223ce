"""The coordinator's line to its SuperLink's Control API: one helper process for the coordinator's life.

The device sync (:meth:`fedge.server.coordinator.Coordinator.sync_devices`: at start, then
every 10 s) registers and unregisters device keys through Flower's own Control API client,
in a helper process, so that the coordinator process never imports Flower's CLI stack.
Started for each look, the helper cost about 1 CPU-second of imports every 10 s, a tenth of
a core for an idle coordinator (3.9 % of the CPU sampled over a suite run's last 12 minutes).
Now it is started once and answers one JSON line per request. It ends when its stdin
closes (the coordinator gone, however it went) and is stopped with Flower's processes (it
runs with the coordinator's ``FLWR_HOME``). The tracebacks of its failed looks go to
``STATE_DIR/fleet-link.log``.

Why not Flower's ``flwr supernode list`` CLI: one command per operation (list, register,
unregister, stop a run), a process each, and no stop of stale runs in one look.
"""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from fedge.errors import FedgeError
from fedge.files import open_private_append

ANSWER_S = 60.0  # a look the SuperLink has not answered in this long is given up (and its helper restarted)

_HELPER = """
import json, os, sys, traceback
# answers go to the real stdout; what Flower prints ("Using SuperLink: ..." at every look) goes nowhere, never
# into an answer (its errors come back as answers, their tracebacks in the log)
answers = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
from flwr.cli.flower_config import read_superlink_connection
from flwr.cli.utils import init_http_client_from_connection
from flwr.proto.control_pb2 import (ListNodesRequest, ListRunsRequest, RegisterNodeRequest, StopRunRequest,
                                    UnregisterNodeRequest)


def look(connection, modes, keys):
    out = {"registered": [], "unregistered": [], "revoked_keys": [], "failed": {}, "stopped_runs": []}
    client = init_http_client_from_connection(read_superlink_connection(connection))
    try:
        if "stop-stale" in modes:
            for run_id, run in client.ListRuns(ListRunsRequest()).run_dict.items():
                if run.status.status != "finished":
                    client.StopRun(StopRunRequest(run_id=run_id))
                    out["stopped_runs"].append(str(run_id))
        nodes = list(client.ListNodes(ListNodesRequest()).nodes_info)
        if "sync" in modes:
            seen = {n.public_key: n for n in nodes}
            for key, name in keys.items():
                if key not in seen:
                    try:
                        client.RegisterNode(RegisterNodeRequest(public_key=key, name=name))
                        out["registered"].append(name)
                    except Exception as exc:
                        out["failed"][name] = str(exc)
                elif seen[key].status == "unregistered":
                    out["revoked_keys"].append(name)
            for node in nodes:
                if node.status != "unregistered" and node.public_key and node.public_key not in keys:
                    client.UnregisterNode(UnregisterNodeRequest(node_id=node.node_id))
                    out["unregistered"].append(str(node.node_id))
            if out["registered"] or out["unregistered"]:
                nodes = list(client.ListNodes(ListNodesRequest()).nodes_info)
    finally:
        client.close()
    out["nodes"] = [{"node_id": str(n.node_id), "status": n.status, "name": keys.get(n.public_key, "")}
                    for n in nodes]
    return out


for line in sys.stdin:
    request = json.loads(line)
    try:
        out = look(request["connection"], request["modes"],
                   {pem.encode(): name for pem, name in request["keys"].items()})
    except Exception as exc:
        traceback.print_exc()
        out = {"error": traceback.format_exception_only(exc)[-1].strip()}
    print(json.dumps(out), file=answers, flush=True)
"""


class FleetLink:
    """One helper process answering device looks, started at the first and again after one died.

    Threat model: the helper runs with the coordinator's environment and user; requests and
    answers (device public keys, names, node ids) cross a pipe between the two processes only.
    """

    def __init__(self, env: Callable[[], dict[str, str]], log_path: Path, *, answer_s: float = ANSWER_S) -> None:
        self._env, self.log_path, self.answer_s = env, log_path, answer_s
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._mark = 0  # the log's size when the current request began: what the helper logged since is its reason

    def ask(self, *, connection: str, modes: list[str], keys: dict[str, str]) -> dict[str, Any]:
        """One look: ``modes`` of ``list``, ``sync``, ``stop-stale``; ``keys``: ``{public key PEM: name}``.

        Raises
        ------
        FedgeError
            The helper gave no answer (it died, or the SuperLink did not answer within
            ``answer_s``) or reported an error; the message says why in one line.
        """
        request = (json.dumps({"connection": connection, "modes": modes, "keys": keys}) + "\n").encode()
        with self._lock:
            process = self._running()
            self._mark = _size(self.log_path)
            try:
                _stdin(process).write(request)
                _stdin(process).flush()
                line = self._answer(process)
            except OSError:
                line = b""
            if line is None:
                self._end(process)
                raise FedgeError(f"listing the coordinator's devices failed: the SuperLink's Control API did not "
                                 f"answer within {self.answer_s:.0f} s")
            if not line.strip():
                self._end(process)
                raise FedgeError(f"listing the coordinator's devices failed: {self._why(process)}")
        try:
            out: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError:
            raise FedgeError(f"listing the coordinator's devices failed: its helper answered {line[:200]!r}") from None
        if "error" in out:
            raise FedgeError(f"listing the coordinator's devices failed: {str(out['error'])[-300:]}")
        return out

    def close(self) -> None:
        """End the helper (closing its stdin; it is killed if it does not end at once)."""
        with self._lock:
            if self._process is not None:
                self._end(self._process)

    def _running(self) -> subprocess.Popen[bytes]:
        if self._process is None or self._process.poll() is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open_private_append(self.log_path) as log:
                self._process = subprocess.Popen([sys.executable, "-c", _HELPER], stdin=subprocess.PIPE,
                                                 stdout=subprocess.PIPE, stderr=log, env=self._env())
        return self._process

    def _answer(self, process: subprocess.Popen[bytes]) -> bytes | None:
        """The helper's answer line (b"" if it ended first), or None if none came within ``answer_s`` (POSIX: a
        pipe is selectable)."""
        stdout = process.stdout
        assert stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            if not selector.select(self.answer_s):
                process.kill()
                return None
        return stdout.readline()

    def _end(self, process: subprocess.Popen[bytes]) -> None:
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self._process = None

    def _why(self, process: subprocess.Popen[bytes]) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._mark)
                lines = log.read().decode(errors="replace").splitlines()
        except OSError:
            lines = []
        return why_no_answer(process.returncode, lines)


def why_no_answer(returncode: int | None, log_lines: list[str]) -> str:
    """Why a helper process gave no answer, in one line: its last error line, else how it ended."""
    lines = [line.strip() for line in log_lines if line.strip()]
    if lines:
        return lines[-1][-300:]
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"its helper process was stopped by {name} before it answered"
    return f"its helper process exited with status {returncode} and printed nothing"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _stdin(process: subprocess.Popen[bytes]) -> IO[bytes]:
    assert process.stdin is not None
    return process.stdin
