"""ONNX export: onnxruntime reproduces torch within 1e-4, at any batch size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from fedge.config import resolve_run_config
from fedge.edge.export import OUTPUT_NAME, PARITY_TOLERANCE, export_onnx
from fedge.task.api import seeded_model
from fedge.task.loading import load_task


@pytest.mark.parametrize("name", ["logreg", "mlp", "cnn"])
def test_export_matches_torch_for_every_batch_size(name: str, tmp_path: Path) -> None:
    # Prepare: the digits task's models take one input (batch, 64)
    task = load_task(resolve_run_config({"model": name}))
    model = seeded_model(task, 0)
    sample = np.random.default_rng(0).random((16, 64), dtype=np.float32)
    # Execute
    report = export_onnx(model, (sample,), tmp_path / "m.onnx", inputs=task.inputs)
    # Assert: parity on the sample, then on batches the exporter never saw
    assert report.max_abs_diff <= PARITY_TOLERANCE and report.parity_ok
    assert [(o.name, o.shape[1:], o.dtype) for o in report.outputs] == [(OUTPUT_NAME, (10,), "float32")]
    session = ort.InferenceSession(str(report.path), providers=["CPUExecutionProvider"])
    assert [(i.name, i.shape) for i in session.get_inputs()] == [("input", ["batch", 64])]
    for batch in (1, 5, 33):
        x = np.random.default_rng(batch).random((batch, 64), dtype=np.float32)
        (out,) = session.run(None, {"input": x})
        with torch.no_grad():
            np.testing.assert_allclose(out, model(torch.from_numpy(x)).numpy(), atol=1e-4)
    assert not list(tmp_path.glob("*.data")), "weights must live inside the .onnx file"


def test_a_sample_of_one_example_still_exports_a_dynamic_batch(tmp_path: Path) -> None:
    # Prepare: torch.export would fix an axis traced at size 1, so the exporter repeats the example
    task = load_task(resolve_run_config({"model": "logreg"}))
    model = seeded_model(task, 0)
    one = np.random.default_rng(1).random((1, 64), dtype=np.float32)
    # Execute
    report = export_onnx(model, (one,), tmp_path / "m.onnx", inputs=task.inputs)
    # Assert
    session = ort.InferenceSession(str(report.path), providers=["CPUExecutionProvider"])
    assert session.run(None, {"input": np.zeros((4, 64), np.float32)})[0].shape == (4, 10)
    assert report.parity_ok
