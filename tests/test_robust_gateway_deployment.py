"""Issue 42: one hostile protocol device through a real gateway is bounded by the gateway's device rule,
and the device tier's norm bounds follow the norms (``update-norm-bound = median``).

Real parts: `fedge coordinator start` (SuperLink, TLS, node auth, FedAvg over its one gateway), one
`fedge gateway start --device-rule median` and four reference protocol devices on 127.0.0.1. Three
train honestly; the fourth sends the model it was given plus 1,000 in every entry. Round 1 runs
without a norm bound (``max-update-norm = 0``): the median of four values of which the largest is
the attacker's keeps it out. Round 2 runs under the bounds round 1's norms set: each device's update
clipped at the gateway to the median device norm the gateway reported, the gateway's update clipped
at the coordinator to its round-1 norm. Every round's model is computed here by hand from what the
devices sent, and the attacker's +1,000 is nowhere in it (the weighted mean would have moved every
entry by about +250 in round 1).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedge.clients.gateway.protocol import decode_frame, encode_frame
from fedge.clients.gateway.service import add_protocol_device
from fedge.clients.protocol_device import ProtocolDevice
from fedge.config import resolve_run_config
from fedge.server.checkpoint import load_checkpoint
from fedge.simulation.loopback import LoopbackFederation, free_port
from fedge.task.loading import load_task
from tests.test_gateway_deployment import RUN, _start_gateway

pytestmark = pytest.mark.slow
DEVICES, ROUNDS, HOSTILE = 4, 2, 3


class RecordingDevice(ProtocolDevice):
    """An honest protocol device that keeps the weights it sent each round."""

    sent: dict[int, dict[str, np.ndarray]]

    def train(self, task: dict[str, Any], *args: Any) -> tuple[float, bytes]:  # noqa: D102
        loss, result = super().train(task, *args)
        self.sent = getattr(self, "sent", {})
        self.sent[int(task["server-round"])] = dict(decode_frame(result)[0].tensors)
        return loss, result


class HostileDevice(RecordingDevice):
    """Trains, then sends the weights it was given plus 1,000 in every entry, under the honest header."""

    def train(self, task: dict[str, Any], weights: dict[str, np.ndarray], *args: Any) -> tuple[float, bytes]:
        loss, result = super().train(task, weights, *args)
        frame, _ = decode_frame(result)
        hostile = {name: (weights[name] + 1000.0).astype(np.float32) for name in frame.tensors}
        self.sent[int(task["server-round"])] = hostile  # what it sent, in place of what it trained
        return loss, encode_frame(frame.header, hostile)


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[LoopbackFederation]:
    fed = LoopbackFederation(tmp_path, num_devices=1)  # dev0: the gateway's node key
    yield fed
    fed.close()


def _devices(federation: LoopbackFederation, port: int) -> dict[int, RecordingDevice]:
    config = resolve_run_config({"partitioner": "iid"})
    task = load_task(config)
    devices = {}
    for index in range(DEVICES):
        shard = task.partition(index, DEVICES, config)
        kind = HostileDevice if index == HOSTILE else RecordingDevice
        devices[index] = kind(gateway=f"https://127.0.0.1:{port}", name=f"phone{index}",
                              key=federation.root / "allow" / f"phone{index}.key",
                              data=(tuple(shard.inputs), shard.targets), trust=federation.bundle_signing_key,
                              ca=federation.keys.ca_cert, state_dir=federation.root / f"phone{index}")
    return devices


@pytest.mark.deployment
def test_a_hostile_protocol_device_is_bounded_by_a_median_gateway_and_the_norm_bounds_follow_the_median(
        federation: LoopbackFederation) -> None:
    # Prepare: the allow-list, the coordinator (its one node a round: the gateway), a gateway whose rounds take all
    # four devices and reply with their coordinate-wise median
    for index in range(DEVICES):
        add_protocol_device(federation.root / "allow", f"phone{index}")
    federation.start_coordinator("--rounds", str(ROUNDS), "--clients-per-round", "1", "--run-config",
                                 f"{RUN} max-update-norm=0.0 update-norm-bound='median' min-train-replies=1")
    federation.wait_for(federation.bundle_signing_key.exists, 900, "the bundle signing key")
    port = free_port()
    _start_gateway(federation, 0, port, extra=("--devices-per-round", str(DEVICES), "--device-rule", "median"))
    devices = _devices(federation, port)
    stop = threading.Event()
    threads = [threading.Thread(target=device.run, kwargs={"stop": stop, "max_wait_s": 1.0}, daemon=True)
               for device in devices.values()]
    # Execute: the devices run until their gateway says the run is over
    for thread in threads:
        thread.start()
    try:
        federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 900, "the summary")
        federation.wait_for(lambda: not any(thread.is_alive() for thread in threads), 900, "the devices to be told")
    finally:
        stop.set()
    # Assert: the gateway replied with its devices' median; round 2 ran under the bounds round 1's norms set
    log = federation.log("gateway0")
    assert "a plain round replies with the median of its devices' updates" in log, log
    assert log.count(f"{DEVICES} device results") == ROUNDS, log
    checkpoints, rows = federation.run_dir / "checkpoints", federation.rows()
    assert (rows[1]["device_norm_bound"], rows[1]["gateway_norm_bound"]) == (0.0, 0.0)  # max-update-norm: off
    assert rows[2]["device_norm_bound"] == pytest.approx(rows[1]["device_norm_medians"][0])
    assert rows[2]["gateway_norm_bound"] == pytest.approx(rows[1]["gateway_norms"][0])
    for server_round in range(1, ROUNDS + 1):
        before = load_checkpoint(checkpoints / f"round-{server_round - 1:04d}.npz").arrays
        after = load_checkpoint(checkpoints / f"round-{server_round:04d}.npz").arrays
        expected, gateway_norm = _expected_model(before, [devices[i].sent[server_round] for i in range(DEVICES)],
                                                 rows[server_round])
        assert rows[server_round]["gateway_norms"] == pytest.approx([gateway_norm], rel=1e-4)
        for name in after:
            np.testing.assert_allclose(after[name], expected[name], atol=1e-5, err_msg=name)
            assert np.max(np.abs(after[name] - before[name])) < 1.0, name  # the attacker's +1,000 is not in it
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.2


def _norm(update: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum(value ** 2) for value in update.values())))


def _expected_model(before: dict[str, np.ndarray], sent: list[dict[str, np.ndarray]],
                    row: dict[str, Any]) -> tuple[dict[str, np.ndarray], float]:
    """The round's model by hand: each device's update clipped to the round's device bound at the gateway, the
    mean of the middle two of the four in each entry (the median), that clipped to the gateway bound here; and the
    gateway's update norm before that clipping. Checks the gateway's reported median device norm on the way."""
    updates = [{name: weights[name].astype(np.float64) - before[name] for name in before} for weights in sent]
    norms = [_norm(update) for update in updates]
    middle = sorted(norms)[1:3]
    assert row["device_norm_medians"] == pytest.approx([sum(middle) / 2], rel=1e-5)
    bound = row["device_norm_bound"]
    clipped = [{name: value * min(1.0, bound / norm) if bound else value for name, value in update.items()}
               for update, norm in zip(updates, norms, strict=True)]
    median = {name: np.sort(np.stack([update[name] for update in clipped]), axis=0)[1:3].mean(axis=0)
              for name in before}
    gateway_norm, bound = _norm(median), row["gateway_norm_bound"]
    scale = min(1.0, bound / gateway_norm) if bound else 1.0
    return {name: before[name] + scale * median[name] for name in before}, gateway_norm
