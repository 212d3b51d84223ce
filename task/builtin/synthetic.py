"""The ``synthetic`` task: FedProx's Synthetic(alpha, beta) benchmark (Li et al., MLSys 2020, sec. 5.1).

Every device has its own generating model, so a device's data is generated on demand from
its own seed ``(seed, partition id)`` rather than split from a pool: a fleet of a million
devices costs nothing until a device is selected, and every process on every backend that
materialises device ``k`` gets the same examples. Each device holds out ``test-fraction``
of its examples; the coordinator evaluates on the held-out examples of up to
:data:`EVALUATION_DEVICES` devices spread evenly over the fleet (all of them in fleets that
small).
"""

from __future__ import annotations

from collections import OrderedDict
from functools import cached_property

import numpy as np

from fedge import knobs
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.profiles import parse_fleet
from fedge.task.api import TaskData
from fedge.task.builtin.flat import FlatClassification
from fedge.task.data import synthetic_device
from fedge.task.registry import register_task

NUM_FEATURES = 60
NUM_CLASSES = 10
EVALUATION_DEVICES = 1000  # the coordinator's test set: held-out examples of this many devices at most
RECENT_DEVICES = 256  # generated devices kept in memory (a round's train and evaluate reuse them)


@register_task("synthetic")
class Synthetic(FlatClassification):
    """Synthetic(``synthetic-alpha``, ``synthetic-beta``): 60 features, 10 classes. Models: ``logreg``, ``mlp``."""

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.fleet_size = parse_fleet(config.text(knobs.FLEET), config.text(knobs.FLEET_FILE)).size
        self._recent: OrderedDict[int, tuple[TaskData, TaskData]] = OrderedDict()

    def device(self, index: int) -> tuple[TaskData, TaskData]:
        """(train, held-out) data of device ``index``, generated from its own seed (a few are cached)."""
        if index in self._recent:
            self._recent.move_to_end(index)
            return self._recent[index]
        seed = self.config.integer(knobs.SEED)
        x, y = synthetic_device(self.config.number(knobs.SYNTHETIC_ALPHA), self.config.number(knobs.SYNTHETIC_BETA),
                                index, seed, num_features=NUM_FEATURES, num_classes=NUM_CLASSES)
        order = np.random.default_rng([seed % 2**63, index, 1]).permutation(len(y))
        n_test = max(1, int(round(len(y) * self.config.number(knobs.TEST_FRACTION))))
        pair = (TaskData.from_xy(x[order[n_test:]], y[order[n_test:]]),
                TaskData.from_xy(x[order[:n_test]], y[order[:n_test]]))
        self._recent[index] = pair
        if len(self._recent) > RECENT_DEVICES:
            self._recent.popitem(last=False)
        return pair

    def devices(self, num_devices: int) -> list[tuple[TaskData, TaskData]]:
        """(train, held-out) data of devices ``0 .. num_devices - 1`` (for small fleets)."""
        return [self.device(index) for index in range(num_devices)]

    def evaluation_devices(self) -> list[int]:
        """The devices whose held-out examples make the central test set: all, or an even spread."""
        count = min(self.fleet_size, EVALUATION_DEVICES)
        return np.unique(np.linspace(0, self.fleet_size - 1, count).round().astype(np.int64)).tolist()

    @cached_property
    def split(self) -> tuple[TaskData, TaskData]:
        """(training, held-out) examples of :meth:`evaluation_devices` (generated once)."""
        pairs = [self._generate_once(index) for index in self.evaluation_devices()]
        return _joined([train for train, _ in pairs]), _joined([test for _, test in pairs])

    def _generate_once(self, index: int) -> tuple[TaskData, TaskData]:
        pair = self.device(index)
        self._recent.pop(index, None)  # the split keeps them; the cache is for selected devices
        return pair

    @property
    def num_features(self) -> int:  # noqa: D102
        return NUM_FEATURES

    @property
    def num_classes(self) -> int:  # noqa: D102
        return NUM_CLASSES

    def partition(self, partition_id: int, num_partitions: int, config: RunConfig) -> TaskData:  # noqa: D102
        if not 0 <= partition_id < num_partitions:
            raise ConfigError(f"partition {partition_id} is not one of the fleet's {num_partitions} devices")
        return self.device(partition_id)[0]


def _joined(parts: list[TaskData]) -> TaskData:
    return TaskData.from_xy(np.concatenate([p.inputs[0] for p in parts]), np.concatenate([p.targets for p in parts]))
