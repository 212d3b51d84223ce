"""Split a task's pooled training data into simulated devices' partitions.

IID, or label skew with per-class proportions drawn from Dirichlet(alpha) (Hsu et al.,
"Measuring the Effects of Non-Identical Data Distribution for Federated Visual
Classification", 2019); every training example lands in exactly one partition. The
index split is computed once per task object, process and setting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from fedge import knobs
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.task.data import dirichlet_partition, iid_partition

if TYPE_CHECKING:
    from fedge.task.api import Task, TaskData

CACHE_ATTRIBUTE = "_fedge_partitions"


def shard_of(task: Task, partition_id: int, num_partitions: int, config: RunConfig) -> TaskData:
    """Partition ``partition_id`` of ``num_partitions`` of ``task.train_data()``."""
    key = (num_partitions, config.text(knobs.PARTITIONER), config.number(knobs.DIRICHLET_ALPHA),
           config.integer(knobs.SEED))
    cache: dict[tuple[object, ...], tuple[TaskData, list[NDArray[np.int64]]]] = task.__dict__.setdefault(
        CACHE_ATTRIBUTE, {})
    if key not in cache:
        data = task.train_data()
        cache[key] = (data, split_indices(data.targets, num_partitions, *key[1:]))  # type: ignore[arg-type]
    data, shards = cache[key]
    return data.take(shards[partition_id])


def split_indices(targets: np.ndarray, num_partitions: int, partitioner: str, alpha: float,
                  seed: int) -> list[NDArray[np.int64]]:
    """Example indices per partition; ``dirichlet`` needs integer class targets (else use iid)."""
    if partitioner == "iid":
        return iid_partition(len(targets), num_partitions, seed)
    if targets.ndim != 1 or not np.issubdtype(targets.dtype, np.integer):
        raise ConfigError(f"partitioner 'dirichlet' skews class labels, but this task's targets are "
                          f"{targets.dtype} with shape {targets.shape}; use partitioner='iid'")
    return dirichlet_partition(targets, num_partitions, alpha, seed)
