"""FedAdam."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedge.aggregate import State, adaptive_step, with_statistics
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.registry import register
from fedge.strategies.validation import AcceptedUpdate


@register("fedadam", options=lambda c, n: {"server_learning_rate": float(c["adaptive-learning-rate"])})
class FedAdam(FedAvg):
    """FedAdam (Reddi et al., "Adaptive Federated Optimization", ICLR 2021).

    FedAvg's mean gives the pseudo-gradient; the server applies an Adam step. The
    moment estimates are strategy state (checkpointed, restored on resume).
    Subclasses change :attr:`rule` (see :class:`~fedge.strategies.FedYogi`).
    """

    rule = "adam"

    def __init__(self, *, server_learning_rate: float = 0.01, beta1: float = 0.9, beta2: float = 0.99,
                 tau: float = 1e-3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.server_learning_rate, self.beta1, self.beta2, self.tau = server_learning_rate, beta1, beta2, tau
        self.first: State = {}
        self.second: State = {}

    def aggregate_updates(self, updates: Iterator[AcceptedUpdate]) -> dict[str, NDArray[np.generic]] | None:
        """FedAvg's mean, then one adaptive server step."""
        average = super().aggregate_updates(updates)
        if average is None:
            return None
        new, self.first, self.second = adaptive_step(
            self.global_numpy(), average, self.first, self.second, server_lr=self.server_learning_rate,
            beta1=self.beta1, beta2=self.beta2, tau=self.tau, rule=self.rule)
        return with_statistics(new, average, self.statistics_of(average))

    def state_dict(self) -> dict[str, NDArray[np.generic]]:  # noqa: D102
        return {**{f"m/{k}": v for k, v in self.first.items()}, **{f"v/{k}": v for k, v in self.second.items()}}

    def load_state_dict(self, state: dict[str, NDArray[np.generic]]) -> None:  # noqa: D102
        self.first = {k[2:]: np.asarray(v, np.float64) for k, v in state.items() if k.startswith("m/")}
        self.second = {k[2:]: np.asarray(v, np.float64) for k, v in state.items() if k.startswith("v/")}
