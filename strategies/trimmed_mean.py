"""Coordinate-wise trimmed mean."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from flwr.serverapp.strategy import FedTrimmedAvg as FlowerFedTrimmedAvg
from numpy.typing import NDArray

from fedge.aggregate import trimmed_mean
from fedge.errors import ConfigError
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.flower_args import flower_constructor
from fedge.strategies.registry import register
from fedge.strategies.validation import AcceptedUpdate


@register("trimmed-mean", needs_individual_updates=True,
          options=lambda c, n: {"trim_fraction": float(c["trim-fraction"])})
@flower_constructor(FlowerFedTrimmedAvg, beta="trim_fraction")
class TrimmedMean(FedAvg):
    """FedAvg with a coordinate-wise beta-trimmed mean (Yin et al., ICML 2018).

    Unweighted, robust to up to ``floor(beta * n)`` arbitrary updates per coordinate.
    Replies are validated exactly as in :class:`FedAvg` (Flower's ``FedTrimmedAvg``
    does not validate, hence this subclass). Flower's name for it, ``FedTrimmedAvg``, is the
    same class and takes Flower's call (``beta``).

    Parameters
    ----------
    trim_fraction : float
        beta in [0, 0.5): the fraction cut from each end of every coordinate (Flower's ``beta``).
    """

    def __init__(self, *, trim_fraction: float = 0.2, **kwargs: Any) -> None:
        if not 0 <= trim_fraction < 0.5:
            raise ConfigError(f"trim-fraction (Flower's beta) = {trim_fraction}: give a fraction in [0, 0.5), "
                              "the share cut from each end of every coordinate")
        super().__init__(**kwargs)
        self.trim_fraction = trim_fraction

    def aggregate_updates(self, updates: Iterator[AcceptedUpdate]) -> dict[str, NDArray[np.generic]] | None:
        """Trimmed mean of all accepted updates (needs them all at once)."""
        arrays = [update.arrays for update in updates]
        return trimmed_mean(arrays, self.trim_fraction) if arrays else None


FedTrimmedAvg = TrimmedMean  # Flower's name (Yin et al.'s trimmed mean)
