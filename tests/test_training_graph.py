"""Training graphs (issue 15): a task model's training step as plain ONNX, checked against torch.

For every built-in task model the exported step, run by onnxruntime with the numpy update
of :class:`fedge.edge.trainer.OnnxTrainer`, must end 20 SGD-with-momentum steps (batch 16)
within 1e-5 of torch's own ``train_local`` from the same weights on the same batches.
Layers the graph cannot reproduce are refused by name.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from fedge.batching import batch_order as torch_batches
from fedge.config import resolve_run_config
from fedge.edge.trainer import OnnxTrainer
from fedge.edge.training_graph import PARITY_TOLERANCE, TrainingGraphs, export_training_graphs
from fedge.errors import ExportError
from fedge.signature import InputSpec
from fedge.task.api import Task, TaskData, seeded_model
from fedge.task.loading import load_task
from fedge.task.models import model_arrays
from fedge.task.training import train_local

CPU = torch.device("cpu")
SAMPLE = 64
# run-config overrides of every built-in task model
MODELS: dict[str, dict[str, Any]] = {
    "digits-cnn": {"dataset": "digits", "model": "cnn"},
    "digits-mlp": {"dataset": "digits", "model": "mlp"},
    "digits-logreg": {"dataset": "digits", "model": "logreg"},
    "synthetic": {"dataset": "synthetic", "model": "mlp"},
    "chars": {"task": "chars"},
    "diabetes": {"task": "diabetes"},
}
FAST = {"digits-cnn"}  # the others take 10-30 s each on a 2-core machine
# The images ResNet is not here: its export takes minutes on 2 cores (the suite must fit CI's 30). Its
# single-step gradients match torch within 1e-6, but 20 steps of momentum SGD amplify float32 rounding ~3x
# a step (onnx and torch end 0.0099 apart); it passes the float64 rule (onnx 0.0064 from float64 training,
# torch 0.012), measured by bench/ondevice.py and tested below on the rule itself.
# The LSTM is unrolled over the sequence: the full 64-character export takes minutes on 2 cores
# (bench/ondevice.py measures it); here the same model trains on windows of 8 characters.
SEQUENCE = {"chars": 8}


def task_of(name: str) -> Task:
    return load_task(resolve_run_config(MODELS[name]))


def sample_of(task: Task, size: int = SAMPLE) -> TaskData:
    data = task.train_data().take(slice(0, size))
    length = SEQUENCE.get(task.name)
    if length is None:
        return data
    return TaskData(tuple(array[:, :length] for array in data.inputs), data.targets[:, :length])


@functools.cache
def exported(name: str) -> tuple[TrainingGraphs, float]:
    """The model's training graphs (from seed 0 weights, 64 examples) and the seconds the export took."""
    task = task_of(name)
    data = sample_of(task)
    start = time.perf_counter()
    graphs = export_training_graphs(seeded_model(task, 0), task.loss, data.inputs, data.targets, inputs=task.inputs)
    return graphs, time.perf_counter() - start


def manifest_of(graphs: TrainingGraphs, metrics: tuple[str, ...] = ("loss", "accuracy")) -> dict[str, Any]:
    """What a training bundle's manifest says about the graphs (as the trainer reads it)."""
    return {"state": [entry.manifest() for entry in graphs.state], "inputs": [s.manifest() for s in graphs.inputs],
            "targets": {"shape": list(graphs.target_shape), "dtype": graphs.target_dtype}, "metrics": list(metrics)}


def torch_order(size: int, batch_size: int, seed: int, epochs: int, max_steps: int | None) -> list[np.ndarray]:
    """The batches ``train_local`` draws, as index arrays."""
    return list(torch_batches(size, batch_size, seed, epochs, max_steps))


def weights_of(model: nn.Module) -> dict[str, np.ndarray]:
    return {name: array.numpy().copy() for name, array in model_arrays(model).items()}


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)), initial=0.0)) for k in a)


