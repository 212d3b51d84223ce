"""FedAdam."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from flwr.serverapp.strategy import FedAdam as FlowerFedAdam
from numpy.typing import NDArray

from fedge.aggregate import State, adaptive_step, with_statistics
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.flower_args import flower_constructor
from fedge.strategies.registry import register
from fedge.strategies.validation import AcceptedUpdate


@register("fedadam", options=lambda c, n: {"server_learning_rate": float(c["adaptive-learning-rate"])})
@flower_constructor(FlowerFedAdam, eta="server_learning_rate", beta_1="beta1", beta_2="beta2")
class FedAdam(FedAvg):
    """FedAdam (Reddi et al., "Adaptive Federated Optimization", ICLR 2021).

    FedAvg's mean gives the pseudo-gradient; the server applies an Adam step. The
    moment estimates are strategy state (checkpointed, restored on resume).
    Subclasses change :attr:`rule` (see :class:`~fedge.strategies.FedYogi`).

    Takes Flower's ``FedAdam`` call as well (``eta``, ``eta_l``, ``beta_1``, ``beta_2``, ``tau``
    and Flower's defaults, :mod:`fedge.strategies.flower_args`); fedge's run config sets
    ``adaptive-learning-rate`` instead. The step is the paper's: ``v`` starts at ``tau**2`` and
    there is no bias correction (Flower's ``FedAdam`` starts ``v`` at 0 and corrects the bias).

    Parameters
    ----------
    server_learning_rate : float
        eta, the server's step size (Flower's ``eta``).
    eta_l : float
        The devices' learning rate, kept for Flower's signature (devices read their own).
    beta1, beta2 : float
        Moment decay rates (Flower's ``beta_1``, ``beta_2``).
    tau : float
        Adaptivity: the smallest root second moment.
    """

    rule = "adam"

    needs_global_model = True  # steps from the global model configure_train sent

    def __init__(self, *, server_learning_rate: float = 0.1, eta_l: float = 0.1, beta1: float = 0.9,
                 beta2: float = 0.99, tau: float = 1e-3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.eta_l = eta_l
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
