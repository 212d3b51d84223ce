"""int8 quantization of an fp32 ONNX model with onnxruntime's quantization tools.

Per model (recorded in the manifest): static QDQ with per-channel weights,
calibrated on a sample of the training distribution (every input fed), when the graph
has convolutions (activations dominate their cost); dynamic quantization (int8 weights,
activations quantized on the fly) otherwise, which needs no calibration.

Normalisation layers stay fp32. When the quantizer fails on a graph, or gives one that
devices refuse (onnxruntime's own ``com.microsoft`` kernels, such as ``DynamicQuantizeLSTM``
for an LSTM: devices run standard ONNX ops only, :mod:`fedge.edge.graph_check`), it is
tried again on the convolutions and matrix products alone. Quantization is best effort: when onnxruntime's
tools still fail, when nothing in the graph quantizes (the int8 model would be the fp32
one), or when onnxruntime cannot run the result, :func:`quantize_int8` says why instead of
giving a model, and the bundle ships fp32 only.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)
from onnxruntime.quantization.registry import IntegerOpsRegistry, QDQRegistry
from onnxruntime.quantization.shape_inference import quant_pre_process

from fedge.edge.graph_check import check_graph
from fedge.errors import BundleVerificationError
from fedge.signature import InputSpec

log = logging.getLogger("fedge.edge")

STATIC, DYNAMIC = "static-qdq", "dynamic"
CALIBRATION_BATCH = 32
_INT8_TYPES = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)
NORMALIZATIONS = {"BatchNormalization", "GroupNormalization", "InstanceNormalization", "LayerNormalization"}
CORE_OPS = ("Conv", "Gemm", "MatMul")


@dataclass(frozen=True)
class Int8Model:
    """The outcome of quantizing: the int8 model's bytes, or why there is none.

    Attributes
    ----------
    model : bytes or None
        The int8 ONNX model; None when ``skipped``.
    method : str
        ``static-qdq`` or ``dynamic``: what was (or would have been) done.
    skipped : str or None
        Why there is no int8 model (None when there is one).
    """

    model: bytes | None
    method: str
    skipped: str | None = None


class _Batches(CalibrationDataReader):
    """Calibration feeds: every input, :data:`CALIBRATION_BATCH` examples at a time."""

    def __init__(self, specs: Sequence[InputSpec], arrays: Sequence[np.ndarray]) -> None:
        self._feeds = _feeds(specs, arrays)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)


def _feeds(specs: Sequence[InputSpec], arrays: Sequence[np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
    size = min(len(array) for array in arrays)
    for start in range(0, size, CALIBRATION_BATCH):
        yield {spec.name: np.ascontiguousarray(array[start:start + CALIBRATION_BATCH], spec.dtype)
               for spec, array in zip(specs, arrays, strict=True)}


def quantization_method(model: onnx.ModelProto) -> str:
    """``static-qdq`` for graphs with convolutions, else ``dynamic``."""
    return STATIC if any(node.op_type == "Conv" for node in model.graph.node) else DYNAMIC


def quantize_int8(fp32: bytes, calibration: Sequence[np.ndarray], *, inputs: Sequence[InputSpec]) -> Int8Model:
    """Quantize ``fp32`` (ONNX bytes) calibrated on ``calibration`` (one array per input).

    Returns
    -------
    Int8Model
        The int8 model and the method, or the method and why no int8 model ships.
    """
    method = quantization_method(onnx.load_from_string(fp32))
    unfit = [spec.describe() for spec, array in zip(inputs, calibration, strict=True) if not spec.matches(array)]
    if unfit or not len(calibration[0]):
        return _skipped(method, f"the calibration sample does not fit the exported inputs {unfit or '(empty)'}")
    failures: list[str] = []
    int8 = None
    for op_types in _op_sets(method):
        try:
            int8 = _quantized(fp32, method, calibration, inputs, op_types)
        except Exception as exc:  # noqa: BLE001 - onnxruntime.quantization raises anything on graphs it cannot handle
            failures.append(f"{type(exc).__name__}: {_first_line(exc)}")
            continue
        refusal = _device_refusal(int8)
        if refusal is None:
            break
        failures.append(refusal)
        int8 = None
    if int8 is None:
        return _skipped(method, f"onnxruntime.quantization failed ({'; then '.join(failures)})")
    if not _has_int8_weights(onnx.load_from_string(int8)):
        ops = sorted({node.op_type for node in onnx.load_from_string(fp32).graph.node})
        return _skipped(method, f"no op of the graph quantizes ({', '.join(ops)}): an int8 model would be "
                                "the fp32 one")
    problem = _run_problem(int8, calibration, inputs)
    if problem is not None:
        return _skipped(method, problem)
    return Int8Model(int8, method)


def _skipped(method: str, reason: str) -> Int8Model:
    log.warning("no int8 model in this bundle (fp32 only): %s", reason)
    return Int8Model(None, method, reason)


def _op_sets(method: str) -> list[list[str]]:
    """The op types to quantize, widest first: every op onnxruntime quantizes with ``method`` but
    normalisations (fp32 kernels anyway, and their scales are often constants shared between
    layers, which the quantizer refuses), then only the ops that dominate the cost."""
    registry = QDQRegistry if method == STATIC else IntegerOpsRegistry
    return [sorted(set(registry) - NORMALIZATIONS), sorted(set(registry) & set(CORE_OPS))]


def _quantized(fp32: bytes, method: str, calibration: Sequence[np.ndarray], inputs: Sequence[InputSpec],
               op_types: list[str]) -> bytes:
    with tempfile.TemporaryDirectory() as scratch:
        src, pre, out = (Path(scratch) / name for name in ("fp32.onnx", "pre.onnx", "int8.onnx"))
        src.write_bytes(fp32)
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        if method == STATIC:
            quantize_static(str(pre), str(out), _Batches(inputs, calibration),
                            quant_format=QuantFormat.QDQ, per_channel=True, op_types_to_quantize=op_types,
                            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
        else:
            quantize_dynamic(str(pre), str(out), weight_type=QuantType.QInt8, op_types_to_quantize=op_types)
        return out.read_bytes()


def _device_refusal(int8: bytes) -> str | None:
    """Why devices would refuse the int8 graph (non-standard ops), or None when they run it."""
    try:
        check_graph(int8, what="the int8 model")
    except BundleVerificationError as exc:
        return _first_line(exc)
    return None


def _has_int8_weights(model: onnx.ModelProto) -> bool:
    """Whether quantization left any int8/uint8 weight in the graph."""
    return any(init.data_type in _INT8_TYPES for init in model.graph.initializer)


def _run_problem(int8: bytes, calibration: Sequence[np.ndarray], inputs: Sequence[InputSpec]) -> str | None:
    """Why onnxruntime cannot use the int8 model on a calibration batch, or None when it can."""
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(int8, providers=["CPUExecutionProvider"])
        outputs = session.run(None, next(_feeds(inputs, calibration)))
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types
        return f"onnxruntime cannot run the int8 model ({type(exc).__name__}: {_first_line(exc)})"
    if not all(np.isfinite(np.asarray(out, np.float64)).all() for out in outputs):
        return "the int8 model gives non-finite outputs on the calibration sample"
    return None


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return text if len(text) <= limit else text[:limit] + "..."
