"""FedNova."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedge.aggregate import FedNovaAccumulator, fednova_norm
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.registry import register
from fedge.strategies.validation import AcceptedUpdate


@register("fednova", options=lambda c, n: {"local_momentum": float(c["momentum"])})
class FedNova(FedAvg):
    """FedNova (Wang et al., NeurIPS 2020): normalise each update by its local work.

    Devices that ran more local steps move further; FedAvg then biases the model
    toward them. FedNova divides each device's change by ``a_i`` (its number of
    local steps, adjusted for momentum) and rescales by the weighted mean ``a``, so
    the objective stays the weighted sum of local objectives. Devices report their
    steps in fedge's reply meta (``steps``).

    Parameters
    ----------
    local_momentum : float
        The devices' SGD momentum (enters ``a_i``).
    """

    needs_global_model = True  # steps from the global model configure_train sent

    def __init__(self, *, local_momentum: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.local_momentum = local_momentum

    def aggregate_updates(self, updates: Iterator[AcceptedUpdate]) -> dict[str, NDArray[np.generic]] | None:
        """Streaming normalised averaging."""
        accumulator = FedNovaAccumulator(self.global_numpy())
        for update in updates:  # steps were checked (type, range, the instruction's limit) by validation
            steps = update.meta.steps if update.meta is not None and update.meta.steps is not None else 1
            accumulator.add(update.arrays, update.weight, fednova_norm(steps, self.local_momentum))
        return accumulator.result() if accumulator.count else None
