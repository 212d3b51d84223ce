"""Build a signed edge bundle from a torch model (coordinator side; imports torch)."""

from __future__ import annotations

import datetime as dt
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from torch import nn

import fedge
from fedge.edge.bundle import format_time, write_bundle
from fedge.edge.export import INPUT_NAME, OUTPUT_NAME, export_onnx
from fedge.edge.quantize import quantize_int8
from fedge.errors import ExportError

FP32_FILE, INT8_FILE = "model.onnx", "model.int8.onnx"


@dataclass(frozen=True)
class BundleSpec:
    """What a bundle says about its model, beyond the model itself.

    ``model_id`` names the model's lineage (default ``<source_run>/<model_name>``)
    and ``server_round`` is its ``version``: devices with a freshness store refuse
    a lower version of the same lineage (rollback). ``valid_for`` makes the bundle
    expire that long after it is signed (default: never).
    """

    model_name: str
    source_run: str
    server_round: int
    preprocessing: dict[str, Any]
    labels: list[str]
    model_id: str | None = None
    valid_for: dt.timedelta | None = None

    @property
    def lineage(self) -> str:
        """``model_id``, or ``<source_run>/<model_name>`` when none was given."""
        return self.model_id or default_model_id(self.source_run, self.model_name)


def default_model_id(source_run: str, model_name: str) -> str:
    """The lineage of a run's bundles: every round of one run shares it."""
    return f"{source_run}/{model_name}"


@dataclass(frozen=True)
class BuiltBundle:
    """A written bundle and its manifest."""

    path: Path
    manifest: dict[str, Any]


def build_bundle(
    model: nn.Module,
    out_dir: str | Path,
    *,
    spec: BundleSpec,
    private_key: Ed25519PrivateKey,
    test_set: tuple[np.ndarray, np.ndarray],
    calibration: np.ndarray,
    make_zip: bool = False,
) -> BuiltBundle:
    """Export fp32 + int8 ONNX, measure them on ``test_set``, write and sign the bundle.

    Parameters
    ----------
    model : nn.Module
        The global model (flat float32 inputs, logits out).
    out_dir : str or Path
        Bundle directory to create.
    spec : BundleSpec
        Name, provenance, lineage and version, expiry, preprocessing and labels
        for the manifest.
    private_key : Ed25519PrivateKey
        Signs the manifest (keyword-only: a security-sensitive argument).
    test_set : (x, y)
        Held-out data for the accuracy and agreement metrics.
    calibration : np.ndarray
        A sample of the training distribution for static quantization.
    """
    x_test, y_test = test_set
    with tempfile.TemporaryDirectory() as scratch:
        report = export_onnx(model, x_test[:64], Path(scratch) / FP32_FILE)
        fp32 = report.path.read_bytes()
    try:
        onnx.checker.check_model(onnx.load_from_string(fp32), full_check=True)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"exported model fails onnx.checker: {exc}; the exporter produced an invalid graph, "
                          "report it with the model's class and the torch and onnx versions") from exc
    int8, method = quantize_int8(fp32, calibration, input_name=INPUT_NAME)
    fp32_pred, int8_pred = _predict(fp32, x_test), _predict(int8, x_test)
    issued = dt.datetime.now(dt.UTC)
    manifest = {
        "model_name": spec.model_name,
        "source_run": spec.source_run,
        "round": spec.server_round,
        "model_id": spec.lineage,
        "version": spec.server_round,
        "issued_at": format_time(issued),
        "expires_at": format_time(issued + spec.valid_for) if spec.valid_for is not None else None,
        "created_at": format_time(issued),
        "versions": {"fedge": fedge.__version__, "onnx": onnx.__version__,
                     "onnxruntime": ort.__version__, "torch": torch.__version__, "opset": report.opset},
        "inputs": [{"name": INPUT_NAME, "shape": ["batch", int(x_test.shape[1])], "dtype": "float32"}],
        "outputs": [{"name": OUTPUT_NAME, "shape": ["batch", len(spec.labels)], "dtype": "float32",
                     "meaning": "unnormalised class scores; softmax gives probabilities"}],
        "preprocessing": spec.preprocessing,
        "labels": spec.labels,
        "variants": {"fp32": {"file": FP32_FILE},
                     "int8": {"file": INT8_FILE, "quantization": method}},
        "metrics": {
            "test_samples": int(len(y_test)),
            "fp32_accuracy": float(np.mean(fp32_pred == y_test)),
            "int8_accuracy": float(np.mean(int8_pred == y_test)),
            "int8_top1_agreement": float(np.mean(int8_pred == fp32_pred)),
            "torch_onnx_max_abs_diff": report.max_abs_diff,
        },
    }
    path = write_bundle(out_dir, {FP32_FILE: fp32, INT8_FILE: int8}, manifest,
                        private_key=private_key, make_zip=make_zip)
    return BuiltBundle(path=path, manifest=manifest)


def _predict(model_bytes: bytes, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {INPUT_NAME: np.ascontiguousarray(x, np.float32)})
    return np.asarray(logits).argmax(axis=1)
