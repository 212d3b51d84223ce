"""How many deployment tests run at once across the xdist workers, and letting a slot go while a test waits.

A deployment test (a real SuperLink, SuperNodes and gateways, each Flower message a process that imports
torch and Flower) holds one of ``DEPLOYMENT_SLOTS`` file locks shared by the run's workers (the kernel
releases it if the worker dies): four at once on two cores slowed each one's processes past Flower's 60 s
heartbeat window and a round's devices past their deadlines. A test that then waits on one of Flower's fixed
windows (a dead node's heartbeats to lapse, a frozen ServerApp's) with its own processes idle lends its slot
for that wait (:func:`slot_released`) and takes one again after it.
"""

from __future__ import annotations

import fcntl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

DEPLOYMENT_SLOTS = 2
_held: dict[str, object] = {}  # this worker's: "shared" (the run's lock directory), "handle" (the slot held)


def _take(shared: Path) -> IO[str]:
    """Lock a free slot in ``shared``, waiting for one; its open handle."""
    paths = [shared / f"deployment-slot-{index}" for index in range(DEPLOYMENT_SLOTS)]
    while True:
        for path in paths:
            handle = open(path, "a")  # noqa: SIM115 - held past this function, closed by _give
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            return handle
        time.sleep(0.2)


def _give(handle: IO[str]) -> None:
    fcntl.flock(handle, fcntl.LOCK_UN)
    handle.close()


@contextmanager
def deployment_slot(shared: Path) -> Iterator[None]:
    """Hold a slot for a deployment test (the worker's: :func:`slot_released` may trade it for another)."""
    _held.update(shared=shared, handle=_take(shared))
    try:
        yield
    finally:
        handle = _held.pop("handle", None)
        if handle is not None:
            _give(handle)  # type: ignore[arg-type]
        _held.clear()


@contextmanager
def slot_released() -> Iterator[None]:
    """Let another deployment have this test's slot while it waits with its processes idle, then take one again
    (waiting for it). Outside a slot (one process, or a test that holds none) it does nothing."""
    handle, shared = _held.pop("handle", None), _held.get("shared")
    if handle is None or not isinstance(shared, Path):
        yield
        return
    _give(handle)  # type: ignore[arg-type]
    try:
        yield
    finally:
        _held["handle"] = _take(shared)
