"""Small signed bundles for the bundle security tests: no torch, a 4 -> 3 ONNX Gemm in a few kB."""

from __future__ import annotations

import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from onnx import TensorProto, helper, numpy_helper

from fedge.edge.bundle import pack_bundle

FEATURES, CLASSES = 4, 3
MODEL_ID = "run-1/mlp-digits"
ISSUED_AT = "2025-01-01T00:00:00Z"


def tiny_model(scale: float = 1.0) -> bytes:
    """An ONNX model ``logits = x @ W + b`` taking ``input`` (batch, 4), giving ``logits`` (batch, 3)."""
    weights = numpy_helper.from_array((np.arange(12, dtype=np.float32).reshape(4, 3) * scale), "W")
    bias = numpy_helper.from_array(np.zeros(3, np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["input", "W", "b"], ["logits"])], "tiny",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        initializer=[weights, bias])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def manifest_for(*, model_id: str | None = MODEL_ID, version: int | None = 5,
                 expires_at: str | None = None, **extra: Any) -> dict[str, Any]:
    """The manifest fields of a tiny bundle (``None`` leaves ``model_id``/``version`` out, as old bundles)."""
    manifest: dict[str, Any] = {
        "model_name": "mlp-digits", "source_run": "run-1", "round": version or 0, "issued_at": ISSUED_AT,
        "expires_at": expires_at,
        "inputs": [{"name": "input", "shape": ["batch", FEATURES], "dtype": "float32"}],
        "outputs": [{"name": "logits", "shape": ["batch", CLASSES], "dtype": "float32"}],
        "preprocessing": {"scale": 1.0, "offset": 0.0}, "labels": ["a", "b", "c"],
        "variants": {"fp32": {"file": "model.onnx"}, "int8": {"file": "model.int8.onnx"}},
        "metrics": {"fp32_accuracy": 1.0},
    }
    if model_id is not None:
        manifest["model_id"] = model_id
    if version is not None:
        manifest["version"] = version
    return {**manifest, **extra}


def tiny_bundle(key: Ed25519PrivateKey, *, models: Mapping[str, bytes] | None = None,
                **manifest: Any) -> dict[str, bytes]:
    """A signed tiny bundle in memory (``{name: bytes}``); ``manifest`` overrides :func:`manifest_for`."""
    model = tiny_model()
    files = dict(models) if models is not None else {"model.onnx": model, "model.int8.onnx": model}
    return pack_bundle(files, manifest_for(**manifest), private_key=key)


def write_dir(files: Mapping[str, bytes], path: Path) -> Path:
    """``files`` as a bundle directory."""
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def write_zip(entries: Iterable[tuple[str, bytes]], path: Path) -> Path:
    """``entries`` as a zip, in order and as given (duplicates and odd names included)."""
    import warnings

    with warnings.catch_warnings(), zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        warnings.simplefilter("ignore")  # zipfile warns about a duplicate name, and writes it
        for name, data in entries:
            archive.writestr(name, data)
    return path


def load_check(data: bytes) -> None:
    """Raise unless ``data`` is a valid ONNX model (used to prove the tiny model is sound)."""
    onnx.checker.check_model(onnx.load_from_string(data), full_check=True)
