"""What a protocol device takes from its gateway (issue 38 items 7 and 12), attacks replayed.

Item 7: a gateway served an older signed training graph of the device's lineage (30 days
older, another model) or another lineage's graph, and `ProtocolDevice` trained it. Item 12:
a device signed whatever gateway name `hello` announced, so a gateway could pass the signed
check-in on to the gateway it named and act as the device there.

Real parts: gateways' device listeners over TLS with certificates from `fedge keys
add-gateway` (and a relaying gateway: a stdlib HTTPS server holding gateway A's
certificate), reference protocol devices, training graphs exported from the digits task and
signed with the run's key, onnxruntime.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import http.client
import json
import logging
import ssl
import stat
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from fedge.clients.gateway.protocol import PREFIX
from fedge.clients.gateway.service import Gateway, GatewaySettings, Served, add_protocol_device, device_app
from fedge.clients.protocol_device import ProtocolDevice
from fedge.config import resolve_run_config
from fedge.edge.training_bundle import read_training_bundle, write_training_bundle
from fedge.errors import BundleVerificationError, DeviceProtocolError, FedgeError
from fedge.listeners import ListenerLimits
from fedge.server.bundles import run_signing_key
from fedge.server.pki import CoordinatorKeys, add_gateway, init_keys
from fedge.server.training_bundle import export_training_graph
from fedge.task.api import seeded_model
from fedge.task.loading import load_task
from fedge.task.models import model_arrays
from tests.live_gateway import LiveGateway

DAY_S = 86_400


# --------------------------------------------------------------------------- item 7: the training graph
@pytest.fixture(scope="module")
def graphs(run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The run's graph (version N of its lineage), and logistic regression signed with the run's key twice:
    as version N minus 30 days of the same lineage (an older run's), and as another lineage at N + 1."""
    root = tmp_path_factory.mktemp("graphs")
    current = read_training_bundle(run["bundle"], trusted_keys=[run["trust"]]).manifest
    config = resolve_run_config({**run["config"], "model": "logreg"})
    task = load_task(config)
    model = seeded_model(task, config.integer("seed"))
    exported, metrics = export_training_graph(task, model, config)
    key = run_signing_key(resolve_run_config(run["config"]), Path(run["config"]["run-dir"]))
    weights = {name: array.numpy() for name, array in model_arrays(model).items()}
    made = {"current": {"bundle": run["bundle"], "architecture": run["architecture"], "weights": run["weights"],
                        "model_id": current["model_id"], "version": current["version"]}}
    for name, model_id, version in (("older", current["model_id"], current["version"] - 30 * DAY_S),
                                    ("other-lineage", "another-model", current["version"] + 1)):
        issued = dt.datetime.fromtimestamp(version, dt.UTC)
        manifest = write_training_bundle(root / f"{name}.zip", exported, task=task.name, metrics=metrics,
                                         model_id=model_id, version=version, private_key=key, issued_at=issued,
                                         preprocessing=dict(task.preprocessing))
        made[name] = {"bundle": root / f"{name}.zip", "architecture": manifest["architecture"], "weights": weights,
                      "model_id": model_id, "version": version}
    return made


@pytest.fixture
def gateway(tmp_path: Path, run: dict[str, Any]) -> Iterator[LiveGateway]:
    """A live gateway whose rounds complete on one device's result."""
    with LiveGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=1, round_deadline_s=300,
                                                   idle_poll_s=0.2)) as live:
        yield live


def _serve(live: LiveGateway, graph: dict[str, Any], server_round: int) -> tuple[threading.Thread, dict[str, Any]]:
    """The gateway serves ``graph`` and opens a train round naming it, with weights of its model."""
    live.gateway.training_bundle = graph["bundle"]
    live.run = {**live.run, "architecture": graph["architecture"], "weights": graph["weights"]}
    box: dict[str, Any] = {}

    def ask() -> None:
        try:
            box["result"] = live.round(server_round=server_round)
        except FedgeError as exc:
            box["error"] = exc

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    _wait(lambda: live.gateway.round is not None and live.gateway.round.server_round == server_round)
    return thread, box


