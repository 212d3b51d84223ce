"""The browser as a training device (issue 15): fedge's training graph in onnxruntime-web.

The graph ``export_training_graphs`` makes (loss and gradients; the optimiser step is the
caller's) runs in onnxruntime-web's WebAssembly build inside headless Chromium, served from
one loopback folder. The page (``tests/browser/train_step.js``) does the SGD step in float32
JavaScript; the new weights and the loss must match one torch autograd step on the same batch
within 1e-5. Any device with an ONNX runtime can therefore train; ``docs/ondevice.md`` says
what a native app needs.

Needs Debian's chromium + chromedriver and the pinned onnxruntime-web npm package under
``.cache/ortweb`` (``make browser`` installs both); skipped with the reason otherwise.
"""

from __future__ import annotations

import base64
import copy
import functools
import importlib.util
import itertools
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from chromium import start_chromium
from onnx import TensorProto, helper

from fedge.config import resolve_run_config
from fedge.task.api import Task, seeded_model
from fedge.task.loading import load_task

ROOT = Path(__file__).resolve().parent.parent
PAGE = Path(__file__).resolve().parent / "browser"
# Where `make browser` installs onnxruntime-web (FEDGE_ORTWEB_DIR, relative to the repository root).
ORT_DIST = ROOT / os.environ.get("FEDGE_ORTWEB_DIR", ".cache/ortweb") / "node_modules" / "onnxruntime-web" / "dist"
ORT_FILES = ("ort.wasm.min.js", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")
TOLERANCE = 1e-5
LEARNING_RATE = 0.05
BATCH = 16
_RUNS = itertools.count()


# --------------------------------------------------------------------------- serving and driving the page

class _Handler(SimpleHTTPRequestHandler):
    extensions_map = {**SimpleHTTPRequestHandler.extensions_map, ".wasm": "application/wasm",
                      ".mjs": "text/javascript", ".js": "text/javascript", ".json": "application/json",
                      ".onnx": "application/octet-stream"}

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")  # each case is new: never a cached graph or batch
        super().end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The page and onnxruntime-web's wasm build, served from a temp folder on 127.0.0.1 (port 0)."""
    missing = [name for name in ORT_FILES if not (ORT_DIST / name).is_file()]
    if missing:
        pytest.skip(f"onnxruntime-web is not installed under {ORT_DIST.parent} (missing {', '.join(missing)}); "
                    "`make browser` installs it with npm")
    folder = tmp_path_factory.mktemp("ortweb-site")
    for name in ORT_FILES:
        shutil.copyfile(ORT_DIST / name, folder / name)
    for page in PAGE.iterdir():
        shutil.copyfile(page, folder / page.name)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/train_step.html", folder
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium (skipped where it is not installed)."""
    driver = start_chromium()
    yield driver
    driver.quit()


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def _feed(name: str, array: np.ndarray) -> dict[str, Any]:
    return {"name": name, "dtype": str(array.dtype), "dims": list(array.shape), "data": _b64(array)}


def _train_in_browser(driver: Any, site: tuple[str, Path], graph: bytes, feeds: Sequence[tuple[str, np.ndarray]],
                      params: Sequence[str], *, steps: int = 1, momentum: float = 0.0,
                      timeout: float = 120.0) -> tuple[list[float], dict[str, np.ndarray]]:
    """Run ``steps`` training steps of ``graph`` in the page: (losses, new float32 weights by name)."""
    url, folder = site
    run = next(_RUNS)
    (folder / f"train-{run}.onnx").write_bytes(graph)
    case = {"graph": f"train-{run}.onnx", "learning_rate": LEARNING_RATE, "momentum": momentum, "steps": steps,
            "loss": "loss", "feeds": [_feed(name, array) for name, array in feeds],
            "params": [{"name": name, "input": f"state:{name}", "grad": f"grad:{name}"} for name in params]}
    (folder / f"case-{run}.json").write_text(json.dumps(case))
    driver.get(f"{url}?case=case-{run}.json")  # a fresh page, graph and batch each time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result, error = driver.execute_script("return [window.__result || null, window.__error || null];")
        if error:
            raise AssertionError(f"the page failed: {error}")
        if result:
            weights = {name: np.frombuffer(base64.b64decode(text), dtype=np.float32)
                       for name, text in result["weights"].items()}
            return [float(loss) for loss in result["losses"]], weights
        time.sleep(0.1)
    raise AssertionError(f"the page gave no result within {timeout} s")


# --------------------------------------------------------------------------- torch's reference

def _digits(model: str) -> tuple[Task, torch.nn.Module, np.ndarray, np.ndarray]:
    """The built-in digits task with ``model``, its seeded model and a fixed batch of 16 examples."""
    task = load_task(resolve_run_config({"model": model}))
    data = task.train_data()
    pick = np.random.default_rng(7).permutation(len(data))[:BATCH]
    return task, seeded_model(task, 0), np.ascontiguousarray(data.inputs[0][pick]), data.targets[pick]


def _torch_steps(task: Task, model: torch.nn.Module, x: np.ndarray, y: np.ndarray, *, steps: int = 1,
                 momentum: float = 0.0) -> tuple[list[float], dict[str, np.ndarray]]:
    """``steps`` SGD steps with torch autograd on one batch: (the loss before each step, the new weights).

    One step is ``loss.backward(); p - lr * p.grad``; later ones add heavy-ball momentum
    ``v = momentum * v + grad; p = p - lr * v``, fedge's local optimiser.
    """
    model = copy.deepcopy(model).train()
    params = dict(model.named_parameters())
    velocity: dict[str, torch.Tensor] = {}
    losses = []
    for _ in range(steps):
        model.zero_grad()
        loss = task.loss(task.forward(model, [torch.as_tensor(x)]), torch.as_tensor(y))
        loss.backward()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            for name, p in params.items():
                assert p.grad is not None, name
                velocity[name] = momentum * velocity[name] + p.grad if name in velocity else p.grad.clone()
                p.sub_(LEARNING_RATE * velocity[name])
    return losses, {name: p.detach().numpy().copy() for name, p in params.items()}


def _compare(browser: tuple[list[float], dict[str, np.ndarray]],
             reference: tuple[list[float], dict[str, np.ndarray]]) -> tuple[float, float]:
    """(max |weight difference|, max |loss difference|), each asserted to be at most 1e-5."""
    (browser_losses, browser_weights), (torch_losses, torch_weights) = browser, reference
    assert set(browser_weights) == set(torch_weights)
    assert len(browser_losses) == len(torch_losses)
    weight_diff = max(float(np.max(np.abs(browser_weights[name] - torch_weights[name].reshape(-1))))
                      for name in torch_weights)
    loss_diff = max(abs(a - b) for a, b in zip(browser_losses, torch_losses, strict=True))
    print(f"\n{len(torch_losses)} step(s): max |w_browser - w_torch| = {weight_diff:.3g}, "
          f"max |loss_browser - loss_torch| = {loss_diff:.3g} (loss {torch_losses[0]:.6f})")
    assert weight_diff <= TOLERANCE, weight_diff
    assert loss_diff <= TOLERANCE, loss_diff
    return weight_diff, loss_diff


# --------------------------------------------------------------------------- the harness, on a hand-written graph

def _softmax_regression_graph(features: int, classes: int, batch: int) -> bytes:
    """Mean cross-entropy of ``x @ W.T + b`` and its gradients, written by hand in ONNX."""
    f32 = TensorProto.FLOAT
    nodes = [
        helper.make_node("Gemm", ["x", "state:linear.weight", "state:linear.bias"], ["logits"], transB=1),
        helper.make_node("LogSoftmax", ["logits"], ["logp"], axis=1),
        helper.make_node("Softmax", ["logits"], ["p"], axis=1),
        helper.make_node("OneHot", ["targets", "depth", "onoff"], ["onehot"], axis=-1),
        helper.make_node("Mul", ["onehot", "logp"], ["picked"]),
        helper.make_node("ReduceSum", ["picked"], ["total"], keepdims=0),
        helper.make_node("Div", ["total", "minus_n"], ["loss"]),
        helper.make_node("Sub", ["p", "onehot"], ["residual"]),
        helper.make_node("Div", ["residual", "n"], ["dlogits"]),
        helper.make_node("Gemm", ["dlogits", "x"], ["grad:linear.weight"], transA=1),
        helper.make_node("ReduceSum", ["dlogits", "axis0"], ["grad:linear.bias"], keepdims=0),
    ]
    constants = [
        helper.make_tensor("depth", TensorProto.INT64, [], [classes]),
        helper.make_tensor("onoff", f32, [2], [0.0, 1.0]),
        helper.make_tensor("n", f32, [], [float(batch)]),
        helper.make_tensor("minus_n", f32, [], [-float(batch)]),
        helper.make_tensor("axis0", TensorProto.INT64, [1], [0]),
    ]
    graph = helper.make_graph(
        nodes, "softmax_regression_train",
        [helper.make_tensor_value_info("state:linear.weight", f32, [classes, features]),
         helper.make_tensor_value_info("state:linear.bias", f32, [classes]),
         helper.make_tensor_value_info("x", f32, [batch, features]),
         helper.make_tensor_value_info("targets", TensorProto.INT64, [batch])],
        [helper.make_tensor_value_info("loss", f32, []),
         helper.make_tensor_value_info("grad:linear.weight", f32, [classes, features]),
         helper.make_tensor_value_info("grad:linear.bias", f32, [classes])],
        initializer=constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model.SerializeToString()


@pytest.mark.parametrize(("steps", "momentum"), [(1, 0.0), (5, 0.9)], ids=["one-step", "five-momentum-steps"])
def test_the_page_steps_a_hand_written_gradient_graph_like_torch(site: tuple[str, Path], browser: Any, steps: int,
                                                                 momentum: float) -> None:
    # Prepare: logistic regression on 16 digits examples; the graph's gradients written by hand
    task, model, x, y = _digits("logreg")
    state = {name: value.numpy() for name, value in model.state_dict().items()}
    graph = _softmax_regression_graph(x.shape[1], state["linear.bias"].shape[0], len(x))
    feeds = [*((f"state:{name}", value) for name, value in state.items()), ("x", x), ("targets", y)]
    # Execute
    got = _train_in_browser(browser, site, graph, feeds, list(state), steps=steps, momentum=momentum)
    # Assert: the browser's steps are torch's steps
    _compare(got, _torch_steps(task, model, x, y, steps=steps, momentum=momentum))


# --------------------------------------------------------------------------- fedge's exported training graph

@functools.cache
def _exported(model_name: str) -> Any:
    """fedge's training graphs of the seeded digits ``model_name`` (exported once per module)."""
    if importlib.util.find_spec("fedge.edge.training_graph") is None:
        pytest.fail("fedge.edge.training_graph (export_training_graphs) is missing")
    from fedge.edge.training_graph import export_training_graphs

    task, model, x, y = _digits(model_name)
    return export_training_graphs(model, task.loss, [x], y, inputs=task.inputs, learning_rate=LEARNING_RATE)


@pytest.mark.slow  # the exports take 10-30 s each
@pytest.mark.parametrize(("model_name", "steps", "momentum"), [("mlp", 1, 0.0), ("cnn", 1, 0.0), ("mlp", 5, 0.9)],
                         ids=["mlp-one-step", "cnn-one-step", "mlp-five-momentum-steps"])
def test_training_steps_in_the_browser_match_torch(site: tuple[str, Path], browser: Any, model_name: str,
                                                   steps: int, momentum: float) -> None:
    # Prepare: fedge's training graph of the digits model, a fixed batch of 16 examples
    graphs = _exported(model_name)
    task, model, x, y = _digits(model_name)
    state = model.state_dict()
    assert [entry.name for entry in graphs.state] == list(state)
    feeds = [*((f"state:{entry.name}", state[entry.name].numpy()) for entry in graphs.state),
             *((spec.name, array) for spec, array in zip(graphs.inputs, [x], strict=True)), ("targets", y)]
    trainable = [entry.name for entry in graphs.state if entry.trainable]
    # Execute: the graph in onnxruntime-web, the step in JavaScript
    got = _train_in_browser(browser, site, graphs.train_onnx, feeds, trainable, steps=steps, momentum=momentum)
    # Assert: the same new weights and losses as torch autograd's SGD steps, within 1e-5;
    # the graph uses the standard ONNX domain only (what docs/ondevice.md lists)
    _compare(got, _torch_steps(task, model, x, y, steps=steps, momentum=momentum))
    proto = onnx.load_from_string(graphs.train_onnx)
    assert {node.domain for node in proto.graph.node} <= {"", "ai.onnx"} and not proto.functions
