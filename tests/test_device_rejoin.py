"""A device killed outright rejoins at once; a device whose coordinator is gone stops (issue 26 items 7, 8).

Real SuperLink and SuperNode on 127.0.0.1, with TLS and device authentication. Flower's
SuperLink lists a node whose SuperNode died online until two heartbeats are missed (about a
minute) and refuses its key meanwhile; the restarted device used to be refused for that
minute ("not registered ... or a previous session still listed online") and lose the round.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedge.simulation.loopback import LoopbackFederation

FAST = "model='mlp' local-epochs=1 export-onnx=false round-timeout=60.0 runtime='torch'"
JOINED = re.compile(r"joined the coordinator as node (\d+)")


@pytest.mark.slow
@pytest.mark.deployment
def test_a_device_killed_outright_rejoins_at_once_then_stops_once_its_coordinator_is_gone(tmp_path: Path) -> None:
    fed = LoopbackFederation(tmp_path, num_devices=2)  # two registered, one started
    try:
        # Prepare: a run that waits for two devices (nothing trains); one device joins
        fed.start_coordinator("--rounds", "100", "--clients-per-round", "2", "--run-config", FAST)
        fed.start_device(0, None, "--offline-limit", "5")
        fed.wait_for(lambda: JOINED.search(fed.log("device0")) is not None, 900, "device 0 joining")
        match = JOINED.search(fed.log("device0"))
        assert match is not None
        node = match.group(1)
        # Execute: the device's host loses power (fedge device, SuperNode and helpers killed at once);
        # it comes back within Flower's heartbeat window
        fed.kill_device(0)
        fed.start_device(0, None, "--offline-limit", "5")
        fed.wait_for(lambda: len(JOINED.findall(fed.log("device0"))) == 2, 900, "device 0 joining again")
        # Assert: it ended its stale session itself and joined as the same node, never refused
        log = fed.log("device0")
        assert f"ended this device's previous session (node {node})" in log, log
        assert JOINED.findall(log) == [node, node]
        assert "did not activate" not in log, log
        # Execute: the coordinator stops
        assert fed.coordinator is not None and fed.stop(fed.coordinator) == 0
        # Assert: the device ends in one line with status 0 after its offline limit (it retried forever before);
        # Flower's lines and colour codes stayed in its log file
        assert fed.devices[0].wait(600) == 0
        log = fed.log("device0")
        assert "has been unreachable for 5 s" in log, log
        assert "\x1b[" not in log and "Starting Flower SuperNode" not in log, log
        assert "Starting Flower SuperNode" in (tmp_path / "device0" / "supernode.log").read_text()
    finally:
        fed.close()
