"""Coordinate-wise trimmed mean."""

from __future__ import annotations

from typing import Any

from flwr.serverapp.strategy import FedTrimmedAvg as FlowerFedTrimmedAvg

from fedge import knobs
from fedge.aggregate import trimmed_mean
from fedge.errors import ConfigError
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.flower_args import RuleSetting, flower_constructor
from fedge.strategies.registry import register
from fedge.strategies.rule import Arrays, EachUpdateRule, Update


class Trimmed(EachUpdateRule):
    """The coordinate-wise beta-trimmed mean of the updates (Yin et al., ICML 2018); unweighted."""

    def __init__(self, *, trim_fraction: float) -> None:
        super().__init__()
        self.trim_fraction = trim_fraction

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
