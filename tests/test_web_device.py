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
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from chromium import start_chromium, trust_certificate_flag
from google.protobuf.internal import encoder

from fedge.batching import batch_order
from fedge.clients.gateway import GatewaySettings, Served, device_app
from fedge.clients.gateway_pool import GatewayRound, device_seed
from fedge.clients.gateway_web import WebSite
from fedge.config import resolve_run_config
from fedge.edge.trainer import OnnxTrainer
from fedge.edge.training_bundle import architecture_of, pack_training_bundle, read_training_bundle
from fedge.errors import FedgeError
from fedge.listeners import ListenerLimits
from fedge.server.bundles import run_signing_key
from fedge.web import ORT_FILES
from tests.live_gateway import CONFIG, LiveGateway
from tests.ort_polyglot import HIDDEN_SCALE, hidden_ort_model, polyglot
from tests.tiny_bundles import MODEL_ID, tiny_bundle, tiny_model, write_zip

ROOT = Path(__file__).resolve().parent.parent
ORT_DIST = ROOT / os.environ.get("FEDGE_ORTWEB_DIR", ".cache/ortweb") / "node_modules" / "onnxruntime-web" / "dist"


def demo_examples(inputs: tuple[np.ndarray, ...], targets: np.ndarray) -> dict[str, Any]:
    """A device's examples as the demo page reads them (data/NAME.json)."""
    def entry(array: np.ndarray) -> dict[str, Any]:
        array = np.ascontiguousarray(array)
        return {"dtype": str(array.dtype), "dims": list(array.shape),
                "b64": base64.b64encode(array.tobytes()).decode()}
    return {"inputs": [entry(array) for array in inputs], "targets": entry(targets)}


class WebGateway(LiveGateway):
    """A live gateway whose device listener also serves the web SDK's demo page."""

    def __init__(self, root: Path, run: dict[str, Any], settings: GatewaySettings, bundle: Path | None = None) -> None:
        super().__init__(root, run, settings)
        self.devices.stop()
        data = root / "demo-data"
        data.mkdir()
        for index in range(4):
            inputs, targets = run["shards"][index]
            (data / f"browser{index}.json").write_text(json.dumps(demo_examples(inputs, targets)))
        if bundle is not None:
            self.gateway.training_bundle = bundle
        site = WebSite(ort=ORT_DIST, bundle_key=run["trust"], data=data)
        self.devices = Served(device_app(self.gateway, web=site), "127.0.0.1", 0, limits=ListenerLimits(per_address=64),
                              cert=run["gateway-cert"][0], cert_key=run["gateway-cert"][1])
        self.url = f"https://127.0.0.1:{self.devices.port}"


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


def _join_and_wait(driver: Any, rounds: int) -> dict[str, Any]:
    """Start the page's device for ``rounds`` train rounds; its state once done (or failed)."""
    return dict(driver.execute_async_script(
        "const done = arguments[1]; window.fedgeJoin(arguments[0]);"
        "(function wait() { const s = window.__fedge;"
        " if (s.done || s.error) done({done: s.done, error: s.error, trained: s.trained || 0,"
        "  kinds: s.progress.map((e) => e.kind), errors: s.progress.filter((e) => e.error).map((e) => e.error)});"
        " else setTimeout(wait, 100); })();", rounds))


@pytest.mark.parametrize("uplink", ["fp32", "int8-delta"])
def test_a_browser_tab_trains_a_gateway_round_as_the_python_device_would(tmp_path: Path, run: dict[str, Any],
                                                                         chromium: Any, uplink: str) -> None:
    # Prepare: a gateway round of 1 device, served with the demo page; the tab admitted as browser0
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=1, round_deadline_s=600,
                                                       idle_poll_s=0.2, uplink=uplink))
    try:
        _open_device(chromium, gateway, "browser0")
        box: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: box.update(result=gateway.round()), daemon=True)
        thread.start()
        # Execute: the tab joins for one round
        state = _join_and_wait(chromium, 1)
        thread.join()
    finally:
        gateway.close()
    header, arrays = box["result"]
    # Assert: one browser result, the update of one local epoch from the round's weights
    assert state["done"] and state["trained"] == 1 and state["error"] is None, state
    assert header["devices"] == 1 and header["num-examples"] == len(run["shards"][0][1])
    bundle = read_training_bundle(run["bundle"], trusted_keys=[run["trust"]])
    trainer = OnnxTrainer(bundle.train_onnx, bundle.eval_onnx, bundle.manifest)
    inputs, targets = run["shards"][0]
    python, _ = trainer.train(run["weights"], inputs, targets, epochs=1, batch_size=32, learning_rate=0.05,
                              momentum=0.9, seed=device_seed(7, 1, "browser0"))
    # the update a Python device sends: the same batches (numpy's order), float32 steps in onnxruntime-web;
    # in int8-delta, within one quantisation step of each tensor (max |delta| / 127)
    assert arrays.keys() == python.keys()
    for name in python:
        step = float(np.max(np.abs(python[name] - run["weights"][name]))) / 127 if uplink == "int8-delta" else 0.0
        assert float(np.max(np.abs(arrays[name] - python[name]))) <= step + 1e-5, name
    assert min(float(np.max(np.abs(arrays[k] - run["weights"][k]))) for k in python) > 1e-3  # it trained


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
        chromium.execute_script("window.fedgeJoin(3)")
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
        state = _join_and_wait(chromium, 1)
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


def test_a_secure_run_refuses_a_browser_at_check_in_naming_why(tmp_path: Path, run: dict[str, Any],
                                                               chromium: Any) -> None:
    # Prepare: a gateway whose coordinator runs secure aggregation (the web SDK does not implement it yet)
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=1, idle_poll_s=0.2))
    gateway.gateway.sessions.secure_run = True
    try:
        _open_device(chromium, gateway, "browser3")
        # Execute
        state = _join_and_wait(chromium, 1)
    finally:
        gateway.close()
    # Assert: refused at check-in with the reason; the page stops instead of retrying
    assert "this run uses secure aggregation, which this device does not implement" in (state["error"] or ""), state
    assert state["trained"] == 0 and len(gateway.gateway.sessions) == 0


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
