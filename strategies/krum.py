"""Krum and Multi-Krum."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
from flwr.serverapp.strategy import Krum as FlowerKrum
from flwr.serverapp.strategy import MultiKrum as FlowerMultiKrum
from numpy.typing import NDArray

from fedge.aggregate import multi_krum
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.flower_args import flower_constructor
from fedge.strategies.registry import register
from fedge.strategies.validation import AcceptedUpdate

log = logging.getLogger("fedge.strategies")


@register("krum", needs_individual_updates=True,
          options=lambda c, n: {"num_byzantine": int(c["num-byzantine"]), "num_selected": int(c["krum-select"])})
@flower_constructor(FlowerKrum, num_malicious_nodes="num_byzantine")
class Krum(FedAvg):
    """Krum / Multi-Krum (Blanchard et al., NeurIPS 2017).

    Scores each update by the summed squared distance to its ``n - f - 2`` nearest
    neighbours and averages the ``num_selected`` best (1 = Krum). Tolerates ``f``
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

    def __init__(self, *, num_byzantine: int = 0, num_selected: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_byzantine = num_byzantine
        self.num_selected = num_selected

    def aggregate_updates(self, updates: Iterator[AcceptedUpdate]) -> dict[str, NDArray[np.generic]] | None:
        """Multi-Krum over all accepted updates."""
        accepted = list(updates)
        if not accepted:
            return None
        selected = min(self.num_selected, len(accepted))
        aggregate, chosen = multi_krum([u.arrays for u in accepted], self.num_byzantine, selected)
        log.info("krum kept nodes %s", [accepted[i].node_id for i in chosen])
        return aggregate


@flower_constructor(FlowerMultiKrum, num_malicious_nodes="num_byzantine", num_nodes_to_select="num_selected")
class MultiKrum(Krum):
    """Multi-Krum (Blanchard et al., NeurIPS 2017) under Flower's name and call: Flower's
    ``MultiKrum`` arguments (``num_malicious_nodes``, ``num_nodes_to_select``, in Flower's
    order) on :class:`Krum`, which is Multi-Krum whenever ``num_selected > 1``."""
