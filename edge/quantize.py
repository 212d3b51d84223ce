"""int8 quantization of an fp32 ONNX model with onnxruntime's quantization tools.

Per model (recorded in the manifest): static QDQ with per-channel weights,
calibrated on a sample of the training distribution, when the graph has
convolutions (activations dominate their cost); dynamic quantization (int8
weights, activations quantized on the fly) for MatMul/Gemm-only models, which
needs no calibration.
"""

from __future__ import annotations

import tempfile
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
from onnxruntime.quantization.shape_inference import quant_pre_process

STATIC, DYNAMIC = "static-qdq", "dynamic"


class _Batches(CalibrationDataReader):
    def __init__(self, input_name: str, sample: np.ndarray, batch: int = 32) -> None:
        self._feeds = iter([{input_name: sample[i:i + batch]} for i in range(0, len(sample), batch)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)


def quantization_method(model: onnx.ModelProto) -> str:
    """``static-qdq`` for graphs with convolutions, else ``dynamic``."""
    return STATIC if any(node.op_type == "Conv" for node in model.graph.node) else DYNAMIC


def quantize_int8(fp32: bytes, calibration: np.ndarray, *, input_name: str) -> tuple[bytes, str]:
    """Quantize ``fp32`` (ONNX bytes); return the int8 model's bytes and the method used."""
    method = quantization_method(onnx.load_from_string(fp32))
    with tempfile.TemporaryDirectory() as scratch:
        src, pre, out = (Path(scratch) / name for name in ("fp32.onnx", "pre.onnx", "int8.onnx"))
        src.write_bytes(fp32)
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        if method == STATIC:
            quantize_static(str(pre), str(out),
                            _Batches(input_name, np.ascontiguousarray(calibration, np.float32)),
                            quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
        else:
            quantize_dynamic(str(pre), str(out), weight_type=QuantType.QInt8)
        return out.read_bytes(), method
