"""The web device SDK in Chromium (issue 28): a browser tab is a device of a gateway.

Real parts: a gateway's TLS device listener in this process serving the SDK and its demo page
(``--demo-page``), onnxruntime-web's WebAssembly build, headless Chromium told to trust the
gateway's certificate (and no other), WebCrypto keys made in the page, the run's signed training
graph verified in the page. Needs Debian's chromium + chromedriver and the pinned onnxruntime-web
under ``.cache/ortweb`` (``make test`` installs both); skipped with the reason otherwise.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from chromium import start_chromium, trust_certificate_flag
from flwr.app import Context, RecordDict
from google.protobuf.internal import encoder

from fedge.batching import batch_order
from fedge.clients.gateway.bridge import ask_gateway
from fedge.clients.gateway.pool import GatewayRound, device_seed
from fedge.clients.gateway.protocol import encode_task
from fedge.clients.gateway.service import GatewaySettings, Served, device_app
from fedge.clients.gateway.web import WebSite, demo_examples
from fedge.config import resolve_run_config
from fedge.edge.trainer import OnnxTrainer
from fedge.edge.training_bundle import architecture_of, pack_training_bundle, read_training_bundle
from fedge.errors import FedgeError
from fedge.listeners import ListenerLimits
from fedge.preprocessing import AS_GIVEN, OUTSIDE, RAW_SCALED, Preprocessing, prepare_device_inputs
from fedge.server.bundles import run_signing_key
from fedge.web import ASSETS, ORT_FILES
from tests.live_gateway import CONFIG, LiveGateway
from tests.ort_polyglot import HIDDEN_SCALE, hidden_ort_model, polyglot
from tests.test_gateway_secure import _check_in_body
from tests.tiny_bundles import MODEL_ID, tiny_bundle, tiny_model, write_zip

ROOT = Path(__file__).resolve().parent.parent
ORT_DIST = ROOT / os.environ.get("FEDGE_ORTWEB_DIR", ".cache/ortweb") / "node_modules" / "onnxruntime-web" / "dist"


class WebGateway(LiveGateway):
    """A live gateway whose device listener also serves the web SDK's demo page.

    ``inputs``: turns each demo device's inputs into what its file holds (the shards are preprocessed);
    ``allow_origins``: the web apps' origins it allows (``--allow-origin``).
    """

    def __init__(self, root: Path, run: dict[str, Any], settings: GatewaySettings, bundle: Path | None = None, *,
                 inputs: Any = None, allow_origins: tuple[str, ...] = ()) -> None:
        super().__init__(root, run, settings)
        self.devices.stop()
        data = root / "demo-data"
        data.mkdir(exist_ok=True)
        for index in range(4):
            shard_inputs, targets = run["shards"][index]
            if inputs is not None:
                shard_inputs = tuple(inputs(array) for array in shard_inputs)
            (data / f"browser{index}.json").write_text(json.dumps(demo_examples(shard_inputs, targets)))
        if bundle is not None:
            self.gateway.training_bundle = bundle
        site = WebSite(ort=ORT_DIST, bundle_key=run["trust"], data=data)
        self.devices = Served(device_app(self.gateway, web=site, allow_origins=allow_origins), "127.0.0.1", 0,
                              limits=ListenerLimits(per_address=64), cert=run["gateway-cert"][0],
                              cert_key=run["gateway-cert"][1])
        self.url = f"https://127.0.0.1:{self.devices.port}"

    def round_of(self, server_round: int, num_rounds: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Round ``server_round`` of a run of ``num_rounds``, as the gateway's ClientApp hands it on (num-rounds)."""
        context = Context(run_id=1, node_id=9, state=RecordDict(), run_config={}, node_config={
            "gateway-control": f"127.0.0.1:{self.control.port}", "gateway-token": str(self.root / "token")})
        (self.root / "token").write_text(self.token)
        header = {"kind": "train", "server-round": server_round, "num-rounds": num_rounds,
                  "graph": self.run["architecture"], "config": CONFIG, "secure": None}
        return ask_gateway(context, header, self.run["weights"])


@pytest.fixture(scope="module")
def chromium(run: dict[str, Any]) -> Iterator[Any]:
    missing = [name for name in ORT_FILES if not (ORT_DIST / name).is_file()]
    if missing:
        pytest.skip(f"onnxruntime-web is not installed under {ORT_DIST.parent}; `make test` installs it with npm")
    driver = start_chromium(trust_certificate_flag(run["gateway-cert"][0].read_bytes()))
    driver.set_script_timeout(600)
    yield driver
    driver.quit()


def _open_device(driver: Any, gateway: WebGateway, name: str) -> None:
    """Load the demo page as device ``name`` and admit the key the page made (as an operator would)."""
    driver.get(f"{gateway.url}/web/demo.html?name={name}")
    pem = driver.execute_async_script(
        "const done = arguments[0];"
        "(function wait() { const s = window.__fedge;"
        " if (s && (s.publicKeyPem || s.error)) done(s.publicKeyPem || s.error); else setTimeout(wait, 50); })();")
    assert pem.startswith("-----BEGIN PUBLIC KEY-----"), pem
    (gateway.allow / f"{name}.pub").write_text(pem)
    gateway.gateway.allow.refresh(force=True)


def _join_and_wait(driver: Any, gateway: WebGateway, rounds: int) -> dict[str, Any]:
    """Join the page's device (it follows the run); once it trained ``rounds`` rounds the gateway says the run is
    over. Its state once done (or failed)."""
    script = ("const [rounds, done] = arguments;"
              "(function wait() { const s = window.__fedge;"
              " const trained = s.progress.filter((e) => e.kind === 'train').length;"
              " if (s.done || s.error || trained >= rounds) done({done: s.done, error: s.error,"
              "  trained: s.trained || trained, kinds: s.progress.map((e) => e.kind),"
              "  errors: s.progress.filter((e) => e.error).map((e) => e.error)});"
              " else setTimeout(wait, 100); })();")
    driver.execute_script("window.fedgeJoin()")
    state = dict(driver.execute_async_script(script, rounds))
    if state["done"] or state["error"]:
        return state
    gateway.gateway.finish("the test's run is over")
    return dict(driver.execute_async_script(script, rounds + 1))


