"""What one local training job did, whichever runtime did it (no Flower: a torch-free,
Flower-free protocol device imports it)."""

from __future__ import annotations

import math
from dataclasses import dataclass


def max_local_steps(*, epochs: int, batch_size: int, num_examples: int) -> int:
    """The most local SGD steps an instruction of ``epochs`` over ``num_examples`` in batches of
    ``batch_size`` allows: one a batch, the last one partial."""
    return epochs * math.ceil(num_examples / max(1, batch_size))


def max_samples(*, epochs: int, num_examples: int) -> int:
    """The most samples such an instruction processes: every example once an epoch."""
    return epochs * num_examples


@dataclass(frozen=True)
class LocalWork:
    """What one local training job did (what a train reply reports)."""

    loss: float
    num_examples: int
    samples_processed: int
    steps: int
