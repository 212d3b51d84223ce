"""q-FedAvg."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
from flwr.serverapp.strategy import QFedAvg as FlowerQFedAvg
from numpy.typing import NDArray

from fedge import wire
from fedge.aggregate import QFedAvgAccumulator, WeightedMeanAccumulator
from fedge.errors import ConfigError
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.flower_args import flower_constructor
from fedge.strategies.registry import register
from fedge.strategies.validation import AcceptedUpdate

log = logging.getLogger("fedge.strategies")


@register("qfedavg", options=lambda c, n: {"client_learning_rate": float(c["learning-rate"]),
                                           "q": float(c["qfedavg-q"]), "train_loss_key": wire.TRAIN_LOSS})
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

    needs_global_model = True  # steps from the global model configure_train sent

    def __init__(self, *, client_learning_rate: float, q: float = 0.1, train_loss_key: str = "train_loss",
                 **kwargs: Any) -> None:
        if not client_learning_rate > 0 or not q >= 0:
            raise ConfigError(f"qfedavg: client_learning_rate = {client_learning_rate} must be > 0 and q = {q} "
                              ">= 0 (0: FedAvg's objective)")
        super().__init__(**kwargs)
        self.client_learning_rate, self.q, self.train_loss_key = client_learning_rate, q, train_loss_key

    def aggregate_updates(self, updates: Iterator[AcceptedUpdate]) -> dict[str, NDArray[np.generic]] | None:
        """The q-FedAvg step over the accepted updates that report their loss."""
        global_arrays = self.global_numpy()
        statistics = self.statistics_of(global_arrays)  # averaged, and kept out of the step and its ||Delta||^2
        weights = {name: value for name, value in global_arrays.items() if name not in statistics}
        step = QFedAvgAccumulator(weights, q=self.q, client_lr=self.client_learning_rate)
        means = WeightedMeanAccumulator()
        for update in updates:
            loss = next(iter(update.content.metric_records.values())).get(self.train_loss_key)
            if isinstance(loss, bool) or not isinstance(loss, int | float) or not math.isfinite(loss) or loss < 0:
                log.warning("qfedavg: node %d reported no usable '%s' (%r); its update is left out of the step",
                            update.node_id, self.train_loss_key, loss)
                continue
            step.add({name: update.arrays[name] for name in weights}, float(loss))
            if statistics:
                means.add({name: update.arrays[name] for name in statistics}, update.weight)
            update.arrays.clear()
        if not step.count:
            return None
        return {**step.result(), **means.result()} if statistics else step.result()