@pytest.mark.parametrize(("uplink", "downlink"), [("fp32", "fp32"), ("int8-delta", "fp16"), ("fp32", "int8")])
def test_a_browser_tab_trains_a_gateway_round_as_the_python_device_would(tmp_path: Path, run: dict[str, Any],
                                                                         chromium: Any, uplink: str,
                                                                         downlink: str) -> None:
    # Prepare: a gateway round of 1 device, served with the demo page; the tab admitted as browser0; the task
    # sent in the downlink's encoding (the tab's check-in says it reads fp16 and int8 tasks)
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=1, round_deadline_s=600,
                                                       idle_poll_s=0.2, uplink=uplink, downlink=downlink))
    try:
        _open_device(chromium, gateway, "browser0")
        box: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: box.update(result=gateway.round()), daemon=True)
        thread.start()
        # Execute: the tab joins for one round
        state = _join_and_wait(chromium, gateway, 1)
        thread.join()
    finally:
        gateway.close()
    header, arrays = box["result"]
    # Assert: one browser result, the update of one local epoch from the weights as the task carried them, put on
    # the round's exact weights
    assert state["done"] and state["trained"] == 1 and state["error"] is None, state
    assert header["devices"] == 1 and header["num-examples"] == len(run["shards"][0][1])
    bundle = read_training_bundle(run["bundle"], trusted_keys=[run["trust"]])
    trainer = OnnxTrainer(bundle.train_onnx, bundle.eval_onnx, bundle.manifest)
    inputs, targets = run["shards"][0]
    read = encode_task(run["weights"], downlink).received
    trained, _ = trainer.train(read, inputs, targets, epochs=1, batch_size=32, learning_rate=0.05,
                               momentum=0.9, seed=device_seed(7, 1, "browser0"))
    python = {name: run["weights"][name] + (trained[name] - read[name]) for name in trained}
    # the update a Python device sends: the same batches (numpy's order), float32 steps in onnxruntime-web;
    # in int8-delta, within one quantisation step of each tensor (max |delta| / 127)
    assert arrays.keys() == python.keys()
    for name in python:
        step = float(np.max(np.abs(python[name] - run["weights"][name]))) / 127 if uplink == "int8-delta" else 0.0
        assert float(np.max(np.abs(arrays[name] - python[name]))) <= step + 1e-5, name
    assert min(float(np.max(np.abs(arrays[k] - run["weights"][k]))) for k in python) > 1e-3  # it trained


def test_a_tab_that_names_two_gateways_checks_in_at_the_next_when_its_gateway_stops_and_trains_each_round_once(
        tmp_path: Path, run: dict[str, Any], chromium: Any) -> None:
    # Prepare: gateway A serves the page; gateway B allows A's origin; the tab names B after A (?gateway=)
    settings = GatewaySettings(name="gw-test", devices_per_round=1, round_deadline_s=600, idle_poll_s=0.2)
    first = WebGateway(tmp_path / "a", run, settings)
    second = WebGateway(tmp_path / "b", run, settings, allow_origins=(first.url,))
    try:
        chromium.get(f"{first.url}/web/demo.html?name=browser0&gateway={second.url}")
        pem = chromium.execute_async_script(
            "const done = arguments[0];"
            "(function wait() { const s = window.__fedge;"
            " if (s && (s.publicKeyPem || s.error)) done(s.publicKeyPem || s.error); else setTimeout(wait, 50); })();")
        for gateway in (first, second):  # the operator admits the tab's key at both
            (gateway.allow / "browser0.pub").write_text(pem)
            gateway.gateway.allow.refresh(force=True)
        # Execute: round 1 through A; A stops; round 2 through B
        chromium.execute_script("window.fedgeJoin()")
        header1, _ = first.round_of(1, 3)
        first.close()
        header2, _ = second.round_of(2, 3)
        # ... and B asks for round 2 again: the tab does not train it twice, so B's round ends on its deadline
        # with no device (the deadline is what this waits for)
        second.gateway.settings = replace(settings, round_deadline_s=3.0)
        with pytest.raises(FedgeError, match="none of this gateway's devices answered"):
            second.round_of(2, 3)
        state = _page_when(chromium, "s.progress.some((e) => e.kind === 'skipped')")
    finally:
        first.close()
        second.close()
    # Assert: one device in each round, through each gateway; the page said it switched, and skipped round 2's repeat
    assert header1["devices"] == 1 and header1["gateway"] == "gw-test" and header2["devices"] == 1
    assert state["kinds"].count("train") == 2 and state["error"] is None, state
    assert any("checking in at " + second.url in line for line in state["lines"]), state["lines"]
    assert any(line.startswith("skipped round 2: this device trained round 2 already") for line in state["lines"])


# The tab's first train result is lost on the way (the request fails as a dropped connection does, once); the worker's
# train calls are counted
LOSE_FIRST_RESULT = """
const [done] = arguments;
window.__trainCalls = 0;
import('./fedge-device.js').then(({FedgeDevice}) => {
  const send = FedgeDevice.prototype.send, call = FedgeDevice.prototype.call;
  let lost = false;
  FedgeDevice.prototype.send = async function (method, path, body, headers) {
    if (!lost && method === "POST" && path.endsWith("/result")) {
      lost = true;
      const failed = new Error("cannot reach the gateway at " + this.gateway + ": Failed to fetch");
      failed.network = true;
      throw failed;
    }
    return send.call(this, method, path, body, headers);
  };
  FedgeDevice.prototype.call = async function (message) {
    if (message.type === "train") window.__trainCalls++;
    return call.call(this, message);
  };
  done(true);
});
"""


def test_a_tab_whose_result_was_lost_sends_the_same_result_again_when_its_gateway_offers_the_task_again(
        tmp_path: Path, run: dict[str, Any], chromium: Any) -> None:
    # Prepare: a gateway round of one device; the tab's first result does not reach the gateway
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=1, round_deadline_s=600,
                                                       idle_poll_s=0.2))
    try:
        _open_device(chromium, gateway, "browser0")
        assert chromium.execute_async_script(LOSE_FIRST_RESULT)
        box: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: box.update(result=gateway.round()), daemon=True)
        thread.start()
        # Execute: the tab trains, loses its result, polls again and gets the same task
        chromium.execute_script("window.fedgeJoin()")
        state = _page_when(chromium, "s.progress.some((e) => e.kind === 'train' || e.kind === 'skipped')")
        assert "skipped" not in state["kinds"], state  # (before: it refused the task it had trained, as a repeat)
        thread.join()
        train_calls = chromium.execute_script("return window.__trainCalls")
        resent = chromium.execute_script("return window.__fedge.progress.filter((e) => e.kind === 'train')"
                                         ".map((e) => !!e.resent)")
    finally:
        gateway.close()
    header, arrays = box["result"]
    # Assert: the round has the tab's one result, trained once and sent again; the lost request was a network error
    assert header["devices"] == 1 and header["num-examples"] == len(run["shards"][0][1]), header
    assert train_calls == 1 and resent == [True], (train_calls, resent)
    assert state["kinds"].index("error") < state["kinds"].index("train"), state
    assert min(float(np.max(np.abs(arrays[k] - run["weights"][k]))) for k in arrays) > 1e-3  # it trained


