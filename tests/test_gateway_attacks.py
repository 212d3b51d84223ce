"""The device tier's listener attacks of security round 3 (issue 38), replayed on real sockets.

Items 1 (trickled bodies lock devices out), 4 (unauthenticated bodies buffered in full),
6 (replaced and removed allow-list keys), 11 (handshakes that never start) and 14 (malformed
numbers answered 500 with a traceback). Attackers connect from 127.0.0.2 (loopback), devices
from 127.0.0.1, so the per-address caps can be told apart; every target is on 127.0.0.1.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedge.clients.gateway.pool import GatewayRound
from fedge.clients.gateway.protocol import PREFIX, b64, check_in_message
from fedge.clients.gateway.service import GatewaySettings, Served, device_app
from fedge.listeners import ListenerLimits
from tests.http_attacks import wait_until
from tests.live_gateway import LiveGateway

ATTACKER = "127.0.0.2"
SMALL = GatewaySettings(name="gw-test", devices_per_round=3, round_deadline_s=300, idle_poll_s=0.2, max_in_flight=8,
                        max_per_address=4)
LIMITS = ListenerLimits(per_address=8, body_timeout_s=2.0, handshake_timeout_s=1.0)


class SmallGateway(LiveGateway):
    """A live gateway with small caps: 8 requests in flight, 4 per address, 8 connections per address."""

    def __init__(self, root: Path, run: dict[str, Any]) -> None:
        super().__init__(root, run, SMALL)
        self.devices.stop()
        self.devices = Served(device_app(self.gateway), "127.0.0.1", 0, limits=LIMITS, cert=run["gateway-cert"][0],
                              cert_key=run["gateway-cert"][1])
        self.url = f"https://127.0.0.1:{self.devices.port}"


@pytest.fixture
def small(tmp_path: Path, run: dict[str, Any]) -> Iterator[SmallGateway]:
    with SmallGateway(tmp_path, run) as gateway:
        yield gateway


def _tls(live: LiveGateway, source: str = ATTACKER) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(live.run["keys"].ca_cert))
    raw = socket.create_connection(("127.0.0.1", live.devices.port), timeout=30, source_address=(source, 0))
    return context.wrap_socket(raw, server_hostname="127.0.0.1")


def _status_of(sock: socket.socket) -> tuple[int | None, bytes]:
    """The status and body of the response on ``sock`` (None: closed without one)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data and len(data.split(b"\r\n\r\n", 1)[1]) >= _length(data):
                break
    except (OSError, ssl.SSLError):
        pass
    parts = data.split(b" ", 2)
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None), data.split(b"\r\n\r\n", 1)[-1]


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


# --------------------------------------------------------------------------- item 1: trickled bodies
def test_one_address_trickling_bodies_cannot_lock_devices_out(small: SmallGateway) -> None:
    # Prepare: one address opens more check-ins than the gateway takes in flight and trickles each body
    held = []
    for _ in range(SMALL.max_in_flight):
        sock = _tls(small)
        sock.sendall(f"POST {PREFIX}/check-in HTTP/1.1\r\nHost: x\r\nContent-Length: 4000\r\n\r\n{{".encode())
        held.append(sock)
    wait_until(lambda: small.gateway.in_flight_by.get(ATTACKER, 0) == SMALL.max_per_address, 30,
               "the attacker holding its whole share of in-flight requests")
    # Execute: a registered device checks in from its own address while the attacker holds its share
    device = small.device("phone0")
    device.check_in()
    outcomes = [_status_of(sock)[0] for sock in held]
    # Assert: the device got a session; the attacker's excess got 503 at once, its held bodies 408 at their deadline
    assert device._session is not None
    assert sorted(outcomes) == [408] * SMALL.max_per_address + [503] * (SMALL.max_in_flight - SMALL.max_per_address)
    wait_until(lambda: not small.gateway.in_flight_by, 30, "the attacker's requests ending")


