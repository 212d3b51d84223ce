"""FedBuff: asynchronous buffered aggregation."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedge import knobs
from fedge.aggregate import WeightedMeanAccumulator, apply_buffer, with_statistics
from fedge.errors import ConfigError
from fedge.strategies.drivers.asynchronous import AsynchronousDriver
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.registry import register
from fedge.strategies.rule import Arrays, RoundContext, Rule, Update


class Buffered(Rule):
    """FedBuff's server step (Nguyen et al., AISTATS 2022): ``x <- x - lr * (1/K) sum_i w_i delta_i``
    over the ``K`` buffered updates, ``delta_i`` each one's change from the model it trained from
    and ``w_i`` its staleness weight; statistics (BatchNorm buffers) are averaged as values (a
    stale change would overshoot them).

    Not a weighted mean (it divides by ``K``, not by the weights' sum), so not offered to secure
    aggregation; it holds the buffer's changes (O(K x model)). Through gateways (an asynchronous
    run with ``gateways = true``) a gateway's partial mean of ``D`` device results counts as ``D``
    of the ``K`` with ``D`` times its staleness weight: the paper's step over those devices, except
    that within a partial the gateway weighs devices by their examples and their own staleness.
    """

    takes_stale_updates = True
    hierarchical = True  # a gateway's partial mean of D devices' results counts as D of them (see the class doc)

    def __init__(self, *, server_learning_rate: float = 1.0) -> None:
        super().__init__()
        self.server_learning_rate = server_learning_rate

    def begin(self, context: RoundContext) -> None:  # noqa: D102
        super().begin(context)
        self.deltas: list[Arrays] = []
        self.weights: list[float] = []
        self.devices = 0  # the device results behind the deltas (K: a gateway's mean of D counts D)
        self.statistics = WeightedMeanAccumulator()

    def fold(self, update: Update) -> None:
        """Keep ``update``'s change from its model, and its statistics' share of the mean."""
        start = update.base if update.base is not None else self.context.global_numpy()
        self.deltas.append({k: np.asarray(start[k], np.float64) - np.asarray(v, np.float64)
                            for k, v in update.arrays.items()})
        self.weights.append(update.weight)
        self.devices += update.devices
        if statistics := self.context.statistics_of(update.arrays):
            self.statistics.add({k: update.arrays[k] for k in statistics}, update.weight)

    def result(self) -> Arrays | None:  # noqa: D102
        if not self.deltas:
            return None
        new = apply_buffer(self.context.global_numpy(), self.deltas, self.weights, self.server_learning_rate,
                           self.devices)
        if self.statistics.count:
            means = self.statistics.result()
            new = with_statistics(new, means, means)
        return new


@register("fedbuff", options=lambda c, n: {"driver": AsynchronousDriver.from_config(c, n),
                                           "server_learning_rate": float(c[knobs.SERVER_LEARNING_RATE])})
class FedBuff(FedAvg):
    """FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation",
    AISTATS 2022): the :class:`Buffered` rule under the
    :class:`~fedge.strategies.drivers.asynchronous.AsynchronousDriver`.

    ``concurrency`` devices train at once on whatever global model was current when
    they started; every ``buffer_size`` arrived updates are applied with weight
    ``1/sqrt(1 + staleness)`` and a new device starts as each one finishes. A server
    "round" is one buffer flush.
    """

    keeps_partial_work = True  # asynchronous: whatever arrives is aggregated, stragglers' partial work too

    def __init__(self, *, concurrency: int = 20, buffer_size: int = 10, server_learning_rate: float = 1.0,
                 staleness_exponent: float = 0.5, driver: Any = None, **kwargs: Any) -> None:
        if driver is not None and not driver.asynchronous:
            raise ConfigError("FedBuff is asynchronous: it takes no other driver (secure aggregation runs synchronous "
                              "rounds); use a synchronous strategy, or give another rule AsynchronousDriver()")
        driver = driver or AsynchronousDriver(concurrency=concurrency, buffer_size=buffer_size,
                                              staleness_exponent=staleness_exponent)
        concurrency, buffer_size, staleness_exponent = driver.concurrency, driver.buffer_size, driver.staleness_exponent
        super().__init__(rule=Buffered(server_learning_rate=server_learning_rate), driver=driver, **kwargs)
        self.concurrency, self.buffer_size = concurrency, buffer_size
        self.server_learning_rate, self.staleness_exponent = server_learning_rate, staleness_exponent
