"""A signed graph must not read the device's files (issue 23, item 1).

Each attack is replayed with real signed bundles (the project's own signing code), real
onnxruntime and a device whose working directory holds its private key: a training
graph (or an inference model) whose tensor keeps its "external data" in
``phone-017.key`` made onnxruntime read that file and return its bytes inside the
device's update. Every case is now refused by :mod:`fedge.edge.graph_check` before any
onnxruntime session exists (a spy on ``onnxruntime.InferenceSession`` counts them), and
the session itself resolves external data in a private empty directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.app import Context, RecordDict
from onnx import TensorProto, helper
from ort_polyglot import HIDDEN_SCALE, hidden_ort_model, polyglot
from tiny_bundles import manifest_for, tiny_model

from fedge.clients.onnx_client import load_trainer
from fedge.config import RunConfig
from fedge.edge import EdgeModel
from fedge.edge.bundle import pack_bundle
from fedge.edge.graph_check import CheckedGraph, check_graph, session_of
from fedge.edge.training_bundle import (
    EVAL_FILE,
    GRAPH_OPS,
    TRAIN_FILE,
    architecture_of,
    pack_training_bundle,
    training_manifest,
)
from fedge.errors import BundleVerificationError, ConfigError
from fedge.signature import InputSpec

KEY = Ed25519PrivateKey.generate()
SECRET = b"-----BEGIN PRIVATE KEY-----phone-017-0123456789abcdef"[:16]  # 16 bytes: one 4x4 weight
KEY_FILE = "phone-017.key"
F32 = TensorProto.FLOAT
WHERE = ["initializer", "constant", "if-branch", "loop-body", "function"]


# --------------------------------------------------------------------------- graphs that steal a file


def stolen(name: str = "stolen", location: str = KEY_FILE) -> TensorProto:
    """A uint8[16] tensor whose bytes onnxruntime reads from ``location`` (external data)."""
    tensor = TensorProto(name=name, data_type=TensorProto.UINT8, dims=[len(SECRET)])
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(len(SECRET)))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def leak_nodes(where: str, out: str) -> tuple[list[Any], list[TensorProto], list[Any]]:
    """Nodes producing ``out`` = the stolen bytes as float32 (16,), the initializers and functions they need."""
    cast = helper.make_node("Cast", ["raw"], [out], to=F32)
    if where == "initializer":
        return [cast], [stolen("raw")], []
    if where == "constant":
        return [helper.make_node("Constant", [], ["raw"], value=stolen("value")), cast], [], []
    if where == "if-branch":
        branch = helper.make_graph([helper.make_node("Constant", [], ["inner"], value=stolen("value"))], "then", [],
                                   [helper.make_tensor_value_info("inner", TensorProto.UINT8, [len(SECRET)])])
        condition = helper.make_tensor("yes", TensorProto.BOOL, [], [True])
        return [helper.make_node("If", ["yes"], ["raw"], then_branch=branch, else_branch=branch), cast], [condition], []
    if where == "loop-body":
        body = helper.make_graph(
            [helper.make_node("Identity", ["cond"], ["cond_out"]), helper.make_node("Identity", ["inner"], ["scan"])],
            "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                     helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
            [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
             helper.make_tensor_value_info("scan", TensorProto.UINT8, [len(SECRET)])],
            initializer=[stolen("inner")])
        once = [helper.make_tensor("once", TensorProto.INT64, [], [1]), helper.make_tensor("go", TensorProto.BOOL, [],
                                                                                           [True])]
        sixteen = helper.make_tensor("sixteen", TensorProto.INT64, [1], [len(SECRET)])
        return [helper.make_node("Loop", ["once", "go"], ["scanned"], body=body),
                helper.make_node("Reshape", ["scanned", "sixteen"], ["raw"]), cast], [*once, sixteen], []
    assert where == "function"
    function = helper.make_function("fedge.local", "Leak", [], ["raw"],
                                    [helper.make_node("Constant", [], ["raw"], value=stolen("value"))],
                                    [helper.make_opsetid("", 17)])
    return [helper.make_node("Leak", [], ["raw"], domain="fedge.local"), cast], [], [function]


def model_bytes(nodes: list[Any], inputs: list[Any], outputs: list[Any], initializers: list[TensorProto],
                functions: list[Any], domains: tuple[str, ...] = ()) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=initializers)
    opsets = [helper.make_opsetid("", 17), *(helper.make_opsetid(domain, 1) for domain in domains)]
    model = helper.make_model(graph, opset_imports=opsets, functions=list(functions))
    model.ir_version = 8
    return bytes(model.SerializeToString())


def training_graphs(where: str | None) -> tuple[bytes, bytes]:
    """train.onnx whose gradient of ``w`` is the stolen bytes (``where`` says how; None: zeros, no theft)."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [4, 4])
    nodes, initializers, functions = leak_nodes(where, "flat") if where else (
        [helper.make_node("Mul", ["state:w", "zero"], ["flat"])], [helper.make_tensor("zero", F32, [], [0.0])], [])
    inputs = [helper.make_tensor_value_info("state:w", F32, [4, 4]), helper.make_tensor_value_info("x", F32, ["b", 4]),
              helper.make_tensor_value_info("targets", TensorProto.INT64, ["b"])]
    loss = helper.make_node("ReduceSum", ["x"], ["loss"], keepdims=0)
    train = model_bytes([*nodes, helper.make_node("Reshape", ["flat", "shape"], ["grad:w"]), loss], inputs,
                        [helper.make_tensor_value_info("loss", F32, []),
                         helper.make_tensor_value_info("grad:w", F32, [4, 4])],
                        [*initializers, shape], functions, ("fedge.local",) if functions else ())
    evaluate = model_bytes([helper.make_node("MatMul", ["x", "state:w"], ["output"]), loss], inputs,
                           [helper.make_tensor_value_info("loss", F32, []),
                            helper.make_tensor_value_info("output", F32, ["b", 4])], [], [])
    return train, evaluate


