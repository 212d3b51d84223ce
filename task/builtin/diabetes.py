"""The ``diabetes`` task: regression of disease progression on scikit-learn's bundled diabetes data.

Data
----
Efron, Hastie, Johnstone and Tibshirani, "Least Angle Regression", Annals of Statistics
32(2), 2004: 442 diabetes patients, ten baseline measurements (age, sex, body mass index,
average blood pressure and six blood serum measurements s1..s6) and a quantitative
measure of disease progression one year later (25 to 346). scikit-learn ships it as
``datasets/data/diabetes_data_raw.csv.gz`` (space-separated, unscaled) and
``diabetes_target.csv.gz``; they are read here with numpy, as
:func:`fedge.task.data.load_digits_arrays` reads the digits, since importing scikit-learn
costs about a second per process.

A seeded ``test-fraction`` of the patients (default 0.2: 354 training, 88 test) is the
coordinator's central test set. Features are standardised with the training split's
means and standard deviations, and the target likewise (``(y - mean) / std``), so an MSE
of 1 is what predicting the training mean scores; ``preprocessing`` records both
transforms, and :meth:`Diabetes.device_data` applies them to a real device's raw file.

Model and metrics
-----------------
An MLP (10 -> 32 -> ReLU -> 1; 385 parameters): the data are small and nearly linear
(Efron et al.'s models are linear), so a bigger model gains nothing. The loss and the
headline are the mean squared error (lower is better) of the scaled target; metrics add
the mean absolute error and R^2 = 1 - MSE / Var(y). R^2 is not a mean over examples, so
:meth:`Diabetes.metrics` reports the batch means of ``y`` and ``y^2`` and
:meth:`Diabetes.summarize` forms ``Var(y) = E[y^2] - E[y]^2`` from their example-weighted
means, which makes it exact over any batching of the evaluated set (then drops the two
helper entries): exact for the coordinator's central evaluation, while an average of
devices' own R^2 (federated evaluation) is only an approximation of the fleet's.

Partitions
----------
fedge's ``dirichlet`` partitioner skews class labels, which a regression target has not.
Here it skews the target instead: the training targets are cut into :data:`BINS`
quantile bins, each device draws its mix of bins from Dirichlet(``dirichlet-alpha``)
(as Hsu et al., 2019, draw each device's class mix) and is dealt near-equal numbers of
examples, each from a bin drawn from its mix among the bins not yet used up; so some
devices hold mostly mild cases and others mostly severe ones. Devices dealt last get
what is left, so their skew is weaker. ``partitioner = "iid"`` deals examples at random.
Either way every training example lands on exactly one device.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from fedge import knobs
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.signature import InputSpec
from fedge.task.api import Task, TaskData
from fedge.task.data import check_partitionable
from fedge.task.registry import register_task

FEATURES = ("age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6")
HIDDEN = 32
BINS = 5


def load_diabetes_arrays() -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The 442 raw feature rows ``(442, 10)`` and targets ``(442,)`` that scikit-learn ships.

    Raises
    ------
    ConfigError
        If scikit-learn is not installed.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("task 'diabetes' reads scikit-learn's bundled data; pip install scikit-learn")
    folder = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data"
    return np.loadtxt(folder / "diabetes_data_raw.csv.gz"), np.loadtxt(folder / "diabetes_target.csv.gz")


@dataclass(frozen=True)
class Scaling:
    """Standardisation of the features and of the target, fitted on training examples."""

    mean: NDArray[np.float64]
    std: NDArray[np.float64]
    target_mean: float
    target_std: float

    @classmethod
    def fit(cls, x: NDArray[np.float64], y: NDArray[np.float64]) -> Scaling:
        """Means and standard deviations of ``x``'s columns and of ``y``."""
        return cls(x.mean(axis=0), x.std(axis=0), float(y.mean()), float(y.std()))

    def apply(self, x: NDArray[Any], y: NDArray[Any]) -> TaskData:
        """Standardised float32 features and targets."""
        return TaskData.from_xy(((x - self.mean) / self.std).astype(np.float32),
                                ((y - self.target_mean) / self.target_std).astype(np.float32))

    def describe(self) -> dict[str, Any]:
        """The task's ``preprocessing`` entry (JSON numbers, for bundles)."""
        return {"kind": "standardize", "features": list(FEATURES), "mean": self.mean.tolist(),
                "std": self.std.tolist(), "target_mean": self.target_mean, "target_std": self.target_std,
                "description": "each raw feature minus 'mean', divided by 'std' (per feature, training split); "
                               "the model predicts (progression - target_mean) / target_std"}


