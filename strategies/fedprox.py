"""FedProx."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedProx as FlowerFedProx

from fedge import knobs
from fedge.errors import ConfigError
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.flower_args import flower_constructor
from fedge.strategies.registry import register
from fedge.wire import PROXIMAL_MU


@register("fedprox", dp=True, options=lambda c, n: {"proximal_mu": float(c[knobs.PROXIMAL_MU])})
@flower_constructor(FlowerFedProx)
class FedProx(FedAvg):
    """FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

    Aggregates like FedAvg; each device adds ``mu/2 ||w - w_global||^2`` to its local loss
    (fedge's client SDK reads ``proximal-mu`` from the train instruction), which keeps
    local models near the global one when devices do unequal amounts of work.

    Parameters
    ----------
    proximal_mu : float
        mu >= 0 (0, Flower's default, is FedAvg; fedge's run config defaults to ``proximal-mu``).
    """

    keeps_partial_work = True

    def __init__(self, *, proximal_mu: float = 0.0, **kwargs: Any) -> None:
        if proximal_mu < 0:
            raise ConfigError(f"proximal-mu = {proximal_mu}: give 0 (plain FedAvg) or more")
        super().__init__(**kwargs)
        self.proximal_mu = proximal_mu

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's instructions, carrying ``proximal-mu``."""
        config[PROXIMAL_MU] = self.proximal_mu
        return super().configure_train(server_round, arrays, config, grid)
