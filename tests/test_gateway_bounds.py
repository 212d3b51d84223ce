"""Round 3's steering attacks on the device tier (issue 38, items 2, 3, 9, 10 and 12), replayed.

A registered device, a device inside a secure pool and a lying gateway each tried to move the
global model to weights of their choosing (98.8 % to 100 % of the way), or to knock their
gateway out of every round. Each test replays one of them against a real gateway (TLS, real
protocol devices) or the coordinator's real validator, and shows the bound that now holds.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

from fedge import wire
from fedge.aggregate import update_norm, weighted_mean
from fedge.clients.gateway.bridge import secure_settings
from fedge.clients.gateway.protocol import PREFIX, decode_frame, encode_frame
from fedge.clients.gateway.service import GatewaySettings, check_certificate_name
from fedge.clients.protocol_device import ProtocolDevice
from fedge.config import resolve_run_config
from fedge.errors import ConfigError, UpdateRejected
from fedge.server.app import build_strategy
from fedge.strategies.validation import DecodedOnUse, spec_of
from tests.live_gateway import LiveGateway
from tests.replies import global_arrays, good_arrays, train_reply

BOUNDS = {"max-device-examples": 10_000, "max-update-norm": 10.0}


@pytest.fixture
def four(tmp_path: Path, run: dict[str, Any]) -> Iterator[LiveGateway]:
    """A gateway whose rounds complete with four device results."""
    with LiveGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=4, round_deadline_s=300,
                                                   idle_poll_s=0.2)) as gateway:
        yield gateway


def _open_round(live: LiveGateway, **kwargs: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(result=live.round(**kwargs)), daemon=True)
    thread.start()
    while live.gateway.round is None and live.gateway.exchange is None:
        thread.join(0.02)
    return thread, box


def _send(device: ProtocolDevice, fields: dict[str, Any], tensors: dict[str, np.ndarray]) -> tuple[int, str]:
    """``device`` answers the open task with ``fields`` and ``tensors`` of its choosing."""
    status, _, body = device._authenticated("GET", f"{PREFIX}/task")
    task = decode_frame(body)[0].header
    header = {"task": task["task"], "kind": "train", "encoding": "fp32", **fields}
    code, _, answer = device._authenticated("POST", f"{PREFIX}/result", encode_frame(header, tensors))
    return code, json.loads(answer).get("error", "")


# --------------------------------------------------------------------------- item 2: one device replaces the model
def test_one_device_cannot_replace_the_model_through_its_gateway(four: LiveGateway, run: dict[str, Any]) -> None:
    # Prepare: the attacker's weights, far from the global model; it claims 99,000 examples
    target = {name: np.full_like(value, 3.0) for name, value in run["weights"].items()}
    distance = update_norm(target, run["weights"])
    thread, box = _open_round(four, config=BOUNDS)
    # Execute: three honest devices train; the attacker sends its weights
    outcomes = [four.device(f"phone{i}", i).poll() for i in range(3)]
    code, _ = _send(four.device("phone3", 3), {"num-examples": 99_000, "metrics": {"train-loss": 0.1}}, target)
    thread.join()
    header, arrays = box["result"]
    # Assert: accepted, its weight capped and its update clipped (both counted); the gateway's mean moved at most
    # the norm bound, a small fraction of the way to the attacker's weights
    honest = sum(o.kind == "train" for o in outcomes)
    moved = update_norm(arrays, run["weights"])
    assert code == 200 and honest == 3 and header["capped"] == 1 and header["clipped"] >= 1
    assert header["num-examples"] < 3 * 2_000 + BOUNDS["max-device-examples"]
    assert moved <= BOUNDS["max-update-norm"] + 1e-3 and moved / distance < 0.05


# --------------------------------------------------------------------------- item 3: one device knocks its gateway out
BREAKERS = [
    ("steps of 10**12", {"steps": 10**12}, "'steps' must be a whole number in [0, "),
    ("samples of 10**12", {"samples-processed": 10**12}, "'samples-processed' must be a whole number in [0, "),
    ("more steps than its examples allow", {"num-examples": 10, "steps": 50},
     "'steps' must be a whole number in [0, 1]"),
]


@pytest.mark.parametrize(("case", "fields", "reason"), BREAKERS, ids=[c[0] for c in BREAKERS])
def test_a_device_breaking_the_instructions_budget_is_dropped_and_its_gateway_still_answers(
        four: LiveGateway, run: dict[str, Any], case: str, fields: dict[str, Any], reason: str) -> None:
    # Prepare
    thread, box = _open_round(four, config=BOUNDS)
    weights = {k: np.asarray(v, np.float32) for k, v in run["weights"].items()}
    # Execute: the breaker answers first; four honest devices complete the round
    code, error = _send(four.device("phone3", 3), {"num-examples": 100, "metrics": {"train-loss": 1.0}, **fields},
                        weights)
    outcomes = [four.device(name, index).poll() for index, name in enumerate(["phone0", "phone1", "phone2", "browser"])]
    thread.join()
    header, _ = box["result"]
    # Assert: the breaker is named and dropped; the gateway's reply is one the coordinator takes
    assert code == 422 and reason in error, error
    assert [o.kind for o in outcomes] == ["train"] * 4 and header["devices"] == 4 and header["rejected"] == 1
    _coordinator_takes(header)


def test_a_loss_of_1e308_leaves_the_gateways_metric_means_finite(four: LiveGateway, run: dict[str, Any]) -> None:
    # Prepare: two devices that each send 1e308 as their loss (finite alone; a sum of the two is not)
    thread, box = _open_round(four, config=BOUNDS)
    weights = {k: np.asarray(v, np.float32) for k, v in run["weights"].items()}
    big = {"num-examples": 100, "metrics": {"train-loss": 1e308}}
    # Execute
    first = _send(four.device("phone3", 3), big, weights)
    second = _send(four.device("browser", 2), big, weights)
    outcomes = [four.device(f"phone{i}", i).poll() for i in range(2)]
    thread.join()
    header, _ = box["result"]
    # Assert: running float64 means stay finite, so both are taken and the coordinator takes the gateway's reply
    assert first[0] == 200 and second[0] == 200 and [o.kind for o in outcomes] == ["train"] * 2
    assert header["devices"] == 4 and all(np.isfinite(v) for v in header["metrics"].values())
    _coordinator_takes(header)


def _coordinator_takes(header: dict[str, Any]) -> None:
    """The coordinator's validator accepts a reply carrying this gateway result's meta and counts."""
    reply = train_reply(3, good_arrays(0.0), num_examples=int(header["num-examples"]))
    meta = reply.content[wire.REPLY_META]
    assert isinstance(meta, ConfigRecord)
    meta[wire.AGGREGATE_OF], meta[wire.STEPS] = int(header["devices"]), max(1, int(header["steps"]))
    meta[wire.SAMPLES_PROCESSED] = int(header["samples-processed"])
    metrics = reply.content[wire.METRICS]
    assert isinstance(metrics, MetricRecord)
    metrics[wire.TRAIN_LOSS] = float(header["metrics"].get(wire.TRAIN_LOSS, 0.0))
    strategy = build_strategy(resolve_run_config({"gateways": True, "clients-per-round": 2}), 10)
    strategy.validator.check(reply.content, server_round=1, spec=spec_of(global_arrays()))


def test_an_honest_gateway_whose_devices_hold_more_than_max_num_examples_is_taken() -> None:
    # Prepare: 20 devices of 7,500 examples: 150,000, above max-num-examples (100,000), within 20 x 10,000
    strategy = build_strategy(resolve_run_config({"gateways": True, "clients-per-round": 2}), 10)
    reply = _gateway_reply(devices=20, examples=150_000, arrays=good_arrays(0.5))
    # Execute
    _, weight = strategy.validator.check(reply, server_round=1, spec=spec_of(global_arrays()))
    # Assert
    assert weight == 150_000


# --------------------------------------------------------------------------- item 10: a lying gateway
def _gateway_reply(*, devices: int, examples: int, arrays: dict[str, np.ndarray], secure_pool: int = 0,
                   name: str | None = None) -> Any:
    reply = train_reply(3, arrays, num_examples=examples)
    meta = reply.content[wire.REPLY_META]
    assert isinstance(meta, ConfigRecord)
    meta[wire.AGGREGATE_OF], meta[wire.SECURE_POOL] = devices, secure_pool
    if name is not None:
        meta[wire.GATEWAY] = name
    return reply.content


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secure-pool"])
def test_a_lying_gateway_moves_the_model_at_most_the_norm_bound(secure: bool) -> None:
    # Prepare: an honest gateway (5 devices, 5,000 examples, a small step) and a liar claiming 1,000 devices, the
    # most examples, and weights of its choosing
    config = {"gateways": True, "clients-per-round": 2, "secure-aggregation": secure}
    strategy = build_strategy(resolve_run_config(config), 10)
    reference: ArrayRecord = global_arrays()
    honest = _gateway_reply(devices=5, examples=5_000, arrays=good_arrays(0.01), secure_pool=5 if secure else 0)
    liar = _gateway_reply(devices=1000, examples=1000 * 10_000, arrays=good_arrays(500.0),
                          secure_pool=1000 if secure else 0)
    # Execute: the validator's checked replies, then FedAvg's weighted mean of them
    checked = [strategy.validator.read(content, server_round=1, spec=spec_of(reference),
                                       reference=DecodedOnUse(reference), node_id=node)
               for node, content in ((1, honest), (2, liar))]
    mean = weighted_mean([c.arrays for c in checked], [c.weight for c in checked])
    # Assert: the liar's update was clipped (counted) to max-update-norm, so the model moved at most that far,
    # against the ~1,500 its weights are away
    zeros = {name: np.zeros_like(value) for name, value in mean.items()}
    assert [c.clipped for c in checked] == [False, True]
    assert update_norm(mean, zeros) <= 10.0 + 1e-4 and update_norm(good_arrays(500.0), zeros) > 1000


@pytest.mark.parametrize(("devices", "examples", "reason"), [
    (1000, 1000 * 10_000 + 1, "is outside [1, 10000000]"),
    (20_000, 100, "claims 20000 devices, more than max-gateway-devices = 10000"),
])
def test_a_gateway_claiming_more_than_its_devices_can_hold_is_refused(devices: int, examples: int,
                                                                      reason: str) -> None:
    strategy = build_strategy(resolve_run_config({"gateways": True, "clients-per-round": 2}), 10)
    with pytest.raises(UpdateRejected, match=re.escape(reason)):
        strategy.validator.check(_gateway_reply(devices=devices, examples=examples, arrays=good_arrays(0.0)),
                                 server_round=1, spec=spec_of(global_arrays()))


# --------------------------------------------------------------------------- item 12: one name, two gateways
def test_the_coordinator_refuses_a_second_gateway_under_one_name() -> None:
    # Prepare
    strategy = build_strategy(resolve_run_config({"gateways": True, "clients-per-round": 2}), 10)
    spec = spec_of(global_arrays())
    first = _gateway_reply(devices=3, examples=300, arrays=good_arrays(0.0), name="gw1")
    second = _gateway_reply(devices=3, examples=300, arrays=good_arrays(0.0), name="gw1")
    # Execute / Assert: node 1 holds the name (again next round too); node 2 is refused, naming both
    strategy.validator.read(first, server_round=1, spec=spec, node_id=1)
    strategy.validator.read(first, server_round=1, spec=spec, node_id=1)
    with pytest.raises(UpdateRejected, match="gateway name 'gw1' is used by node 1 already"):
        strategy.validator.read(second, server_round=1, spec=spec, node_id=2)


# --------------------------------------------------------------------------- item 9: a device in a secure pool
class Inflating(ProtocolDevice):
    """A pool device that trains honestly and claims 99,000 examples as its weight."""

    def _ready(self, graph: str) -> Any:
        trainer, data = super()._ready(graph)
        return _InflatingTrainer(trainer), data


class _InflatingTrainer:
    """The device's real trainer, reporting 99,000 examples for its work."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def train(self, *args: Any, **kwargs: Any) -> Any:
        trained, work = self.trainer.train(*args, **kwargs)
        return trained, dataclasses.replace(work, num_examples=99_000)