# --------------------------------------------------------------------------- item 4: bodies before sessions
def test_an_unauthenticated_result_is_refused_before_its_body_is_read(small: SmallGateway) -> None:
    # Prepare: a 60 MiB result announced, only its headers sent, no session
    sock = _tls(small)
    # Execute
    sock.sendall(f"POST {PREFIX}/result HTTP/1.1\r\nHost: x\r\nContent-Length: {60 << 20}\r\n\r\n".encode())
    status, body = _status_of(sock)
    # Assert: answered at once (the 60 MiB never sent), naming the missing session
    assert status == 401 and b"check in first" in body


def test_a_result_larger_than_the_open_round_can_be_is_refused_unread(small: SmallGateway) -> None:
    # Prepare: a checked-in device; first no round is open, then one is
    device = small.device("phone0")
    device.check_in()

    def announce(length: int) -> tuple[int | None, bytes]:
        assert device._session is not None
        device._counter += 1
        sock = _tls(small, "127.0.0.1")
        sock.sendall((f"POST {PREFIX}/result HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n"
                      f"Authorization: Fedge-Session {device._session[0]}\r\nX-Fedge-Counter: {device._counter}\r\n"
                      "X-Fedge-Mac: AAAA\r\n\r\n").encode())
        return _status_of(sock)

    # Execute
    no_round = announce(60 << 20)
    small.gateway.model_elements = 1000
    small.gateway.round = GatewayRound(kind="train", server_round=1, config={}, graph="", target=1,
                                       weights={"w": np.zeros(1000, np.float32)}, max_num_examples=10)
    too_large = announce(60 << 20)
    # Assert: 409 with no round open, 413 past 8 bytes per model element plus the slack
    assert no_round[0] == 409 and b"no round is open" in no_round[1]
    assert too_large[0] == 413 and b"larger than this gateway takes" in too_large[1]


# --------------------------------------------------------------------------- item 6: keys replaced or removed
def _new_key() -> tuple[ec.EllipticCurvePrivateKey, bytes]:
    private = ec.generate_private_key(ec.SECP256R1())
    return private, private.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo)


