"""Edge inference: torch eager fp32 vs onnxruntime fp32 vs onnxruntime int8, in one run.

Models: the demo's CNN (taken from a real demo-config simulation) and a wider CNN
(trained centrally here) to show how the int8 gains grow with model size. For
each: file size, batch-1 and batch-32 latency (p50, p99; one thread each, as on
a small device), test accuracy, and ratios against torch eager fp32.

Usage: python bench/edge.py [--iters N]
Writes bench/results/edge.json and prints a table.
Targets (issue #3): int8 >= 2x faster than torch eager at batch 1, >= 3x smaller
than fp32, accuracy within 0.5 points of fp32.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from flwr.app import Array, ArrayRecord
from torch import nn

from fedge.config import resolve_run_config
from fedge.edge.build import FP32_FILE, INT8_FILE, BundleSpec, build_bundle
from fedge.edge.signing import generate_signing_key, load_private_key
from fedge.server.bundles import CALIBRATION_SIZE, task_score
from fedge.server.checkpoint import load_checkpoint
from fedge.simulation.runner import simulate
from fedge.task.api import Task, seeded_model
from fedge.task.loading import load_task
from fedge.task.models import load_arrays
from fedge.task.training import train_local

HERE = Path(__file__).resolve().parent


class WideCNN(nn.Module):
    """A larger CNN for 8x8 inputs: 64 and 128 channels, a 256-unit head (~600k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(128 * 16, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(-1, 1, 8, 8))  # type: ignore[no-any-return]


def demo_model(task: Task, scratch: Path) -> nn.Module:
    """The demo task's CNN after the demo's federated run (default config, no export)."""
    run_dir, _ = simulate({"export-onnx": False, "run-dir": str(scratch / "demo")}, progress=False)
    model = seeded_model(task, 0)
    arrays = load_checkpoint(run_dir / "checkpoint.npz").arrays
    load_arrays(model, ArrayRecord({k: Array(v) for k, v in arrays.items()}))
    return model


def wide_model(task: Task) -> nn.Module:
    """WideCNN trained centrally on the task's pooled training examples."""
    torch.manual_seed(0)
    model = WideCNN()
    train_local(task, model, task.train_data(), epochs=10, batch_size=32, learning_rate=0.05, momentum=0.9,
                device=torch.device("cpu"), seed=0)
    return model


def latency_ms(run: Any, x: np.ndarray, iters: int) -> dict[str, float]:
    """p50 and p99 latency of ``run(x)`` in milliseconds, after a warm-up."""
    for _ in range(max(10, iters // 10)):
        run(x)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        run(x)
        samples.append((time.perf_counter() - start) * 1e3)
    return {"p50": float(np.percentile(samples, 50)), "p99": float(np.percentile(samples, 99))}


def measure(name: str, model: nn.Module, task: Task, key: Any, scratch: Path, iters: int) -> dict[str, Any]:
    """Sizes, latencies and accuracies of one model in its three forms (two when int8 is skipped)."""
    test = task.central_data()
    assert test is not None, "the digits task holds out a test set"
    (x_test,), y_test = test.inputs, test.targets
    input_name = task.inputs[0].name
    spec = BundleSpec(model_name=name, source_run="bench", server_round=0, preprocessing=dict(task.preprocessing),
                      labels=list(task.labels or ()), output_meaning=task.output, headline=task.headline)
    bundle = build_bundle(model, scratch / name, spec=spec, private_key=key, inputs=task.inputs,
                          sample=test.inputs, score=task_score(task, y_test),
                          calibration=task.calibration_data(CALIBRATION_SIZE, 0))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    model = model.eval()
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1

    def torch_run(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(x)).numpy()  # type: ignore[no-any-return]

    forms: dict[str, Any] = {"torch eager fp32": (torch_run, buffer.getbuffer().nbytes)}
    for variant, file in (("onnxruntime fp32", FP32_FILE), ("onnxruntime int8", INT8_FILE)):
        if not (bundle.path / file).exists():  # int8 skipped: the manifest says why
            continue
        session = ort.InferenceSession(str(bundle.path / file), options, providers=["CPUExecutionProvider"])
        size = (bundle.path / file).stat().st_size
        forms[variant] = (lambda x, s=session: s.run(None, {input_name: x})[0], size)
    results: dict[str, Any] = {"quantization": bundle.manifest["variants"]["int8"]["quantization"],
                               "parameters": sum(p.numel() for p in model.parameters()), "forms": {}}
    for form, (run, size) in forms.items():
        results["forms"][form] = {
            "bytes": int(size),
            "batch1_ms": latency_ms(run, np.ascontiguousarray(x_test[:1]), iters),
            "batch32_ms": latency_ms(run, np.ascontiguousarray(x_test[:32]), max(iters // 3, 20)),
            "accuracy": float(np.mean(np.argmax(run(np.ascontiguousarray(x_test)), axis=1) == y_test)),
        }
    if len(forms) < 3:
        results["int8_skipped"] = bundle.manifest["variants"]["int8"].get("skipped")
        results["ratios"] = {}
        return results
    base, fp32, int8 = (results["forms"][f] for f in forms)
    results["ratios"] = {
        "int8_speedup_vs_torch_batch1": base["batch1_ms"]["p50"] / int8["batch1_ms"]["p50"],
        "int8_speedup_vs_torch_batch32": base["batch32_ms"]["p50"] / int8["batch32_ms"]["p50"],
        "onnx_fp32_speedup_vs_torch_batch1": base["batch1_ms"]["p50"] / fp32["batch1_ms"]["p50"],
        "fp32_over_int8_size": fp32["bytes"] / int8["bytes"],
        "int8_minus_fp32_accuracy_points": 100 * (int8["accuracy"] - fp32["accuracy"]),
    }
    return results


def print_table(rows: dict[str, Any]) -> None:
    """All forms of all models with their ratios."""
    print(f"\n{'model':<10}{'form':<18}{'KiB':>8}{'b1 p50':>9}{'b1 p99':>9}{'b32 p50':>9}{'b32 p99':>9}"
          f"{'acc':>8}")
    for name, result in rows.items():
        for form, r in result["forms"].items():
            print(f"{name:<10}{form:<18}{r['bytes'] / 1024:>8.1f}{r['batch1_ms']['p50']:>9.3f}"
                  f"{r['batch1_ms']['p99']:>9.3f}{r['batch32_ms']['p50']:>9.3f}{r['batch32_ms']['p99']:>9.3f}"
                  f"{r['accuracy']:>8.4f}")
        ratios = result["ratios"]
        if not ratios:
            print(f"{'':<10}no int8 model: {result.get('int8_skipped')}")
            continue
        verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
        print(f"{'':<10}int8 vs torch, batch 1: x{ratios['int8_speedup_vs_torch_batch1']:.2f} "
              f"({verdict(ratios['int8_speedup_vs_torch_batch1'] >= 2)}: >= 2x); size fp32/int8: "
              f"x{ratios['fp32_over_int8_size']:.2f} ({verdict(ratios['fp32_over_int8_size'] >= 3)}: >= 3x); "
              f"accuracy {ratios['int8_minus_fp32_accuracy_points']:+.2f} points "
              f"({verdict(abs(ratios['int8_minus_fp32_accuracy_points']) <= 0.5)}: within 0.5); "
              f"int8 = {result['quantization']}, {result['parameters']} parameters")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    task = load_task(resolve_run_config({}))  # the demo's task: digits, cnn
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        key = load_private_key(generate_signing_key(scratch / "keys")[0])
        rows = {"demo-cnn": measure("demo-cnn", demo_model(task, scratch), task, key, scratch, args.iters),
                "wide-cnn": measure("wide-cnn", wide_model(task), task, key, scratch, args.iters)}
    print_table(rows)
    out = HERE / "results" / "edge.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"iters": args.iters, "threads": 1, "onnxruntime": ort.__version__,
                               "torch": torch.__version__, "models": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
