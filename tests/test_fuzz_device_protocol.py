"""Fuzzing the gateway's readers of what devices send (security round 3, issue 38).

Starting from valid inputs made by fedge's own writers (a signed check-in, a session's
headers, a device's result frame, the coordinator's round config), mutated or drawn at
random: each reader either accepts, or raises :class:`fedge.errors.DeviceProtocolError`
(answered with its 4xx status), never another exception (a 500 with a traceback, as a
check-in time of 10**400 was), never a hang, never a non-finite running mean.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedge.clients.gateway.pool import AllowList, DeviceBounds, GatewayRound, Sessions
from fedge.clients.gateway.protocol import b64, check_in_message, decode_frame, encode_frame, int8_delta, read_json
from fedge.clients.gateway.service import add_protocol_device
from fedge.clients.protocol_device import load_private_key, sign
from fedge.errors import DeviceProtocolError
from fuzzing import bounded, fuzz, mutated

NUMBERS = [b"1" + b"0" * 400, b"9" * 5000, b"-1", b"1e400", b"-1e400", b"NaN", b"Infinity", b"null", b"true",
           b"1.5", b"[]", b"{}", b'"x"', b"18446744073709551616"]
DIRECTORY = Path(os.environ.get("TMPDIR", "/tmp")) / f"fedge-fuzz-devices-{os.getpid()}"
add_protocol_device(DIRECTORY, "phone0", force=True)
ALLOW = AllowList(DIRECTORY)
KEY = load_private_key(DIRECTORY / "phone0.key")
WEIGHTS = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), "b": np.zeros(4, np.float32)}


ISSUED = int(time.time())


def _check_in_body(nonce: bytes = b"n" * 16) -> bytes:
    """A signed check-in at :data:`ISSUED` (checked at that time: a fixed original for the mutations)."""
    signature = sign(KEY, check_in_message(device="phone0", gateway="gw", issued_at=ISSUED, nonce=b64(nonce)))
    return json.dumps({"device": "phone0", "time": ISSUED, "nonce": b64(nonce), "signature": b64(signature),
                       "capabilities": ["int8-delta"]}).encode()


CHECK_IN = _check_in_body()


@fuzz()
@given(data=st.data())
def test_fuzz_check_in_bodies_open_a_session_or_are_refused(data: st.DataObject) -> None:
    body = data.draw(mutated(CHECK_IN, interesting=NUMBERS, inserts=NUMBERS))
    sessions = Sessions(ALLOW, "gw")
    with bounded(memory=False):
        try:
            sessions.check_in(read_json(body, "check-in body"), now=ISSUED)
        except DeviceProtocolError as exc:
            assert 400 <= getattr(exc, "status", 400) < 500


@fuzz()
@given(authorization=st.one_of(st.none(), st.text(max_size=80), st.just("Fedge-Session ")),
       counter=st.one_of(st.none(), st.text(max_size=40), st.sampled_from(["0", "1", "9" * 19, "-1", "1e9", "²"])),
       mac=st.one_of(st.none(), st.text(max_size=60)))
def test_fuzz_session_headers_are_refused_with_4xx(authorization: str | None, counter: str | None,
                                                   mac: str | None) -> None:
    sessions = Sessions(ALLOW, "gw")
    token, _, _ = sessions.check_in(json.loads(CHECK_IN), now=ISSUED)
    header = authorization if authorization != "Fedge-Session " else f"Fedge-Session {token}"
    try:
        sessions.authenticate(authorization=header, counter=counter, mac=mac, method="GET", path="/v1/task",
                              body=b"", now=ISSUED)
    except DeviceProtocolError as exc:
        assert getattr(exc, "status", 400) in (401, 403)


@pytest.mark.parametrize("counter", ["\u00b2", "\u0663", "\uff11"])  # digits to str.isdigit, not to int()
def test_counters_found_by_fuzzing_are_refused_with_401(counter: str) -> None:
    sessions = Sessions(ALLOW, "gw")
    token, _, _ = sessions.check_in(json.loads(CHECK_IN), now=ISSUED)
    with pytest.raises(DeviceProtocolError, match="X-Fedge-Counter"):
        sessions.authenticate(authorization=f"Fedge-Session {token}", counter=counter, mac="x", method="GET",
                              path="/v1/task", body=b"", now=ISSUED)


def _result_frame(task: str, encoding: str) -> bytes:
    trained = {name: value + 0.01 for name, value in WEIGHTS.items()}
    header = {"task": task, "kind": "train", "num-examples": 40, "samples-processed": 40, "steps": 2,
              "encoding": encoding, "metrics": {"train-loss": 0.7}}
    if encoding == "int8-delta":
        return encode_frame(header, *int8_delta(trained, WEIGHTS))
    return encode_frame(header, trained)


@fuzz()
@given(data=st.data(), encoding=st.sampled_from(["fp32", "int8-delta"]))
def test_fuzz_results_fold_in_or_are_refused_and_the_sum_stays_finite(data: st.DataObject, encoding: str) -> None:
    current = GatewayRound(kind="train", server_round=1, config={}, graph="", weights=WEIGHTS, target=100,
                           max_num_examples=100_000, bounds=DeviceBounds(epochs=1, batch_size=32))
    sessions = Sessions(ALLOW, "gw")
    _, _, session = sessions.check_in(json.loads(CHECK_IN), now=ISSUED)
    body = data.draw(mutated(_result_frame(current.task_id, encoding), interesting=NUMBERS, inserts=NUMBERS))
    with bounded():
        try:
            frame, scales = decode_frame(body)
            current.accept(session, frame, scales)
        except DeviceProtocolError as exc:
            assert getattr(exc, "status", 400) in (400, 409, 422)
    result = current.close()
    if result is not None:
        assert all(np.all(np.isfinite(value)) for value in result.arrays.values())
        assert all(np.isfinite(value) for value in result.metrics.values())


@fuzz()
@given(config=st.dictionaries(st.sampled_from(["max-device-examples", "max-update-norm", "local-epochs",
                                                "batch-size", "seed"]),
                              st.one_of(st.integers(), st.floats(), st.text(max_size=5), st.booleans(), st.none(),
                                        st.lists(st.integers(), max_size=2))))
def test_fuzz_round_bounds_read_or_are_refused(config: dict[str, Any]) -> None:
    try:
        bounds = DeviceBounds.of(config)
    except DeviceProtocolError as exc:
        assert getattr(exc, "status", 400) == 400
        return
    assert bounds.max_device_examples >= 1 and bounds.max_update_norm >= 0
    assert bounds.steps_for(100) >= 0 and bounds.samples_for(100) >= 0