def _page_when(driver: Any, condition: str) -> dict[str, Any]:
    """The demo page's state once ``condition`` (JavaScript over its state ``s``) holds: an event, not a pause."""
    return dict(driver.execute_async_script(
        "const done = arguments[0];"
        "(function wait() { const s = window.__fedge; const status = document.getElementById('status');"
        f" if ({condition}) done({{done: s.done, error: s.error, outcome: s.outcome || null, trained: s.trained || 0,"
        "  kinds: s.progress.map((e) => e.kind), status: status.textContent, statusClass: status.className,"
        "  errorLines: document.querySelectorAll('#log li.error').length,"
        "  lines: Array.from(document.querySelectorAll('#log li'), (li) => li.textContent)});"
        " else setTimeout(wait, 100); })();"))


def test_the_page_shows_a_result_that_missed_its_closed_round_as_normal_and_says_when_the_run_is_over(
        tmp_path: Path, run: dict[str, Any], chromium: Any) -> None:
    # Prepare: a round that closes right after handing the tab its task (as a deadline would), the tab joined
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=1, idle_poll_s=0.2))
    current = GatewayRound(kind="train", server_round=2, config=CONFIG, graph=run["architecture"],
                           weights=run["weights"], target=1, max_num_examples=100_000)
    handed = gateway.gateway.task_for

    def close_after_handing(session: Any) -> bytes | None:
        frame = handed(session)
        current.close()
        return frame

    try:
        _open_device(chromium, gateway, "browser0")
        gateway.gateway.round = current
        gateway.gateway.model_elements = sum(int(np.size(value)) for value in run["weights"].values())
        gateway.gateway.task_for = close_after_handing  # type: ignore[method-assign]
        chromium.execute_script("window.fedgeJoin()")
        # Execute: the tab's result reaches a closed round (409); then the run ends
        late = _page_when(chromium, "s.progress.some((e) => e.kind === 'late' || e.kind === 'error')")
        gateway.gateway.finish("round 2 of 2 was its last and the coordinator has closed")
        over = _page_when(chromium, "s.done || s.error")
    finally:
        gateway.close()
    # Assert: the late result is a normal outcome (no error, nothing red); the run's end resolves run() with "done"
    # and the page says so
    assert "error" not in late["kinds"] and late["errorLines"] == 0 and late["statusClass"] != "error", late
    assert "round 2 closed before this tab's result arrived" in late["status"], late
    assert any("had closed when this tab's result arrived" in line for line in late["lines"]), late
    assert over["done"] and over["outcome"] == "done" and over["error"] is None and over["trained"] == 0, over
    assert over["status"] == ("the run is over: round 2 of 2 was its last and the coordinator has closed "
                              "(0 rounds trained here)"), over
    assert over["kinds"][-1] == "done" and over["errorLines"] == 0 and over["statusClass"] != "error", over
    assert gateway.gateway.heard() == (1, 1)


def _unanswered_round(gateway: WebGateway) -> None:
    """A round no device answers (the test ends it): the gateway's ClientApp gets its refusal."""
    with pytest.raises(FedgeError, match="none of this gateway's devices answered"):
        gateway.round()


def _joined_with_bundle(tmp_path: Path, run: dict[str, Any], chromium: Any, bundle: Path) -> tuple[dict[str, Any], int]:
    """A tab's state after joining a round of a gateway that hands out ``bundle``; the results the round got."""
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=1, round_deadline_s=600,
                                                       idle_poll_s=0.2), bundle=bundle)
    thread = threading.Thread(target=_unanswered_round, args=(gateway,), daemon=True)
    thread.start()
    try:
        _open_device(chromium, gateway, "browser1")
        state = _join_and_wait(chromium, gateway, 1)
    finally:
        while gateway.gateway.round is None:  # the round opens once the control POST lands
            threading.Event().wait(0.02)
        gateway.gateway.round.complete.set()  # end the round nobody answers
        thread.join()
        gateway.close()
    assert gateway.gateway.round is not None
    return state, gateway.gateway.round.answered


def _tampered(bundle: Path, out: Path, change: Any) -> Path:
    with zipfile.ZipFile(bundle) as source:
        files = {name: source.read(name) for name in source.namelist()}
    change(files)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        for name, data in files.items():
            target.writestr(name, data)
    return out


def _flip_graph_byte(files: dict[str, bytes]) -> None:
    graph = bytearray(files["train.onnx"])
    graph[len(graph) // 2] ^= 0xFF
    files["train.onnx"] = bytes(graph)


def _altered_manifest(files: dict[str, bytes]) -> None:
    files["manifest.json"] = files["manifest.json"].replace(b'"training"', b'"training" ', 1)


@pytest.mark.parametrize(("case", "change", "reason"), [
    ("a graph byte changed", _flip_graph_byte, "train.onnx: its SHA-256 does not match"),
    ("the manifest altered", _altered_manifest, "the signature does not verify"),
    ("an extra file", lambda files: files.update({"extra.onnx": b"x"}), "differ from the manifest"),
    ("a zip bomb (100 MB of zeros)", lambda files: files.update({"train.onnx": bytes(100 << 20)}),
     "entry train.onnx declares a size its archive cannot hold"),
])
def test_a_tampered_training_graph_is_refused_in_the_browser(tmp_path: Path, run: dict[str, Any], chromium: Any,
                                                            case: str, change: Any, reason: str) -> None:
    # Prepare: a gateway that hands out a tampered copy of the run's signed training bundle
    bundle = _tampered(run["bundle"], tmp_path / "tampered.zip", change)
    # Execute: a tab joins for one round
    state, answered = _joined_with_bundle(tmp_path, run, chromium, bundle)
    # Assert: refused by name before onnxruntime-web saw the graph; nothing was sent
    error = state["error"] or ""
    assert "training bundle refused" in error and reason in error, state
    assert state["trained"] == 0 and answered == 0




ORDERS = [(1, 1, 0, 1), (10, 3, 0, 2), (450, 32, 7, 2), (1000, 64, 2**32, 1), (37, 5, 2**63 - 1, 3),
          (300, 300, 123456789, 1)]


def test_the_browser_draws_numpys_batch_order(tmp_path: Path, run: dict[str, Any], chromium: Any) -> None:
    # Prepare: a page of the gateway that serves the SDK; sizes, batch sizes, seeds (past 2^32) and epochs
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test"))
    try:
        chromium.get(f"{gateway.url}/web/demo.html?name=order")
        # Execute: the SDK's batch order in the browser, for each case
        orders = chromium.execute_async_script(
            "const [cases, done] = arguments; const script = document.createElement('script');"
            "script.src = 'batch-order.js'; script.onload = () => done(cases.map(([size, batch, seed, epochs]) =>"
            " fedgeBatchOrder.batchOrder(size, batch, seed, epochs))); document.head.appendChild(script);",
            [[size, batch, str(seed), epochs] for size, batch, seed, epochs in ORDERS])
    finally:
        gateway.close()
    # Assert: fedge.batching.batch_order's (numpy's PCG64), batch for batch
    for order, (size, batch, seed, epochs) in zip(orders, ORDERS, strict=True):
        assert order == [list(map(int, b)) for b in batch_order(size, batch, seed, epochs)], (size, batch, seed)


def _external_data(model: Any) -> None:
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="phone-017.key")


