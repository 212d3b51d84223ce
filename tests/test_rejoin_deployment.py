"""Issue 17: a device restarted in the middle of a round still counts in that round.

Real SuperLink and SuperNodes on 127.0.0.1 (TLS, node authentication): device 1 takes round
2's instruction, is stopped before it replies and started again. The coordinator sees it
go and come back, sends the instruction again, and round 2 ends with both devices, long
before the round timeout. Without the resend the round waited for the timeout (300 s here)
and ended with one device.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fedge.simulation.loopback import LoopbackFederation

pytestmark = pytest.mark.slow

SLOW_TRAINING = "model='mlp' local-epochs=5 export-onnx=false round-timeout=300.0 runtime='torch'"


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[LoopbackFederation]:
    fed = LoopbackFederation(tmp_path, num_devices=2)
    yield fed
    fed.close()


def done(federation: LoopbackFederation) -> int:
    """The last round with a metrics row (round 0 is the initial model's evaluation)."""
    rows = federation.rows()
    return int(rows[-1]["round"]) if rows else -1


def received(federation: LoopbackFederation, index: int) -> int:
    """How many messages device ``index``'s SuperNode has taken so far."""
    path = federation.root / f"device{index}.log"
    return path.read_text(errors="replace").count("Received successfully") if path.exists() else 0


def test_a_device_restarted_mid_round_takes_part_in_that_round(federation: LoopbackFederation) -> None:
    # Prepare: two devices, round 1 done
    federation.start_coordinator("--rounds", "2", "--clients-per-round", "2", "--run-config", SLOW_TRAINING)
    for index in range(2):
        federation.start_device(index)
    federation.wait_for(lambda: done(federation) >= 1, 240, "round 1")
    taken = received(federation, 1)
    federation.wait_for(lambda: received(federation, 1) > taken, 120, "device 1 taking round 2's instruction")
    # Execute: device 1 is restarted while it trains (a supervisor's SIGTERM, then start)
    assert federation.stop(federation.devices[1]) == 0
    federation.start_device(1)
    federation.wait_for(lambda: done(federation) >= 2, 240, "round 2 (the resend)")
    # Assert: round 2 kept both devices, and the coordinator says why
    last = federation.rows()[-1]
    assert last["round"] == 2 and last["participants"] == 2, last
    run_log = (federation.root / "state" / "run.log")
    assert "sending its instruction again" in run_log.read_text(errors="replace")
