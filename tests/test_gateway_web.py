"""The demo page's data route hands a device's training examples to that device's session only
(issue 38, item 13).

Before: ``GET /web/data/NAME.json`` answered anyone, on a port the guide binds to 0.0.0.0, with
every demo device's examples. Now it takes the device protocol's session MAC, checked by the same
``Sessions.authenticate`` the ``/v1`` routes use (a real allow-list, a real signed check-in here),
and the session's device must be NAME. A gateway serving the page beyond loopback says so loudly.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from fedge.clients.gateway import add_protocol_device
from fedge.clients.gateway_pool import AllowList, Sessions
from fedge.clients.gateway_web import WebSite, demo_page_warning, web_routes
from fedge.clients.protocol_device import load_private_key, sign
from fedge.device_protocol import (
    COUNTER_HEADER,
    MAC_HEADER,
    NONCE_BYTES,
    SESSION_HEADER,
    b64,
    check_in_message,
    request_mac,
)

GATEWAY = "gw-test"
EXAMPLES = {"inputs": [{"dtype": "float32", "dims": [1, 2], "b64": "AACAPwAAAEA="}],
            "targets": {"dtype": "int64", "dims": [1], "b64": "AQAAAAAAAAA="}}


class Device:
    """A checked-in device: its session token and key, and its request counter."""

    def __init__(self, sessions: Sessions, allow: Path, name: str) -> None:
        issued, nonce = int(time.time()), b64(secrets.token_bytes(NONCE_BYTES))
        signature = sign(load_private_key(allow / f"{name}.key"),
                         check_in_message(device=name, gateway=GATEWAY, issued_at=issued, nonce=nonce))
        self.token, self.key, _ = sessions.check_in({"protocol": 1, "device": name, "time": issued, "nonce": nonce,
                                                     "signature": b64(signature)})
        self.counter = 0

    def headers(self, path: str, *, counter: int | None = None) -> dict[str, str]:
        """The session headers of a GET of ``path`` (the next counter unless one is given)."""
        if counter is None:
            self.counter += 1
        number = self.counter if counter is None else counter
        return {SESSION_HEADER: f"Fedge-Session {self.token}", COUNTER_HEADER: str(number),
                MAC_HEADER: request_mac(self.key, method="GET", path=path, counter=number, body=b"")}


@pytest.fixture
def site(tmp_path: Path) -> tuple[TestClient, Sessions, Path]:
    """The web routes over a real allow-list (phone0, phone1) and its sessions; each phone's examples."""
    allow, data = tmp_path / "allow", tmp_path / "demo-data"
    data.mkdir()
    for name in ("phone0", "phone1"):
        add_protocol_device(allow, name)
        (data / f"{name}.json").write_text(json.dumps({**EXAMPLES, "device": name}))
    (tmp_path / "signing.pub").write_text("-----BEGIN PUBLIC KEY-----\n")
    sessions = Sessions(AllowList(allow), GATEWAY)

    def authenticate(request: Any, body: bytes) -> Any:  # as the gateway's /v1 routes authenticate
        return sessions.authenticate(authorization=request.headers.get(SESSION_HEADER),
                                     counter=request.headers.get(COUNTER_HEADER), mac=request.headers.get(MAC_HEADER),
                                     method=request.method, path=request.url.path, body=body)

    app = Starlette(routes=web_routes(WebSite(ort=tmp_path, bundle_key=tmp_path / "signing.pub", data=data),
                                      authenticate=authenticate))
    return TestClient(app), sessions, allow


def test_an_anonymous_request_gets_no_training_examples(site: tuple[TestClient, Sessions, Path]) -> None:
    # Prepare: the route that answered anyone before
    client, _, _ = site
    # Execute: an outsider asks for a device's examples, and for a name that does not exist
    known, unknown = client.get("/web/data/phone0.json"), client.get("/web/data/nobody.json")
    # Assert: refused before anything is looked up (no way to tell which names exist); the page itself is public
    assert known.status_code == unknown.status_code == 401, known.text
    assert "phone0" not in known.text and known.json()["error"]
    assert client.get("/web/demo.html").status_code == 200


def test_a_device_gets_its_own_examples_and_no_one_elses(site: tuple[TestClient, Sessions, Path]) -> None:
    # Prepare: phone0 checked in with its real key
    client, sessions, allow = site
    phone0 = Device(sessions, allow, "phone0")
    # Execute: its own examples, then phone1's, then a replay of its first request
    own = client.get("/web/data/phone0.json", headers=phone0.headers("/web/data/phone0.json"))
    other = client.get("/web/data/phone1.json", headers=phone0.headers("/web/data/phone1.json"))
    replay = client.get("/web/data/phone0.json", headers=phone0.headers("/web/data/phone0.json", counter=1))
    # Assert: only its own, and once per counter
    assert own.status_code == 200 and own.json()["device"] == "phone0"
    assert other.status_code == 403 and "may fetch only its own examples" in other.json()["error"]
    assert replay.status_code == 401 and "replay" in replay.json()["error"]


def test_a_mac_for_another_path_or_with_a_body_does_not_fetch_examples(site: tuple[TestClient, Sessions, Path]) -> None:
    # Prepare
    client, sessions, allow = site
    phone1 = Device(sessions, allow, "phone1")
    # Execute: headers signed for the task route, replayed on the data route; a GET carrying a body
    moved = client.get("/web/data/phone1.json", headers=phone1.headers("/v1/task"))
    with_body = client.request("GET", "/web/data/phone1.json", content=b"x" * 10,
                               headers=phone1.headers("/web/data/phone1.json"))
    # Assert
    assert moved.status_code == 401 and "MAC does not verify" in moved.json()["error"]
    assert with_body.status_code == 413


@pytest.mark.parametrize(("host", "loud"), [("127.0.0.1", False), ("::1", False), ("[::1]", False),
                                            ("localhost", False), ("127.0.0.2", False), ("0.0.0.0", True),
                                            ("::", True), ("192.168.1.20", True), ("gw1.example.org", True)])
def test_a_demo_page_beyond_loopback_is_announced_loudly(host: str, loud: bool) -> None:
    warning = demo_page_warning(host)
    assert (warning is not None) == loud
    if warning is not None:
        assert warning.startswith("WARNING") and host in warning and "127.0.0.1" in warning
