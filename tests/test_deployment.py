"""End-to-end deployment: real SuperLink and SuperNodes on 127.0.0.1, TLS and device auth on."""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedge.server.checkpoint import load_checkpoint
from fedge.server.pki import add_device
from fedge.simulation.loopback import FEDGE, LoopbackFederation

pytestmark = pytest.mark.slow

# runtime=torch: these devices all train with torch, so the coordinator skips the training graph export
FAST = "model='mlp' local-epochs=2 export-onnx=false round-timeout=900.0 runtime='torch'"


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[LoopbackFederation]:
    fed = LoopbackFederation(tmp_path, num_devices=3)
    yield fed
    fed.close()


@pytest.mark.deployment
def test_two_rounds_with_tls_and_auth_and_an_unregistered_device_refused(federation: LoopbackFederation) -> None:
    # Prepare: coordinator + 3 devices, 2 rounds; a fourth key the coordinator never saw
    stranger, _ = add_device(federation.root / "elsewhere", "stranger")
    shutil.copy(federation.root / "dev0.npz", federation.root / "dev3.npz")
    federation.start_coordinator("--rounds", "2", "--clients-per-round", "3",
                                 "--run-config", "model='mlp' local-epochs=2 export-every=0 runtime='torch'")
    # Execute
    for index in range(3):
        federation.start_device(index)
    # the intruder gives up 10 s after it is refused: started once the coordinator listens (a loaded
    # machine took longer than that to start the coordinator, and it gave up as unreachable instead)
    federation.wait_for(lambda: "coordinator listening" in federation.log("coordinator"), 900, "the coordinator")
    intruder = federation.start_device(3, stranger, "--max-wait", "10")
    federation.wait_for(lambda: len(federation.rows()) >= 2, 900, "round 1")
    status = subprocess.run([FEDGE, "coordinator", "status", "--state-dir", str(federation.root / "state")],
                            capture_output=True, text=True, timeout=600)
    federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 900, "the summary")
    assert federation.coordinator is not None and federation.coordinator.wait(600) == 0
    # Assert: both rounds aggregated all three devices; the model moved; the run dir is complete
    rows = federation.rows()
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all(r["aggregated"] and r["participants"] == 3 for r in rows[1:])
    assert rows[2]["accuracy"] > rows[0]["accuracy"] + 0.3
    first = load_checkpoint(federation.run_dir / "checkpoints" / "round-0000.npz").arrays
    last = load_checkpoint(federation.run_dir / "checkpoint.npz").arrays
    assert any(not np.array_equal(first[k], last[k]) for k in first)
    for name in ("config.json", "summary.json", "headline.png", "model.onnx", "bundles/round-0002/manifest.sig"):
        assert (federation.run_dir / name).exists(), name
    assert status.returncode == 0 and status.stdout.count("device ") == 3, status.stdout + status.stderr
    assert "online" in status.stdout
    # Assert: the unregistered device was refused with a one-line reason and took no part
    assert intruder.wait(600) == 2
    assert "does not know this device's key" in federation.log("device3")


@pytest.mark.deployment
def test_a_dead_device_is_left_out_and_the_round_goes_on(federation: LoopbackFederation) -> None:
    # Prepare: 3 devices connect, then one dies before the round (still listed online by the SuperLink,
    # until its heartbeats are 2 x 10 s late: the devices announce a 10 s heartbeat, not Flower's 30 s) The
    # deadline is generous: live devices on a loaded machine need 30-40 s for a first round, and what is tested
    # is that the round ends without the dead one and names it, whichever comes first (the deadline, or the
    # SuperLink's 'Node Unavailable' reply)
    federation.start_coordinator("--rounds", "1", "--clients-per-round", "3", "--run-config",
                                 "model='mlp' local-epochs=2 export-onnx=false round-timeout=300.0 runtime='torch' "
                                 "min-train-replies=2")
    for index in range(3):
        federation.start_device(index, None, "--heartbeat-s", "10")
    joined = "joined the coordinator as node"
    federation.wait_for(lambda: all(joined in federation.log(f"device{i}") for i in range(3)), 900,
                        "three devices connected")
    federation.kill_device(2)
    # Execute
    federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 900, "the summary")
    # Assert: the round went on with the two that replied, and said who was missing
    rows = federation.rows()
    assert rows[1]["participants"] == 2 and rows[1]["aggregated"]
    round_line = next(line for line in federation.log("coordinator").splitlines() if line.startswith("round 1/1"))
    assert "1 failed: dev2" in round_line or "1 of 3 devices did not reply" in federation.log("coordinator")


