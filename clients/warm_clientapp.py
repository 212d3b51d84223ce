"""A device's ClientApp processes forked from one warm parent, not started cold for every message.

Why: Flower 1.42's SuperExec starts a fresh ``flwr-clientapp`` process for every message a device
receives (``subprocess.Popen(["flwr-clientapp", ...])``, fire and forget), and that process imports
Python's Flower, fedge and the device's runtime (torch alone is ~2 s of CPU) before it trains: on
a small device it is most of a round's time (``bench/deploy_latency.py``). Nothing in Flower keeps
them warm outside Kubernetes (its prestarted workers are for warm Pods).

What this module does instead (run as ``python -m fedge.clients.warm_clientapp`` in place of
``flower-superexec``, by :mod:`fedge.clients.supernode`):

1. It starts a **warm parent** (``--warm-parent``) before Flower's SuperExec starts: one process that
   imports Flower's ClientApp runtime, :mod:`fedge.clients.app` and the device runtime's modules
   (:attr:`fedge.clients.runtimes.RuntimeHandlers.warm`), starts no thread, and then waits for
   launches on its stdin (one JSON list of arguments a line).
2. It runs Flower's own SuperExec in this process with its launcher's ``subprocess.Popen`` of
   ``flwr-clientapp`` replaced by a line to the warm parent.
3. For each line the warm parent forks; the child reseeds what a new process would have fresh
   (numpy's and torch's global generators; Python's ``random`` reseeds itself on fork), takes
   ``/dev/null`` for stdin (and for stdout and stderr where Flower asked for no output), and runs
   Flower's own ``flwr-clientapp`` entry point with the same arguments: the same token, the same
   ``--parent-pid`` watch on the SuperExec. Children are reaped by the kernel (``SIGCHLD``
   ignored), as Flower never waits for them either.

If the warm parent is gone (it exits when the SuperExec's end of its stdin closes, or died), a
launch falls back to Flower's own cold process, and the first such fallback says so once.

Threat model: unchanged from Flower's subprocess isolation. The warm parent runs as the device's
user with the device's environment, like the processes it replaces; it takes launches only from
its own stdin, a pipe only the SuperExec that started it holds. Each message's ClientApp is still a
process of its own (a fork), so one message's state never reaches the next.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import IO, Any

CLIENTAPP = "flwr-clientapp"
"""The program Flower's SuperExec starts for each message."""


def warm_modules(runtime: str) -> list[str]:
    """The modules a warm parent imports for a device of ``runtime`` ("" for a gateway node: no runtime)."""
    modules = ["flwr.supernode.cli.flwr_clientapp", "fedge.clients.app"]
    if runtime:
        from fedge.clients.runtimes import handlers_for

        modules += handlers_for(runtime).warm
    return modules


def serve(modules: Sequence[str], commands: IO[str]) -> None:
    """The warm parent: import ``modules``, then fork a ClientApp for each launch line on ``commands``."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:  # an install without it (e.g. no torch): its children import what they need
            print(f"warm ClientApp parent: {name} not preloaded ({exc})", file=sys.stderr, flush=True)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    for line in commands:
        launch = json.loads(line)
        if os.fork() == 0:
            _run_child(list(launch["args"]), quiet=bool(launch["quiet"]))


def _run_child(args: list[str], *, quiet: bool) -> None:
    """In a forked child: become a fresh ``flwr-clientapp`` with ``args`` and exit with its status."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _reseed()
        _redirect(quiet=quiet)
        from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

        sys.argv = [CLIENTAPP, *args[1:]]
        flwr_clientapp()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a child must never return into the parent's loop
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reseed() -> None:
    """Fresh global generators, as a new process would have (a fork copies the parent's state)."""
    import numpy as np

    np.random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


def _redirect(*, quiet: bool) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    if quiet:
        os.dup2(null, 1)
        os.dup2(null, 2)
    os.close(null)


class _WarmLauncher:
    """``subprocess.Popen`` for Flower's SuperExec launcher: ``flwr-clientapp`` goes to the warm parent."""

    def __init__(self, parent: subprocess.Popen[str]) -> None:
        self.parent = parent
        self.fell_back = False

    def popen(self, args: Any, *rest: Any, **options: Any) -> Any:
        if isinstance(args, list) and args and args[0] == CLIENTAPP and self._send(args, options):
            return None  # Flower keeps no handle on its ClientApp processes
        return subprocess.Popen(args, *rest, **options)

    def _send(self, args: list[str], options: dict[str, Any]) -> bool:
        quiet = options.get("stdout") is subprocess.DEVNULL
        try:
            assert self.parent.stdin is not None
            self.parent.stdin.write(json.dumps({"args": args, "quiet": quiet}) + "\n")
            self.parent.stdin.flush()
            return True
        except OSError:
            if not self.fell_back:
                self.fell_back = True
                print("WARNING: the warm ClientApp parent is gone; each message starts a cold ClientApp process",
                      file=sys.stderr, flush=True)
            return False


def start_parent(runtime: str) -> subprocess.Popen[str]:
    """The warm parent for a device of ``runtime``, its stdin the pipe launches go down."""
    command = [sys.executable, "-m", "fedge.clients.warm_clientapp", "--warm-parent", "--runtime", runtime]
    return subprocess.Popen(command, stdin=subprocess.PIPE, text=True)


def main(argv: Sequence[str] | None = None) -> None:
    """``--warm-parent --runtime R``: be the warm parent; else Flower's SuperExec with its arguments."""
    parser = argparse.ArgumentParser(prog="fedge.clients.warm_clientapp", add_help=False)
    parser.add_argument("--warm-parent", action="store_true")
    parser.add_argument("--runtime", default="")
    ours, flowers = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if ours.warm_parent:
        serve(warm_modules(ours.runtime), sys.stdin)
        return
    parent = start_parent(ours.runtime)
    from flwr.supercore.cli.flower_superexec import flower_superexec
    from flwr.supercore.superexec.executor import subprocess_executor

    from fedge.clients.supernode import Swapped

    subprocess_executor.subprocess = Swapped(subprocess, Popen=_WarmLauncher(parent).popen)  # type: ignore[assignment]
    sys.argv = ["flower-superexec", *flowers]
    try:
        flower_superexec()
    finally:
        if parent.stdin is not None:
            parent.stdin.close()


if __name__ == "__main__":
    main()
