"""Coordinate-wise trimmed mean."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from flwr.serverapp.strategy import FedTrimmedAvg as FlowerFedTrimmedAvg

from fedge import knobs
from fedge.aggregate import trimmed_mean
from fedge.errors import ConfigError
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.flower_args import RuleSetting, flower_constructor
from fedge.strategies.registry import register
from fedge.strategies.rule import Arrays, EachUpdateRule, Update


class Trimmed(EachUpdateRule):
    """The coordinate-wise beta-trimmed mean of the updates (Yin et al., ICML 2018); unweighted.

    Over group means (``takes_group_means``): ``floor(beta * n)`` of ``n`` groups may hold attackers.
    """

    takes_group_means = True

    def __init__(self, *, trim_fraction: float) -> None:
        super().__init__()
        self.trim_fraction = trim_fraction

    def groups_needed(self) -> tuple[int, str]:
        """Over group means, ``floor(beta * n)`` hostile groups are cut from each end: at least one
        needs ``n >= ceil(1 / beta)`` groups (none with beta = 0, a plain mean)."""
        beta = self.trim_fraction
        if beta <= 0:
            return 10**9, "trim-fraction = 0 cuts nothing (a plain mean of the groups): give trim-fraction > 0"
        needed = max(1, math.ceil(1 / beta) - 1)
        while int(np.floor(beta * needed)) < 1:  # ceil(1 / beta) up to floating point
            needed += 1
        return needed, (f"the trimmed mean cuts floor(trim-fraction x n) groups at each end, at least one "
                        f"(trim-fraction = {beta:g}: n >= {needed})")

    def combine(self, updates: list[Update]) -> Arrays | None:  # noqa: D102
        return trimmed_mean([update.arrays for update in updates], self.trim_fraction)


@register("trimmed-mean", options=lambda c, n: {"trim_fraction": float(c[knobs.TRIM_FRACTION])})
@flower_constructor(FlowerFedTrimmedAvg, beta="trim_fraction")
class TrimmedMean(FedAvg):
    """FedAvg with a coordinate-wise beta-trimmed mean (Yin et al., ICML 2018).

    Unweighted, robust to up to ``floor(beta * n)`` arbitrary updates per coordinate:
    :class:`FedAvg` with the :class:`Trimmed` rule, so replies are validated exactly as in
    :class:`FedAvg` (Flower's ``FedTrimmedAvg`` does not validate). Flower's name for it, ``FedTrimmedAvg``, is the
    same class and takes Flower's call (``beta``).

    Parameters
    ----------
    trim_fraction : float
        beta in [0, 0.5): the fraction cut from each end of every coordinate (Flower's ``beta``).
    """

    trim_fraction = RuleSetting[float]()  # read at each aggregation, under fedge's name and Flower's
    beta = RuleSetting[float]("trim_fraction")

    def __init__(self, *, trim_fraction: float = 0.2, **kwargs: Any) -> None:
        if not 0 <= trim_fraction < 0.5:
            raise ConfigError(f"trim-fraction (Flower's beta) = {trim_fraction}: give a fraction in [0, 0.5), "
                              "the share cut from each end of every coordinate")
        super().__init__(rule=Trimmed(trim_fraction=trim_fraction), **kwargs)


FedTrimmedAvg = TrimmedMean  # Flower's name (Yin et al.'s trimmed mean)
