"""A coordinator with two gateways on 127.0.0.1 trains with protocol devices (issue 27, end to end).

Real parts: `fedge coordinator start` (SuperLink, TLS, node auth, the signed training graph),
two `fedge gateway start` processes (each a SuperNode node plus an HTTPS device listener),
six reference protocol devices (no Flower, no torch in what they run: their modules are
checked in tests/test_gateway.py) on the digits task, and the inline simulation of the same
six devices for the flat baseline.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedge.clients.gateway import add_protocol_device
from fedge.clients.protocol_device import ProtocolDevice
from fedge.config import resolve_run_config
from fedge.server.report import read_jsonl
from fedge.simulation.loopback import LoopbackFederation, free_port
from fedge.simulation.runner import simulate
from fedge.tasks import load_task

pytestmark = pytest.mark.slow
DEVICES, ROUNDS = 6, 3
RUN = "model='mlp' local-epochs=2 export-onnx=false runtime='onnx' round-timeout=300.0 gateways=true"


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[LoopbackFederation]:
    fed = LoopbackFederation(tmp_path, num_devices=2)  # dev0 / dev1: the gateways' node keys
    yield fed
    fed.close()


def _start_gateway(federation: LoopbackFederation, index: int, port: int) -> None:
    keys = federation.keys
    federation.devices[100 + index] = federation.spawn(
        ["gateway", "start", "--coordinator", f"127.0.0.1:{federation.port}", "--name", f"gw{index}",
         "--devices", str(federation.root / "allow"), "--key", str(keys.devices / f"dev{index}.key"),
         "--ca", str(keys.ca_cert), "--trust", str(federation.bundle_signing_key), "--cert", str(keys.cert),
         "--cert-key", str(keys.key), "--port", str(port), "--state-dir", str(federation.root / f"gw{index}"),
         "--devices-per-round", str(DEVICES // 2), "--poll-interval", "0.5"], f"gateway{index}.log")


def test_two_gateways_train_protocol_devices_to_the_accuracy_of_a_flat_federation(
        federation: LoopbackFederation) -> None:
    # Prepare: six devices' shards and keys; the coordinator (2 nodes a round: the gateways)
    config = resolve_run_config({"partitioner": "iid"})
    task = load_task(config)
    shards = [task.partition(index, DEVICES, config) for index in range(DEVICES)]
    for index in range(DEVICES):
        add_protocol_device(federation.root / "allow", f"phone{index}")
    federation.start_coordinator("--rounds", str(ROUNDS), "--clients-per-round", "2", "--run-config", RUN)
    federation.wait_for(federation.bundle_signing_key.exists, 120, "the bundle signing key")
    ports = [free_port(), free_port()]
    for index, port in enumerate(ports):
        _start_gateway(federation, index, port)
    stop = threading.Event()
    devices = [ProtocolDevice(gateway=f"https://127.0.0.1:{ports[index % 2]}", name=f"phone{index}",
                              key=federation.root / "allow" / f"phone{index}.key",
                              data=(tuple(shards[index].inputs), shards[index].targets),
                              trust=federation.bundle_signing_key, ca=federation.keys.ca_cert,
                              state_dir=federation.root / f"phone{index}") for index in range(DEVICES)]
    trained = [0] * DEVICES

    def run_device(index: int) -> None:
        trained[index] = devices[index].run(stop=stop, max_wait_s=1.0)

    threads = [threading.Thread(target=run_device, args=(index,), daemon=True) for index in range(DEVICES)]
    # Execute
    for thread in threads:
        thread.start()
    try:
        federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 900, "the summary")
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
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
    assert np.isfinite(rows[-1]["loss"])