def _wait(condition: Callable[[], bool]) -> None:
    """Until ``condition`` holds (an event, not a duration: the test's own timeout bounds it)."""
    event = threading.Event()
    while not condition():
        event.wait(0.02)


def _end_unanswered(live: LiveGateway, thread: threading.Thread, box: dict[str, Any]) -> None:
    """End the open round now, as its deadline would, and check that no device answered it."""
    assert live.gateway.round is not None and live.gateway.round.answered == 0
    live.gateway.round.complete.set()
    thread.join()
    assert "none of this gateway's devices answered" in str(box["error"])


def _device(live: LiveGateway, **options: Any) -> ProtocolDevice:
    return ProtocolDevice(gateway=live.url, name="phone0", key=live.allow / "phone0.key", data=live.run["shards"][0],
                          trust=live.run["trust"], ca=live.run["keys"].ca_cert, state_dir=live.root / "phone0",
                          **options)


@pytest.mark.parametrize("restarted", [False, True], ids=["same-process", "restarted-device"])
def test_a_gateway_cannot_roll_a_protocol_device_back_to_an_older_graph_of_its_lineage(
        gateway: LiveGateway, graphs: dict[str, dict[str, Any]], restarted: bool) -> None:
    # Prepare: the device trains round 1 with graph version N
    device = _device(gateway)
    thread, _ = _serve(gateway, graphs["current"], 1)
    assert device.poll().kind == "train"
    thread.join()
    held = (gateway.root / "phone0" / "training.zip").read_bytes()
    # Execute: the gateway serves version N - 30 days (another model) and names it in round 2's task
    thread, box = _serve(gateway, graphs["older"], 2)
    device = _device(gateway) if restarted else device
    with pytest.raises(BundleVerificationError) as refused:
        device.poll()
    # Assert: refused as a rollback, naming both versions; nothing trained; the graph held is kept
    message = str(refused.value)
    assert "rollback refused" in message and "training graph is refused" in message
    assert f"version {graphs['older']['version']} is older than version {graphs['current']['version']}" in message
    assert (gateway.root / "phone0" / "training.zip").read_bytes() == held
    _end_unanswered(gateway, thread, box)


def test_a_graph_of_another_lineage_is_refused_unless_the_owner_names_it(
        gateway: LiveGateway, graphs: dict[str, dict[str, Any]]) -> None:
    # Prepare: the device trains round 1 with its lineage's graph, which pins that lineage
    device = _device(gateway)
    thread, _ = _serve(gateway, graphs["current"], 1)
    assert device.poll().kind == "train"
    thread.join()
    # Execute: the gateway serves another lineage's graph (a higher version) in round 2
    thread, box = _serve(gateway, graphs["other-lineage"], 2)
    with pytest.raises(BundleVerificationError) as refused:
        device.poll()
    # Assert: refused, naming both lineages and how the owner switches; nothing trained
    message = str(refused.value)
    assert f"of model 'another-model', but this device follows model '{graphs['current']['model_id']}'" in message
    assert "--model-id 'another-model'" in message
    assert gateway.gateway.round is not None and gateway.gateway.round.answered == 0
    # Execute: the owner names the lineage
    named = _device(gateway, model_id="another-model")
    outcome = named.poll()
    thread.join()
    # Assert: trained with it; the pin now follows it
    assert outcome.kind == "train" and box["result"][0]["devices"] == 1
    pin = json.loads((gateway.root / "phone0" / "freshness" / "training" / "lineage.pin").read_text())
    assert pin == {"model_id": "another-model"}


def test_a_protocol_device_keeps_its_state_private_in_a_default_directory(
        gateway: LiveGateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, umask_zero: None) -> None:
    # Prepare: a device given no state directory, under the most permissive umask
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    device = ProtocolDevice(gateway=gateway.url, name="phone1", key=gateway.allow / "phone1.key",
                            data=gateway.run["shards"][1], trust=gateway.run["trust"], ca=gateway.run["keys"].ca_cert)
    # Execute
    device.training_graph()
    # Assert: ~/.fedge-protocol-device/NAME, 0700; the graph, its freshness record and the pin 0600
    state = tmp_path / "home" / ".fedge-protocol-device" / "phone1"
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    files = [state / "training.zip", *(state / "freshness" / "training").glob("*.json"),
             state / "freshness" / "training" / "lineage.pin"]
    assert len(files) == 3 and all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in files)