def test_a_pool_device_claiming_99000_examples_is_held_to_max_device_examples(four: LiveGateway) -> None:
    # Prepare: the secure settings the coordinator's bridge sends; three honest phones and one inflating its weight
    secure = secure_settings(resolve_run_config({"gateways": True, "secure-aggregation": True, "clients-per-round": 2}))
    devices = [four.device(f"phone{i}", i, secure=True) for i in range(3)]
    liar = Inflating(gateway=four.url, name="phone3", key=four.allow / "phone3.key", data=four.run["shards"][3],
                     trust=four.run["trust"], ca=four.run["keys"].ca_cert, state_dir=four.root / "phone3", secure=True)
    stop = threading.Event()
    threads = [threading.Thread(target=d.run, kwargs={"stop": stop, "max_wait_s": 0.05}, daemon=True)
               for d in [*devices, liar]]
    for device in [*devices, liar]:
        device.check_in()
    for thread in threads:
        thread.start()
    # Execute
    try:
        header, _ = four.round(secure=secure)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    # Assert: the liar's weight entered the sum as max-device-examples; the pool reply is within the coordinator's
    # bound for a pool of four
    honest = header["num-examples"] - 10_000
    assert secure["weight-clip"] == 10_000 and header["secure-pool"] == 4
    assert 0 < honest < 3 * 2_000 and header["num-examples"] <= 4 * 10_000


def test_a_gateway_refuses_to_start_under_a_name_its_certificate_does_not_carry(run: dict[str, Any]) -> None:
    # Prepare: the certificate `fedge keys add-gateway gw-test` made
    cert = run["gateway-cert"][0]
    # Execute / Assert: its own name starts; another is refused, naming both and the fix
    check_certificate_name(cert, "gw-test")
    with pytest.raises(ConfigError, match=re.escape("names gateway 'gw-test', but this gateway runs as --name 'gw-b'")):
        check_certificate_name(cert, "gw-b")
