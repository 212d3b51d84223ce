"""Issue 17: a device restarted mid-round counts in that round; SIGTERM/SIGINT leave no process behind.

Real SuperLink and SuperNodes on 127.0.0.1 (TLS, node authentication). Device 1 takes round
2's instruction and is stopped by its supervisor (SIGTERM) before it replies, then started
again. The coordinator sees it go and come back, sends the instruction again, and round 2
ends with both devices, long before the round timeout (without the resend the round waited
for the timeout, 300 s here, and ended with one device). Then the coordinator and the devices
are stopped as systemd stops them: each prints one line and leaves no Flower helper behind.

A ServerApp the machine froze for longer than Flower's 60 s heartbeat loses its run (the
SuperLink ends it; CI's stalled VM did this): the coordinator stops what is left of it and
goes on after the last checkpointed round.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedge.process import processes_of
from fedge.server.checkpoint import load_checkpoint
from fedge.simulation.loopback import LoopbackFederation

pytestmark = pytest.mark.slow

# local-epochs=5: device 1 is still training when its SIGTERM comes
LONG = "model='mlp' local-epochs=5 export-onnx=false round-timeout=300.0 runtime='torch'"


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
    """How many messages device ``index``'s SuperNode has taken so far (Flower's log, in its state directory)."""
    path = federation.root / f"device{index}" / "supernode.log"
    return path.read_text(errors="replace").count("Received successfully") if path.exists() else 0


@pytest.mark.deployment
def test_a_device_restarted_mid_round_counts_and_sigterm_leaves_no_process(federation: LoopbackFederation) -> None:
    # Prepare: a long run with two devices, round 1 done, device 1 holding round 2's instruction
    federation.start_coordinator("--rounds", "200", "--clients-per-round", "2", "--run-config", LONG)
    for index in range(2):
        federation.start_device(index)
    federation.wait_for(lambda: done(federation) >= 1, 900, "round 1")
    taken = received(federation, 1)
    federation.wait_for(lambda: received(federation, 1) > taken, 900, "device 1 taking round 2's instruction")
    # Execute: a supervisor restarts device 1 while it trains (SIGTERM, then start again)
    assert federation.stop(federation.devices[1]) == 0
    assert federation.leftovers(federation.root / "device1") == []
    federation.start_device(1)
    federation.wait_for(lambda: done(federation) >= 2, 900, "round 2 (the resend)")
    # Assert: round 2 kept both devices, the coordinator says why, and the device was not refused
    second = federation.rows()[2]
    assert second["round"] == 2 and second["participants"] == 2, second
    assert "sending its instruction again" in (federation.root / "state" / "run.log").read_text(errors="replace")
    assert "device stopped (SIGTERM)" in federation.log("device1")
    assert "did not activate" not in federation.log("device1")
    # Execute: SIGTERM the coordinator and SIGINT the devices (the process only, as systemd's KillMode=mixed)
    started = time.monotonic()
    assert federation.coordinator is not None and federation.stop(federation.coordinator) == 0
    stop_s = time.monotonic() - started
    for process in federation.devices.values():
        assert federation.stop(process, signal.SIGINT) == 0
    # Assert: no Flower process is left; one line each; completed rounds are checkpointed
    assert federation.leftovers() == [], federation.leftovers()
    log = federation.log("coordinator")
    assert "coordinator stopped (SIGTERM)" in log and "--resume" in log and "Traceback" not in log, log
    assert f"--keys {federation.keys.directory}" in log and f"--port {federation.port}`" in log, log
    assert "device stopped (SIGINT)" in federation.log("device0")
    assert "Traceback" not in federation.log("device0")
    assert (federation.run_dir / "checkpoint.npz").exists()
    assert stop_s < 30


def checkpointed(federation: LoopbackFederation) -> int:
    """The round of the run's last checkpoint (-1 before the first; it is written atomically)."""
    path = federation.run_dir / "checkpoint.npz"
    return load_checkpoint(path).server_round if path.exists() else -1


@pytest.mark.deployment
def test_a_server_app_frozen_past_flowers_heartbeat_is_replaced_and_the_run_goes_on(
        federation: LoopbackFederation) -> None:
    # Prepare: three rounds, one device, round 1 checkpointed
    federation.start_coordinator("--rounds", "3", "--clients-per-round", "1", "--run-config",
                                 "model='mlp' export-onnx=false round-timeout=300.0 runtime='torch'")
    federation.start_device(0)
    federation.wait_for(lambda: checkpointed(federation) >= 1, 900, "round 1's checkpoint")
    flwr_home = federation.root / "state" / "flwr-home"
    [frozen] = processes_of(flwr_home, "flwr-serverapp")
    # Execute: the ServerApp stops as a stalled machine stops it, until the SuperLink ends its run
    os.kill(frozen, signal.SIGSTOP)
    try:
        federation.wait_for(lambda: "was lost, not failed" in federation.log("coordinator"), 900,
                            "the coordinator to see its ServerApp lost")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGCONT)
    federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 900, "the summary")
    # Assert: the frozen process is gone, the run went on from round 1 and recorded each round once
    log = federation.log("coordinator")
    assert frozen not in processes_of(flwr_home, "flwr-serverapp")
    assert "No heartbeat received from the task" in log and "restart 1 of 3" in log, log
    assert "goes on after its last checkpointed round" in log and "Traceback" not in log, log
    assert [row["round"] for row in federation.rows()] == [0, 1, 2, 3]
    assert federation.coordinator is not None and federation.coordinator.wait(60) == 0