def ops_of(graph: bytes) -> list[str]:
    """Every node's op type, subgraphs and functions included (what a rogue signer would list)."""
    model = onnx.load_from_string(graph)
    found = {node.op_type for function in model.functions for node in function.node}
    pending = [model.graph]
    while pending:
        current = pending.pop()
        for node in current.node:
            found.add(node.op_type)
            pending.extend(attr.g for attr in node.attribute if attr.HasField("g"))
    return sorted(found)


def signed_training_bundle(path: Path, train: bytes, evaluate: bytes, *, ops: dict[str, Any] | None = None) -> Path:
    """A training bundle a rogue coordinator signs with the run's real key (bypassing fedge's export checks)."""
    clean_train, clean_eval = training_graphs(None)
    manifest = training_manifest({"train_onnx": clean_train, "eval_onnx": clean_eval,
                                  "state": [{"name": "w", "shape": [4, 4], "dtype": "float32", "trainable": True}],
                                  "inputs": [InputSpec("x", ("batch", 4))], "target_shape": ("batch",),
                                  "target_dtype": "int64", "max_abs_diff": 0.0, "opset": 17},
                                 task="toy", metrics=["loss"], model_id="run/toy", version=1)
    manifest["architecture"] = architecture_of(train, evaluate)
    manifest[GRAPH_OPS] = ops or {TRAIN_FILE: {"domains": ["ai.onnx"], "ops": ops_of(train)},
                                  EVAL_FILE: {"domains": ["ai.onnx"], "ops": ops_of(evaluate)}}
    path.write_bytes(pack_training_bundle(train, evaluate, manifest, private_key=KEY))
    return path


# --------------------------------------------------------------------------- the device