def _custom_domain(model: Any) -> None:
    model.graph.node[0].domain = "com.microsoft"


def _unlisted_op(model: Any) -> None:
    model.graph.node.append(onnx.helper.make_node("Identity", [model.graph.node[0].output[0]], ["copy"]))


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field."""
    return encoder._VarintBytes(number << 3 | 2) + encoder._VarintBytes(len(payload)) + payload


def _repeated_domain(model: Any) -> bytes:
    """The first node names its domain twice: "" and then com.microsoft (protobuf keeps the last)."""
    node = model.graph.node[0].SerializeToString() + _field(7, b"") + _field(7, b"com.microsoft")
    rest = onnx.GraphProto()
    rest.CopyFrom(model.graph)
    del rest.node[0]
    graph = _field(1, node) + rest.SerializeToString()
    shell = onnx.ModelProto()
    shell.CopyFrom(model)
    shell.ClearField("graph")
    return bytes(shell.SerializeToString() + _field(7, graph))


@functools.cache
def _hidden_ort() -> bytes:
    return hidden_ort_model()


def _ort_polyglot(model: Any) -> bytes:
    """The graph over an ORT-format model onnxruntime would run instead (tests/ort_polyglot.py)."""
    return polyglot(model.SerializeToString(), _hidden_ort())


@pytest.mark.parametrize(("case", "change", "reason"), [
    ("an ORT-format polyglot", _ort_polyglot, "is an ORT-format model (file identifier 'ORTM' at byte 4)"),
    ("an initializer read from a device file", _external_data, "keeps tensor data outside the model"),
    ("a contrib op", _custom_domain, "of domain com.microsoft"),
    ("an op the manifest does not list", _unlisted_op, 'uses ops ["Identity"] its signed manifest does not list'),
    ("a domain named twice", _repeated_domain, "has a node that names its op or domain twice"),
])
def test_a_signed_graph_that_would_read_device_data_is_refused_in_the_browser(
        tmp_path: Path, run: dict[str, Any], chromium: Any, case: str, change: Any, reason: str) -> None:
    # Prepare: the coordinator's own key signs a changed train.onnx (a compromised or curious coordinator)
    bundle = read_training_bundle(run["bundle"], trusted_keys=[run["trust"]])
    model = onnx.load_from_string(bundle.train_onnx)
    train = change(model) or model.SerializeToString()
    key = run_signing_key(resolve_run_config(run["config"]), Path(run["config"]["run-dir"]))
    manifest = {**bundle.manifest, "architecture": architecture_of(train, bundle.eval_onnx)}  # consistent, as signed
    signed = tmp_path / "signed.zip"
    signed.write_bytes(pack_training_bundle(train, bundle.eval_onnx, manifest, private_key=key))
    # Execute: a tab joins for one round
    state, answered = _joined_with_bundle(tmp_path, run, chromium, signed)
    # Assert: the signature verified, the graph walk refused it by name; nothing was sent
    error = state["error"] or ""
    assert "training bundle refused: train.onnx" in error and reason in error, state
    assert answered == 0


def test_a_secure_run_admits_a_browser_that_declares_secure_aggregation_and_still_refuses_a_device_that_does_not(
        tmp_path: Path, run: dict[str, Any], chromium: Any) -> None:
    # Prepare: a gateway whose coordinator runs secure aggregation (the web SDK implements it: web/secagg.js)
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=1, idle_poll_s=0.2))
    sessions = gateway.gateway.sessions
    sessions.secure_run = True
    try:
        _open_device(chromium, gateway, "browser3")
        # Execute: the tab joins and waits for a round; a device whose check-in lacks the capability checks in
        chromium.execute_script("window.fedgeJoin()")
        state = _page_when(chromium, "s.progress.some((e) => e.kind === 'wait') || s.error")
        chromium.execute_script("window.__fedge.device.stop()")
        admitted = sessions.live_devices(60, secure=True)
        with pytest.raises(FedgeError, match="this run uses secure aggregation, which this device does not implement"):
            sessions.check_in(_check_in_body(gateway, "browser", ["fp32", "int8-delta"]))
    finally:
        gateway.close()
    # Assert: the tab was admitted as a device of secure pools; the other one is still refused, naming why
    assert state["error"] is None, state
    assert admitted == ["browser3"]


PREDICT = """
const done = arguments[arguments.length - 1];
(async () => {
  const {FedgeDevice} = await import("./fedge-device.js");
  const device = window.__predictor || (window.__predictor = new FedgeDevice({
      gateway: location.origin, name: "browser0", bundleKeyPem: await (await fetch("bundle-key.pem")).text(),
      data: null, ortBase: new URL("ort/", location.href).href}));
  const manifest = await device.model();
  const out = await device.predict({data: new Float32Array([1, 0, 0, 0, 0.5, -1, 2, 0]), dims: [2, 4]});
  done({version: manifest.version, dims: out.dims, data: Array.from(out.data)});
})().catch((error) => done({error: String(error.message || error)}));
"""


def test_the_browser_predicts_with_the_signed_inference_bundle_and_refuses_a_rollback(
        tmp_path: Path, run: dict[str, Any], chromium: Any) -> None:
    # Prepare: the coordinator's key signs version 5 and then version 3 of a small model; the gateway relays them
    key = run_signing_key(resolve_run_config(run["config"]), Path(run["config"]["run-dir"]))
    bundles = {version: write_zip(tiny_bundle(key, version=version).items(), tmp_path / f"v{version}.zip")
               for version in (5, 3)}
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test"))
    gateway.gateway.inference_bundle = bundles[5]
    try:
        _open_device(chromium, gateway, "browser0")
        # Execute: predict with version 5; then the gateway hands out version 3
        newest = chromium.execute_async_script(PREDICT)
        gateway.gateway.inference_bundle = bundles[3]
        older = chromium.execute_async_script(PREDICT)
    finally:
        gateway.close()
    # Assert: x @ W + b of the signed model, as onnxruntime gives it; version 3 refused as a rollback
    expected = np.array([[1, 0, 0, 0], [0.5, -1, 2, 0]], np.float32) @ (np.arange(12, dtype=np.float32).reshape(4, 3))
    assert newest.get("version") == 5 and newest["dims"] == [2, 3], newest
    assert np.allclose(np.array(newest["data"]).reshape(2, 3), expected, atol=1e-5)
    assert "inference bundle refused: it is version 3 of run-1/mlp-digits, older than version 5 this device " \
           "accepted: a rollback" in older["error"]


# --------------------------------------------------------------------------- issue 38: the browser's bundle checks
X = np.array([[1, 0, 0, 0], [0.5, -1, 2, 0]], np.float32)
VISIBLE = X @ np.arange(12, dtype=np.float32).reshape(4, 3)  # the tiny model's Gemm, what the graph check reads
HIDDEN = X @ (np.arange(12, dtype=np.float32).reshape(4, 3) * HIDDEN_SCALE)  # what the ORT-format reading runs

BUNDLE = """
const [kind, options, done] = arguments;
(async () => {
  const {FedgeDevice} = await import("./fedge-device.js");
  const device = new FedgeDevice({gateway: location.origin, name: "browser0", data: null,
      bundleKeyPem: await (await fetch("bundle-key.pem")).text(), ortBase: new URL("ort/", location.href).href,
      ...options});
  const manifest = kind === "training" ? (await device.ready(), device.manifest) : await device.model();
  done({model_id: manifest.model_id, version: manifest.version});
})().catch((error) => done({error: String(error.message || error)}));
"""

WORKER = """
const [model, input, done] = arguments;
const worker = new Worker("worker.js");
worker.onerror = (event) => done({error: "the worker failed: " + String(event.message || event)});
let id = 0;
const call = (message) => new Promise((resolve, reject) => {
  worker.onmessage = (e) => e.data.error ? reject(new Error(e.data.error)) : resolve(e.data);
  worker.postMessage({...message, id: ++id});
});
const bytes = Uint8Array.from(atob(model), (c) => c.charCodeAt(0));
call({type: "model", ortBase: new URL("ort/", location.href).href, model: bytes})
  .then(() => call({type: "infer", input: "input", dtype: "float32", data: new Float32Array(input), dims: [2, 4]}))
  .then((answer) => done({data: Array.from(answer.output.data)}))
  .catch((error) => done({error: String(error.message || error)}));
