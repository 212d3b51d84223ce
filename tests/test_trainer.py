"""The torch-free trainer (issue 15): numpy + onnxruntime local SGD matches torch's ``train_local``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedge.batching import batch_order as torch_batches
from fedge.config import resolve_run_config
from fedge.edge.trainer import OnnxTrainer, batch_order
from fedge.edge.training_graph import TrainingGraphs, export_training_graphs
from fedge.errors import ConfigError
from fedge.task.api import Task, seeded_model
from fedge.task.loading import load_task
from fedge.task.models import model_arrays
from fedge.task.training import evaluate, train_local

CPU = torch.device("cpu")
_CACHE: dict[str, Any] = {}


def cnn() -> tuple[Task, TrainingGraphs]:
    """The digits CNN task and its training graphs (exported once per session)."""
    if "cnn" not in _CACHE:
        task = load_task(resolve_run_config({"dataset": "digits", "model": "cnn"}))
        data = task.train_data().take(slice(0, 64))
        _CACHE["cnn"] = task, export_training_graphs(seeded_model(task, 0), task.loss, data.inputs, data.targets,
                                                     inputs=task.inputs, parity_steps=2)
    return _CACHE["cnn"]  # type: ignore[no-any-return]


def manifest_of(graphs: TrainingGraphs, metrics: tuple[str, ...] = ("loss", "accuracy")) -> dict[str, Any]:
    return {"state": [entry.manifest() for entry in graphs.state], "inputs": [s.manifest() for s in graphs.inputs],
            "targets": {"shape": list(graphs.target_shape), "dtype": graphs.target_dtype}, "metrics": list(metrics)}


def weights_of(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: array.numpy().copy() for name, array in model_arrays(model).items()}


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)), initial=0.0)) for k in a)


@pytest.mark.parametrize(("momentum", "mu", "epochs", "max_steps"), [
    pytest.param(0.0, 0.0, 1, None, id="plain-sgd"),
    pytest.param(0.9, 0.0, 2, None, id="momentum"),
    pytest.param(0.9, 0.1, 1, None, id="fedprox"),
    pytest.param(0.9, 0.0, 1, 11, id="max-steps"),
])
def test_onnx_trainer_matches_train_local(momentum: float, mu: float, epochs: int, max_steps: int | None) -> None:
    # Prepare: same weights, same data, and torch's own batch order (100 examples: a partial last batch)
    task, graphs = cnn()
    data = task.train_data().take(slice(200, 300))
    model = seeded_model(task, 1)
    start = weights_of(model)
    order = list(torch_batches(len(data), 16, 5, epochs, max_steps))
    trainer = OnnxTrainer(graphs.train_onnx, graphs.eval_onnx, manifest_of(graphs))
    # Execute
    expected = train_local(task, model, data, epochs=epochs, batch_size=16, learning_rate=0.05, momentum=momentum,
                           device=CPU, seed=5, proximal_mu=mu, max_steps=max_steps)
    weights, stats = trainer.train(start, data.inputs, data.targets, epochs=epochs, batch_size=16,
                                   learning_rate=0.05, momentum=momentum, seed=0, proximal_mu=mu,
                                   max_steps=max_steps, batches=order)
    # Assert: weights within 1e-5, the same loss (proximal term excluded) and counts; every entry, float32
    assert max_diff(weights, weights_of(model)) <= 1e-5
    assert stats.loss == pytest.approx(expected.loss, abs=1e-5)
    assert (stats.num_examples, stats.samples_processed, stats.steps) == (
        expected.num_examples, expected.samples_processed, expected.steps)
    assert all(array.dtype == np.float32 for array in weights.values())


def test_fedprox_pulls_towards_the_start() -> None:
    # Prepare
    task, graphs = cnn()
    data = task.train_data().take(slice(0, 64))
    start = weights_of(seeded_model(task, 2))
    trainer = OnnxTrainer(graphs.train_onnx, graphs.eval_onnx, manifest_of(graphs))
    common: dict[str, Any] = {"epochs": 2, "batch_size": 16, "learning_rate": 0.1, "momentum": 0.9, "seed": 1}
    # Execute
    free, _ = trainer.train(start, data.inputs, data.targets, **common)
    held, _ = trainer.train(start, data.inputs, data.targets, proximal_mu=1.0, **common)
    # Assert
    assert max_diff(held, start) < max_diff(free, start)


def test_batch_order_covers_each_epoch_once_and_keeps_the_partial_batch() -> None:
    # Execute
    batches = list(batch_order(10, 4, seed=3, epochs=2))
    # Assert: 3 batches per epoch (4, 4, 2), each epoch a permutation, reproducible, epochs differ
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
    first, second = np.concatenate(batches[:3]), np.concatenate(batches[3:])
    assert sorted(first) == list(range(10)) == sorted(second)
    assert not np.array_equal(first, second)
    assert all(np.array_equal(a, b) for a, b in zip(batches, batch_order(10, 4, seed=3, epochs=2), strict=True))
    assert not np.array_equal(first, np.concatenate(list(batch_order(10, 4, seed=4, epochs=1))))


def test_batch_order_with_max_steps_gives_exactly_that_many_cycling_epochs() -> None:
    # Execute
    batches = list(batch_order(10, 4, seed=3, epochs=1, max_steps=7))
    # Assert
    assert len(batches) == 7
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2, 4]
    with pytest.raises(ConfigError, match="batch_size"):
        list(batch_order(10, 0, seed=3, epochs=1))


def test_evaluate_matches_the_task_metrics() -> None:
    # Prepare
    task, graphs = cnn()
    data = task.central_data().take(slice(0, 300))
    model = seeded_model(task, 3)
    trainer = OnnxTrainer(graphs.train_onnx, graphs.eval_onnx, manifest_of(graphs, ("loss", "accuracy", "r2")))
    # Execute
    got = trainer.evaluate(weights_of(model), data.inputs, data.targets, batch_size=64)
    expected = evaluate(task, model, data, device=CPU, batch_size=64)
    # Assert: metrics without a numpy version (r2 here) are left out
    assert set(got) == {"loss", "accuracy"}
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert got["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-12)


def test_weights_and_data_that_do_not_match_the_manifest_are_refused_by_name() -> None:
    # Prepare
    task, graphs = cnn()
    data = task.train_data().take(slice(0, 8))
    trainer = OnnxTrainer(graphs.train_onnx, graphs.eval_onnx, manifest_of(graphs))
    weights = weights_of(seeded_model(task, 0))
    common: dict[str, Any] = {"epochs": 1, "batch_size": 4, "learning_rate": 0.1, "momentum": 0.0, "seed": 0}
    missing = {k: v for k, v in weights.items() if k != "head.1.bias"}
    misshaped = {**weights, "head.1.bias": np.zeros(3, np.float32)}
    # Execute / Assert
    with pytest.raises(ConfigError, match=r"missing \['head\.1\.bias'\]"):
        trainer.train(missing, data.inputs, data.targets, **common)
    with pytest.raises(ConfigError, match=r"extra \['surplus'\]"):
        trainer.train({**weights, "surplus": np.zeros(1)}, data.inputs, data.targets, **common)
    with pytest.raises(ConfigError, match=r"weight 'head\.1\.bias' has shape \(3,\)"):
        trainer.train(misshaped, data.inputs, data.targets, **common)
    with pytest.raises(ConfigError, match=r"input 'input' has shape \(8, 64\) float64"):
        trainer.train(weights, [data.inputs[0].astype(np.float64)], data.targets, **common)
    with pytest.raises(ConfigError, match=r"targets have shape \(8,\) float32"):
        trainer.evaluate(weights, data.inputs, data.targets.astype(np.float32))


def test_the_trainer_runs_where_torch_cannot_be_imported(tmp_path: Path) -> None:
    # Prepare: the graphs and a manifest on disk, and a process in which `import torch` fails
    task, graphs = cnn()
    data = task.train_data().take(slice(0, 40))
    (tmp_path / "train.onnx").write_bytes(graphs.train_onnx)
    (tmp_path / "eval.onnx").write_bytes(graphs.eval_onnx)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest_of(graphs)))
    np.savez(tmp_path / "data.npz", x=data.inputs[0], y=data.targets,
             **{f"w{i}": a for i, a in enumerate(weights_of(seeded_model(task, 0)).values())})
    names = list(weights_of(seeded_model(task, 0)))
    script = f"""
import sys, json
sys.modules['torch'] = None  # any import of torch now raises ImportError
from pathlib import Path
import numpy as np
from fedge.edge.trainer import OnnxTrainer
import fedge.edge.training_bundle
d = Path({str(tmp_path)!r})
arrays = np.load(d / "data.npz")
weights = {{name: arrays[f"w{{i}}"] for i, name in enumerate({names!r})}}
trainer = OnnxTrainer((d / "train.onnx").read_bytes(), (d / "eval.onnx").read_bytes(),
                      json.loads((d / "manifest.json").read_text()))
new, stats = trainer.train(weights, [arrays["x"]], arrays["y"], epochs=1, batch_size=16, learning_rate=0.05,
                           momentum=0.9, seed=0)
print(stats.steps, sorted(trainer.evaluate(new, [arrays["x"]], arrays["y"])), "torch" in sys.modules and
      sys.modules["torch"] is not None)
"""
    # Execute
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    # Assert
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[-2] == "3 ['accuracy', 'loss'] False"
