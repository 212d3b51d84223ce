"""ONNX export: onnxruntime reproduces torch within 1e-4, at any batch size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from fedge.edge.export import INPUT_NAME, PARITY_TOLERANCE, export_onnx
from fedge.task.models import build_model


@pytest.mark.parametrize("name", ["logreg", "mlp", "cnn"])
def test_export_matches_torch_for_every_batch_size(name: str, tmp_path: Path) -> None:
    # Prepare
    model = build_model(name, 64, 10, seed=0)
    sample = np.random.default_rng(0).random((16, 64), dtype=np.float32)
    # Execute
    report = export_onnx(model, sample, tmp_path / "m.onnx")
    # Assert: parity on the sample, then on batches the exporter never saw
    assert report.max_abs_diff <= PARITY_TOLERANCE and report.parity_ok
    session = ort.InferenceSession(str(report.path), providers=["CPUExecutionProvider"])
    for batch in (1, 5, 33):
        x = np.random.default_rng(batch).random((batch, 64), dtype=np.float32)
        (out,) = session.run(None, {INPUT_NAME: x})
        with torch.no_grad():
            np.testing.assert_allclose(out, model(torch.from_numpy(x)).numpy(), atol=1e-4)
    assert not list(tmp_path.glob("*.data")), "weights must live inside the .onnx file"