"""


def _pulls(chromium: Any, gateway: WebGateway, kind: str, served: list[tuple[Path, dict[str, Any]]]
           ) -> list[dict[str, Any]]:
    """The tab (device browser0, admitted) takes a ``kind`` bundle each time the gateway serves the next one
    (a new FedgeDevice each time: a page reload keeps only localStorage); what each take gave."""
    _open_device(chromium, gateway, "browser0")
    taken = []
    for path, options in served:
        setattr(gateway.gateway, f"{kind}_bundle", path)
        taken.append(dict(chromium.execute_async_script(BUNDLE, kind, options)))
    return taken


def test_the_browser_refuses_an_ort_format_polyglot_inference_model(tmp_path: Path, run: dict[str, Any],
                                                                     chromium: Any) -> None:
    # Prepare: the coordinator's key signs a model that is the tiny Gemm to the graph walk and a com.microsoft
    # graph to onnxruntime (ORT format, "ORTM" at byte 4)
    key = run_signing_key(resolve_run_config(run["config"]), Path(run["config"]["run-dir"]))
    files = tiny_bundle(key, models={"model.onnx": polyglot(tiny_model(), _hidden_ort()),
                                     "model.int8.onnx": tiny_model()})
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test"))
    try:
        # Execute
        (taken,) = _pulls(chromium, gateway, "inference", [(write_zip(files.items(), tmp_path / "poly.zip"), {})])
    finally:
        gateway.close()
    # Assert: refused by name, naming the inference bundle
    assert "inference bundle refused: model.onnx is an ORT-format model (file identifier 'ORTM' at byte 4)" \
        in taken.get("error", ""), taken


def test_the_worker_runs_the_onnx_reading_of_a_polyglot(tmp_path: Path, run: dict[str, Any], chromium: Any) -> None:
    # Prepare: the polyglot handed straight to the worker, as if it had passed the checks
    data = polyglot(tiny_model(), _hidden_ort())
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test"))
    try:
        chromium.get(f"{gateway.url}/web/demo.html?name=worker")
        # Execute: the worker's session runs it
        answer = chromium.execute_async_script(WORKER, base64.b64encode(data).decode(), X.ravel().tolist())
    finally:
        gateway.close()
    # Assert: onnxruntime-web ran the ONNX graph that was checked (before: the hidden one, x @ 100 W)
    assert "data" in answer, answer
    assert np.allclose(np.array(answer["data"]).reshape(2, 3), VISIBLE), answer


def test_the_browser_follows_one_inference_lineage_unless_the_app_names_another(
        tmp_path: Path, run: dict[str, Any], chromium: Any) -> None:
    # Prepare: version 5 of this run's model, then version 9 of another run's model, signed by the same key
    key = run_signing_key(resolve_run_config(run["config"]), Path(run["config"]["run-dir"]))
    mine = write_zip(tiny_bundle(key, version=5).items(), tmp_path / "mine.zip")
    other = write_zip(tiny_bundle(key, version=9, model_id="run-2/mlp-digits").items(), tmp_path / "other.zip")
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test"))
    try:
        # Execute: the tab takes version 5, then the other lineage's version 9, then the same with the app naming it
        first, crossed, named = _pulls(chromium, gateway, "inference", [
            (mine, {}), (other, {}), (other, {"modelId": "run-2/mlp-digits"})])
    finally:
        gateway.close()
    # Assert: the other lineage's higher version is refused (a cross-lineage downgrade), unless named
    assert first == {"model_id": MODEL_ID, "version": 5}, first
    assert 'inference bundle refused: it is of model "run-2/mlp-digits", but this device follows model ' \
           f'"{MODEL_ID}"' in crossed.get("error", ""), crossed
    assert named == {"model_id": "run-2/mlp-digits", "version": 9}, named


def _resigned_training(run: dict[str, Any], path: Path, **changes: Any) -> Path:
    """The run's training graphs under a manifest with ``changes``, signed by the run's own key."""
    bundle = read_training_bundle(run["bundle"], trusted_keys=[run["trust"]])
    key = run_signing_key(resolve_run_config(run["config"]), Path(run["config"]["run-dir"]))
    path.write_bytes(pack_training_bundle(bundle.train_onnx, bundle.eval_onnx, {**bundle.manifest, **changes},
                                          private_key=key))
    return path


def test_the_browser_refuses_an_older_or_another_lineages_training_graph(tmp_path: Path, run: dict[str, Any],
                                                                         chromium: Any) -> None:
    # Prepare: the run's signed training graph (version N of its lineage), the same graphs signed as version N-1
    # (an older run's), and as another lineage (another task's or width's), signed by the same key
    manifest = read_training_bundle(run["bundle"], trusted_keys=[run["trust"]]).manifest
    lineage, version = manifest["model_id"], manifest["version"]
    older = _resigned_training(run, tmp_path / "older.zip", version=version - 1)
    other = _resigned_training(run, tmp_path / "other.zip", model_id="chars-training", version=version + 1)
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test"))
    try:
        # Execute: the tab takes version N; then the gateway serves N-1, the other lineage, and the other lineage
        # that the app names
        taken = _pulls(chromium, gateway, "training", [(run["bundle"], {}), (older, {}), (other, {}),
                                                       (other, {"trainingModelId": "chars-training"})])
    finally:
        gateway.close()
    first, rolled_back, crossed, named = taken
    # Assert: N accepted; N-1 refused as a rollback; the other lineage refused unless named
    assert first == {"model_id": lineage, "version": version}, first
    assert f"training bundle refused: it is version {version - 1} of {lineage}, older than version {version} this " \
           "device accepted: a rollback" in rolled_back.get("error", ""), rolled_back
    assert f'training bundle refused: it is of model "chars-training", but this device follows model "{lineage}"' \
        in crossed.get("error", ""), crossed
    assert named == {"model_id": "chars-training", "version": version + 1}, named


CHECK_IN = """
const [options, done] = arguments;
(async () => {
  const {FedgeDevice} = await import("./fedge-device.js");
  const device = new FedgeDevice({gateway: location.origin, name: "browser0", data: null, bundleKeyPem: "",
                                  ...options});
  await device.checkIn();
  done({session: Boolean(device.session), signed: device.gatewayName});
})().catch((error) => done({error: String(error.message || error)}));
"""


def test_an_app_that_names_its_gateway_signs_no_check_in_for_another(tmp_path: Path, run: dict[str, Any],
                                                                    chromium: Any) -> None:
    # Prepare: gateway gw-test serves the page; the tab's key admitted
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=1, round_deadline_s=60,
                                                        idle_poll_s=0.2))
    try:
        _open_device(chromium, gateway, "browser0")
        # Execute: an app expecting another gateway's name, then one expecting this one's
        other = dict(chromium.execute_async_script(CHECK_IN, {"gatewayName": "gw-b"}))
        own = dict(chromium.execute_async_script(CHECK_IN, {"gatewayName": "gw-test"}))
    finally:
        gateway.close()
    # Assert: the first refuses before signing anything, naming both; the second checks in
    assert "announces 'gw-test', but this app expects gateway 'gw-b'" in other["error"]
    assert own == {"session": True, "signed": "gw-test"}


# ---------------------------------------------------------------------- issue 39 §4: the web developer's first hour
DIGITS = {"kind": "affine", "scale": 1.0 / 16.0, "offset": 0.0, "raw-range": [0, 16]}
ODD = {"kind": "affine", "scale": 1.0 / 255.0, "offset": -0.5, "raw-range": [0, 255]}
FAR = {"kind": "affine", "scale": 1e-7, "offset": 123456789.0, "raw-range": [-3.5, 1e6]}
PREPROCESS = """
const [cases, done] = arguments;
(async () => {
  const pre = await import("./preprocessing.js");
  const {DTYPES} = await import("./frame.js");
  const bytes = (b64) => Uint8Array.from(atob(b64), (c) => c.charCodeAt(0)).buffer;
  const text = (array) => { let raw = ""; const b = new Uint8Array(array.buffer, array.byteOffset, array.byteLength);
                            for (const x of b) raw += String.fromCharCode(x); return btoa(raw); };
  done(cases.map(({spec, inputs}) => {
    const {inputs: out, verdict} = pre.prepareDeviceInputs(
      inputs.map((e) => ({data: new DTYPES[e.dtype](bytes(e.b64)), dims: e.dims})), spec);
    return {verdict, message: pre.inputsMessage(verdict, spec, "device d's data"),
            outputs: out.map((e) => ({dtype: e.data.constructor.name, b64: text(e.data)}))};
  }));
})().catch((error) => done({error: String(error.message || error)}));
"""


def _preprocessing_cases() -> list[tuple[dict[str, Any], list[np.ndarray]]]:
    rng = np.random.default_rng(3)
    raw_digits = rng.integers(0, 17, (50, 64)).astype(np.float32)
    raw_odd = (rng.random((40, 7)) * 255).astype(np.float32)
    with_nan = raw_digits.copy()
    with_nan[3, 5] = np.nan
    return [
        (DIGITS, [raw_digits]),  # raw 0..16: scaled
        (DIGITS, [raw_digits / np.float32(16)]),  # preprocessed already: as given
        (DIGITS, [raw_digits * np.float32(255 / 16)]),  # 0..255: outside both
        (DIGITS, [raw_digits + np.float32(0.7)]),  # within the 5% overshoot of the raw range: scaled
        (ODD, [raw_odd, raw_odd.astype(np.float64)]),  # non-integer raw values, float32 and float64
        (ODD, [raw_odd, rng.integers(0, 9, (40, 3))]),  # an integer input is left as it is
        (DIGITS, [with_nan]),  # NaN: outside
        (FAR, [np.array([[-3.5, 2.0], [1e6, 5.25]], np.float32)]),  # ranges worded as Python's %g words them
        ({"kind": "affine", "scale": 0.5, "offset": 1.0}, [raw_digits]),  # no declared range: nothing guessed
        ({"kind": "none"}, [raw_digits]),
    ]


def _python_message(verdict: str, spec: dict[str, Any]) -> str | None:
    """What fedge.clients.common.prepared_device_inputs logs (the browser cannot tell the coordinator: its end)."""
    ranges = Preprocessing.of(spec).describe_ranges()
    if verdict == RAW_SCALED:
        return f"'device d's data' holds raw inputs ({ranges}): the task's preprocessing is applied on this device"
    if verdict == OUTSIDE:
        return (f"'device d's data': inputs fall outside the task's declared range ({ranges}); they are used as they "
                "are: check the data (units, scaling)")
    return None


def test_the_browser_preprocesses_raw_inputs_to_the_python_devices_float32_bytes(tmp_path: Path, run: dict[str, Any],
                                                                                 chromium: Any) -> None:
    # Prepare: raw, preprocessed, out-of-range, mixed and NaN inputs under the digits' and other declared preprocessing
    cases = _preprocessing_cases()
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test"))
    try:
        chromium.get(f"{gateway.url}/web/demo.html?name=pre")
        # Execute: the SDK's preprocessing in the browser, on the same bytes
        answers = chromium.execute_async_script(PREPROCESS, [
            {"spec": spec, "inputs": demo_examples(inputs, np.zeros(1, np.int64))["inputs"]} for spec, inputs in cases])
    finally:
        gateway.close()
    # Assert: fedge.preprocessing's verdict and float32 bytes, input for input; the Python device's message
    assert isinstance(answers, list), answers
    verdicts = []
    for (spec, inputs), answer in zip(cases, answers, strict=True):
        prepared, verdict = prepare_device_inputs(tuple(inputs), spec)
        verdicts.append(answer["verdict"])
        assert answer["verdict"] == verdict, (spec, answer)
        assert answer["message"] == _python_message(verdict, spec), answer["message"]
        for python, browser in zip(prepared, answer["outputs"], strict=True):
            assert base64.b64decode(browser["b64"]) == np.ascontiguousarray(python).tobytes(), (spec, browser["dtype"])
    assert verdicts == [RAW_SCALED, AS_GIVEN, OUTSIDE, RAW_SCALED, RAW_SCALED, RAW_SCALED, OUTSIDE, RAW_SCALED,
                        AS_GIVEN, AS_GIVEN]


def test_a_tab_fed_raw_digits_trains_as_a_python_device_and_one_outside_the_range_is_flagged(
        tmp_path: Path, run: dict[str, Any], chromium: Any) -> None:
    # Prepare: demo devices whose files hold raw digits (0..16; the shards are preprocessed), then 0..255 ones
    pages = {}
    for name, raw_scale in (("browser0", 16), ("browser1", 255)):
        (tmp_path / name).mkdir()
        gateway = WebGateway(tmp_path / name, run, GatewaySettings(
            name="gw-test", devices_per_round=1, round_deadline_s=600, idle_poll_s=0.2),
            inputs=lambda x, k=raw_scale: x * np.float32(k))
        box: dict[str, Any] = {}
        thread = threading.Thread(target=lambda g=gateway, b=box: b.update(result=g.round()), daemon=True)
        thread.start()
        try:
            # Execute: the tab joins and trains a round on its raw file
            _open_device(chromium, gateway, name)
            pages[name] = _join_and_wait(chromium, gateway, 1)
            thread.join()
            pages[name].update(
                result=box["result"], page=_page_when(chromium, "true"),
                warnings=chromium.execute_script("return document.querySelectorAll('#log li.warning').length"),
                events=chromium.execute_script("return window.__fedge.progress.filter((e) => e.kind === 'inputs')"))
        finally:
            gateway.close()
    # Assert: browser0 scaled its raw digits and sent exactly the Python device's update on the preprocessed shard
    raw, outside = pages["browser0"], pages["browser1"]
    assert raw["error"] is None and raw["trained"] == 1, raw
    bundle = read_training_bundle(run["bundle"], trusted_keys=[run["trust"]])
    trainer = OnnxTrainer(bundle.train_onnx, bundle.eval_onnx, bundle.manifest)
    python, _ = trainer.train(run["weights"], run["shards"][0][0], run["shards"][0][1], epochs=1, batch_size=32,
                              learning_rate=0.05, momentum=0.9, seed=device_seed(7, 1, "browser0"))
    header, arrays = raw["result"]
    assert header["devices"] == 1
    for name in python:
        assert float(np.max(np.abs(arrays[name] - python[name]))) <= 1e-5, name
    assert [e["verdict"] for e in raw["events"]] == [RAW_SCALED], raw["events"]
    assert any("'device browser0's data' holds raw inputs (raw 0..16, 0..1 after x * 0.0625 + 0)" in line
               for line in raw["page"]["lines"]) and raw["warnings"] == 0, raw["page"]
    # ... browser1's 0..255 inputs are flagged, in the page's log as a warning, with the ranges
    assert [e["verdict"] for e in outside["events"]] == [OUTSIDE], outside["events"]
    assert outside["events"][0]["message"] == _python_message(OUTSIDE, DIGITS).replace("device d", "device browser1")
    assert outside["warnings"] == 1 and outside["error"] is None, outside["page"]


class AppSite:
    """A developer's own site on another origin (another 127.0.0.1 port, plain HTTP: a secure context on
    loopback): the SDK's files and an empty page, served as any static server would."""

    def __init__(self, root: Path) -> None:
        from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer  # noqa: PLC0415

        root.mkdir()
        for name in ("fedge-device.js", "frame.js", "bundle.js", "onnx-check.js", "preprocessing.js", "worker.js",
                     "batch-order.js"):
            (root / name).write_bytes((ASSETS / name).read_bytes())
        (root / "app.html").write_text("<!doctype html><title>an app</title><p>an app</p>")

        class Quiet(SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(root), **kwargs)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
        self.origin = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


