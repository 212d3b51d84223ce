"""The order in which a device visits its examples: the same for every runtime.

A device draws the same mini-batches whether torch or the onnx training graph trains it
(and whichever backend simulates it), so a mixed fleet is reproducible and a torch and
an onnx device on the same data send the same update. numpy's ``default_rng`` (PCG64) is
the generator: documented, stable across numpy versions and platforms, and available
on every Python device; torch's generator is not available on a device without torch.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from fedge.errors import ConfigError


def batch_order(size: int, batch_size: int, seed: int, epochs: int,
                max_steps: int | None = None) -> Iterator[np.ndarray]:
    """Index batches: a fresh ``default_rng(seed)`` permutation per epoch, cut into ``batch_size`` pieces.

    The last partial batch of an epoch is kept (``DataLoader(drop_last=False)``). With
    ``max_steps`` exactly that many batches come, cycling through as many epochs as needed;
    otherwise ``epochs`` passes.

    Raises
    ------
    ConfigError
        For an empty data set or a batch size, epoch count or step count below 1.
    """
    if size < 1:
        raise ConfigError("no training examples: a device needs at least one")
    if batch_size < 1:
        raise ConfigError(f"batch_size {batch_size} must be at least 1")
    if max_steps is None and epochs < 1:
        raise ConfigError(f"epochs {epochs} must be at least 1 (or give max_steps)")
    if max_steps is not None and max_steps < 1:
        raise ConfigError(f"max_steps {max_steps} must be at least 1")
    rng = np.random.default_rng(seed)
    done, epoch = 0, 0
    while (max_steps is None and epoch < epochs) or (max_steps is not None and done < max_steps):
        order = rng.permutation(size)
        for start in range(0, size, batch_size):
            yield order[start:start + batch_size]
            done += 1
            if max_steps is not None and done == max_steps:
                return
        epoch += 1
