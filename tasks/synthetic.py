"""The ``synthetic`` task: FedProx's Synthetic(alpha, beta) benchmark (Li et al., MLSys 2020, sec. 5.1).

Every device has its own generating model, so partitions are generated per device rather
than split from a pool; each device holds out ``test-fraction`` of its examples, and the
coordinator evaluates on all held-out examples of the fleet.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from fedge.config import RunConfig
from fedge.profiles import parse_fleet
from fedge.task.api import TaskData
from fedge.task.data import synthetic_fedprox
from fedge.task.registry import register_task
from fedge.tasks.flat import FlatClassification

NUM_CLASSES = 10


@register_task("synthetic")
class Synthetic(FlatClassification):
    """Synthetic(``synthetic-alpha``, ``synthetic-beta``): 60 features, 10 classes. Models: ``logreg``, ``mlp``."""

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.fleet_size = parse_fleet(config.text("fleet"), config.text("fleet-file")).size
        self._devices: dict[int, list[tuple[TaskData, TaskData]]] = {}

    def devices(self, num_devices: int) -> list[tuple[TaskData, TaskData]]:
        """(train, held-out) data of each of ``num_devices`` devices, generated once."""
        if num_devices not in self._devices:
            seed = self.config.integer("seed")
            generated = synthetic_fedprox(self.config.number("synthetic-alpha"),
                                          self.config.number("synthetic-beta"), num_devices, seed)
            rng, split = np.random.default_rng(seed), []
            for x, y in generated:
                order = rng.permutation(len(y))
                n_test = max(1, int(round(len(y) * self.config.number("test-fraction"))))
                split.append((TaskData.from_xy(x[order[n_test:]], y[order[n_test:]]),
                              TaskData.from_xy(x[order[:n_test]], y[order[:n_test]])))
            self._devices[num_devices] = split
        return self._devices[num_devices]

    @cached_property
    def split(self) -> tuple[TaskData, TaskData]:  # noqa: D102
        devices = self.devices(self.fleet_size)
        return _joined([train for train, _ in devices]), _joined([test for _, test in devices])

    @property
    def num_classes(self) -> int:  # noqa: D102
        return NUM_CLASSES

    def partition(self, partition_id: int, num_partitions: int, config: RunConfig) -> TaskData:  # noqa: D102
        return self.devices(num_partitions)[partition_id][0]


def _joined(parts: list[TaskData]) -> TaskData:
    return TaskData.from_xy(np.concatenate([p.inputs[0] for p in parts]), np.concatenate([p.targets for p in parts]))
