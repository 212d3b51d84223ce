"""A coordinator with two gateways on 127.0.0.1 trains with protocol devices (issue 27, end to end).

Real parts: `fedge coordinator start` (SuperLink, TLS, node auth, the signed training graph),
two `fedge gateway start` processes (each a SuperNode node plus an HTTPS device listener),
six reference protocol devices (no Flower, no torch in what they run: their modules are
checked in tests/test_gateway.py) on the digits task, and the inline simulation of the same
six devices for the flat baseline.

The devices run until their gateway tells them the run is over (``done``, once the coordinator
closed after the run's last round): a test ends because they were told, whatever the machine's
load, never because a wait ran out.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedge.cli.main import main
from fedge.clients.gateway.service import add_protocol_device
from fedge.clients.protocol_device import ProtocolDevice
from fedge.config import resolve_run_config
from fedge.server.report import read_jsonl
from fedge.simulation.loopback import LoopbackFederation, free_port
from fedge.simulation.runner import simulate
from fedge.task.loading import load_task

pytestmark = pytest.mark.slow
DEVICES, ROUNDS = 6, 3
RUN = "model='mlp' local-epochs=2 export-onnx=false runtime='onnx' round-timeout=120.0 gateways=true"


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[LoopbackFederation]:
    fed = LoopbackFederation(tmp_path, num_devices=2)  # dev0 / dev1: the gateways' node keys
    yield fed
    fed.close()


def _start_gateway(federation: LoopbackFederation, index: int, port: int, deadline_s: float = 120.0) -> None:
    keys, cert = federation.keys, federation.keys.directory / "gateways" / f"gw{index}"
    if not cert.with_suffix(".crt").exists():  # its TLS certificate for devices, as an operator makes it
        assert main(["keys", "add-gateway", f"gw{index}", "--dir", str(keys.directory)]) == 0
    federation.devices[100 + index] = federation.spawn(
        ["gateway", "start", "--coordinator", f"127.0.0.1:{federation.port}", "--name", f"gw{index}",
         "--devices", str(federation.root / "allow"), "--key", str(keys.devices / f"dev{index}.key"),
         "--ca", str(keys.ca_cert), "--trust", str(federation.bundle_signing_key),
         "--cert", str(cert.with_suffix(".crt")), "--cert-key", str(cert.with_suffix(".key")), "--port", str(port),
         "--state-dir", str(federation.root / f"gw{index}"),
         "--devices-per-round", str(DEVICES // 2), "--poll-interval", "0.5", "--round-deadline", str(deadline_s)],
        f"gateway{index}.log")


# `fedge protocol-device` in a process where importing Flower or torch fails, as on a device without them
WITHOUT_FLOWER_OR_TORCH = (
    "import sys\n"
    "class Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('flwr', 'torch'):\n"
    "            raise ImportError('this device has no ' + name)\n"
    "sys.meta_path.insert(0, Block())\n"
    "from fedge.cli.main import main\n"
    "sys.exit(main(sys.argv[1:]))\n")


class ProtocolFleet:
    """Six protocol devices, three per gateway: threads of this process, and the last ``processes`` of them
    as `fedge protocol-device` processes that cannot import Flower or torch. Each runs until its gateway
    says the run is over."""

    def __init__(self, federation: LoopbackFederation, ports: list[int], *, processes: int = 0,
                 secure: bool = False) -> None:
        config = resolve_run_config({"partitioner": "iid"})
        task = load_task(config)
        shards = [task.partition(index, DEVICES, config) for index in range(DEVICES)]
        self.federation, self.stop, self.trained = federation, threading.Event(), [0] * DEVICES
        self.devices = [ProtocolDevice(gateway=f"https://127.0.0.1:{ports[index % 2]}", name=f"phone{index}",
                                       key=federation.root / "allow" / f"phone{index}.key",
                                       data=(tuple(shards[index].inputs), shards[index].targets),
                                       trust=federation.bundle_signing_key, ca=federation.keys.ca_cert,
                                       state_dir=federation.root / f"phone{index}", secure=secure)
                        for index in range(DEVICES)]
        self.threads = [threading.Thread(target=self._run, args=(index,), daemon=True)
                        for index in range(DEVICES - processes)]
        for thread in self.threads:
            thread.start()
        self.processes = {}
        for index in range(DEVICES - processes, DEVICES):
            np.savez(federation.root / f"phone{index}.npz", x=shards[index].inputs[0], y=shards[index].targets)
            argv = ["protocol-device", "--gateway", f"https://127.0.0.1:{ports[index % 2]}", "--name",
                    f"phone{index}", "--key", str(federation.root / "allow" / f"phone{index}.key"), "--data",
                    str(federation.root / f"phone{index}.npz"), "--trust", str(federation.bundle_signing_key),
                    "--ca", str(federation.keys.ca_cert), "--state-dir", str(federation.root / f"phone{index}"),
                    *(["--secure-aggregation"] if secure else [])]
            with (federation.root / f"phone{index}.log").open("wb") as out:
                self.processes[index] = subprocess.Popen([sys.executable, "-c", WITHOUT_FLOWER_OR_TORCH, *argv],
                                                         stdout=out, stderr=subprocess.STDOUT)
        self.codes: dict[int, int | None] = {}

    def _run(self, index: int) -> None:
        self.trained[index] = self.devices[index].run(stop=self.stop, max_wait_s=1.0)

    def told(self) -> bool:
        """Whether every device has stopped on its own (its gateway said the run is over)."""
        return not any(thread.is_alive() for thread in self.threads) and \
            all(process.poll() is not None for process in self.processes.values())

    def close(self) -> None:
        """Stop whatever still runs (a device that was not told: the test then fails on it) and collect counts."""
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        for index, process in self.processes.items():
            if process.poll() is None:
                process.kill()
            self.codes[index] = process.wait()
            log = self.federation.log(f"phone{index}")
            if self.codes[index] == 0 and "stopped after " in log:
                self.trained[index] = int(log.rsplit("stopped after ", 1)[1].split()[0])

    def check_told(self, rounds: int) -> None:
        """Every device stopped because its gateway told it the run was over after round ``rounds``, with one
        line; the processes exit 0 having logged one line per round they trained; each gateway said so."""
        over = f"round {rounds} of {rounds} was its last and the coordinator has closed"
        for device in self.devices[:len(self.threads)]:
            assert device.run_over == over, (device.name, device.run_over)
        for index in self.processes:
            log = self.federation.log(f"phone{index}")
            assert self.codes[index] == 0 and log.count("the run is over: ") == 1 and over in log, log
            sent = re.findall(rf"device phone{index}: round \d+: trained on \d+ examples, loss [0-9.]+, sent", log)
            assert len(sent) >= self.trained[index] > 0, log
        for index in range(2):
            assert f"the run is over ({over})" in self.federation.log(f"gateway{index}")


def _summary_then_devices_told(federation: LoopbackFederation, fleet: ProtocolFleet) -> None:
    """Wait for the run's summary, then for every device to stop on its own: events, with bounds that only
    catch a broken run (a device never told would otherwise hang the test)."""
    federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 900, "the summary")
    federation.wait_for(fleet.told, 300, "the devices to hear from their gateways that the run is over")


def _start(federation: LoopbackFederation, rounds: int, run_config: str = RUN,
           gateway_deadline_s: float = 120.0) -> list[int]:
    """Allow-list, coordinator (2 nodes a round: the gateways) and both gateways; their device ports."""
    for index in range(DEVICES):
        add_protocol_device(federation.root / "allow", f"phone{index}")
    federation.start_coordinator("--rounds", str(rounds), "--clients-per-round", "2", "--run-config", run_config)
    federation.wait_for(federation.bundle_signing_key.exists, 120, "the bundle signing key")
    ports = [free_port(), free_port()]
    for index, port in enumerate(ports):
        _start_gateway(federation, index, port, gateway_deadline_s)
    return ports


def test_two_gateways_train_protocol_devices_to_the_accuracy_of_a_flat_federation(
        federation: LoopbackFederation) -> None:
    # Prepare: six devices' keys; the coordinator and two gateways
    ports = _start(federation, ROUNDS)
    # Execute: six protocol devices, three per gateway (one a `fedge protocol-device` without Flower or torch)
    fleet = ProtocolFleet(federation, ports, processes=1)
    try:
        _summary_then_devices_told(federation, fleet)
    finally:
        fleet.close()
    fleet.check_told(ROUNDS)
    trained = fleet.trained
    rows = federation.rows()
    # the flat baseline: the same six devices, the same settings, in the inline simulation
    flat_dir, _ = simulate({"partitioner": "iid", "fleet": f"laptop={DEVICES}", "runtime": "onnx",
                            "num-rounds": ROUNDS, "clients-per-round": DEVICES, "model": "mlp", "local-epochs": 2,
                            "export-onnx": False, "run-dir": str(federation.root / "flat")}, progress=False)
    flat_rows = read_jsonl(flat_dir / "metrics.jsonl")
    # Assert: every round aggregated both gateways (all six devices' examples) and learned like the flat run
    assert [row["round"] for row in rows] == list(range(ROUNDS + 1)), federation.log("coordinator")
    assert all(row["aggregated"] and row["participants"] == 2 and row["rejected"] == 0 for row in rows[1:])
    assert sum(trained) == DEVICES * ROUNDS
    flat_accuracy = float(flat_rows[-1]["accuracy"])
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.3
    assert abs(rows[-1]["accuracy"] - flat_accuracy) <= 0.05, (rows[-1]["accuracy"], flat_accuracy)
    for index in range(2):
        log = federation.log(f"gateway{index}")
        assert "serves devices on https://127.0.0.1" in log and f"{DEVICES // 2} device results" in log, log
        assert "(gateway, 3 devices)" in log, log
    assert np.isfinite(rows[-1]["loss"])


def test_a_gateway_restart_loses_at_most_its_round_in_flight(federation: LoopbackFederation) -> None:
    # Prepare: a 4-round run through two gateways
    rounds = 4
    ports = _start(federation, rounds)
    fleet = ProtocolFleet(federation, ports)
    try:
        federation.wait_for(lambda: len(federation.rows()) >= 2, 600, "round 1")
        # Execute: gateway 0 dies outright (process group and Flower helpers), then starts again on the same state
        gateway = federation.devices[100]
        os.killpg(gateway.pid, signal.SIGKILL)
        gateway.wait()
        federation._kill_marked(str(federation.root / "gw0"))
        _start_gateway(federation, 0, ports[0])
        _summary_then_devices_told(federation, fleet)
    finally:
        fleet.close()
    fleet.check_told(rounds)
    rows = federation.rows()
    # Assert: every round ran and aggregated; at most one round lacked gateway 0; the model still learned
    assert [row["round"] for row in rows] == list(range(rounds + 1)), federation.log("coordinator")
    assert all(row["aggregated"] and row["rejected"] == 0 for row in rows[1:]), rows
    assert sum(row["participants"] < 2 for row in rows[1:]) <= 1, [row["participants"] for row in rows]
    assert rows[-1]["participants"] == 2
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.3
    assert federation.log("gateway0").count("serves devices on https://") == 2


def test_secure_aggregation_through_two_gateways_trains_protocol_devices(federation: LoopbackFederation) -> None:
    # Prepare: the coordinator asks for secure aggregation; every device requires it (one without Flower or torch).
    # Every round must take both pools, so no deadline may end one on a loaded machine (rounds end on their
    # devices' answers: the deadlines only bound a round that lost its devices, which this test has none of)
    ports = _start(federation, ROUNDS, RUN.replace("round-timeout=120.0", "round-timeout=900.0")
                   + " secure-aggregation=true", gateway_deadline_s=900.0)
    # Execute
    fleet = ProtocolFleet(federation, ports, processes=1, secure=True)
    try:
        _summary_then_devices_told(federation, fleet)
    finally:
        fleet.close()
    fleet.check_told(ROUNDS)
    rows = federation.rows()
    # Assert: every round took both gateways' secure pool sums (three devices each) and the model learned
    assert [row["round"] for row in rows] == list(range(ROUNDS + 1)), federation.log("coordinator")
    assert all(row["aggregated"] and row["participants"] == 2 and row["rejected"] == 0 for row in rows[1:]), rows
    assert sum(fleet.trained) == DEVICES * ROUNDS
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.3
    for index in range(2):
        log = federation.log(f"gateway{index}")
        assert log.count("3 devices' masked inputs summed") == ROUNDS, log
        assert "the secure sum of 3 devices' updates (gateway)" in log, log