@pytest.fixture
def device_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A device started in its home directory, which holds its private key and the coordinator's public key."""
    home = tmp_path / "home"
    home.mkdir()
    (home / KEY_FILE).write_bytes(SECRET)
    (home / "signing.pub").write_bytes(KEY.public_key().public_bytes(serialization.Encoding.PEM,
                                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    monkeypatch.chdir(home)
    return home


@pytest.fixture
def sessions(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every onnxruntime session created from now on (the real class, counted)."""
    created: list[object] = []
    real = ort.InferenceSession

    def counted(*args: Any, **kwargs: Any) -> Any:
        created.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", counted)
    return created


def device_update(home: Path, bundle: Path) -> bytes:
    """What the onnx device sends after one step (lr 1, no momentum) from zero weights: -update as bytes."""
    context = Context(run_id=1, node_id=7, node_config={"training-bundle": str(bundle),
                                                        "trusted-key": str(home / "signing.pub")},
                      state=RecordDict(), run_config={})
    _, trainer = load_trainer(context, RunConfig({}), None)
    rng = np.random.default_rng(0)
    new, _ = trainer.train({"w": np.zeros((4, 4), np.float32)}, [rng.random((4, 4), dtype=np.float32)],
                           np.zeros(4, np.int64), epochs=1, batch_size=4, learning_rate=1.0, momentum=0.0, seed=0)
    return bytes((-new["w"]).astype(np.uint8).tobytes())


def test_a_clean_hand_made_training_graph_trains_on_the_device(device_home: Path) -> None:
    # Prepare: the same bundle without the theft (the harness reads back what the graph computes)
    bundle = signed_training_bundle(device_home / "clean.zip", *training_graphs(None))
    # Execute
    update = device_update(device_home, bundle)
    # Assert: a zero gradient, nothing of the key
    assert update == bytes(16)


@pytest.mark.parametrize("where", WHERE)
def test_a_training_graph_reading_the_devices_key_is_refused_before_any_session(
        device_home: Path, sessions: list[object], where: str) -> None:
    # Prepare: a signed training bundle whose graph keeps a tensor's data in the device's key file
    bundle = signed_training_bundle(device_home / "evil.zip", *training_graphs(where))
    update: bytes | None = None
    # Execute / Assert: refused naming the reason; before the fix the key's bytes were the update
    with pytest.raises(BundleVerificationError, match="external data|model-local functions"):
        update = device_update(device_home, bundle)
    assert update is None and sessions == []


@pytest.mark.parametrize("domain", ["com.microsoft", "evil.domain"])
def test_a_training_graph_with_an_op_of_another_domain_is_refused(
        device_home: Path, sessions: list[object], domain: str) -> None:
    # Prepare: the gradient comes from a contrib op (com.microsoft Gelu runs on stock onnxruntime)
    train, evaluate = training_graphs(None)
    model = onnx.load_from_string(train)
    model.graph.node[0].CopyFrom(helper.make_node("Gelu", ["state:w"], ["flat"], domain=domain))
    model.opset_import.append(helper.make_opsetid(domain, 1))
    bundle = signed_training_bundle(device_home / "custom.zip", model.SerializeToString(), evaluate)
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match=f"domain '{domain}'"):
        device_update(device_home, bundle)
    assert sessions == []


def test_a_training_graph_whose_ops_differ_from_the_signed_list_is_refused(device_home: Path,
                                                                          sessions: list[object]) -> None:
    # Prepare: a clean graph, but the manifest the owner reads lists other ops than the graph holds
    train, evaluate = training_graphs(None)
    ops = {TRAIN_FILE: {"domains": ["ai.onnx"], "ops": ["Relu"]},
           EVAL_FILE: {"domains": ["ai.onnx"], "ops": ops_of(evaluate)}}
    bundle = signed_training_bundle(device_home / "listed.zip", train, evaluate, ops=ops)
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match="its signed manifest does not list"):
        device_update(device_home, bundle)
    assert sessions == []


def test_the_signed_training_manifest_lists_each_graphs_ops(device_home: Path) -> None:
    # Prepare / Execute: a bundle made by fedge's own writer
    train, evaluate = training_graphs(None)
    manifest = training_manifest({"train_onnx": train, "eval_onnx": evaluate, "state": [], "inputs": [],
                                  "target_shape": ("batch",), "target_dtype": "int64", "max_abs_diff": 0.0,
                                  "opset": 17}, task="toy", metrics=[], model_id="run/toy", version=1)
    # Assert: what a device owner reads next to the graphs' hashes
    assert manifest[GRAPH_OPS] == {TRAIN_FILE: {"domains": ["ai.onnx"], "ops": ["Mul", "ReduceSum", "Reshape"]},
                                   EVAL_FILE: {"domains": ["ai.onnx"], "ops": ["MatMul", "ReduceSum"]}}


def test_fedge_refuses_to_sign_a_training_graph_devices_would_refuse() -> None:
    train, evaluate = training_graphs("initializer")
    with pytest.raises(ConfigError, match="every device would refuse this training graph"):
        training_manifest({"train_onnx": train, "eval_onnx": evaluate, "state": [], "inputs": [],
                           "target_shape": ("batch",), "target_dtype": "int64", "max_abs_diff": 0.0, "opset": 17},
                          task="toy", metrics=[], model_id="run/toy", version=1)


# --------------------------------------------------------------------------- inference bundles


def inference_model(where: str | None, domain: str = "") -> bytes:
    """``logits = input @ W`` with W (4x3, from 12 of the stolen bytes when ``where`` is given)."""
    op = "Gelu" if domain else "Relu"  # com.microsoft's Gelu runs on stock onnxruntime
    nodes, initializers, functions = leak_nodes(where, "flat") if where else (
        [helper.make_node(op, ["zeros"], ["flat"], domain=domain)],
        [helper.make_tensor("zeros", F32, [16], [0.0] * 16)], [])
    cut = [helper.make_tensor(name, TensorProto.INT64, [len(values)], values)
           for name, values in (("start", [0]), ("end", [12]), ("shape", [4, 3]))]
    nodes = [*nodes, helper.make_node("Slice", ["flat", "start", "end"], ["twelve"]),
             helper.make_node("Reshape", ["twelve", "shape"], ["W"]),
             helper.make_node("MatMul", ["input", "W"], ["logits"])]
    extra = tuple({domain, *(["fedge.local"] if functions else [])} - {""})
    return model_bytes(nodes, [helper.make_tensor_value_info("input", F32, ["batch", 4])],
                       [helper.make_tensor_value_info("logits", F32, ["batch", 3])], [*initializers, *cut],
                       functions, extra)


def signed_inference_bundle(model: bytes) -> dict[str, bytes]:
    return pack_bundle({"model.onnx": model, "model.int8.onnx": model}, manifest_for(), private_key=KEY)


@pytest.mark.parametrize("variant", ["fp32", "int8"])
@pytest.mark.parametrize("where", WHERE)
def test_an_inference_model_reading_the_devices_key_is_refused_by_edge_model(
        device_home: Path, sessions: list[object], where: str, variant: str) -> None:
    # Prepare: a signed inference bundle whose weights are the device's key file
    files = signed_inference_bundle(inference_model(where))
    model = None
    # Execute / Assert: before the fix, predicting on the identity matrix printed the key's bytes
    with pytest.raises(BundleVerificationError, match="external data|model-local functions"):
        model = EdgeModel.from_files(files, trusted_keys=[KEY.public_key()], variant=variant)
    assert model is None and sessions == []


@pytest.mark.parametrize("domain", ["com.microsoft", "evil.domain"])
def test_an_inference_model_with_an_op_of_another_domain_is_refused_by_edge_model(
        device_home: Path, sessions: list[object], domain: str) -> None:
    files = signed_inference_bundle(inference_model(None, domain))
    with pytest.raises(BundleVerificationError, match=f"domain '{domain}'"):
        EdgeModel.from_files(files, trusted_keys=[KEY.public_key()])
    assert sessions == []


def test_a_clean_hand_made_inference_model_runs(device_home: Path) -> None:
    # Prepare: the standard-domain twin of the custom-op model
    files = signed_inference_bundle(inference_model(None))
    # Execute
    model = EdgeModel.from_files(files, trusted_keys=[KEY.public_key()], variant="fp32")
    # Assert
    assert model.run(np.eye(4, dtype=np.float32))[0].tolist() == np.zeros((4, 3)).tolist()


# --------------------------------------------------------------------------- the session's own guard


def test_a_session_resolves_external_data_in_an_empty_private_directory(device_home: Path) -> None:
    # Prepare: a graph that escaped the checker (built unchecked on purpose), in the key's directory
    evil = inference_model("initializer")
    unchecked = CheckedGraph(model_bytes=evil, ops=())
    # Execute / Assert: onnxruntime finds no file where the session looks; the plain session reads the key
    with pytest.raises(Exception, match="External data path"):
        session_of(unchecked)
    plain = ort.InferenceSession(evil, providers=["CPUExecutionProvider"])
    (logits,) = plain.run(None, {"input": np.eye(4, dtype=np.float32)})
    assert bytes(logits.astype(np.uint8).tobytes()) == SECRET[:12]


@pytest.mark.parametrize("location", ["../../etc/passwd", "/etc/passwd", "phone-017.key"])
def test_every_external_location_is_refused_by_the_checker(location: str) -> None:
    graph = helper.make_graph([helper.make_node("Identity", ["s"], ["o"])], "g", [],
                              [helper.make_tensor_value_info("o", TensorProto.UINT8, [16])],
                              initializer=[stolen("s", location)])
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    with pytest.raises(BundleVerificationError, match=f"external data '{location}'"):
        check_graph(data, what="model.onnx")


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (what onnx's own helpers refuse to build past ~32 levels)."""
    def varint(value: int) -> bytes:
        out = bytearray()
        while True:
            out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
            value >>= 7
            if not value:
                return bytes(out)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def nested(depth: int) -> bytes:
    """A model whose If nodes nest ``depth`` subgraphs deep (wire format written directly)."""
    graph = helper.make_graph([helper.make_node("Identity", ["c"], ["o"])], "leaf", [],
                              [helper.make_tensor_value_info("o", TensorProto.BOOL, [])]).SerializeToString()
    for _ in range(depth):
        attribute = _field(1, b"then_branch") + _field(6, graph) + bytes([0xA0, 0x01, 5])  # type = GRAPH
        graph = _field(1, _field(1, b"c") + _field(2, b"o") + _field(4, b"If") + _field(5, attribute))
    return _field(7, graph)


@pytest.mark.parametrize(("depth", "reason"), [(17, "deeper than 16"), (40, "not a valid ONNX model")])
def test_subgraphs_nested_too_deep_are_refused(depth: int, reason: str) -> None:
    check_graph(nested(16), what="model.onnx")  # 16 levels: fine
    with pytest.raises(BundleVerificationError, match=reason):
        check_graph(nested(depth), what="model.onnx")


@pytest.mark.parametrize("listed", [None, {TRAIN_FILE: {"ops": []}}, {TRAIN_FILE: {"domains": [], "ops": [7]},
                                                                     EVAL_FILE: {"domains": [], "ops": []}}],
                         ids=["missing", "one-graph", "not-names"])
def test_a_training_bundle_without_a_proper_op_list_is_refused(device_home: Path, listed: Any) -> None:
    # Prepare: a signed bundle whose manifest does not say (properly) which ops its graphs run
    train, evaluate = training_graphs(None)
    bundle = device_home / "unlisted.zip"
    raw = training_manifest({"train_onnx": train, "eval_onnx": evaluate,
                             "state": [{"name": "w", "shape": [4, 4], "dtype": "float32", "trainable": True}],
                             "inputs": [InputSpec("x", ("batch", 4))], "target_shape": ("batch",),
                             "target_dtype": "int64", "max_abs_diff": 0.0, "opset": 17},
                            task="toy", metrics=["loss"], model_id="run/toy", version=1)
    if listed is None:
        del raw[GRAPH_OPS]
    else:
        raw[GRAPH_OPS] = listed
    bundle.write_bytes(pack_training_bundle(train, evaluate, raw, private_key=KEY))
    # Execute / Assert: the device refuses it before any graph is looked at
    with pytest.raises(BundleVerificationError, match="graph_ops"):
        device_update(device_home, bundle)


# --------------------------------------------------------------------------- ORT-format polyglots (issue 38, item 5)
# One file, two models (tests/ort_polyglot.py): onnx reads a harmless Gemm; onnxruntime, left to pick the
# format from bytes 4..8 ("ORTM"), runs a hidden com.microsoft graph from the same bytes.

X = np.array([[1, 0, 0, 0], [0.5, -1, 2, 0]], np.float32)
VISIBLE = X @ np.arange(12, dtype=np.float32).reshape(4, 3)  # tiny_model's Gemm
HIDDEN = X @ (np.arange(12, dtype=np.float32).reshape(4, 3) * HIDDEN_SCALE)  # Gelu of these: themselves (>= 0)


@pytest.fixture(scope="module")
def hidden_ort() -> bytes:
    return hidden_ort_model()


@pytest.fixture(scope="module")
def ort_polyglot(hidden_ort: bytes) -> bytes:
    data = polyglot(tiny_model(), hidden_ort)
    assert [node.op_type for node in onnx.load_from_string(data).graph.node] == ["Gemm"]  # what a checker reads
    (hidden,) = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"input": X})
    assert np.allclose(hidden, HIDDEN)  # what a session that guesses the format runs
    return data


def test_an_ort_format_polyglot_is_refused_by_the_checker(ort_polyglot: bytes) -> None:
    # Execute / Assert: refused by name (before the fix it passed as the harmless Gemm it also is)
    with pytest.raises(BundleVerificationError, match="is an ORT-format model .file identifier 'ORTM' at byte 4."):
        check_graph(ort_polyglot, what="model.onnx")


def test_a_signed_ort_format_polyglot_is_refused_by_edge_model(device_home: Path, sessions: list[object],
                                                               ort_polyglot: bytes) -> None:
    # Prepare: the coordinator's key signs the polyglot as an inference model
    files = signed_inference_bundle(ort_polyglot)
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match="model.onnx is an ORT-format model"):
        EdgeModel.from_files(files, trusted_keys=[KEY.public_key()], variant="fp32")
    assert sessions == []


