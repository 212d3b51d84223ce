"""Built-in models (all take flat feature vectors) and torch <-> Flower array helpers."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
from flwr.app import ArrayRecord
from torch import nn

from fedge.errors import CheckpointMismatch, ConfigError

# Models by run-config name (``model = "<name>"``); a model registers itself with
# :func:`register_model`, so adding one is one class.
MODELS: dict[str, type[nn.Module]] = {}
M = TypeVar("M", bound=type[nn.Module])


def register_model(name: str) -> Callable[[M], M]:
    """Class decorator: make ``cls(num_features, num_classes)`` the model ``name``."""
    def decorate(cls: M) -> M:
        if name in MODELS and MODELS[name] is not cls:
            raise ConfigError(f"two models registered as '{name}': {MODELS[name].__name__} and {cls.__name__}")
        MODELS[name] = cls
        return cls
    return decorate


@register_model("logreg")
class LogReg(nn.Module):
    """Multinomial logistic regression (the FedProx paper's Synthetic model)."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(num_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)  # type: ignore[no-any-return]


@register_model("mlp")
class MLP(nn.Module):
    """Two-layer perceptron: features -> hidden -> classes."""

    def __init__(self, num_features: int, num_classes: int, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(num_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


@register_model("cnn")
class SmallCNN(nn.Module):
    """A small CNN for square single-channel images given as flat vectors (digits: 8x8)."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        super().__init__()
        side = math.isqrt(num_features)
        if side * side != num_features or side % 2:
            raise ConfigError(
                f"model 'cnn' needs square images with an even side; {num_features} features"
                " are not; use model='mlp'"
            )
        self.side = side
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * (side // 2) ** 2, 64), nn.ReLU(), nn.Linear(64, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.reshape(-1, 1, self.side, self.side)))  # type: ignore[no-any-return]


def model_class(name: str) -> type[nn.Module]:
    """The model registered as ``name``.

    Raises
    ------
    ConfigError
        Naming the registered models.
    """
    if name not in MODELS:
        raise ConfigError(f"run-config 'model' = {name!r} is not a registered model; use one of: "
                          f"{', '.join(MODELS)}")
    return MODELS[name]


def build_model(name: str, num_features: int, num_classes: int, *, seed: int | None = None) -> nn.Module:
    """Instantiate a registered model; ``seed`` makes its initial weights reproducible."""
    cls = model_class(name)
    if seed is not None:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return cls(num_features, num_classes)  # type: ignore[call-arg]
    return cls(num_features, num_classes)  # type: ignore[call-arg]


def model_arrays(model: nn.Module) -> ArrayRecord:
    """The model's state as a Flower ArrayRecord (CPU, detached copies)."""
    return ArrayRecord({k: v.detach().cpu() for k, v in model.state_dict().items()})


def load_arrays(model: nn.Module, arrays: ArrayRecord, *, source: str = "arrays") -> None:
    """Load ``arrays`` into ``model``, refusing missing, extra or mis-shaped entries."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    given = {k: tuple(a.shape) for k, a in arrays.items()}
    if expected != given:
        missing = sorted(set(expected) - set(given))
        extra = sorted(set(given) - set(expected))
        shapes = sorted(k for k in set(expected) & set(given) if expected[k] != given[k])
        raise CheckpointMismatch(
            f"{source} do not match the model: missing {missing}, extra {extra}, "
            f"wrong shape {[(k, given[k], expected[k]) for k in shapes]}; run with the "
            "model/dataset settings the arrays were made with"
        )
    model.load_state_dict(arrays.to_torch_state_dict())
