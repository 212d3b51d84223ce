"""What one local training job did, whichever runtime did it (no Flower: a torch-free,
Flower-free protocol device imports it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LocalWork:
    """What one local training job did (what a train reply reports)."""

    loss: float
    num_examples: int
    samples_processed: int
    steps: int
