"""Coordinate-wise median."""

from __future__ import annotations

from typing import Any

from flwr.serverapp.strategy import FedMedian as FlowerFedMedian

from fedge.aggregate import coordinate_median
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.flower_args import flower_constructor
from fedge.strategies.registry import register
from fedge.strategies.rule import Arrays, EachUpdateRule, Update


class CoordinateMedian(EachUpdateRule):
    """The coordinate-wise median of the updates (Yin et al., ICML 2018); unweighted.

    Over group means (``takes_group_means``): with ``n`` groups, up to ``floor((n - 1) / 2)`` of
    them may hold attackers and each coordinate stays within the range of the honest groups' values.
    """

    takes_group_means = True

    def groups_needed(self) -> tuple[int, str]:  # noqa: D102
        return 3, "the median of n groups outvotes floor((n - 1) / 2) hostile groups: n >= 3 for one"

    def combine(self, updates: list[Update]) -> Arrays | None:  # noqa: D102
        return coordinate_median([update.arrays for update in updates])


@register("median")
@flower_constructor(FlowerFedMedian)
class Median(FedAvg):
    """FedAvg with the coordinate-wise median (Yin et al., ICML 2018): :class:`FedAvg` with the
    :class:`CoordinateMedian` rule.

    Flower's name for it, ``FedMedian``, is the same class and takes Flower's call."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(rule=CoordinateMedian(), **kwargs)


FedMedian = Median  # Flower's name