APP_IDENTITY = """
const done = arguments[0];
import("./fedge-device.js").then(({FedgeDevice}) => FedgeDevice.identity("app0"))
  .then((identity) => done(identity.publicKeyPem), (error) => done("error: " + String(error.message || error)));
"""
APP_RUN = """
const [gateway, done] = arguments;
const events = [];
(async () => {
  const {FedgeDevice} = await import("./fedge-device.js");
  const device = new FedgeDevice({gateway, name: "app0", bundleKeyPem: "", data: null, maxNetworkFailures: 3});
  const outcome = await device.run({maxWaitS: 0.05, onProgress: (event) => {
    events.push(event.kind); if (event.kind === "wait") device.stop(); }});
  done({outcome: outcome.kind, kinds: events});
})().catch((error) => done({error: String(error.message || error), kinds: events}));
"""


def test_an_app_on_another_origin_reaches_an_allowing_gateway_and_stops_clearly_at_another(
        tmp_path: Path, run: dict[str, Any], chromium: Any) -> None:
    # Prepare: the app's own site; gateway A allows its origin (--allow-origin), gateway B does not
    app = AppSite(tmp_path / "app")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    allowing = WebGateway(tmp_path / "a", run, GatewaySettings(name="gw-test", idle_poll_s=0.2),
                          allow_origins=(app.origin,))
    other = WebGateway(tmp_path / "b", run, GatewaySettings(name="gw-test", idle_poll_s=0.2))
    try:
        chromium.get(f"{app.origin}/app.html")
        pem = chromium.execute_async_script(APP_IDENTITY)
        assert pem.startswith("-----BEGIN PUBLIC KEY-----"), pem
        for gateway in (allowing, other):
            (gateway.allow / "app0.pub").write_text(pem)
            gateway.gateway.allow.refresh(force=True)
        # Execute: the app's device runs against each gateway
        reached = dict(chromium.execute_async_script(APP_RUN, allowing.url))
        refused = dict(chromium.execute_async_script(APP_RUN, other.url))
        # the app serves the plain SDK files only (no secagg.js): its check-in does not declare secure aggregation
        plain = allowing.gateway.sessions.live_devices(600), allowing.gateway.sessions.live_devices(600, secure=True)
    finally:
        allowing.close()
        other.close()
        app.close()
    # Assert: A checked it in and answered its poll; B's answers reach no page: three failures, then a stop that
    # names the causes and the flag that allows the origin
    assert reached == {"outcome": "stopped", "kinds": ["wait"]}, reached
    assert len(allowing.gateway.sessions) == 1 and len(other.gateway.sessions) == 0
    assert plain == (["app0"], [])
    assert refused["kinds"] == ["error", "error", "error"], refused
    error = refused.get("error", "")
    assert f"stopped: 3 requests in a row to the gateway at {other.url} got no answer" in error, error
    assert f"CORS: the gateway does not allow this page's origin {app.origin}" in error, error
    assert f"--allow-origin {app.origin}" in error and "TLS trust" in error and "ca.crt" in error, error