@pytest.mark.deployment
def test_coordinator_killed_mid_run_resumes_to_the_same_round_count(federation: LoopbackFederation) -> None:
    # Prepare: a 3-round run, killed with SIGKILL after round 1 (a round takes 10 s or more: processes start)
    config = "model='mlp' local-epochs=5 export-onnx=false round-timeout=900.0 runtime='torch'"
    federation.start_coordinator("--rounds", "3", "--clients-per-round", "3", "--run-config", config)
    for index in range(3):
        federation.start_device(index)
    federation.wait_for(lambda: len(federation.rows()) >= 2, 900, "round 1")
    federation.kill_coordinator_hard()
    done_before = len(federation.rows()) - 1
    assert 1 <= done_before < 3
    # Execute: restart on the same state; the devices are not restarted
    federation.start_coordinator("--rounds", "3", resume=True)
    federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 900, "the resumed summary")
    # Assert: every round exactly once, three completed; the dead run was stopped, not left to time out
    assert "left unfinished by an earlier coordinator" in federation.log("coordinator")
    rows = federation.rows()
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert all(r["aggregated"] for r in rows[1:])
    assert all(device.poll() is None for device in federation.devices.values()), "devices kept running"


@pytest.mark.deployment
def test_insecure_mode_must_be_asked_for_and_warns(tmp_path: Path) -> None:
    fed = LoopbackFederation(tmp_path, num_devices=2)
    try:
        fed.coordinator = fed.spawn(
            ["coordinator", "start", "--insecure", "--state-dir", str(tmp_path / "state"), "--port", str(fed.port),
             "--run-dir", str(fed.run_dir), "--rounds", "1", "--clients-per-round", "2", "--run-config", FAST],
            "coordinator.log")
        for index in range(2):
            fed.devices[index] = fed.spawn(
                ["device", "--insecure", "--coordinator", f"127.0.0.1:{fed.port}",
                 "--data", str(tmp_path / f"dev{index}.npz"), "--state-dir", str(tmp_path / f"device{index}")],
                f"device{index}.log")
        fed.wait_for(lambda: (fed.run_dir / "summary.json").exists(), 900, "the summary")
        assert "INSECURE MODE" in fed.log("coordinator") and "INSECURE MODE" in fed.log("device0")
        assert fed.rows()[1]["participants"] == 2
    finally:
        fed.close()


@pytest.mark.deployment
def test_deadline_with_over_selection_in_deployment(federation: LoopbackFederation) -> None:
    # K = 2 with over-selection 1.5: 3 devices asked, the first 2 replies within 60 s kept
    federation.start_coordinator("--rounds", "2", "--clients-per-round", "2", "--run-config",
                                 "model='mlp' local-epochs=2 export-onnx=false round-policy='deadline' runtime='torch' "
                                 "deadline-s=900.0 over-selection=1.5")
    for index in range(3):
        federation.start_device(index)
    federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 900, "the summary")
    rows = federation.rows()
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all(r["participants"] == 2 and r["aggregated"] for r in rows[1:])


def _dashboard_status(port: int) -> str | None:
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/summary", timeout=2) as response:
            return str(json.loads(response.read())["status"])
    except OSError:
        return None


@pytest.mark.deployment
def test_secure_aggregation_in_deployment(federation: LoopbackFederation) -> None:
    # The five secure-aggregation steps over a real SuperLink, TLS and device auth on; the
    # coordinator also serves its dashboard (before any device connects, the run is "starting")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    federation.start_coordinator("--rounds", "1", "--clients-per-round", "3", "--dashboard", "--dashboard-port",
                                 str(port), "--run-config",
                                 "model='mlp' local-epochs=2 export-onnx=false secure-aggregation=true runtime='torch'")
    federation.wait_for(lambda: _dashboard_status(port) == "starting", 900, "the dashboard")
    for index in range(3):
        federation.start_device(index)
    federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 900, "the summary")
    rows = federation.rows()
    assert rows[1]["aggregated"] and rows[1]["participants"] == 3
    assert rows[1]["accuracy"] > rows[0]["accuracy"] + 0.2
