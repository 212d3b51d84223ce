"""The demo page's data route hands a device's training examples to that device's session only
(issue 38, item 13).

Before: ``GET /web/data/NAME.json`` answered anyone, on a port the guide binds to 0.0.0.0, with
every demo device's examples. Now it takes the device protocol's session MAC, checked by the same
``Sessions.authenticate`` the ``/v1`` routes use (a real allow-list, a real signed check-in here),
and the session's device must be NAME. A gateway serving the page beyond loopback says so loudly.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import shlex
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from fedge.cli.main import build_parser, main
from fedge.clients.gateway.pool import AllowList, Sessions
from fedge.clients.gateway.protocol import (
    COUNTER_HEADER,
    MAC_HEADER,
    NONCE_BYTES,
    SESSION_HEADER,
    b64,
    check_in_message,
    request_mac,
)
from fedge.clients.gateway.service import (
    Gateway,
    GatewayOptions,
    GatewaySettings,
    add_protocol_device,
    check_gateway,
    device_app,
)
from fedge.clients.gateway.web import (
    WebSite,
    check_demo_data,
    check_origins,
    check_web,
    demo_page_warning,
    web_routes,
)
from fedge.clients.protocol_device import load_private_key, sign
from fedge.config import resolve_run_config
from fedge.errors import ConfigError
from fedge.task.loading import load_task
from fedge.web import ORT_FILES

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


# ---------------------------------------------------------------------- issue 39 §4: the web developer's first hour
APP = "https://app.example.org"


def _site_folder(tmp_path: Path, data: Path) -> WebSite:
    """A demo page's site whose onnxruntime-web folder holds the files the worker loads."""
    ort = tmp_path / "ort"
    ort.mkdir(exist_ok=True)
    for name in ORT_FILES:
        (ort / name).write_bytes(b"x")
    (tmp_path / "signing.pub").write_text("-----BEGIN PUBLIC KEY-----\n")
    return WebSite(ort=ort, bundle_key=tmp_path / "signing.pub", data=data)


@pytest.mark.parametrize(("case", "files", "reason"), [
    ("an empty folder", {}, "holds no NAME.json: a device joining the demo page would find no examples"),
    ("no inputs", {"tab0.json": {"targets": EXAMPLES["targets"]}},
     "tab0.json is not a demo examples file (no 'inputs'"),
    ("not JSON", {"tab0.json": "{"}, "tab0.json is not a demo examples file"),
    ("an unknown dtype", {"tab0.json": {**EXAMPLES, "targets": {**EXAMPLES["targets"], "dtype": "float16"}}},
     "targets: dtype 'float16' is not one of float32"),
    ("bytes short of the dims", {"tab0.json": {**EXAMPLES, "inputs": [{**EXAMPLES["inputs"][0], "dims": [1, 3]}]}},
     "inputs[0]: 'b64' holds 8 bytes, its dims and dtype say 12"),
    ("rows that differ", {"tab0.json": {**EXAMPLES, "targets": {"dtype": "int64", "dims": [0], "b64": ""}}},
     "different numbers of examples"),
])
def test_a_demo_data_folder_the_page_could_not_use_is_refused_at_start(tmp_path: Path, case: str,
                                                                       files: dict[str, Any], reason: str) -> None:
    # Prepare: a --demo-data folder as a developer might leave it
    data = tmp_path / "demo"
    data.mkdir()
    for name, content in files.items():
        (data / name).write_text(content if isinstance(content, str) else json.dumps(content))
    (tmp_path / "allow").mkdir()
    options = GatewayOptions(coordinator="127.0.0.1:9092", devices=tmp_path / "allow", key=None, ca=None,
                             trust=tmp_path / "signing.pub", insecure=True, web=_site_folder(tmp_path, data))
    # Execute / Assert: refused before anything listens, naming the file, the problem and the command that makes them
    with pytest.raises(ConfigError, match=re.escape(reason)) as refused:
        check_gateway(options)
    assert "fedge gateway demo-data" in str(refused.value)


def test_a_good_demo_data_folder_is_accepted(tmp_path: Path) -> None:
    # Prepare
    data = tmp_path / "demo"
    data.mkdir()
    (data / "tab0.json").write_text(json.dumps(EXAMPLES))
    (data / "notes.txt").write_text("not read")
    # Execute
    names = check_demo_data(data)
    # Assert
    assert names == ["tab0"]
    check_web(_site_folder(tmp_path, data))


