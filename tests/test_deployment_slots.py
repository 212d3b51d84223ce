"""The suite's deployment slots (tests/deployment_slots.py): a deployment test holds one of two, and lends it
while it waits on one of Flower's fixed windows."""

from __future__ import annotations

import fcntl
from pathlib import Path

from tests.deployment_slots import DEPLOYMENT_SLOTS, _give, _take, deployment_slot, slot_released


def _free(shared: Path) -> int:
    """How many slots another worker could take now."""
    free = 0
    for index in range(DEPLOYMENT_SLOTS):
        with open(shared / f"deployment-slot-{index}", "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            fcntl.flock(handle, fcntl.LOCK_UN)
            free += 1
    return free


def test_a_deployment_lends_its_slot_while_it_waits_and_takes_one_again_after(tmp_path: Path) -> None:
    # Prepare: another worker's deployment holds the other slot
    other = _take(tmp_path)
    try:
        with deployment_slot(tmp_path):
            held = _free(tmp_path)
            # Execute
            with slot_released():
                lent = _free(tmp_path)
            after = _free(tmp_path)
        done = _free(tmp_path)
    finally:
        _give(other)
    # Assert: none free while both run; the waiting test's slot is free to take; taken again; freed at the end
    assert (held, lent, after, done) == (0, 1, 0, 1)

