"""FedAvgM."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvgM as FlowerFedAvgM
from numpy.typing import NDArray

from fedge import knobs
from fedge.aggregate import State, fedavgm_step, with_statistics
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.flower_args import RuleSetting, flower_constructor
from fedge.strategies.registry import register
from fedge.strategies.rule import Arrays, LinearRule


class Momentum(LinearRule):
    """FedAvg's mean, then one server momentum step (Hsu et al., 2019).

    The velocity is rule state: checkpointed and restored on resume. With momentum 0 and
    learning rate 1 the step is FedAvg's mean, which needs no global model.
    """

    state_prefixes = ("velocity/",)

    def __init__(self, *, server_learning_rate: float = 1.0, server_momentum: float = 0.0) -> None:
        super().__init__()
        self.server_learning_rate, self.server_momentum = server_learning_rate, server_momentum
        self.velocity: State = {}
        self.needs_global_model = not (server_momentum == 0 and server_learning_rate == 1)

    def step(self, mean: Arrays) -> Arrays:
        """One momentum step from the global model (the mean itself when called without one)."""
        if not self.context.has_global_model:  # aggregate_train alone, with FedAvg's step (see above)
            return mean
        new, self.velocity = fedavgm_step(self.context.global_numpy(), mean, self.velocity,
                                          server_lr=self.server_learning_rate, momentum=self.server_momentum)
        return with_statistics(new, mean, self.context.statistics_of(mean))

    def state_dict(self) -> Arrays:  # noqa: D102
        return {f"velocity/{k}": v for k, v in self.velocity.items()}

    def load_state_dict(self, state: Mapping[str, NDArray[np.generic]]) -> None:  # noqa: D102
        self.velocity = {k.split("/", 1)[1]: np.asarray(v, np.float64) for k, v in state.items()}


@register("fedavgm", options=lambda c, n: {"server_learning_rate": float(c[knobs.SERVER_LEARNING_RATE]),
                                              "server_momentum": float(c[knobs.SERVER_MOMENTUM])})
@flower_constructor(FlowerFedAvgM)
class FedAvgM(FedAvg):
    """FedAvg with server momentum (Hsu et al., "Measuring the Effects of Non-Identical
    Data Distribution for Federated Visual Classification", 2019): :class:`FedAvg` with the
    :class:`Momentum` rule. With Flower's defaults (momentum 0, learning rate 1) it is FedAvg,
    and like Flower's it then aggregates without ``configure_train``.
    """

    rule: Momentum
    server_learning_rate = RuleSetting[float]()  # read at each step, as Flower's FedAvgM reads its own
    server_momentum = RuleSetting[float]()

    def __init__(self, *, server_learning_rate: float = 1.0, server_momentum: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(rule=Momentum(server_learning_rate=server_learning_rate, server_momentum=server_momentum),
                         **kwargs)

    @property
    def momentum_vector(self) -> list[NDArray[np.float64]] | None:
        """Flower's momentum buffer (``server_momentum * buffer + (old - new)``, in the model's array
        order; None before the first step): the negated velocity fedge keeps."""
        return [-velocity for velocity in self.rule.velocity.values()] or None

    @momentum_vector.setter
    def momentum_vector(self, vectors: list[NDArray[Any]] | None) -> None:
        if vectors is None:
            self.rule.velocity = {}
            return
        names = list(self.rule.velocity or (self.global_arrays or {}))
        if len(names) != len(vectors):
            raise ValueError(f"momentum_vector holds {len(vectors)} arrays for a model of {len(names)} "
                             "(set current_arrays first: its names order the buffer)")
        self.rule.velocity = {name: -np.asarray(vector, np.float64)
                              for name, vector in zip(names, vectors, strict=True)}

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FedAvg's, then, as Flower's FedAvgM, a server step's result is the model the next step
        starts from (:attr:`current_arrays`) until ``configure_train`` sends another."""
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None and self.rule.needs_global_model:
            self.global_arrays = arrays
        return arrays, metrics
