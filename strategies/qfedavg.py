"""q-FedAvg."""

from __future__ import annotations

import logging
import math
from typing import Any

from flwr.serverapp.strategy import QFedAvg as FlowerQFedAvg

from fedge import knobs, wire
from fedge.aggregate import QFedAvgAccumulator, WeightedMeanAccumulator
from fedge.errors import ConfigError
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.flower_args import RuleSetting, flower_constructor
from fedge.strategies.registry import register
from fedge.strategies.rule import Arrays, RoundContext, Rule, Update

log = logging.getLogger("fedge.strategies")


class FairStep(Rule):
    """q-FedAvg's step (Li et al., ICLR 2020, Algorithm 2) over the updates that report their loss,
    streaming (:class:`fedge.aggregate.QFedAvgAccumulator`); statistics are averaged, never stepped.

    Not linear: each update is weighted by its own loss to the power ``q``.
    """

    def __init__(self, *, client_learning_rate: float, q: float, train_loss_key: str) -> None:
        super().__init__()
        self.client_learning_rate, self.q, self.train_loss_key = client_learning_rate, q, train_loss_key

    def begin(self, context: RoundContext) -> None:  # noqa: D102
        super().begin(context)
        self.step: QFedAvgAccumulator | None = None
        self.means = WeightedMeanAccumulator()

    def fold(self, update: Update) -> None:
        """Add ``update`` to the step, or leave it out (logged) without a usable loss."""
        if self.step is None:
            global_arrays = self.context.global_numpy()
            self.statistics = self.context.statistics_of(global_arrays)  # kept out of the step and its ||Delta||^2
            self.weights = [name for name in global_arrays if name not in self.statistics]
            self.step = QFedAvgAccumulator({name: global_arrays[name] for name in self.weights}, q=self.q,
                                           client_lr=self.client_learning_rate)
        loss = update.metrics.get(self.train_loss_key)
        if isinstance(loss, bool) or not isinstance(loss, int | float) or not math.isfinite(loss) or loss < 0:
            log.warning("qfedavg: node %d reported no usable '%s' (%r); its update is left out of the step",
                        update.node_id, self.train_loss_key, loss)
            return
        self.step.add({name: update.arrays[name] for name in self.weights}, float(loss))
        if self.statistics:
            self.means.add({name: update.arrays[name] for name in self.statistics}, update.weight)
        update.arrays.clear()

    def result(self) -> Arrays | None:  # noqa: D102
        if self.step is None or not self.step.count:
            return None
        return {**self.step.result(), **self.means.result()} if self.statistics else self.step.result()


@register("qfedavg", options=lambda c, n: {"client_learning_rate": float(c[knobs.LEARNING_RATE]),
                                           "q": float(c[knobs.QFEDAVG_Q]), "train_loss_key": wire.TRAIN_LOSS})
@flower_constructor(FlowerQFedAvg)
class QFedAvg(FedAvg):
    """q-FedAvg (Li et al., "Fair Resource Allocation in Federated Learning", ICLR 2020).

    Reweights devices by their training loss to the power ``q`` (a fairer spread of accuracy
    across devices; ``q = 0`` is FedAvg's objective), with the step size from
    ``client_learning_rate`` (``L = 1 / lr``), as Flower's ``QFedAvg``: the math is
    :class:`fedge.aggregate.QFedAvgAccumulator`, streaming. Takes Flower's call
    (``client_learning_rate`` first, ``q`` 0.1, ``train_loss_key`` ``"train_loss"``);
    fedge's runs read ``learning-rate``, ``qfedavg-q`` and fedge's ``train-loss``.
    BatchNorm statistics are averaged, never stepped.

    Parameters
    ----------
    client_learning_rate : float
        The devices' learning rate (> 0).
    q : float
        Fairness (>= 0).
    train_loss_key : str
        The train metric holding a device's loss; a reply without a finite one is left out of
        the step (logged), where Flower's would stop the round with an error.
    """

    # read at each step, as Flower's QFedAvg reads its own
    client_learning_rate = RuleSetting[float]()
    q = RuleSetting[float]()
    train_loss_key = RuleSetting[str]()

    def __init__(self, *, client_learning_rate: float, q: float = 0.1, train_loss_key: str = "train_loss",
                 **kwargs: Any) -> None:
        if not client_learning_rate > 0 or not q >= 0:
            raise ConfigError(f"qfedavg: client_learning_rate = {client_learning_rate} must be > 0 and q = {q} "
                              ">= 0 (0: FedAvg's objective)")
        super().__init__(rule=FairStep(client_learning_rate=client_learning_rate, q=q, train_loss_key=train_loss_key),
                         **kwargs)
