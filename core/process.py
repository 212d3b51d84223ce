"""Starting Flower's processes the same way on both sides (coordinator and device).

Every Flower process fedge starts gets the same environment: Flower's home under the
caller's state directory, telemetry, update checks and runtime dependency installation
off, and the console scripts of the interpreter fedge runs in.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Settable Flower knobs that lower round latency (see bench/deploy_latency.py). A device's SuperExec launches a
# ClientApp process for every message, so its poll is on each round's path; the coordinator's launches the ServerApp
# once a run, and its 0.1 s poll only cost the SuperLink a tenth of a core while idle (0.17 -> 0.07 CPU-s a second).
SUPEREXEC_POLL_S = "0.1"
COORDINATOR_SUPEREXEC_POLL_S = "1.0"


def flower_env(flwr_home: Path, *, superexec_poll_s: str = SUPEREXEC_POLL_S) -> dict[str, str]:
    """Environment for every Flower process fedge starts (``superexec_poll_s``: its SuperExec's task poll)."""
    return {
        **os.environ,
        # Flower starts its helpers (flower-superexec, flwr-serverapp, ...) from PATH.
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "FLWR_HOME": str(flwr_home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": os.environ.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL",
                                                            superexec_poll_s),
    }


def flower_bin(name: str) -> str:
    """A Flower console script next to this interpreter (the same virtualenv)."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


def processes_of(flwr_home: Path, program: str | None = None) -> list[int]:
    """Ids of live processes whose ``FLWR_HOME`` is ``flwr_home``: every Flower process fedge started for it.

    Flower starts its helpers (SuperExec, ServerApp, ClientApp) in sessions of their own, so
    a process group does not reach them; the environment every one of them inherits does.
    ``program`` (e.g. ``flwr-serverapp``): only processes whose command line names it.
    """
    marker, found = str(flwr_home), []
    if not Path("/proc/self/environ").exists():  # not Linux: psutil (the sim extra) reads environments
        import psutil  # noqa: PLC0415

        for proc in psutil.process_iter(["pid"]):
            try:
                if (proc.pid != os.getpid() and proc.environ().get("FLWR_HOME") == marker
                        and (program is None or _runs(proc.cmdline(), program))):
                    found.append(proc.pid)
            except (psutil.Error, OSError):
                continue
        return found
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            variables = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"FLWR_HOME={marker}".encode() in variables and int(entry.name) != os.getpid() \
                and (program is None or _names(entry, program)):
            found.append(int(entry.name))
    return found


def _names(entry: Path, program: str) -> bool:
    """Whether the process ``/proc/PID`` runs ``program``: its executable or (a console script under an
    interpreter) its first argument is named so."""
    try:
        argv = [os.fsdecode(word) for word in (entry / "cmdline").read_bytes().split(b"\0")[:2]]
    except OSError:
        return False
    return _runs(argv, program)


def _runs(argv: list[str], program: str) -> bool:
    """Whether a command line runs ``program``: its executable or its first argument is named so."""
    return any(Path(word).name == program for word in argv[:2] if word)


def signal_processes(flwr_home: Path, *, term_s: float, kill_s: float, program: str | None = None) -> None:
    """SIGTERM the processes of ``flwr_home`` (``program``: only those running it), SIGKILL what is left after
    ``term_s``, and wait up to ``kill_s`` for those to go."""
    for signum, wait_s in ((signal.SIGTERM, term_s), (signal.SIGKILL, kill_s)):
        for pid in processes_of(flwr_home, program):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
        deadline = time.monotonic() + wait_s
        while processes_of(flwr_home, program) and time.monotonic() < deadline:
            time.sleep(0.2)


def stop_processes(flwr_home: Path, first: list[subprocess.Popen[Any]], grace_s: float = 10.0) -> None:
    """SIGTERM ``first`` and every process of ``flwr_home``; SIGKILL what is left after ``grace_s``."""
    for process in first:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in first:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    signal_processes(flwr_home, term_s=max(0.0, deadline - time.monotonic()), kill_s=5.0)
