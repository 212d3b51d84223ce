"""Which connected devices train in a round.

Selection is seeded per round (``seed``, round number), so a run and a resumed
run pick the same devices for the same round.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


class RandomSelector:
    """Uniform sampling without replacement (FedAvg's default)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def select(self, server_round: int, node_ids: Sequence[int], k: int) -> list[int]:
        """``min(k, len(node_ids))`` distinct nodes, reproducible for (seed, round, nodes)."""
        rng = random.Random(self.seed * 1_000_003 + server_round)
        return rng.sample(sorted(node_ids), min(k, len(node_ids)))