def test_the_page_follows_the_run_and_lets_the_developer_join_again_after_an_error(
        tmp_path: Path, run: dict[str, Any], chromium: Any) -> None:
    # Prepare: a tab admitted as browser9, for which the operator left no examples yet
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=1, round_deadline_s=600,
                                                       idle_poll_s=0.2))
    results: list[Any] = []

    def two_rounds() -> None:
        results.extend(gateway.round_of(server_round, 2) for server_round in (1, 2))

    try:
        _open_device(chromium, gateway, "browser9")
        # Execute: Join fails (no examples); the operator adds them; Join again; the run has 2 rounds
        chromium.find_element("id", "join").click()
        failed = _page_when(chromium, "s.error")
        enabled = chromium.execute_script("return !document.getElementById('join').disabled")
        (tmp_path / "demo-data" / "browser9.json").write_text((tmp_path / "demo-data" / "browser0.json").read_text())
        thread = threading.Thread(target=two_rounds, daemon=True)
        thread.start()
        chromium.find_element("id", "join").click()
        trained = _page_when(chromium, "s.progress.filter((e) => e.kind === 'train').length >= 2 || s.error")
        thread.join()
        gateway.gateway.finish("round 2 of 2 was its last and the coordinator has closed")
        over = _page_when(chromium, "s.done || s.error")
        bar = chromium.execute_script("const p = document.getElementById('progress'); return [p.value, p.max]")
        inputs = chromium.execute_script("return document.querySelectorAll('input').length")
        rounds = chromium.execute_script(
            "return window.__fedge.progress.filter((e) => e.kind === 'train').map((e) => [e.round, e.numRounds])")
    finally:
        gateway.close()
    # Assert: the error said what was missing and Join works again; the tab then followed the run to its end
    assert "no demo examples for 'browser9'" in failed["error"] and failed["statusClass"] == "error", failed
    assert enabled
    assert trained["error"] is None and len(results) == 2, trained
    assert rounds == [[1, 2], [2, 2]] and "round 2 of 2: trained and sent" in trained["status"], (rounds, trained)
    assert over["outcome"] == "done" and over["status"] == (
        "the run is over: round 2 of 2 was its last and the coordinator has closed (2 rounds trained here)"), over
    assert bar == [2, 2] and inputs == 0