def test_a_training_graph_that_is_an_ort_format_polyglot_is_refused(device_home: Path, hidden_ort: bytes,
                                                                   sessions: list[object]) -> None:
    # Prepare: a signed training bundle whose train.onnx is the clean graph over a hidden ORT-format model
    train, evaluate = training_graphs(None)
    bundle = signed_training_bundle(device_home / "polyglot.zip", polyglot(train, hidden_ort), evaluate)
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match="train.onnx is an ORT-format model"):
        device_update(device_home, bundle)
    assert sessions == []


def test_ort_format_bytes_made_by_reordering_fields_are_refused() -> None:
    # Prepare: "ORTM" is not at byte 4 as sent, but is once the checker re-serializes the message in field order
    # (ir_version, then producer_name "ORTM...")
    model = onnx.load_from_string(tiny_model())
    model.ClearField("ir_version")
    sent = model.SerializeToString() + b"\x08\x08" + b"\x12\x06ORTMxx"
    assert sent[4:8] != b"ORTM" and onnx.load_from_string(sent).SerializeToString()[4:8] == b"ORTM"
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match="is an ORT-format model"):
        check_graph(sent, what="model.onnx")


def test_a_session_reads_a_checked_graph_as_onnx_only(ort_polyglot: bytes, hidden_ort: bytes) -> None:
    # Prepare: the polyglot as if it had escaped the checker (unchecked on purpose), and a plain ORT-format model
    unchecked = CheckedGraph(model_bytes=ort_polyglot, ops=())
    # Execute: the session fedge builds pins the ONNX format
    (logits,) = session_of(unchecked).run(None, {"input": X})
    # Assert: it runs the graph the checker reads, not the hidden one; an ORT-format file does not load at all
    assert np.allclose(logits, VISIBLE)
    with pytest.raises(Exception, match="protobuf parsing failed"):
        session_of(CheckedGraph(model_bytes=hidden_ort, ops=()))
