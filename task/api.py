"""The Task API: the one object a user writes to federate their model and data.

A :class:`Task` declares how to build the model, where the data comes from (a simulated
device's partition, a real device's own files, optional central evaluation data), the loss,
the optimiser, the metrics (one of them the headline) and the input signature that ONNX
bundles carry. Every fedge feature (strategies, secure aggregation, DP, codecs, deadlines,
FedBuff, checkpoints, bundles, the dashboard) works through this object only, the way a
Flower app works through its task module.

Example
-------
>>> class Diabetes(Task):
...     name, headline, higher_is_better = "diabetes", "mse", False
...     inputs = (InputSpec("features", ("batch", 10)),)
...     def build_model(self): return torch.nn.Linear(10, 1)
...     def train_data(self): return TaskData.from_xy(x, y)
...     def loss(self, outputs, targets): return F.mse_loss(outputs.squeeze(-1), targets)
...     def metrics(self, outputs, targets): return {"mse": float(self.loss(outputs, targets))}
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.signature import InputSpec


@dataclass(frozen=True)
class TaskData:
    """A set of examples as arrays: one array per model input, and the targets.

    Every array has the examples on its first axis. Use :meth:`from_xy` for the common
    one-input case and :func:`fedge.task.loaders.from_dataset` for a torch ``Dataset``.
    """

    inputs: tuple[np.ndarray, ...]
    targets: np.ndarray

    def __post_init__(self) -> None:
        sizes = {len(array) for array in (*self.inputs, self.targets)}
        if not self.inputs or len(sizes) != 1:
            raise ConfigError(f"task data: inputs {[a.shape for a in self.inputs]} and targets "
                              f"{self.targets.shape} must hold the same number of examples on axis 0")

    @classmethod
    def from_xy(cls, x: np.ndarray, y: np.ndarray) -> TaskData:
        """One input ``x`` and targets ``y``."""
        return cls((np.asarray(x),), np.asarray(y))

    def __len__(self) -> int:
        return len(self.targets)

    def take(self, index: np.ndarray | slice) -> TaskData:
        """The examples at ``index`` (an index array or a slice)."""
        return TaskData(tuple(array[index] for array in self.inputs), self.targets[index])

    def tensors(self) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The arrays as torch tensors (shared memory where the dtype allows)."""
        return tuple(torch.as_tensor(array) for array in self.inputs), torch.as_tensor(self.targets)


