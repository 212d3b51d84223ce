"""fedge's SuperNode launcher: Flower's SuperNode with its idle pull, heartbeat and ClientApp start set.

Why not plain ``flower-supernode``: three of Flower 1.42's SuperNode timings are on every round's
path and none is an option.

1. **The idle pull.** While it has no message, the SuperNode waits a fixed 3 s before asking
   the SuperLink again (``flwr.supernode.start_client_internal``), so each message a round
   sends (a train instruction; five for a secure round) waits 1.5 s on average before its device
   starts. ``--idle-pull-s`` sets it (default :data:`IDLE_PULL_S`, Flower's 3 s). Each pull is
   one authenticated HTTPS request to the SuperLink, which answered ~160 a second on one core
   (``bench/fleet_http_probe.py``): 1 s suits a fleet of tens of devices, not thousands (those
   go through gateways).
2. **The heartbeat.** The SuperNode announces a 30 s heartbeat interval and the SuperLink takes
   it for gone two intervals after its last beat: a device that died is still offered a round's
   instructions for a minute. Flower's Fleet API accepts any interval from 10 s
   (``HEARTBEAT_MIN_INTERVAL``) to 30 minutes; ``--heartbeat-s`` sets the one announced
   (default :data:`HEARTBEAT_S`, Flower's), and a dead device is noticed after 2 x that.
3. **A warm ClientApp parent.** The SuperNode starts Flower's SuperExec, which starts a cold
   ``flwr-clientapp`` process for every message; fedge's SuperExec forks them from a parent
   that imported Flower, fedge and the device's runtime once (:mod:`fedge.clients.warm_clientapp`;
   on by default, ``fedge device --cold-clientapps`` for Flower's own way).

All three are set on Flower's own modules before its ``flower_supernode()`` runs with the rest
of the command line: the pull by the one 3 s pause of ``start_client_internal``'s loop, the
heartbeat by the module constant its Fleet connection and heartbeat thread read when they
send, the SuperExec by the command its ``subprocess.Popen`` starts. A Flower whose loop no longer
has that pause is run at its own pace, and says so (:func:`pace`).
"""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

IDLE_PULL_S = 3.0
"""Seconds between an idle device's pulls by default: Flower's (:data:`FLOWER_IDLE_PULL_S`)."""
FLOWER_IDLE_PULL_S = 3
"""The pause Flower 1.42's SuperNode loop takes when a pull brought no message."""
HEARTBEAT_S = 30
"""The heartbeat interval a device announces by default: Flower's (its Fleet API's floor: 10 s)."""


class Swapped:
    """``module`` as one of Flower's modules sees it once fedge set it: some attributes swapped (``overrides``)."""

    def __init__(self, module: ModuleType, **overrides: Any) -> None:
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _paced_sleep(idle_s: float) -> Callable[[float], None]:
    """``time.sleep`` with Flower's idle pause replaced by ``idle_s``."""
    def sleep(seconds: float) -> None:
        time.sleep(idle_s if seconds == FLOWER_IDLE_PULL_S else seconds)
    return sleep


def _warm_superexec(runtime: str) -> Callable[..., Any]:
    """``subprocess.Popen`` that starts fedge's SuperExec (:mod:`fedge.clients.warm_clientapp`) for Flower's."""
    def popen(args: Any, *rest: Any, **options: Any) -> Any:
        if isinstance(args, list) and args and args[0] == "flower-superexec":
            args = [sys.executable, "-m", "fedge.clients.warm_clientapp", "--runtime", runtime, *args[1:]]
        return subprocess.Popen(args, *rest, **options)
    return popen


def pace(*, idle_pull_s: float, heartbeat_s: int, warm_runtime: str | None = None) -> list[str]:
    """Set Flower's SuperNode (in this process) to pull every ``idle_pull_s`` and announce ``heartbeat_s``.

    ``warm_runtime``: start fedge's SuperExec, whose ClientApps fork from a parent warmed for that
    runtime ("" for none: a gateway's node); None: Flower's own SuperExec.

    Returns what could not be set, as lines to show (empty when both were).
    """
    from flwr.common import constant
    from flwr.supercore import heartbeat
    from flwr.supernode import fleet_http_connection, start_client_internal

    if not constant.HEARTBEAT_MIN_INTERVAL <= heartbeat_s <= constant.HEARTBEAT_MAX_INTERVAL:
        raise ValueError(f"--heartbeat-s {heartbeat_s}: Flower's SuperLink accepts "
                         f"{constant.HEARTBEAT_MIN_INTERVAL}-{constant.HEARTBEAT_MAX_INTERVAL} s")
    if idle_pull_s <= 0:
        raise ValueError(f"--idle-pull-s {idle_pull_s}: give a positive number of seconds")
    if warm_runtime is not None:
        start_client_internal.subprocess = Swapped(subprocess, Popen=_warm_superexec(warm_runtime))  # type: ignore[assignment]
    fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL = heartbeat_s  # type: ignore[attr-defined]
    heartbeat.HEARTBEAT_DEFAULT_INTERVAL = heartbeat_s  # type: ignore[attr-defined]
    if not _has_idle_pause(start_client_internal):
        return [f"WARNING: this Flower's SuperNode loop has no {FLOWER_IDLE_PULL_S} s idle pause to shorten: "
                "the device pulls at Flower's own pace (--idle-pull-s has no effect)"]
    start_client_internal.time = Swapped(time, sleep=_paced_sleep(idle_pull_s))  # type: ignore[assignment]
    return []


def _has_idle_pause(module: ModuleType) -> bool:
    source = inspect.getsource(module.start_client_internal)
    return f"time.sleep({FLOWER_IDLE_PULL_S})" in source and module.time is time


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m fedge.clients.supernode [--idle-pull-s S] [--heartbeat-s S] [--warm-runtime R]
    <flower-supernode arguments>``."""
    parser = argparse.ArgumentParser(prog="fedge.clients.supernode", add_help=False)
    parser.add_argument("--idle-pull-s", type=float, default=IDLE_PULL_S)
    parser.add_argument("--heartbeat-s", type=int, default=HEARTBEAT_S)
    parser.add_argument("--warm-runtime", default=None)
    ours, flowers = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        for line in pace(idle_pull_s=ours.idle_pull_s, heartbeat_s=ours.heartbeat_s, warm_runtime=ours.warm_runtime):
            print(line, file=sys.stderr, flush=True)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    from flwr.supernode.cli.flower_supernode import flower_supernode

    sys.argv = ["flower-supernode", *flowers]
    flower_supernode()


if __name__ == "__main__":
    main()
