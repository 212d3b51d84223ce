"""FedAvgM."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from flwr.serverapp.strategy import FedAvgM as FlowerFedAvgM
from numpy.typing import NDArray

from fedge.aggregate import State, fedavgm_step, with_statistics
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.flower_args import flower_constructor
from fedge.strategies.registry import register
from fedge.strategies.validation import AcceptedUpdate


@register("fedavgm", options=lambda c, n: {"server_learning_rate": float(c["server-learning-rate"]),
                                              "server_momentum": float(c["server-momentum"])})
@flower_constructor(FlowerFedAvgM)
class FedAvgM(FedAvg):
    """FedAvg with server momentum (Hsu et al., "Measuring the Effects of Non-Identical
    Data Distribution for Federated Visual Classification", 2019).

    The velocity is strategy state: it is checkpointed and restored on resume. With Flower's
    defaults (momentum 0, learning rate 1) it is FedAvg, and like Flower's it then aggregates
    without ``configure_train``.
    """

    def __init__(self, *, server_learning_rate: float = 1.0, server_momentum: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.server_learning_rate, self.server_momentum = server_learning_rate, server_momentum
        self.velocity: State = {}
        # steps from the global model configure_train sent, unless the step is FedAvg's mean
        self.needs_global_model = not (server_momentum == 0 and server_learning_rate == 1)

    def aggregate_updates(self, updates: Iterator[AcceptedUpdate]) -> dict[str, NDArray[np.generic]] | None:
        """FedAvg's mean, then one server momentum step."""
        average = super().aggregate_updates(updates)
        if average is None or self.global_arrays is None:  # None: called alone, with FedAvg's step (see above)
            return average
        new, self.velocity = fedavgm_step(self.global_numpy(), average, self.velocity,
                                          server_lr=self.server_learning_rate, momentum=self.server_momentum)
        return with_statistics(new, average, self.statistics_of(average))

    def state_dict(self) -> dict[str, NDArray[np.generic]]:  # noqa: D102
        return {f"velocity/{k}": v for k, v in self.velocity.items()}

    def load_state_dict(self, state: dict[str, NDArray[np.generic]]) -> None:  # noqa: D102
        self.velocity = {k.split("/", 1)[1]: np.asarray(v, np.float64) for k, v in state.items()}
