"""Bulyan."""

from __future__ import annotations

import logging
from typing import Any

from flwr.serverapp.strategy import Bulyan as FlowerBulyan

from fedge import knobs
from fedge.aggregate import bulyan
from fedge.errors import ConfigError
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.flower_args import RuleSetting, flower_constructor
from fedge.strategies.registry import register
from fedge.strategies.rule import Arrays, EachUpdateRule, Update

log = logging.getLogger("fedge.strategies")


class BulyanSelection(EachUpdateRule):
    """Bulyan (El Mhamdi et al., ICML 2018): Multi-Krum selection, then a trimmed mean around the
    median; None (the model kept, logged) with fewer than ``4f + 3`` updates.

    Over group means (``takes_group_means``): ``f`` of ``n >= 4f + 3`` groups may hold attackers.
    """

    takes_group_means = True

    def __init__(self, *, num_byzantine: int) -> None:
        super().__init__()
        self.num_byzantine = num_byzantine

    def groups_needed(self) -> tuple[int, str]:
        """Over group means, ``f`` (num-byzantine) counts hostile groups: ``n >= 4f + 3`` groups."""
        f = self.num_byzantine
        return 4 * f + 3, f"bulyan tolerating num-byzantine = {f} groups needs n > 4f + 2, n >= 4f + 3 = {4 * f + 3}"

    def combine(self, updates: list[Update]) -> Arrays | None:  # noqa: D102
        needed = 4 * self.num_byzantine + 3
        if len(updates) < needed:
            log.warning("bulyan: %d accepted updates, fewer than 4f + 3 = %d (f = %d); global model kept",
                        len(updates), needed, self.num_byzantine)
            return None
        aggregate, chosen = bulyan([u.arrays for u in updates], self.num_byzantine)
        log.info("bulyan kept nodes %s", [updates[i].node_id for i in chosen])
        return aggregate


@register("bulyan", options=lambda c, n: {"num_byzantine": int(c[knobs.NUM_BYZANTINE])})
@flower_constructor(FlowerBulyan, num_malicious_nodes="num_byzantine")
class Bulyan(FedAvg):
    """Bulyan (El Mhamdi et al., ICML 2018): Krum selection, then a trimmed mean around the median.

    Tolerates ``f`` Byzantine updates per round with at least ``4f + 3`` replies; a round
    with fewer keeps the global model (logged), as Flower's ``Bulyan`` does. Takes Flower's
    call (``num_malicious_nodes``, default 0); Flower's ``selection_rule`` (a function of
    Flower records) is not taken: the selection is Multi-Krum, Flower's default.

    Parameters
    ----------
    num_byzantine : int
        f, the Byzantine updates to tolerate per round (Flower's ``num_malicious_nodes``).
    """

    num_byzantine = RuleSetting[int]()  # read at each aggregation, under fedge's name and Flower's
    num_malicious_nodes = RuleSetting[int]("num_byzantine")

    def __init__(self, *, num_byzantine: int = 0, selection_rule: Any = None, **kwargs: Any) -> None:
        if selection_rule is not None:
            raise ConfigError("Bulyan(selection_rule=...) is Flower's hook on its own records; fedge's Bulyan selects "
                              "by Multi-Krum (Flower's default): leave selection_rule out")
        if num_byzantine < 0:
            raise ConfigError(f"num-byzantine (Flower's num_malicious_nodes) = {num_byzantine}: give 0 or more")
        per_round = kwargs.get("clients_per_round")
        if per_round is not None and per_round < 4 * num_byzantine + 3:
            needed = 4 * num_byzantine + 3
            raise ConfigError(f"bulyan tolerating num-byzantine = {num_byzantine} needs 4f + 3 = {needed} updates a "
                              f"round, but clients-per-round = {per_round}: every round would keep the model; raise "
                              "clients-per-round or lower num-byzantine")
        super().__init__(rule=BulyanSelection(num_byzantine=num_byzantine), **kwargs)
