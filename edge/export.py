"""torch -> ONNX export with an onnxruntime parity check.

Uses torch's dynamo exporter (needs ``onnxscript``) with a dynamic batch
dimension and all weights inside the one ``.onnx`` file.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedge.errors import ExportError

log = logging.getLogger("fedge.edge")

PARITY_TOLERANCE = 1e-4
INPUT_NAME = "input"
OUTPUT_NAME = "logits"


@dataclass(frozen=True)
class ExportReport:
    """Where the model went and how closely onnxruntime reproduces torch."""

    path: Path
    max_abs_diff: float
    opset: int

    @property
    def parity_ok(self) -> bool:
        """Whether onnxruntime's logits are within :data:`PARITY_TOLERANCE` of torch's."""
        return self.max_abs_diff <= PARITY_TOLERANCE


def export_onnx(model: nn.Module, sample: np.ndarray, path: str | Path) -> ExportReport:
    """Export ``model`` (eval mode, CPU) to ``path`` and compare it with torch on ``sample``.

    Parameters
    ----------
    model : nn.Module
        Takes a float32 batch shaped like ``sample``.
    sample : np.ndarray
        A batch of real inputs (batch dimension first), used to trace and to check parity.
    path : str or Path
        Output ``.onnx`` file (single file, no external data).
    """
    path = Path(path)
    model = model.cpu().eval()
    example = torch.as_tensor(sample[:2], dtype=torch.float32)
    batch = torch.export.Dim("batch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(
                model, (example,), dynamo=True, input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME], dynamic_shapes=({0: batch},), verbose=False,
            )
        except Exception as exc:  # noqa: BLE001 - the exporter raises many types
            raise ExportError(f"torch.onnx.export failed for {type(model).__name__}: {exc}; the model must run "
                              "on a float32 batch shaped like the sample and use only layers torch's ONNX "
                              "exporter supports") from exc
    assert program is not None
    program.save(str(path), external_data=False)
    opset = int(program.model.opset_imports.get("", 0))
    return ExportReport(path=path, max_abs_diff=parity_diff(model, path, sample), opset=opset)


def parity_diff(model: nn.Module, path: Path, sample: np.ndarray) -> float:
    """Largest absolute difference between torch's and onnxruntime's outputs on ``sample``."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.ascontiguousarray(sample, dtype=np.float32)
    (onnx_out,) = session.run(None, {INPUT_NAME: x})
    with torch.no_grad():
        torch_out = model(torch.from_numpy(x)).numpy()
    return float(np.max(np.abs(onnx_out - torch_out)))
