"""Issue 17: SIGTERM/SIGINT stop everything a coordinator or device started; a restarted device rejoins."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedge.simulation.loopback import LoopbackFederation

pytestmark = pytest.mark.slow

LONG = "model='mlp' local-epochs=2 export-onnx=false round-timeout=60.0 runtime='torch'"


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[LoopbackFederation]:
    fed = LoopbackFederation(tmp_path, num_devices=2)
    yield fed
    fed.close()


def test_sigterm_leaves_no_process_and_a_restarted_device_keeps_rounds_going(federation: LoopbackFederation) -> None:
    # Prepare: a long run with two devices, past its first round
    federation.start_coordinator("--rounds", "200", "--clients-per-round", "2", "--run-config", LONG)
    for index in range(2):
        federation.start_device(index)
    federation.wait_for(lambda: len(federation.rows()) >= 2, 180, "round 1")
    # Execute: a supervisor restarts device 1 (SIGTERM, then start again)
    assert federation.stop(federation.devices[1]) == 0
    assert federation.leftovers(federation.root / "device1") == []
    done = len(federation.rows())
    federation.start_device(1)
    federation.wait_for(lambda: len(federation.rows()) >= done + 2, 180, "two rounds after the restart")
    # Assert: the restarted device took part again, without a misleading refusal
    assert "device stopped (SIGTERM)" in federation.log("device1")
    assert "did not activate" not in federation.log("device1")
    assert federation.rows()[-1]["participants"] == 2
    # Execute: SIGTERM the coordinator and the devices (the process only, as systemd's KillMode=mixed)
    started = time.monotonic()
    assert federation.coordinator is not None and federation.stop(federation.coordinator) == 0
    stop_s = time.monotonic() - started
    for process in federation.devices.values():
        assert federation.stop(process, signal.SIGINT) == 0
    # Assert: no Flower process is left; one line each; completed rounds are checkpointed
    assert federation.leftovers() == [], federation.leftovers()
    log = federation.log("coordinator")
    assert "coordinator stopped (SIGTERM)" in log and "--resume" in log and "Traceback" not in log, log
    assert "device stopped (SIGINT)" in federation.log("device0")
    assert "Traceback" not in federation.log("device0")
    assert (federation.run_dir / "checkpoint.npz").exists()
    assert stop_s < 30