def _params(name: str) -> Any:
    return pytest.param(name, marks=() if name in FAST else pytest.mark.slow, id=name)


# --------------------------------------------------------------------------- parity, every built-in model


@pytest.mark.parametrize("name", [_params(name) for name in MODELS])
def test_every_built_in_model_trains_on_onnxruntime_as_on_torch(name: str) -> None:
    # Prepare: the model's graphs, and the same weights and data for both trainers
    graphs, seconds = exported(name)
    task = task_of(name)
    data = sample_of(task)
    model = seeded_model(task, 0)
    start = weights_of(model)
    batches = torch_order(len(data), 16, seed=3, epochs=1, max_steps=20)
    trainer = OnnxTrainer(graphs.train_onnx, graphs.eval_onnx, manifest_of(graphs))
    # Execute: 20 steps of SGD with momentum on each side
    torch_stats = train_local(task, model, data, epochs=1, batch_size=16, learning_rate=0.05, momentum=0.9,
                              device=CPU, seed=3, max_steps=20)
    onnx_weights, onnx_stats = trainer.train(start, data.inputs, data.targets, epochs=1, batch_size=16,
                                             learning_rate=0.05, momentum=0.9, seed=0, batches=batches)
    # Assert: weights, loss and counts agree; the export's own check agrees too
    diff = max_diff(onnx_weights, weights_of(model))
    print(f"{name}: parity {diff:.2e} (export's {graphs.max_abs_diff:.2e}), train.onnx "
          f"{len(graphs.train_onnx) / 1024:.1f} KB, eval.onnx {len(graphs.eval_onnx) / 1024:.1f} KB, "
          f"export {seconds:.0f} s")
    assert diff <= PARITY_TOLERANCE
    assert graphs.max_abs_diff <= PARITY_TOLERANCE
    assert onnx_stats.loss == pytest.approx(torch_stats.loss, abs=1e-5)
    assert (onnx_stats.steps, onnx_stats.samples_processed) == (torch_stats.steps, torch_stats.samples_processed)


# --------------------------------------------------------------------------- the graphs themselves


def test_graph_inputs_and_outputs_are_named_as_documented() -> None:
    # Prepare
    graphs, _ = exported("digits-cnn")
    # Execute
    train, evaluation = onnx.load_from_string(graphs.train_onnx), onnx.load_from_string(graphs.eval_onnx)
    # Assert: state (weights and buffers) in state_dict order, the task inputs, targets; loss then gradients
    expected_inputs = [f"state:{e.name}" for e in graphs.state] + ["input", "targets"]
    assert [value.name for value in train.graph.input] == expected_inputs
    assert [value.name for value in evaluation.graph.input] == expected_inputs
    assert [value.name for value in train.graph.output] == ["loss"] + [f"grad:{e.name}" for e in graphs.state
                                                                       if e.trainable]
    assert [value.name for value in evaluation.graph.output] == ["loss", "output"]
    assert [e.name for e in graphs.state] == list(seeded_model(task_of("digits-cnn"), 0).state_dict())
    batch_axis = train.graph.input[-1].type.tensor_type.shape.dim[0]
    assert batch_axis.dim_param == "batch"
    assert graphs.target_shape == ("batch",) and graphs.target_dtype == "int64"


def test_graphs_are_small_and_free_of_weights_and_stack_traces() -> None:
    # Prepare
    graphs, _ = exported("digits-cnn")
    # Execute
    train = onnx.load_from_string(graphs.train_onnx)
    # Assert: a few KB (weights travel separately), no per-node metadata, no weight-sized constant
    assert len(graphs.train_onnx) < 32 * 1024 and len(graphs.eval_onnx) < 16 * 1024
    assert not any(node.metadata_props or node.doc_string for node in train.graph.node)
    largest_weight = max(int(np.prod(e.shape)) for e in graphs.state)
    assert all(int(np.prod(t.dims)) < largest_weight for t in train.graph.initializer)