def classification_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Mean cross-entropy and top-1 accuracy of class scores ``outputs`` (n, classes, ...)."""
    loss = nn.functional.cross_entropy(outputs, targets)
    correct = int((outputs.argmax(dim=1) == targets).sum())  # counted exactly, not as a float32 mean
    return {"loss": float(loss), "accuracy": correct / targets.numel()}


class Task:
    """A federated learning task. Subclass it and override what differs from the defaults.

    Class attributes
    ----------------
    name : str
        Shown in reports, bundles and the dashboard.
    headline : str
        The metric (a key of :meth:`metrics`) that plots, reports, targets and the dashboard show.
    higher_is_better : bool
        Whether a larger headline is better (accuracy) or worse (loss, MSE, perplexity).
    inputs : tuple[InputSpec, ...]
        The model's input signature (``model(*inputs)``), carried by ONNX bundles.
    labels : tuple[str, ...] | None
        Class names for classification tasks (bundles map scores to them); None otherwise.
    preprocessing : dict
        What a caller does to raw inputs before the model sees them, for bundles
        (``{"kind": "affine", "scale": s, "offset": o}`` is applied by ``EdgeModel``).
    output : str
        What the model's (first) output means, for bundles.
    target_dtype : str
        The targets' dtype: ``int64`` class indices by default, ``float32`` for regression.

    The defaults are those of classification: cross-entropy loss, accuracy as headline,
    fedge's SGD with momentum, partitions split from :meth:`train_data` by the run config's
    ``partitioner``. A task built from the run config is a function ``(RunConfig) -> Task``
    (see :func:`fedge.task.loading.load_task`).
    """

    name: str = "task"
    headline: str = "accuracy"
    higher_is_better: bool = True
    inputs: tuple[InputSpec, ...] = ()
    labels: tuple[str, ...] | None = None
    preprocessing: dict[str, Any] = {"kind": "none", "description": "inputs exactly as in the training data"}
    output: str = "unnormalised class scores; softmax gives probabilities"
    target_dtype: str = "int64"

    # ---- the model
    def build_model(self) -> nn.Module:
        """A new model with fresh initial weights; fedge seeds torch before calling it."""
        raise NotImplementedError(f"task '{self.name}' must define build_model() returning a torch nn.Module")

    # ---- data
    def train_data(self) -> TaskData:
        """All training examples, which simulation splits into device partitions (see :meth:`partition`)."""
        raise NotImplementedError(f"task '{self.name}' must define train_data() (pooled training examples for "
                                  "simulation) or override partition()")

    def central_data(self) -> TaskData | None:
        """Held-out examples the coordinator evaluates on after each round; None: federated evaluation."""
        return None

    def partition(self, partition_id: int, num_partitions: int, config: RunConfig) -> TaskData:
        """Simulated device ``partition_id``'s data: a shard of :meth:`train_data`.

        Split by the run config's ``partitioner`` (``iid``, or ``dirichlet`` label skew for
        integer class targets), seeded by ``seed``; computed once per process.
        """
        from fedge.task.partition import shard_of  # noqa: PLC0415 - keeps numpy-only users light

        return shard_of(self, partition_id, num_partitions, config)

    def device_data(self, path: str) -> TaskData:
        """A real device's own examples, from ``node_config["data-path"]`` (.npz with x, y or .csv)."""
        from fedge.task.loaders import load_file  # noqa: PLC0415

        return load_file(path, self)

    # ---- training and evaluation
    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss of a batch (mean over its examples)."""
        return nn.functional.cross_entropy(outputs, targets)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """Named metrics of one batch, as means over its examples (fedge weights batches by size)."""
        return classification_metrics(outputs, targets)

    def summarize(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics derived from the example-weighted means (e.g. perplexity = exp(loss))."""
        return metrics

    def optimizer(self, params: list[nn.Parameter], *, lr: float, momentum: float) -> Any:
        """The local optimiser: anything with ``step()`` (any ``torch.optim`` optimizer works)."""
        from fedge.task.training import MomentumSGD  # noqa: PLC0415

        return MomentumSGD(params, lr=lr, momentum=momentum)

    def forward(self, model: nn.Module, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The model's output on a batch of ``inputs``: ``model(*inputs)``."""
        return model(*inputs)  # type: ignore[no-any-return]

    # ---- export
    def calibration_data(self, size: int, seed: int) -> tuple[np.ndarray, ...]:
        """A seeded sample of training inputs, for int8 calibration of bundles."""
        data = self.train_data()
        pick = np.random.default_rng(seed).permutation(len(data))[:size]
        return tuple(array[pick] for array in data.inputs)

    def describe(self) -> str:
        """One line: name, inputs, headline."""
        inputs = ", ".join(spec.describe() for spec in self.inputs)
        better = "higher" if self.higher_is_better else "lower"
        return f"task '{self.name}': inputs {inputs}; headline {self.headline} ({better} is better)"


def seeded_model(task: Task, seed: int) -> nn.Module:
    """``task.build_model()`` with torch seeded by ``seed`` (the RNG state around it is kept)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return task.build_model()


def headline_of(metrics: dict[str, float], task: Task) -> float | None:
    """The headline metric's value in ``metrics``, or None when it is missing."""
    value = metrics.get(task.headline)
    return None if value is None else float(value)


def best(values: Iterable[float | None], task: Task) -> float | None:
    """The best headline value among ``values`` (None entries skipped)."""
    present = [value for value in values if value is not None]
    if not present:
        return None
    return max(present) if task.higher_is_better else min(present)
