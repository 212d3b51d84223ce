"""Which connected devices train in a round.

Selection is seeded per round (``seed``, round number), so a run and a resumed
run pick the same devices for the same round; what a selector learned from replies
(Oort's utilities) is its ``state_dict``, which checkpoints keep (``selector/...``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import Message
from numpy.typing import NDArray

from fedge import wire
from fedge.errors import UpdateRejected

SELECTOR_STATE = "selector/"  # what a selector's checkpointed state's keys start with


class RandomSelector:
    """Uniform sampling without replacement (FedAvg's default)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def select(self, server_round: int, node_ids: Sequence[int], k: int) -> list[int]:
        """``min(k, len(node_ids))`` distinct nodes, reproducible for (seed, round, nodes)."""
        rng = random.Random(self.seed * 1_000_003 + server_round)
        return rng.sample(sorted(node_ids), min(k, len(node_ids)))

    def observe(self, server_round: int, replies: Sequence[Message], durations: Mapping[int, float]) -> None:
        """Random selection learns nothing from a round."""

    def state_dict(self) -> dict[str, NDArray[np.generic]]:
        """What it learned, for a checkpoint (keys start with ``selector/``): nothing."""
        return {}

    def load_state_dict(self, state: Mapping[str, NDArray[np.generic]]) -> None:
        """Restore :meth:`state_dict`."""


@dataclass
class _Record:
    utility: float
    duration: float
    last_round: int


class OortSelector(RandomSelector):
    """Capability-aware selection after Oort (Lai et al., "Oort: Efficient Federated Learning
    via Guided Participant Selection", OSDI 2021), simplified.

    * statistical utility of a device: ``num_examples * train_loss`` from its last reply
      (Oort uses ``|B| sqrt(mean loss^2)``);
    * system penalty: ``(preferred_s / duration)^alpha`` when its last round took longer
      than ``preferred_s``;
    * exploration: ``epsilon`` of each selection goes to devices never seen yet;
    * fairness: a device not selected for ``fairness_rounds`` rounds is taken first, so
      none starves.

    The utilities come from device replies, which are untrusted: they steer only who is
    asked next, never the model.
    """

    def __init__(self, seed: int = 0, *, preferred_s: float = 10.0, alpha: float = 2.0,
                 epsilon: float = 0.2, fairness_rounds: int = 20, max_num_examples: int = 100_000) -> None:
        super().__init__(seed)
        self.preferred_s, self.alpha, self.epsilon, self.fairness_rounds = preferred_s, alpha, epsilon, fairness_rounds
        self.max_num_examples = max_num_examples
        self.records: dict[int, _Record] = {}
        self.last_selected: dict[int, int] = {}

    def score(self, node: int) -> float:
        """Utility with the system penalty."""
        record = self.records[node]
        penalty = (self.preferred_s / record.duration) ** self.alpha if record.duration > self.preferred_s else 1.0
        return record.utility * penalty

    def select(self, server_round: int, node_ids: Sequence[int], k: int) -> list[int]:
        """Starving devices first, then exploration, then the highest scores."""
        rng = random.Random(self.seed * 1_000_003 + server_round)
        nodes, k = sorted(node_ids), min(k, len(node_ids))
        starving = [n for n in nodes if server_round - self.last_selected.get(n, 0) > self.fairness_rounds]
        chosen = rng.sample(starving, min(len(starving), k))
        taken = set(chosen)  # membership in O(1): fleets run to a million devices
        unseen = [n for n in nodes if n not in self.records and n not in taken]
        explore = min(len(unseen), max(k - len(chosen), 0), math.ceil(self.epsilon * k) if self.records else k)
        chosen += rng.sample(unseen, explore)
        taken.update(chosen)
        seen = sorted((n for n in nodes if n in self.records and n not in taken), key=self.score, reverse=True)
        chosen += seen[: k - len(chosen)]
        taken.update(chosen)
        rest = [n for n in nodes if n not in taken]
        chosen += rng.sample(rest, max(k - len(chosen), 0))
        for node in chosen:
            self.last_selected[node] = server_round
        return chosen

    def observe(self, server_round: int, replies: Sequence[Message], durations: Mapping[int, float]) -> None:
        """Update each replying device's utility and duration."""
        for reply in replies:
            if reply.has_error():
                continue
            try:  # the same checks as validation: a malformed reply teaches the selector nothing
                metrics = wire.read_train_metrics(reply.content, max_num_examples=self.max_num_examples)
            except UpdateRejected:
                continue
            if metrics.loss is None:
                continue
            node = reply.metadata.src_node_id
            self.records[node] = _Record(utility=max(metrics.loss, 0.0) * metrics.num_examples,
                                         duration=max(durations.get(node, 0.0), 1e-9), last_round=server_round)

    def state_dict(self) -> dict[str, NDArray[np.generic]]:
        """Each device's record and when it was last selected (node ids as uint64, as Flower's)."""
        nodes = sorted(self.records)
        chosen = sorted(self.last_selected)
        return {SELECTOR_STATE + "oort/nodes": np.array(nodes, np.uint64),
                SELECTOR_STATE + "oort/records": np.array([[self.records[n].utility, self.records[n].duration,
                                                    self.records[n].last_round] for n in nodes],
                                                  np.float64).reshape(len(nodes), 3),
                SELECTOR_STATE + "oort/selected": np.array([[n, self.last_selected[n]] for n in chosen],
                                                   np.uint64).reshape(len(chosen), 2)}

    def load_state_dict(self, state: Mapping[str, NDArray[np.generic]]) -> None:
        """Restore :meth:`state_dict` (a run resumed with Oort goes on ranking from what it learned)."""
        prefix = SELECTOR_STATE + "oort/"
        if prefix + "nodes" not in state:
            return
        nodes, records = state[prefix + "nodes"], np.asarray(state[prefix + "records"], np.float64)
        self.records = {int(node): _Record(float(row[0]), float(row[1]), int(row[2]))
                        for node, row in zip(nodes, records, strict=True)}
        self.last_selected = {int(node): int(round_) for node, round_ in state[prefix + "selected"]}
