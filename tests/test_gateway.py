"""The gateway tier and fedge's device protocol (issue 27), on real sockets in one process.

Real parts: a gateway's device listener over TLS (a CA-signed certificate from `fedge keys
init`), its loopback control port, reference protocol devices (ECDSA P-256 and Ed25519 keys,
HMAC sessions), the run's signed training graph on onnxruntime, and fedge's ClientApp for
the Flower-path comparison.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import re
import shutil
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge import wire
from fedge.aggregate import weighted_mean
from fedge.clients.app import make_default_client_app
from fedge.clients.gateway.pool import GatewayRound, Session, device_seed
from fedge.clients.gateway.protocol import (
    COUNTER_HEADER,
    MAC_HEADER,
    PREFIX,
    Frame,
    b64,
    check_in_message,
    decode_frame,
    encode_frame,
    encode_task,
    from_int8_delta,
    int8_delta,
    request_mac,
)
from fedge.clients.gateway.service import (
    GatewaySettings,
    revoke_protocol_device,
)
from fedge.clients.protocol_device import ProtocolDevice
from fedge.config import resolve_run_config
from fedge.errors import BundleVerificationError, ConfigError, DeviceProtocolError, FedgeError
from fedge.server.bundles import run_signing_key
from fedge.server.pki import add_gateway, init_keys
from fedge.server.training_bundle import SIGNING_PUBLIC_KEY
from fedge.task.api import seeded_model
from fedge.task.loading import load_task
from fedge.task.models import model_arrays
from tests.live_gateway import CONFIG, LiveGateway, recomputed


# --------------------------------------------------------------------------- the frame format
def test_a_frame_round_trips_every_dtype_and_int8_scales() -> None:
    # Prepare: one tensor of each dtype, a 0-d tensor and an empty one
    tensors = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.float64(2.5) * np.ones(2),
               "q": np.array([-127, 0, 5], np.int8), "n": np.array(3, np.int64), "e": np.zeros((0, 4), np.int32)}
    # Execute
    frame, scales = decode_frame(encode_frame({"task": "t1"}, tensors, {"q": 0.25}))
    # Assert
    assert frame.header == {"task": "t1"} and scales == {"q": 0.25}
    for name, value in tensors.items():
        assert frame.tensors[name].dtype == value.dtype and np.array_equal(frame.tensors[name], value)


def _frame(header: bytes, tail: bytes = b"") -> bytes:
    return b"FDG1" + len(header).to_bytes(4, "little") + header + tail


BAD_FRAMES = [
    (b"not a frame", "is not a fedge frame"),
    (b"FDG1" + (10**6).to_bytes(4, "little") + b"{}", "exceeds the body"),
    (_frame(b"[1]"), "must be a JSON object"),
    (_frame(b"{bad"), "not valid UTF-8 JSON"),
    (_frame(b'{"tensors": [{"name": "w", "dtype": "object", "shape": [1]}]}'), "is not one of"),
    (_frame(b'{"tensors": [{"name": "w", "dtype": "float32", "shape": [4]}]}', b"\0" * 8), "needs 16 bytes"),
    (_frame(b'{"tensors": [{"name": "w", "dtype": "float32", "shape": [1]}]}', b"\0" * 8), "bytes follow"),
    (_frame(b'{"tensors": [{"name": "w", "dtype": "float32", "shape": [-1]}]}'), "non-negative"),
    (_frame(b'{"tensors": [{"name": "w", "dtype": "int8", "shape": [1]}]}', b"\0"), "needs a finite"),
    (_frame(b'{"tensors": [{"name": "w", "dtype": "float32", "shape": [1]},'
            b'{"name": "w", "dtype": "float32", "shape": [1]}]}', b"\0" * 8), "appears twice"),
    (_frame(b'{"tensors": [{"name": "w", "dtype": "float32", "shape": [100000, 100000]}]}'), "more than"),
]


@pytest.mark.parametrize(("data", "reason"), BAD_FRAMES, ids=[r for _, r in BAD_FRAMES])
def test_a_malformed_frame_is_refused_naming_the_problem(data: bytes, reason: str) -> None:
    with pytest.raises(DeviceProtocolError, match=reason):
        decode_frame(data)


def test_int8_delta_restores_the_weights_within_half_a_step() -> None:
    # Prepare
    rng = np.random.default_rng(0)
    base = {"w": rng.normal(size=(50, 20)).astype(np.float32), "b": np.zeros(20, np.float32)}
    trained = {"w": base["w"] + rng.normal(scale=0.01, size=(50, 20)).astype(np.float32), "b": base["b"]}
    # Execute
    quantised, scales = int8_delta(trained, base)
    frame, read_scales = decode_frame(encode_frame({}, quantised, scales))
    restored = from_int8_delta(frame.tensors, read_scales, base)
    # Assert: each weight within half a quantisation step (plus float32 rounding); an unchanged tensor exactly
    assert np.max(np.abs(restored["w"] - trained["w"])) <= scales["w"] / 2 + 1e-6
    assert np.array_equal(restored["b"], base["b"]) and scales["b"] == 0.0


# --------------------------------------------------------------------------- hierarchical = flat
def _accepted_round(updates: list[dict[str, np.ndarray]], counts: list[int], base: dict[str, np.ndarray]
                    ) -> tuple[dict[str, np.ndarray], int]:
    current = GatewayRound(kind="train", server_round=1, config=CONFIG, graph="", weights=base,
                           target=len(updates), max_num_examples=10**6)
    for index, (update, count) in enumerate(zip(updates, counts, strict=True)):
        header = {"task": current.task_id, "kind": "train", "num-examples": count, "encoding": "fp32",
                  "metrics": {"train-loss": 1.0}}
        current.accept(Session(device=f"d{index}", key=b"k" * 32, expires=1e18), Frame(header, update), {})
    result = current.close()
    assert result is not None
    return result.arrays, result.num_examples


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.integers(1, 5000), min_size=2, max_size=9), split=st.integers(1, 8),
       seed=st.integers(0, 2**16))
def test_gateways_then_coordinator_equal_flat_fedavg(counts: list[int], split: int, seed: int) -> None:
    # Prepare: devices' updates split over two gateways at any point
    rng = np.random.default_rng(seed)
    base = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)}
    updates = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in base.items()} for _ in counts]
    cut = 1 + split % (len(counts) - 1)
    # Execute: each gateway's mean, then the coordinator's FedAvg over the two, weighted by their examples
    first, first_n = _accepted_round(updates[:cut], counts[:cut], base)
    second, second_n = _accepted_round(updates[cut:], counts[cut:], base)
    hierarchical = weighted_mean([first, second], [first_n, second_n])
    flat = weighted_mean(updates, counts)
    # Assert: equal within float32 rounding
    for name in base:
        assert np.max(np.abs(hierarchical[name] - flat[name])) <= 1e-6


# --------------------------------------------------------------------------- a live gateway
def _in_background(function: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(result=function()), daemon=True)
    thread.start()
    return thread, box


def _wait(condition: Any) -> None:
    """Until ``condition`` holds (an event, not a duration: the test's own timeout bounds it)."""
    while not condition():
        time.sleep(0.02)


def _polled_round(live: LiveGateway, devices: list[ProtocolDevice]) -> tuple[list[Any], dict[str, Any],
                                                                            dict[str, Any]]:
    """The devices check in; the coordinator's instruction reaches the gateway; each device polls once.
    Their outcomes, and the gateway's answer (header, arrays)."""
    for device in devices:
        device.check_in()
    thread, box = _in_background(live.round)
    _wait(lambda: live.gateway.round is not None)
    outcomes = [device.poll() for device in devices]
    thread.join()
    header, arrays = box["result"]
    return outcomes, header, arrays


def test_a_gateway_round_sends_the_weighted_mean_of_its_devices_training(live: LiveGateway,
                                                                           run: dict[str, Any]) -> None:
    # Prepare: three devices (two P-256, one Ed25519) on different shards
    devices = [live.device("phone0", 0), live.device("phone1", 1), live.device("browser", 2)]
    # Execute: each takes the round's task once
    outcomes, header, arrays = _polled_round(live, devices)
    # Assert: each device's training, recomputed with the same trainer, seed and shard; their weighted mean
    trainer = devices[0].training_graph()[1]
    expected, counts = [], []
    for device, shard in zip(devices, (0, 1, 2), strict=True):
        inputs, targets = run["shards"][shard]
        trained, work = trainer.train(run["weights"], inputs, targets, epochs=1, batch_size=32, learning_rate=0.05,
                                      momentum=0.9, seed=device_seed(7, 1, device.name))
        expected.append(trained)
        counts.append(work.num_examples)
    mean = weighted_mean(expected, counts)
    assert [o.kind for o in outcomes] == ["train"] * 3
    assert header["num-examples"] == sum(counts) and header["devices"] == 3 and header["rejected"] == 0
    assert max(float(np.max(np.abs(arrays[k] - mean[k]))) for k in mean) <= 1e-6


def test_protocol_devices_train_from_an_fp16_task_and_the_round_is_their_mean_on_the_exact_weights(
        tmp_path: Path, run: dict[str, Any]) -> None:
    # Prepare: a live gateway with an fp16 downlink; two reference devices (they read fp16)
    settings = GatewaySettings(name="gw-test", devices_per_round=2, round_deadline_s=300, idle_poll_s=0.2,
                               downlink="fp16")
    with LiveGateway(tmp_path, run, settings) as live:
        devices = [live.device("phone0", 0), live.device("phone1", 1)]
        # Execute: each takes the round's task once
        outcomes, header, arrays = _polled_round(live, devices)
        trainer = devices[0].training_graph()[1]
    # Assert: each device trained from the fp16 weights (recomputed from them); the gateway's mean is the exact
    # weights plus the devices' weighted mean update
    read = encode_task(run["weights"], "fp16").received
    trained, counts = recomputed(trainer, {**run, "weights": read}, ["phone0", "phone1"], 1)
    updates = [{k: t[k] - read[k] for k in read} for t in trained]
    mean = weighted_mean(updates, counts)
    assert [o.kind for o in outcomes] == ["train"] * 2 and header["devices"] == 2
    assert max(float(np.max(np.abs(arrays[k] - (run["weights"][k] + mean[k])))) for k in mean) <= 2e-6
    assert any(not np.array_equal(read[k], run["weights"][k]) for k in read)  # fp16 did round the weights


def test_a_gateway_evaluate_round_averages_its_devices_metrics(live: LiveGateway) -> None:
    devices = [live.device(f"phone{i}", i) for i in range(3)]
    thread, box = _in_background(lambda: live.round("evaluate"))
    _wait(lambda: live.gateway.round is not None)
    outcomes = [device.poll() for device in devices]
    thread.join()
    header, arrays = box["result"]
    assert [o.kind for o in outcomes] == ["evaluate"] * 3 and arrays == {}
    assert header["devices"] == 3 and 0.0 <= header["metrics"]["accuracy"] <= 1.0


def test_the_reference_client_sends_the_update_a_flower_onnx_device_sends(live: LiveGateway,
                                                                           run: dict[str, Any]) -> None:
    # Prepare: the same shard, weights, settings and seed for the Flower-path onnx device and the protocol device
    config, seed = run["config"], device_seed(7, 1, "phone0")
    inputs, targets = run["shards"][1]
    np.savez(live.root / "shard.npz", x=inputs[0], y=targets)
    instruction = Message(RecordDict({wire.ARRAYS: model_arrays(seeded_model(load_task(resolve_run_config(config)),
                                                                              int(config["seed"]))),
                                      wire.CONFIG: ConfigRecord({wire.SERVER_ROUND: 1,
                                                                 wire.TRAINING_GRAPH: run["architecture"],
                                                                 **{k: CONFIG[k] for k in ("local-epochs",
                                                                    "batch-size", "learning-rate", "momentum")}})}),
                          dst_node_id=5, message_type="train")
    context = Context(run_id=1, node_id=5, state=RecordDict(), run_config=config, node_config={
        "partition-id": 1, "num-partitions": 4, "profile": "laptop", "runtime": "onnx"})
    from fedge.clients import common  # noqa: PLC0415 - pin the Flower path's seed to the protocol device's

    original = common.training_seed
    common.training_seed = lambda *_: seed  # type: ignore[assignment]
    try:
        reply = make_default_client_app()(instruction, context)
    finally:
        common.training_seed = original
    device = live.device("phone0", 1)
    _, trainer = device.training_graph()
    task = {"task": "t", "config": CONFIG, "seed": seed, "uplink": "fp32"}
    # Execute: the protocol device's result frame
    _, result = device.train(task, dict(run["weights"]), trainer, inputs, targets)
    # Assert: the same weights within 1e-5, the same example count
    frame, _ = decode_frame(result)
    flower = {name: array.numpy() for name, array in reply.content[wire.ARRAYS].items()}
    assert flower.keys() == frame.tensors.keys()
    assert max(float(np.max(np.abs(flower[k] - frame.tensors[k]))) for k in flower) <= 1e-5
    assert frame.header["num-examples"] == reply.content[wire.METRICS][wire.NUM_EXAMPLES]


# --------------------------------------------------------------------------- attacks, replayed
def _raw(live: LiveGateway, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, Any]]:
    context = ssl.create_default_context(cafile=str(live.run["keys"].ca_cert))
    connection = http.client.HTTPSConnection("127.0.0.1", live.devices.port, context=context, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    return response.status, (json.loads(data) if data.startswith(b"{") else {"raw": len(data)})


def _signed_check_in(live: LiveGateway, name: str, *, gateway: str = "gw-test", issued: int | None = None,
                     nonce: str = "", key_of: str | None = None) -> bytes:
    from fedge.clients.protocol_device import load_private_key, sign  # noqa: PLC0415

    issued = int(time.time()) if issued is None else issued
    nonce = nonce or b64(os.urandom(16))
    key = load_private_key(live.allow / f"{key_of or name}.key")
    signature = sign(key, check_in_message(device=name, gateway=gateway, issued_at=issued, nonce=nonce))
    return json.dumps({"device": name, "time": issued, "nonce": nonce, "signature": b64(signature)}).encode()


CHECK_IN_ATTACKS = [
    ("another-device-key", {"key_of": "phone1"}, 401, "does not verify"),
    ("signed-for-another-gateway", {"gateway": "gw-other"}, 401, "does not verify"),
    ("stale-timestamp", {"issued": 1_000_000}, 401, "s behind the gateway's (the limit is 300 s)"),
    ("unknown-device", {"name": "intruder", "key_of": "phone0"}, 403, "not in this gateway's allow-list"),
]


@pytest.mark.parametrize(("case", "change", "status", "reason"), CHECK_IN_ATTACKS, ids=[c[0] for c in CHECK_IN_ATTACKS])
def test_a_forged_check_in_is_refused(live: LiveGateway, case: str, change: dict[str, Any], status: int,
                                      reason: str) -> None:
    name = change.pop("name", "phone0")
    code, answer = _raw(live, "POST", f"{PREFIX}/check-in", _signed_check_in(live, name, **change))
    assert code == status and reason in answer["error"] and "session" not in answer


@pytest.mark.parametrize(("case", "body"), [
    ("JSON nested 8,000 deep", b"[" * 8_000), ("not JSON", b"\xff\xfe"), ("an array", b"[1, 2]"),
])
def test_a_hostile_check_in_body_gets_400_not_a_crash(live: LiveGateway, case: str, body: bytes) -> None:
    code, answer = _raw(live, "POST", f"{PREFIX}/check-in", body)
    assert code == 400 and ("JSON" in answer["error"] or "nests too deeply" in answer["error"]), (code, answer)


@pytest.mark.parametrize(("case", "records", "reason"), [
    ("lists nested 900 deep", {"r": {"k": json.loads("[" * 900 + "]" * 900)}}, "a list holds values of one type"),
    ("mixed types in a list", {"r": {"k": [1, "a"]}}, "a list holds values of one type"),
    ("null", {"r": {"k": None}}, "null is not a record value"),
    ("an object that is not bytes", {"r": {"k": {"x": 1}}}, "an object value must be"),
    ("bad base64", {"r": {"k": {"b64": "***"}}}, "not valid base64"),
    ("not an object of records", [1], "must be an object"),
])
def test_malformed_step_records_are_refused_by_name(case: str, records: Any, reason: str) -> None:
    from fedge.clients.gateway.protocol import records_from_json  # noqa: PLC0415

    with pytest.raises(DeviceProtocolError, match=re.escape(reason)):
        records_from_json(records)


def test_a_device_resumes_its_tls_session_and_still_signs_only_for_the_gateway_its_certificate_names(
        live: LiveGateway) -> None:
    # Prepare: a device checks in (a full handshake), then closes its connection between polls, as devices do
    device = live.device("phone0")
    device.check_in()
    first = device._connection
    assert first is not None and isinstance(first.sock, ssl.SSLSocket) and not first.sock.session_reused
    verified = device._peer  # the common name of the certificate the full handshake verified
    device.close()
    # Execute: it checks in again on a new connection
    device.check_in()
    # Assert: the gateway resumed the session (no certificate signature, no chain check), and the signed check-in
    # still went to a connection whose certificate, carried by the session, names the gateway
    second = device._connection
    assert second is not None and isinstance(second.sock, ssl.SSLSocket) and second.sock.session_reused
    assert device._peer == verified and verified.endswith("gw-test") and device.gateway_name == "gw-test"


def test_the_gateways_tls_listener_sends_each_response_at_once(live: LiveGateway) -> None:
    import socket  # noqa: PLC0415

    import psutil  # noqa: PLC0415

    # Prepare: a device's kept-alive TLS connection to the gateway (its listener runs in this process)
    context = ssl.create_default_context(cafile=str(live.run["keys"].ca_cert))
    client = http.client.HTTPSConnection("127.0.0.1", live.devices.port, context=context, timeout=30)
    client.request("GET", "/v1/hello")
    assert client.getresponse().read()
    # Execute: find the gateway's side of that connection (its socket in this process)
    local = client.sock.getsockname()
    (served,) = [c for c in psutil.Process().net_connections("tcp")
                 if c.laddr and c.laddr.port == live.devices.port and c.raddr and c.raddr.port == local[1]]
    gateway_side = socket.socket(fileno=os.dup(served.fd))
    try:
        no_delay = gateway_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        gateway_side.close()
        client.close()
    # Assert: TCP_NODELAY: a response's TLS records go at once (without it every response waited ~40 ms for the
    # device's delayed ACK: 44 ms a request against 0.7 ms, bench/README "TLS session resumption")
    assert no_delay != 0


def test_the_gateways_listener_stops_while_a_device_holds_an_idle_kept_alive_connection(
        tmp_path: Path, run: dict[str, Any]) -> None:
    # Prepare: a gateway; a device's kept-alive TLS connection, idle after one request (it reads nothing more)
    live = LiveGateway(tmp_path, run, GatewaySettings(name="gw-test"))
    context = ssl.create_default_context(cafile=str(run["keys"].ca_cert))
    client = http.client.HTTPSConnection("127.0.0.1", live.devices.port, context=context, timeout=30)
    try:
        client.request("GET", "/v1/hello")
        assert client.getresponse().read()
        # Execute: the gateway stops (as at SIGTERM), waiting up to 10 s for its listener's thread
        live.close()
    finally:
        client.close()
    # Assert: the listener ended: its TLS close waits 1 s for the device's close_notify, not asyncio's 30 s (before,
    # the thread was still waiting after 10 s, and every connection it closed kept its address's slot that long)
    assert not live.devices.thread.is_alive()


def test_a_recorded_check_in_cannot_be_replayed(live: LiveGateway) -> None:
    body = _signed_check_in(live, "phone0")
    first, _ = _raw(live, "POST", f"{PREFIX}/check-in", body)
    replay, answer = _raw(live, "POST", f"{PREFIX}/check-in", body)
    assert (first, replay) == (200, 401) and "replay" in answer["error"]


def test_a_recorded_or_altered_request_is_refused(live: LiveGateway) -> None:
    # Prepare: a real session; one correctly authenticated request
    _, answer = _raw(live, "POST", f"{PREFIX}/check-in", _signed_check_in(live, "phone0"))
    token, key = answer["session"], base64.b64decode(answer["key"])

    def headers(counter: int, body: bytes, path: str = f"{PREFIX}/task") -> dict[str, str]:
        return {"Authorization": f"Fedge-Session {token}", COUNTER_HEADER: str(counter),
                MAC_HEADER: request_mac(key, method="GET", path=path, counter=counter, body=body)}

    good = headers(1, b"")
    # Execute / Assert: it works once; replayed it is refused; a MAC for another body or path is refused
    assert _raw(live, "GET", f"{PREFIX}/task", b"", good)[0] == 200
    replayed = _raw(live, "GET", f"{PREFIX}/task", b"", good)
    assert replayed[0] == 401 and "replay" in replayed[1]["error"]
    wrong_path = _raw(live, "GET", f"{PREFIX}/task", b"", headers(5, b"", f"{PREFIX}/result"))
    assert wrong_path[0] == 401 and "does not verify" in wrong_path[1]["error"]
    no_session = _raw(live, "GET", f"{PREFIX}/task")
    assert no_session[0] == 401 and "check in first" in no_session[1]["error"]


def test_a_revoked_device_loses_its_live_session_and_cannot_check_in(live: LiveGateway) -> None:
    device = live.device("phone2")
    device.check_in()
    assert device.poll().kind == "wait"
    revoke_protocol_device(live.allow, "phone2")
    time.sleep(1.1)  # the allow-list is re-read at most once a second: the documented revocation delay
    with pytest.raises(DeviceProtocolError, match="revoked"):
        device.poll()
    code, answer = _raw(live, "POST", f"{PREFIX}/check-in", _signed_check_in(live, "phone2"))
    assert code == 403 and "revoked" in answer["error"]


BAD_RESULTS = [
    ("nan-weights", lambda w: {k: np.full_like(v, np.nan) for k, v in w.items()}, {}, "NaN or Inf"),
    ("wrong-shape", lambda w: {k: np.zeros(3, np.float32) for k in w}, {}, "shape"),
    ("missing-tensor", lambda w: dict(list(w.items())[:1]), {}, "missing"),
    ("huge-count", lambda w: w, {"num-examples": 10**9}, "num-examples"),
    ("zero-count", lambda w: w, {"num-examples": 0}, "num-examples"),
    ("bad-encoding", lambda w: w, {"encoding": "zip"}, "encoding"),
    ("nan-loss", lambda w: w, {"metrics": {"train-loss": float("nan")}}, "finite"),
]


@pytest.mark.parametrize(("case", "tensors", "fields", "reason"), BAD_RESULTS, ids=[c[0] for c in BAD_RESULTS])
def test_a_malformed_result_is_rejected_and_the_round_goes_on(live: LiveGateway, run: dict[str, Any], case: str,
                                                              tensors: Any, fields: dict[str, Any],
                                                              reason: str) -> None:
    # Prepare: a round waiting for 3 results; one device sends a bad result, three good ones follow
    thread, box = _in_background(live.round)
    _wait(lambda: live.gateway.round is not None)
    bad = live.device("phone3", 3)
    status, _, body = bad._authenticated("GET", f"{PREFIX}/task")
    task = decode_frame(body)[0].header
    header = {"task": task["task"], "kind": "train", "num-examples": 10, "encoding": "fp32",
              "metrics": {"train-loss": 1.0}, **fields}
    weights = {k: np.asarray(v, np.float32) for k, v in run["weights"].items()}
    # Execute
    code, _, answer = bad._authenticated("POST", f"{PREFIX}/result", encode_frame(header, tensors(weights)))
    outcomes = [live.device(f"phone{i}", i).poll() for i in range(3)]
    thread.join()
    # Assert: 422 naming the problem; the round completed with the three good results, one rejection counted
    assert code == 422 and reason in json.loads(answer)["error"]
    result, _ = box["result"]
    assert [o.kind for o in outcomes] == ["train"] * 3 and result["devices"] == 3 and result["rejected"] == 1


def test_a_training_graph_not_signed_by_the_coordinator_is_refused(live: LiveGateway, tmp_path: Path) -> None:
    # A device that trusts another signer (as when a gateway hands out a graph the coordinator did not sign)
    device = live.device("phone0")
    device.trust = _other_key(tmp_path)
    with pytest.raises(BundleVerificationError):
        device.training_graph()


def _other_key(tmp_path: Path) -> Path:
    """A signing public key in the format run keys use, of a key that did not sign the graph."""

    config = resolve_run_config({"run-dir": str(tmp_path / "other-run")})
    (tmp_path / "other-run").mkdir()
    run_signing_key(config, tmp_path / "other-run")
    return tmp_path / "other-run" / SIGNING_PUBLIC_KEY


def test_a_device_that_checks_in_again_after_sending_is_not_counted_twice(live: LiveGateway) -> None:
    # Prepare: a round of 3; phone0 sends its result, then (an app or page reloaded) checks in on a new session
    thread, box = _in_background(live.round)
    _wait(lambda: live.gateway.round is not None)
    phone = live.device("phone0", 0)
    assert phone.poll().kind == "train"
    reloaded = live.device("phone0", 0)
    reloaded.check_in()
    # Execute: the reloaded device asks for a task on its new session
    outcome = reloaded.poll()
    others = [live.device(f"phone{index}", index).poll() for index in (1, 2)]
    thread.join()
    header, _ = box["result"]
    # Assert: no second task for it; the round holds three different devices
    assert outcome.kind == "wait" and [o.kind for o in others] == ["train", "train"]
    assert header["devices"] == 3 and live.gateway.round is not None and live.gateway.round.answered == 3


def test_a_busy_gateway_answers_503_with_retry_after(live: LiveGateway) -> None:
    live.gateway.in_flight = live.gateway.settings.max_in_flight  # as if that many requests were in progress
    try:
        code, answer = _raw(live, "GET", f"{PREFIX}/hello")
    finally:
        live.gateway.in_flight = 0
    assert code == 503 and answer["next-in-s"] > 0


def test_the_protocol_device_imports_neither_flower_nor_torch() -> None:
    # A finder that makes `import flwr` and `import torch` fail, then the reference client's modules
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('flwr', 'torch'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import fedge.clients.protocol_device, fedge.clients.gateway.protocol\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flwr', 'torch')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --------------------------------------------------------------------------- `fedge keys add-gateway`
def test_add_gateway_makes_a_ca_signed_p256_certificate_for_the_gateways_hosts(tmp_path: Path) -> None:
    from cryptography import x509  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415

    from fedge.cli.main import main  # noqa: PLC0415

    # Prepare: a CA
    keys = init_keys(tmp_path / "keys")
    # Execute: the command an operator runs
    assert main(["keys", "add-gateway", "gw1", "--dir", str(keys.directory), "--host", "gw1.example.org",
                 "--host", "10.0.0.7"]) == 0
    # Assert: P-256, signed by the CA, the hosts as SANs, a server certificate; the key 0600
    cert = x509.load_pem_x509_certificate((keys.directory / "gateways" / "gw1.crt").read_bytes())
    ca = x509.load_pem_x509_certificate(keys.ca_cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    public = cert.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey) and public.curve.name == "secp256r1"
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost", "gw1.example.org"]
    assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.0.0.7"]
    assert (keys.directory / "gateways" / "gw1.key").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(("case", "setup", "reason"), [
    ("no CA yet", lambda d: None, "create the CA first with `fedge keys init"),
    ("a bad name", lambda d: init_keys(d), "gateway name 'gw 1' must be"),
    ("an existing key", lambda d: (init_keys(d), add_gateway(d, "gw1", hosts=[])), "already exists; pass --force"),
])
def test_add_gateway_refuses_naming_the_fix(tmp_path: Path, case: str, setup: Any, reason: str) -> None:
    setup(tmp_path / "keys")
    name = "gw 1" if case == "a bad name" else "gw1"
    with pytest.raises(ConfigError, match=re.escape(reason)):
        add_gateway(tmp_path / "keys", name, hosts=[])


# ------------------------------------------------------------------ a device that names several gateways (issue 43 §2)
@pytest.fixture
def two_gateways(tmp_path: Path, run: dict[str, Any]) -> Iterator[tuple[LiveGateway, LiveGateway]]:
    """Gateways gw-test and gw-b, each taking one device a round; phone0's key is allowed at both."""
    first = LiveGateway(tmp_path / "a", run, GatewaySettings(name="gw-test", devices_per_round=1,
                                                             round_deadline_s=600, idle_poll_s=0.2))
    second = LiveGateway(tmp_path / "b", run, GatewaySettings(name="gw-b", devices_per_round=1,
                                                              round_deadline_s=600, idle_poll_s=0.2))
    shutil.copyfile(first.allow / "phone0.pub", second.allow / "phone0.pub.new")
    (second.allow / "phone0.pub.new").replace(second.allow / "phone0.pub")  # one atomic swap: the list reloads
    try:
        yield first, second
    finally:
        first.close()
        second.close()


def test_a_result_lost_on_the_way_is_sent_again_when_its_gateway_offers_the_task_again(
        tmp_path: Path, run: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: a gateway round of one device; the device's first result is lost on the way (its connection drops
    # as the result is sent: a fault put in the transport, once)
    with LiveGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=1, round_deadline_s=600,
                                                    idle_poll_s=0.2)) as live:
        device = live.device("phone0")
        device.check_in()
        sent: list[bytes] = []
        send = device._result_answer

        def dropped(frame: bytes) -> Any:
            sent.append(frame)
            device._result_answer = send  # type: ignore[method-assign]
            raise ConnectionResetError("the connection dropped as the result was sent")

        device._result_answer = dropped  # type: ignore[method-assign]
        thread, box = _in_background(live.round)
        _wait(lambda: live.gateway.round is not None)
        # Execute: the device trains and loses its result; the gateway offers the task again; the device polls
        with pytest.raises(ConnectionResetError):
            device.poll()
        with caplog.at_level(logging.INFO, logger="fedge.protocol_device"):
            again = device.poll()
        thread.join()
        header, arrays = box["result"]
    # Assert: the same result, sent again, not trained twice; the round has it
    frame, scales = decode_frame(sent[0])
    assert again.kind == "train" and header["devices"] == 1 and header["num-examples"] == frame.header["num-examples"]
    assert all(np.array_equal(arrays[name], frame.tensors[name]) for name in frame.tensors)
    assert "its result, trained before, sent again" in caplog.text and "trained on" not in caplog.text


def test_a_device_checks_in_at_its_next_gateway_when_its_gateway_is_stopped_and_trains_each_round_once(
        two_gateways: tuple[LiveGateway, LiveGateway], run: dict[str, Any], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: phone0 names both gateways, gw-test first, and polls on a thread
    first, second = two_gateways
    device = ProtocolDevice(gateway=[first.url, second.url], name="phone0", key=first.allow / "phone0.key",
                            data=run["shards"][0], trust=run["trust"], ca=run["keys"].ca_cert,
                            state_dir=tmp_path / "phone0")
    stop = threading.Event()
    trained: list[int] = []
    thread = threading.Thread(target=lambda: trained.append(device.run(stop=stop, max_wait_s=0.05)), daemon=True)
    thread.start()
    try:
        # Execute: round 1 through gw-test; gw-test stops; round 2 through gw-b
        header1, _ = first.round(server_round=1)
        first.close()
        header2, _ = second.round(server_round=2)
        # ... and gw-b asks for round 2 again (as if it had not heard of the result): the device does not train it
        # twice, so gw-b's round ends on its deadline with no device (the deadline is what this waits for)
        second.gateway.settings = replace(second.gateway.settings, round_deadline_s=3.0)
        with pytest.raises(FedgeError, match="none of this gateway's devices answered"):
            second.round(server_round=2)
    finally:
        stop.set()
        thread.join()
    # Assert: one device in each round, through each gateway; it switched once, trained twice, refused once
    assert header1["devices"] == 1 and header1["gateway"] == "gw-test"
    assert header2["devices"] == 1 and header2["gateway"] == "gw-b"
    assert trained == [2] and device.gateway_name == "gw-b"
    assert "cannot be reached; checking in at" in caplog.text
    assert "not training round 2 again" in caplog.text