def _documented_app(run: dict[str, Any], gateway_url: str) -> str:
    """docs/devices.md's JavaScript example as an app's module script, pointed at ``gateway_url``: its data the raw
    digits of shard 0, its bundle key the run's signing.pub; it publishes its key and its outcome for the test."""
    text = (ROOT / "docs" / "devices.md").read_text()
    (example,) = re.findall(r"```javascript\n(.*?)```", text, flags=re.S)
    training = read_training_bundle(run["bundle"], trusted_keys=[run["trust"]]).manifest["model_id"]
    replaced = (example.replace('"https://gw1.example.org:9443"', json.dumps(gateway_url))
                .replace('"digits-training"', json.dumps(training))
                .replace('gatewayName: "gw1"', 'gatewayName: "gw-test"')
                .replace("// once; the operator admits identity.publicKeyPem", "window.__key = identity.publicKeyPem;")
                .replace("console.log(event.kind, event.round, event.loss)",
                         "(window.__events = window.__events || []).push(event.kind)"))
    assert replaced.count("window.__key") == 1 and gateway_url in replaced and training in replaced
    prelude = ("const SIGNING_PUB = await (await fetch('signing.pub')).text();"
               "const raw = await (await fetch('data.json')).json();"
               "const n = raw.labels.length, pixels = Float32Array.from(raw.pixels),"
               " labels = BigInt64Array.from(raw.labels, BigInt);\n")
    return prelude + replaced + "window.__outcome = outcome;\n"


def test_the_documented_app_on_its_own_origin_trains_through_a_gateway_that_allows_it(
        tmp_path: Path, run: dict[str, Any], chromium: Any) -> None:
    # Prepare: a gateway allowing the app's origin; the app's site serving the SDK, onnxruntime-web at /ort/, the
    # bundle key and raw digits (0..16), and docs/devices.md's example as its page's script
    app = AppSite(tmp_path / "app")
    (tmp_path / "app" / "ort").mkdir()
    for name in ORT_FILES:
        (tmp_path / "app" / "ort" / name).write_bytes((ORT_DIST / name).read_bytes())
    (tmp_path / "app" / "signing.pub").write_bytes(run["trust"].read_bytes())
    inputs, targets = run["shards"][0]
    (tmp_path / "app" / "data.json").write_text(json.dumps(
        {"pixels": (inputs[0] * 16).ravel().tolist(), "labels": targets.tolist()}))
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=1, round_deadline_s=600,
                                                       idle_poll_s=0.2), allow_origins=(app.origin,))
    (tmp_path / "app" / "example.js").write_text(_documented_app(run, gateway.url))
    (tmp_path / "app" / "example.html").write_text('<!doctype html><script type="module" src="example.js"></script>')
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(result=gateway.round_of(1, 1)), daemon=True)
    thread.start()
    try:
        # Execute: the page runs the example; the operator admits the key it shows; the run's one round; its end
        chromium.get(f"{app.origin}/example.html")
        pem = chromium.execute_async_script(
            "const done = arguments[0]; (function wait() { if (window.__key) done(window.__key);"
            " else setTimeout(wait, 50); })();")
        (gateway.allow / "tab-017.pub").write_text(pem)
        gateway.gateway.allow.refresh(force=True)
        thread.join()
        gateway.gateway.finish("round 1 of 1 was its last and the coordinator has closed")
        outcome = chromium.execute_async_script(
            "const done = arguments[0]; (function wait() { if (window.__outcome) done({...window.__outcome,"
            " kinds: window.__events}); else setTimeout(wait, 100); })();")
    finally:
        gateway.close()
        app.close()
    # Assert: the documented app trained the round on its raw digits and heard the run's end
    header, _ = box["result"]
    assert header["devices"] == 1 and header["num-examples"] == len(targets)
    assert outcome["kind"] == "done" and outcome["trained"] == 1, outcome
    assert "train" in outcome["kinds"] and "inputs" in outcome["kinds"], outcome
