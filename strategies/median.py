"""Coordinate-wise median."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from flwr.serverapp.strategy import FedMedian as FlowerFedMedian
from numpy.typing import NDArray

from fedge.aggregate import coordinate_median
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.flower_args import flower_constructor
from fedge.strategies.registry import register
from fedge.strategies.validation import AcceptedUpdate


@register("median", needs_individual_updates=True)
@flower_constructor(FlowerFedMedian)
class Median(FedAvg):
    """FedAvg with the coordinate-wise median (Yin et al., ICML 2018); unweighted.

    Flower's name for it, ``FedMedian``, is the same class and takes Flower's call."""

    def aggregate_updates(self, updates: Iterator[AcceptedUpdate]) -> dict[str, NDArray[np.generic]] | None:
        """Median of all accepted updates."""
        arrays = [update.arrays for update in updates]
        return coordinate_median(arrays) if arrays else None


FedMedian = Median  # Flower's name
