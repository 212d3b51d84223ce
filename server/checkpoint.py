"""Atomic checkpoints of the global model: written whole or not at all.

A checkpoint is one ``.npz`` file (no pickles) holding every global array plus
a JSON string with the round, the config fingerprint and the metrics history.
It is written to a temporary file in the same directory, fsynced, and renamed
over the old one, so a crash at any instant leaves either the previous or the
new checkpoint, never half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedge.errors import CheckpointMismatch

_META = "__fedge_meta__"
_STRATEGY = "__strategy__/"


@dataclass
class Checkpoint:
    """The coordinator's state after a completed round."""

    server_round: int
    arrays: dict[str, NDArray[np.generic]]
    fingerprint: str
    history: list[dict[str, Any]] = field(default_factory=list)
    model_keys: dict[str, Any] = field(default_factory=dict)
    strategy_state: dict[str, NDArray[np.generic]] = field(default_factory=dict)


def save_checkpoint(path: str | Path, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` to ``path`` atomically (temp file + fsync + rename)."""
    path = Path(path)
    meta = json.dumps({"round": checkpoint.server_round, "fingerprint": checkpoint.fingerprint,
                       "history": checkpoint.history, "model_keys": checkpoint.model_keys})
    strategy = {_STRATEGY + name: value for name, value in checkpoint.strategy_state.items()}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            payload: dict[str, Any] = {**checkpoint.arrays, **strategy, _META: np.array(meta)}
            np.savez(handle, **payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Raises
    ------
    CheckpointMismatch
        If the file is missing or is not a fedge checkpoint.
    """
    try:
        with np.load(path, allow_pickle=False) as data:
            if _META not in data.files:
                raise CheckpointMismatch(f"'{path}' is not a fedge checkpoint (no metadata)")
            meta = json.loads(str(data[_META]))
            arrays = {name: data[name] for name in data.files
                      if name != _META and not name.startswith(_STRATEGY)}
            strategy = {name[len(_STRATEGY):]: data[name] for name in data.files
                        if name.startswith(_STRATEGY)}
    except (OSError, ValueError) as exc:
        raise CheckpointMismatch(f"cannot read checkpoint '{path}': {exc}") from None
    return Checkpoint(server_round=int(meta["round"]), arrays=arrays,
                      fingerprint=str(meta["fingerprint"]), history=list(meta["history"]),
                      model_keys=dict(meta.get("model_keys", {})), strategy_state=strategy)
