"""FedAdam."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.serverapp.strategy import FedAdam as FlowerFedAdam
from numpy.typing import NDArray

from fedge import knobs
from fedge.aggregate import State, adaptive_step, with_statistics
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.flower_args import RuleSetting, flower_constructor
from fedge.strategies.registry import register
from fedge.strategies.rule import Arrays, LinearRule


class Adaptive(LinearRule):
    """FedAvg's mean as the pseudo-gradient, then one adaptive server step (Reddi et al., ICLR 2021).

    ``kind`` is the second-moment update: ``"adam"``, ``"yogi"`` or ``"adagrad"``. The moment
    estimates are rule state (checkpointed as ``m/<name>`` and ``v/<name>``, restored on resume).
    """

    needs_global_model = True  # steps from the global model configure_train sent

    state_prefixes = ("m/", "v/")

    def __init__(self, *, kind: str = "adam", server_learning_rate: float = 0.1, beta1: float = 0.9,
                 beta2: float = 0.99, tau: float = 1e-3) -> None:
        super().__init__()
        self.kind, self.server_learning_rate, self.beta1, self.beta2, self.tau = (
            kind, server_learning_rate, beta1, beta2, tau)
        self.first: State = {}
        self.second: State = {}

    def step(self, mean: Arrays) -> Arrays:
        """One adaptive step from the global model along the mean's pseudo-gradient."""
        new, self.first, self.second = adaptive_step(
            self.context.global_numpy(), mean, self.first, self.second, server_lr=self.server_learning_rate,
            beta1=self.beta1, beta2=self.beta2, tau=self.tau, rule=self.kind)
        return with_statistics(new, mean, self.context.statistics_of(mean))

    def state_dict(self) -> Arrays:  # noqa: D102
        return {**{f"m/{k}": v for k, v in self.first.items()}, **{f"v/{k}": v for k, v in self.second.items()}}

    def load_state_dict(self, state: Mapping[str, NDArray[np.generic]]) -> None:  # noqa: D102
        self.first = {k[2:]: np.asarray(v, np.float64) for k, v in state.items() if k.startswith("m/")}
        self.second = {k[2:]: np.asarray(v, np.float64) for k, v in state.items() if k.startswith("v/")}


@register("fedadam", options=lambda c, n: {"server_learning_rate": float(c[knobs.ADAPTIVE_LEARNING_RATE])})
@flower_constructor(FlowerFedAdam, eta="server_learning_rate", beta_1="beta1", beta_2="beta2")
class FedAdam(FedAvg):
    """FedAdam (Reddi et al., "Adaptive Federated Optimization", ICLR 2021): :class:`FedAvg`
    with the :class:`Adaptive` rule. Subclasses change :attr:`kind` (see
    :class:`~fedge.strategies.FedYogi`).

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

    kind = "adam"
    rule: Adaptive
    current_arrays_as_numpy = True  # as Flower's FedOpt keeps it

    # The step's settings, read at each step (as Flower's are), under fedge's names and Flower's
    server_learning_rate = RuleSetting[float]()
    eta = RuleSetting[float]("server_learning_rate")
    beta1 = RuleSetting[float]()
    beta_1 = RuleSetting[float]("beta1")
    beta2 = RuleSetting[float]()
    beta_2 = RuleSetting[float]("beta2")
    tau = RuleSetting[float]()

    def __init__(self, *, server_learning_rate: float = 0.1, eta_l: float = 0.1, beta1: float = 0.9,
                 beta2: float = 0.99, tau: float = 1e-3, **kwargs: Any) -> None:
        super().__init__(rule=Adaptive(kind=self.kind, server_learning_rate=server_learning_rate, beta1=beta1,
                                       beta2=beta2, tau=tau), **kwargs)
        self.eta_l = eta_l

    @property
    def m_t(self) -> dict[str, NDArray[np.float64]] | None:
        """Flower's first moment (None before the first step)."""
        return dict(self.rule.first) or None

    @m_t.setter
    def m_t(self, moments: Mapping[str, NDArray[Any]] | None) -> None:
        self.rule.first = {name: np.asarray(value, np.float64) for name, value in (moments or {}).items()}

    @property
    def v_t(self) -> dict[str, NDArray[np.float64]] | None:
        """Flower's second moment (None before the first step; fedge's starts at ``tau**2``)."""
        return dict(self.rule.second) or None

    @v_t.setter
    def v_t(self, moments: Mapping[str, NDArray[Any]] | None) -> None:
        self.rule.second = {name: np.asarray(value, np.float64) for name, value in (moments or {}).items()}