@pytest.mark.parametrize("batch", [1, 7, 32])
def test_any_batch_size_gives_torch_gradients(batch: int) -> None:
    # Prepare: the graphs were traced on another batch size
    graphs, _ = exported("digits-cnn")
    task = task_of("digits-cnn")
    data = task.train_data().take(slice(100, 100 + batch))
    model = seeded_model(task, 0)
    trainer = OnnxTrainer(graphs.train_onnx, graphs.eval_onnx, manifest_of(graphs))
    # Execute
    loss, grads = trainer.gradients(weights_of(model), data.inputs, data.targets)
    expected = task.loss(model(torch.from_numpy(data.inputs[0])), torch.from_numpy(data.targets))
    expected.backward()
    # Assert
    assert loss == pytest.approx(float(expected), abs=1e-6)
    for name, param in model.named_parameters():
        assert param.grad is not None
        np.testing.assert_allclose(grads[name], param.grad.numpy(), atol=1e-6)


# --------------------------------------------------------------------------- refusals


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


class WithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.drop, self.out = nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.hidden(x))))  # type: ignore[no-any-return]


@torch.library.custom_op("fedge_training_test::odd", mutates_args=())
def _odd(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_odd.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_odd.register_autograd(lambda ctx, grad: grad * 2)


class Odd(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _odd(x)  # type: ignore[no-any-return]


class WithCustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.weird, self.last = nn.Linear(4, 8), Odd(), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.weird(self.first(x)))  # type: ignore[no-any-return]


def _export_small(model: nn.Module) -> TrainingGraphs:
    rng = np.random.default_rng(0)
    x = rng.random((20, 4), dtype=np.float32)
    y = rng.integers(0, 3, 20)
    return export_training_graphs(model, nn.functional.cross_entropy, [x], y, inputs=[InputSpec("x", ("batch", 4))])


def test_batchnorm_in_training_mode_is_refused_naming_the_layer() -> None:
    # Prepare
    model = WithBatchNorm()
    # Execute / Assert: its running statistics would freeze on the device
    with pytest.raises(ExportError, match=r"layer 'net\.1' \(BatchNorm1d\).*running statistics.*GroupNorm"):
        _export_small(model)


def test_dropout_is_refused_naming_the_layer() -> None:
    # Prepare
    model = WithDropout()
    # Execute / Assert
    with pytest.raises(ExportError, match=r"layer 'drop' \(Dropout\).*random"):
        _export_small(model)


def test_a_layer_whose_backward_cannot_be_traced_is_refused_naming_the_layer() -> None:
    # Prepare: a custom op whose autograd formula torch.func cannot trace
    model = WithCustomOp()
    # Execute / Assert
    with pytest.raises(ExportError, match=r"layer 'weird' \(Odd\).*fedge_training_test.odd"):
        _export_small(model)


@pytest.mark.parametrize(("drift", "signed"), [((6.4e-3, 1.2e-2), True), ((3.0e-2, 1.2e-2), False)],
                         ids=["closer-to-float64-than-torch", "further-than-twice-torch"])
def test_past_1e5_a_graph_is_signed_only_if_it_tracks_float64_training_as_torch_does(
        drift: tuple[float, float], signed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the parity check reports the images ResNet's numbers (0.0099 apart after 20 steps) with
    # onnx's and torch's distances from the same training in float64
    import fedge.edge.training_graph as training_graph

    monkeypatch.setattr(training_graph, "_parity", lambda *args, **kwargs: (9.9e-3, drift))
    task = task_of("digits-logreg")
    data = sample_of(task)

    def export() -> TrainingGraphs:
        return export_training_graphs(seeded_model(task, 0), task.loss, data.inputs, data.targets,
                                      inputs=task.inputs)

    # Execute / Assert: within 2x torch's own float32 distance it is signed and the numbers recorded
    if signed:
        graphs = export()
        assert graphs.max_abs_diff == 9.9e-3 and graphs.float64_drift == drift
    else:
        with pytest.raises(ExportError, match="from exact .float64. training"):
            export()