# --------------------------------------------------------------------------- item 12: the gateway's name
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> CoordinatorKeys:
    """A CA with the certificates of gateways gw-a and gw-b (`fedge keys add-gateway`)."""
    keys = init_keys(tmp_path_factory.mktemp("pki"))
    for name in ("gw-a", "gw-b"):
        add_gateway(keys.directory, name, hosts=[])
    return keys


class Listener:
    """A real gateway's device listener (its name, its certificate), on an allow-list it shares."""

    def __init__(self, allow: Path, name: str, cert: tuple[Path, Path] | None) -> None:
        self.gateway = Gateway(GatewaySettings(name=name), allow, None)
        self.served = Served(device_app(self.gateway), "127.0.0.1", 0, limits=ListenerLimits(per_address=64),
                             cert=None if cert is None else cert[0], cert_key=None if cert is None else cert[1])
        self.url = f"{'https' if cert else 'http'}://127.0.0.1:{self.served.port}"


class RelayingGateway:
    """Gateway A (its own certificate) that announces gateway B's name and passes check-ins on to B."""

    def __init__(self, keys: CoordinatorKeys, b_port: int) -> None:
        self.relayed: list[tuple[int, dict[str, Any]]] = []  # B's answers: a session at B for the device
        relay = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._answer(200, {"protocol": 1, "gateway": "gw-b", "next-in-s": 0})

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                status, answer = relay.to_b(b_port, body, keys.ca_cert)
                relay.relayed.append((status, answer))
                self._answer(status, answer)

            def _answer(self, status: int, answer: dict[str, Any]) -> None:
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: Any) -> None:
                pass

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(keys.directory / "gateways" / "gw-a.crt", keys.directory / "gateways" / "gw-a.key")
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @staticmethod
    def to_b(port: int, body: bytes, ca: Path) -> tuple[int, dict[str, Any]]:
        connection = http.client.HTTPSConnection("127.0.0.1", port, timeout=30,
                                                 context=ssl.create_default_context(cafile=str(ca)))
        try:
            connection.request("POST", f"{PREFIX}/check-in", body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _phone(keys: CoordinatorKeys, allow: Path, url: str, tmp_path: Path, **options: Any) -> ProtocolDevice:
    return ProtocolDevice(gateway=url, name="phone0", key=allow / "phone0.key", data=tmp_path / "unused.npz",
                          trust=tmp_path / "unused.pub", ca=keys.ca_cert, state_dir=tmp_path / "phone0", **options)


@pytest.fixture
def gateway_b(tmp_path: Path, pki: CoordinatorKeys) -> Iterator[Listener]:
    """Gateway B, honest (its name is its certificate's), admitting phone0."""
    add_protocol_device(tmp_path / "allow", "phone0")
    b = Listener(tmp_path / "allow", "gw-b", (pki.directory / "gateways" / "gw-b.crt",
                                              pki.directory / "gateways" / "gw-b.key"))
    yield b
    b.served.stop()


def test_a_gateway_announcing_another_gateways_name_gets_no_check_in_to_relay(
        tmp_path: Path, pki: CoordinatorKeys, gateway_b: Listener) -> None:
    # Prepare: gateway A, whose certificate is gw-a's, says "gw-b" in hello and relays check-ins to B
    relay = RelayingGateway(pki, gateway_b.served.port)
    device = _phone(pki, tmp_path / "allow", relay.url, tmp_path)
    try:
        # Execute: the device checks in with A
        with pytest.raises(DeviceProtocolError) as refused:
            device.check_in()
    finally:
        relay.close()
    # Assert: refused, naming both gateways; no check-in signed for B ever reached B
    message = str(refused.value)
    assert "announces itself as 'gw-b' in hello, but its TLS certificate is gateway 'gw-a's" in message
    assert "refusing to check in" in message and relay.relayed == []


def test_a_gateway_whose_name_is_not_its_certificates_is_refused(tmp_path: Path, pki: CoordinatorKeys,
                                                                 gateway_b: Listener) -> None:
    # Prepare: a real gateway started with --name gw-b but serving gw-a's certificate
    lying = Listener(tmp_path / "allow", "gw-b", (pki.directory / "gateways" / "gw-a.crt",
                                                  pki.directory / "gateways" / "gw-a.key"))
    try:
        # Execute / Assert
        with pytest.raises(DeviceProtocolError, match="its TLS certificate is gateway 'gw-a's"):
            _phone(pki, tmp_path / "allow", lying.url, tmp_path).check_in()
    finally:
        lying.served.stop()


def test_a_gateway_certificate_naming_no_gateway_is_refused_saying_how_to_fix_it(
        tmp_path: Path, pki: CoordinatorKeys, gateway_b: Listener) -> None:
    # Prepare: a gateway serving a certificate of the same CA that names no gateway (the coordinator's)
    unnamed = Listener(tmp_path / "allow", "gw-b", (pki.cert, pki.key))
    try:
        # Execute
        with pytest.raises(DeviceProtocolError) as refused:
            _phone(pki, tmp_path / "allow", unnamed.url, tmp_path).check_in()
    finally:
        unnamed.served.stop()
    # Assert: the certificate's name, and where a right one comes from
    message = str(refused.value)
    assert "'fedge coordinator', which names no fedge gateway" in message
    assert "`fedge keys add-gateway NAME`" in message


def test_an_honest_gateway_is_signed_for_by_its_certificates_name(tmp_path: Path, pki: CoordinatorKeys,
                                                                  gateway_b: Listener) -> None:
    device = _phone(pki, tmp_path / "allow", gateway_b.url, tmp_path)
    device.check_in()
    assert device.gateway_name == "gw-b" and device.poll().kind == "wait"


def test_an_insecure_device_signs_hellos_name_and_says_so_once(tmp_path: Path, pki: CoordinatorKeys,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: a plain-HTTP gateway (throwaway tests only)
    add_protocol_device(tmp_path / "allow", "phone0")
    plain = Listener(tmp_path / "allow", "gw-plain", None)
    device = _phone(pki, tmp_path / "allow", plain.url, tmp_path, insecure=True)
    try:
        # Execute: two check-ins
        with caplog.at_level(logging.WARNING, logger="fedge.protocol_device"):
            device.check_in()
            device.check_in()
    finally:
        plain.served.stop()
    # Assert: hello's name signed (the gateway admitted it); one warning saying it is unverified
    warnings = [r.getMessage() for r in caplog.records if "unverified" in r.getMessage()]
    assert device.gateway_name == "gw-plain" and len(warnings) == 1 and "'gw-plain'" in warnings[0]


def test_a_signed_graph_that_fails_the_graph_checks_is_neither_kept_nor_recorded(
        gateway: LiveGateway, run: dict[str, Any], tmp_path: Path) -> None:
    # Prepare: the run's key signs a bundle, a version newer than the run's, whose train graph is its eval
    # graph (no gradient outputs): the signature verifies, the graph checks refuse it
    config = resolve_run_config(run["config"])
    task = load_task(config)
    exported, metrics = export_training_graph(task, seeded_model(task, config.integer("seed")), config)
    current = read_training_bundle(run["bundle"], trusted_keys=[run["trust"]]).manifest
    broken = dataclasses.replace(exported, train_onnx=exported.eval_onnx)
    manifest = write_training_bundle(tmp_path / "broken.zip", broken, task=task.name, metrics=metrics,
                                     model_id=current["model_id"], version=current["version"] + 1,
                                     private_key=run_signing_key(config, Path(run["config"]["run-dir"])),
                                     preprocessing=dict(task.preprocessing))
    graph = {"bundle": tmp_path / "broken.zip", "architecture": manifest["architecture"], "weights": run["weights"]}
    thread, box = _serve(gateway, graph, 1)
    device = _device(gateway)
    # Execute
    with pytest.raises(FedgeError, match="train.onnx"):
        device.poll()
    # Assert: no graph kept, no version recorded (the run's own graph, version N, is still accepted next)
    assert not (gateway.root / "phone0" / "training.zip").exists()
    assert not (gateway.root / "phone0" / "freshness" / "training" / "lineage.pin").exists()
    _end_unanswered(gateway, thread, box)