def quantile_skew(targets: NDArray[Any], num_partitions: int, alpha: float, seed: int,
                  bins: int = BINS) -> list[NDArray[np.int64]]:
    """Example indices per device, skewed by target quantile bin (see the module docstring).

    Raises
    ------
    ConfigError
        If there are more devices than examples.
    """
    check_partitionable(len(targets), num_partitions)
    rng = np.random.default_rng(seed)
    edges = np.quantile(targets, np.linspace(0, 1, bins + 1)[1:-1])
    bin_of = np.searchsorted(edges, targets, side="right")
    pools = [list(rng.permutation(np.flatnonzero(bin_of == index))) for index in range(bins)]
    mixes = rng.dirichlet([alpha] * bins, size=num_partitions)
    sizes = [len(part) for part in np.array_split(np.arange(len(targets)), num_partitions)]
    shards = []
    for mix, size in zip(mixes, sizes, strict=True):
        taken = []
        for _ in range(size):
            left = np.array([len(pool) > 0 for pool in pools], dtype=np.float64)
            weights = mix * left if (mix * left).sum() > 0 else left
            taken.append(pools[int(rng.choice(bins, p=weights / weights.sum()))].pop())
        shards.append(np.sort(np.array(taken, dtype=np.int64)))
    return shards


class MLP(nn.Module):
    """``10 -> 32 -> ReLU -> 1``: the scaled progression, ``(batch, 1)``."""

    def __init__(self, features: int = len(FEATURES), hidden: int = HIDDEN) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.layers(features)  # type: ignore[no-any-return]


@register_task("diabetes")
class Diabetes(Task):
    """Disease progression from ten baseline measurements (Efron et al. 2004), MSE headline (see the module)."""

    name = "diabetes"
    headline, higher_is_better = "mse", False
    inputs = (InputSpec("features", ("batch", len(FEATURES))),)
    labels = None
    output = ("predicted disease progression one year after baseline (scaled): times preprocessing's target_std, "
              "plus its target_mean, gives the progression measure (25..346)")
    target_dtype = "float32"

    def __init__(self, config: RunConfig) -> None:
        self.seed = config.integer(knobs.SEED)
        self.test_fraction = config.number(knobs.TEST_FRACTION)
        self._shards: dict[tuple[int, float, int], list[NDArray[np.int64]]] = {}

    @cached_property
    def prepared(self) -> tuple[Scaling, TaskData, TaskData]:
        """(the scaling fitted on the training split, training data, held-out data), scaled."""
        x, y = load_diabetes_arrays()
        order = np.random.default_rng(self.seed).permutation(len(y))
        held_out = int(round(len(y) * self.test_fraction))
        test, train = order[:held_out], order[held_out:]
        scaling = Scaling.fit(x[train], y[train])
        return scaling, scaling.apply(x[train], y[train]), scaling.apply(x[test], y[test])

    @property
    def preprocessing(self) -> dict[str, Any]:  # type: ignore[override]
        return self.prepared[0].describe()

    def build_model(self) -> nn.Module:  # noqa: D102
        return MLP()

    def train_data(self) -> TaskData:  # noqa: D102
        return self.prepared[1]

    def central_data(self) -> TaskData | None:  # noqa: D102
        return self.prepared[2] if len(self.prepared[2]) else None

    def partition(self, partition_id: int, num_partitions: int, config: RunConfig) -> TaskData:
        """Device ``partition_id``'s examples: IID, or skewed by target quantile for ``dirichlet``."""
        if config.text(knobs.PARTITIONER) == "iid":
            return super().partition(partition_id, num_partitions, config)
        key = (num_partitions, config.number(knobs.DIRICHLET_ALPHA), config.integer(knobs.SEED))
        if key not in self._shards:
            self._shards[key] = quantile_skew(self.train_data().targets, *key)
        return self.train_data().take(self._shards[key][partition_id])

    def device_data(self, path: str) -> TaskData:
        """A real device's raw measurements and progression (.npz or .csv), scaled like the training data."""
        raw = super().device_data(path)
        return self.prepared[0].apply(raw.inputs[0].astype(np.float64), raw.targets.astype(np.float64))

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return nn.functional.mse_loss(outputs.squeeze(-1), targets)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """Batch means: ``mse``, ``mae``, and ``target_mean``/``target_square`` for :meth:`summarize`'s R^2."""
        error = outputs.squeeze(-1) - targets
        return {"mse": float((error**2).mean()), "mae": float(error.abs().mean()),
                "target_mean": float(targets.double().mean()), "target_square": float((targets.double() ** 2).mean())}

    def summarize(self, metrics: dict[str, float]) -> dict[str, float]:
        """Replaces the helper means by ``r2`` = 1 - mse / (E[y^2] - E[y]^2) (absent when the targets barely vary)."""
        if "target_mean" not in metrics or "target_square" not in metrics:
            return metrics
        summary = {name: value for name, value in metrics.items() if name not in ("target_mean", "target_square")}
        variance = metrics["target_square"] - metrics["target_mean"] ** 2
        if variance > 1e-6 * metrics["target_square"] and "mse" in summary:
            summary["r2"] = 1.0 - summary["mse"] / variance
        return summary
