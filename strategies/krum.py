"""Krum and Multi-Krum."""

from __future__ import annotations

import logging
from typing import Any

from flwr.serverapp.strategy import Krum as FlowerKrum
from flwr.serverapp.strategy import MultiKrum as FlowerMultiKrum

from fedge import knobs
from fedge.aggregate import multi_krum
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.flower_args import RuleSetting, flower_constructor
from fedge.strategies.registry import register
from fedge.strategies.rule import Arrays, EachUpdateRule, Update

log = logging.getLogger("fedge.strategies")


class KrumSelection(EachUpdateRule):
    """Multi-Krum (Blanchard et al., NeurIPS 2017): the unweighted mean of the ``num_selected``
    updates closest to their ``n - f - 2`` nearest neighbours (1: Krum).

    Over group means (``takes_group_means``): ``f`` of ``n > 2f + 2`` groups may hold attackers.
    """

    takes_group_means = True

    def __init__(self, *, num_byzantine: int, num_selected: int) -> None:
        super().__init__()
        self.num_byzantine, self.num_selected = num_byzantine, num_selected

    def groups_needed(self) -> tuple[int, str]:
        """Over group means, ``f`` (num-byzantine) counts hostile groups: Krum needs ``n > 2f + 2``
        groups, and Multi-Krum averages at most ``n - f`` of them."""
        f, m = self.num_byzantine, self.num_selected
        needed = max(2 * f + 3, m + f)
        return needed, (f"krum tolerating num-byzantine = {f} groups needs n > 2f + 2 = {2 * f + 2} groups"
                        + (f", and multi-krum's krum-select = {m} needs n >= m + f = {m + f}" if m > 1 else ""))

    def combine(self, updates: list[Update]) -> Arrays | None:  # noqa: D102
        selected = min(self.num_selected, len(updates))
        aggregate, chosen = multi_krum([u.arrays for u in updates], self.num_byzantine, selected)
        log.info("krum kept nodes %s", [updates[i].node_id for i in chosen])
        return aggregate


@register("krum",
          options=lambda c, n: {"num_byzantine": int(c[knobs.NUM_BYZANTINE]),
                                "num_selected": int(c[knobs.KRUM_SELECT])})
@flower_constructor(FlowerKrum, num_malicious_nodes="num_byzantine")
class Krum(FedAvg):
    """Krum / Multi-Krum (Blanchard et al., NeurIPS 2017).

    Scores each update by the summed squared distance to its ``n - f - 2`` nearest
    neighbours and averages the ``num_selected`` best (1 = Krum): :class:`FedAvg` with the
    :class:`KrumSelection` rule. Tolerates ``f``
    Byzantine updates when ``n > 2f + 2``.

    Takes Flower's ``Krum`` call (``num_malicious_nodes``, default 0); the selected updates are
    averaged unweighted, as in the paper (Flower weights them by ``num-examples``).

    Parameters
    ----------
    num_byzantine : int
        f, the number of Byzantine updates to tolerate per round (Flower's ``num_malicious_nodes``).
    num_selected : int
        m, how many lowest-score updates to average (1: Krum; >1: Multi-Krum).
    """

    # read at each aggregation, under fedge's names and Flower's
    num_byzantine = RuleSetting[int]()
    num_malicious_nodes = RuleSetting[int]("num_byzantine")
    num_selected = RuleSetting[int]()
    num_nodes_to_select = RuleSetting[int]("num_selected")

    def __init__(self, *, num_byzantine: int = 0, num_selected: int = 1, **kwargs: Any) -> None:
        super().__init__(rule=KrumSelection(num_byzantine=num_byzantine, num_selected=num_selected), **kwargs)


@flower_constructor(FlowerMultiKrum, num_malicious_nodes="num_byzantine", num_nodes_to_select="num_selected")
class MultiKrum(Krum):
    """Multi-Krum (Blanchard et al., NeurIPS 2017) under Flower's name and call: Flower's
    ``MultiKrum`` arguments (``num_malicious_nodes``, ``num_nodes_to_select``, in Flower's
    order) on :class:`Krum`, which is Multi-Krum whenever ``num_selected > 1``."""