def _doc_command(start: str) -> str:
    """The one command line of docs/devices.md that starts with ``start``."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "devices.md").read_text()
    (line,) = [line for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
               for line in block.replace("\\\n", " ").splitlines() if line.startswith(start)]
    return line.split(" #", 1)[0]


def test_the_documented_demo_data_command_writes_files_the_page_reads(tmp_path: Path) -> None:
    # Prepare: the documented command, writing under tmp_path instead of /srv
    command = _doc_command("fedge gateway demo-data").replace("/srv/", f"{tmp_path}/")
    out = Path(shlex.split(command)[shlex.split(command).index("--out") + 1])
    # Execute: the command as documented, then again with --raw
    code = main(shlex.split(command)[1:])
    raw_code = main([*shlex.split(command)[1:3], "--devices", "4", "--out", str(tmp_path / "raw"), "--raw"])
    # Assert: browser0..3, in the documented layout (numpy dtype names, little-endian bytes, base64), holding the
    # task's simulated partitions; --raw holds the same examples before the digits' x / 16
    assert code == raw_code == 0
    assert check_demo_data(out) == ["browser0", "browser1", "browser2", "browser3"]
    config = resolve_run_config({"task": "digits"})
    shard = load_task(config).partition(2, 4, config)
    for folder, scale in ((out, 1), (tmp_path / "raw", 16)):
        examples = json.loads((folder / "browser2.json").read_text())
        (entry,) = examples["inputs"]
        inputs = np.frombuffer(base64.b64decode(entry["b64"]), np.dtype(entry["dtype"]).newbyteorder("<"))
        targets = np.frombuffer(base64.b64decode(examples["targets"]["b64"]), "<i8")
        assert entry["dtype"] == "float32" and entry["dims"] == list(shard.inputs[0].shape)
        assert np.array_equal(inputs.reshape(entry["dims"]), shard.inputs[0] * np.float32(scale))
        assert examples["targets"]["dtype"] == "int64" and np.array_equal(targets, shard.targets)


@pytest.mark.parametrize("origin", ["*", "https://app.example.org/", "app.example.org", "https://app.example.org/x",
                                    "ftp://app.example.org", "https://user@app.example.org"])
def test_an_allow_origin_that_is_not_one_origin_is_refused(origin: str) -> None:
    with pytest.raises(ConfigError, match="give one web app's origin, as a browser sends it"):
        check_origins([origin])


def test_the_documented_allow_origin_flag_reaches_the_gateway_options() -> None:
    # Execute: the documented start command, parsed by fedge's own parser
    args = build_parser().parse_args(shlex.split(_allow_origin_command())[1:])
    # Assert: repeatable, in order
    assert args.allow_origin == [APP, "http://localhost:8000"]


def _allow_origin_command() -> str:
    text = (Path(__file__).resolve().parents[1] / "docs" / "devices.md").read_text()
    (line,) = [line for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
               for line in block.replace("\\\n", " ").splitlines() if "--allow-origin" in line]
    return line


def test_a_page_of_an_allowed_origin_passes_the_preflight_and_others_do_not(tmp_path: Path) -> None:
    # Prepare: a gateway's device app allowing one app origin, and one allowing none (the default)
    add_protocol_device(tmp_path / "allow", "phone0")
    gateway = Gateway(GatewaySettings(name=GATEWAY), tmp_path / "allow", None)
    allowing = TestClient(device_app(gateway, allow_origins=(APP,)))
    default = TestClient(device_app(gateway))
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type, x-fedge-counter, x-fedge-mac"}
    # Execute: the browser's preflight of a result POST, from the app and from another origin; a hello from the app
    ok = allowing.options("/v1/result", headers={"Origin": APP, **preflight})
    other = allowing.options("/v1/result", headers={"Origin": "https://evil.example.org", **preflight})
    before = default.options("/v1/result", headers={"Origin": APP, **preflight})
    hello = allowing.get("/v1/hello", headers={"Origin": APP})
    hello_other = allowing.get("/v1/hello", headers={"Origin": "https://evil.example.org"})
    # Assert: the app's origin gets the protocol's headers allowed; another origin, and any origin by default, none
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == APP
    assert {"authorization", "x-fedge-counter", "x-fedge-mac", "content-type"} <= \
        {h.strip().lower() for h in ok.headers["access-control-allow-headers"].split(",")}
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert before.status_code == 405 and "access-control-allow-origin" not in before.headers
    assert hello.headers["access-control-allow-origin"] == APP and hello.json()["gateway"] == GATEWAY
    assert "access-control-allow-origin" not in hello_other.headers