def test_a_key_overwritten_in_place_ends_the_old_session_and_admits_the_new_key(small: SmallGateway) -> None:
    # Prepare: phone0 checked in with its old key; the operator overwrites phone0.pub in place
    old = small.device("phone0")
    old.check_in()
    private, public = _new_key()
    with open(small.allow / "phone0.pub", "r+b") as handle:  # same inode, same directory mtime
        handle.truncate(0)
        handle.write(public)
    (small.allow / "phone0.key").write_bytes(private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    new = small.device("phone0")
    # Execute: the old session's next requests, until the gateway has read the file again (within a second)
    answers: list[tuple[int, bytes]] = []
    wait_until(lambda: answers.append(_once(old, "GET", f"{PREFIX}/task")) or answers[-1][0] != 200, 30,
               "the old key's session ending")
    new.check_in()
    # Assert: the old key's session ended naming why; the new key holds a session
    assert answers[-1][0] == 401 and b"replaced or removed" in answers[-1][1]
    assert new._session is not None


def test_a_removed_key_ends_its_live_session(small: SmallGateway) -> None:
    # Prepare
    device = small.device("phone1", 1)
    device.check_in()
    # Execute
    (small.allow / "phone1.pub").unlink()
    # Assert: within a second its session answers 401, naming why
    answers: list[tuple[int, bytes]] = []
    wait_until(lambda: answers.append(_once(device, "GET", f"{PREFIX}/task")) or answers[-1][0] != 200, 30,
               "the removed key's session ending")
    assert answers[-1][0] == 401 and b"replaced or removed" in answers[-1][1]


def _once(device: Any, method: str, path: str) -> tuple[int, bytes]:
    """One authenticated request on the device's session, without checking in again on a 401."""
    from fedge.clients.gateway.protocol import COUNTER_HEADER, MAC_HEADER, request_mac  # noqa: PLC0415

    token, key = device._session
    device._counter += 1
    mac = request_mac(key, method=method, path=path, counter=device._counter, body=b"")
    status, _, body = device._send(method, path, b"", {"Authorization": f"Fedge-Session {token}",
                                                       COUNTER_HEADER: str(device._counter), MAC_HEADER: mac})
    return status, body


def _checks_in(device: Any) -> bool:
    try:
        device.check_in()
    except Exception:  # noqa: BLE001 - refused until the gateway re-read the key
        return False
    return True


# --------------------------------------------------------------------------- item 11: handshakes that never start
def test_handshakes_that_never_start_are_counted_at_accept_and_closed(small: SmallGateway) -> None:
    # Prepare: one address opens its whole share of TCP connections and never starts TLS
    silent = [socket.create_connection(("127.0.0.1", small.devices.port), timeout=30,
                                       source_address=(ATTACKER, 0)) for _ in range(LIMITS.per_address)]
    # Execute: one more from that address; a device from another address
    extra = socket.create_connection(("127.0.0.1", small.devices.port), timeout=30, source_address=(ATTACKER, 0))
    device = small.device("phone2", 2)
    device.check_in()
    # Assert: the extra connection is closed at once (counted before any handshake), the device served,
    # and the silent ones closed at the handshake deadline
    assert extra.recv(1) == b""
    assert device._session is not None
    assert all(_closed(sock) for sock in silent)


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_gateway_raises_its_open_file_limit_to_the_hard_limit() -> None:
    # Prepare: a process whose soft limit is systemd's default, below its hard limit
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    code = ("import resource; from fedge.clients.gateway.service import raise_file_limit; "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, (256, {hard})); print(raise_file_limit())")
    # Execute
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    # Assert
    before, after = eval(out.stdout)  # noqa: S307 - our own child's tuple
    assert before == 256 and after == (hard if hard != resource.RLIM_INFINITY else 1 << 20)


def test_the_documented_gateway_unit_sets_a_file_limit() -> None:
    text = (Path(__file__).parent.parent / "docs" / "operator.md").read_text()
    unit = text[:text.index("ExecStart=/opt/fedge/.venv/bin/fedge gateway start")]
    assert unit.rstrip().endswith("LimitNOFILE=65536")


# --------------------------------------------------------------------------- item 14: malformed numbers
def _check_in_text(live: LiveGateway, time_text: str) -> bytes:
    from fedge.clients.protocol_device import load_private_key, sign  # noqa: PLC0415

    nonce = b64(os.urandom(16))
    key = load_private_key(live.allow / "phone0.key")
    signature = sign(key, check_in_message(device="phone0", gateway="gw-test", issued_at=int(time.time()),
                                           nonce=nonce))
    return (f'{{"device": "phone0", "time": {time_text}, "nonce": "{nonce}", '
            f'"signature": "{b64(signature)}"}}').encode()


@pytest.mark.parametrize(("case", "time_text", "status", "reason"), [
    ("a time of 10**400", "1" + "0" * 400, 400, "whole Unix seconds"),
    ("a 5,000-digit number", "9" * 5000, 400, "not valid UTF-8 JSON"),
    ("a negative time", "-5", 400, "whole Unix seconds"),
    ("a float time of 1e400", "1e400", 400, "whole Unix seconds"),
])
def test_malformed_numbers_get_4xx_with_a_reason_and_no_traceback(small: SmallGateway, caplog: pytest.LogCaptureFixture,
                                                                  case: str, time_text: str, status: int,
                                                                  reason: str) -> None:
    # Prepare
    body = _check_in_text(small, time_text)
    sock = _tls(small, "127.0.0.1")
    # Execute
    with caplog.at_level(logging.INFO):
        sock.sendall(f"POST {PREFIX}/check-in HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                     + body)
        code, answer = _status_of(sock)
    # Assert: a 4xx naming the problem as JSON; nothing logged with a traceback
    assert code == status and reason in json.loads(answer)["error"]
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
