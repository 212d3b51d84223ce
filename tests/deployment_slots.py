"""How many deployment tests run at once across the xdist workers, and letting a slot go while a test waits.

A deployment test (a real SuperLink, SuperNodes and gateways, each Flower message a process that imports
torch and Flower) holds one of ``DEPLOYMENT_SLOTS`` file locks shared by the run's workers (the kernel
releases it if the worker dies): four at once on two cores slowed each one's processes past Flower's 60 s
heartbeat window and a round's devices past their deadlines. (Lending a slot while a test waited on Flower's
fixed heartbeat window, its processes idle, was tried: the fresh-clone run with it had 3 deployments at once
for minutes, the waiting tests ran 1.5-2x slower and the killed-coordinator deployment hung; it was dropped.)
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

# FEDGE_TEST_DEPLOYMENT_SLOTS overrides it (to measure another number on another machine)
DEPLOYMENT_SLOTS = int(os.environ.get("FEDGE_TEST_DEPLOYMENT_SLOTS", "2"))


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
    """Hold a slot for a deployment test."""
    handle = _take(shared)
    try:
        yield
    finally:
        _give(handle)

