"""Atomic checkpoints of the global model: written whole or not at all.

A checkpoint is one ``.npz`` file (no pickles) holding every global array plus
a JSON string with the round, the config fingerprint and the metrics history.
It is written to a temporary file in the same directory, fsynced, and renamed
over the old one, so a crash at any instant leaves either the previous or the
new checkpoint, never half of one.
"""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
from numpy.typing import NDArray

from fedge.archive import ZIP_READ_ERRORS, impossible_sizes
from fedge.errors import CheckpointMismatch
from fedge.files import write_atomic
from fedge.npy import read_npy_header

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
    payload: dict[str, Any] = {**checkpoint.arrays, **strategy, _META: np.array(meta)}
    write_atomic(path, lambda handle: np.savez(handle, **payload))


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint`.

    The file is read as untrusted input: only numeric ``.npy`` arrays (and the metadata
    string) are accepted, nothing is unpickled, every ``.npy`` header must agree with
    the bytes it describes before anything is allocated for it, and the metadata must
    have the fields and types :func:`save_checkpoint` writes.

    Raises
    ------
    CheckpointMismatch
        If the file is missing, damaged, or is not a fedge checkpoint; the message
        says which.
    """
    try:
        members = _read_npz(Path(path))
    except FileNotFoundError:
        raise CheckpointMismatch(f"checkpoint '{path}' does not exist") from None
    except CheckpointMismatch:  # a ValueError too: already says what is wrong
        raise
    except ZIP_READ_ERRORS as exc:
        raise CheckpointMismatch(f"cannot read checkpoint '{path}': {exc}; the file is damaged or not a "
                                 f"fedge checkpoint (.npz): {_INTACT}") from None
    if _META not in members:
        raise CheckpointMismatch(f"'{path}' is not a fedge checkpoint (no metadata)")
    meta = _metadata(members.pop(_META), path)
    arrays = {name: value for name, value in members.items() if not name.startswith(_STRATEGY)}
    strategy = {name[len(_STRATEGY):]: value for name, value in members.items() if name.startswith(_STRATEGY)}
    return Checkpoint(server_round=meta["round"], arrays=arrays, fingerprint=meta["fingerprint"],
                      history=meta["history"], model_keys=meta.get("model_keys", {}), strategy_state=strategy)


# What a damaged .npz can raise from zipfile, zlib and numpy's .npy header parser.
_INTACT = "use an intact one (a run directory keeps one per round in checkpoints/)"


def _read_npz(path: Path) -> dict[str, NDArray[np.generic]]:
    """The arrays of the ``.npz`` at ``path``, by name, checked member by member."""
    file_size = path.stat().st_size
    arrays: dict[str, NDArray[np.generic]] = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            name = info.filename.removesuffix(".npy")
            if name in arrays:
                raise CheckpointMismatch(f"checkpoint '{path}' holds array '{name}' twice")
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise CheckpointMismatch(f"checkpoint '{path}': array '{name}' uses an unsupported compression")
            problem = impossible_sizes(info, file_size)
            if problem:
                raise CheckpointMismatch(f"checkpoint '{path}': array '{name}' {problem}: {_INTACT}")
            with archive.open(info) as member:
                arrays[name] = _read_npy(member, info.file_size, name == _META, f"checkpoint '{path}': array "
                                         f"'{name}'")
    return arrays


def _read_npy(stream: IO[bytes], size: int, metadata: bool, what: str) -> NDArray[np.generic]:
    """One ``.npy`` of ``size`` bytes: numeric (or, for the ``metadata``, a string) and no
    bigger than its bytes, checked before allocating; never unpickled."""
    try:
        shape, fortran_order, dtype = read_npy_header(stream)
    except ValueError as exc:
        raise CheckpointMismatch(f"{what}: {exc}; fedge writes .npy 1.0 or 2.0 with numeric arrays") from None
    allowed = dtype.kind == "U" and shape == () if metadata else dtype.kind in _NUMERIC and not dtype.fields
    if not allowed or dtype.hasobject:
        raise CheckpointMismatch(f"{what} has dtype {dtype}{' and shape ' + str(shape) if metadata else ''}; a "
                                 "checkpoint holds numeric arrays and one metadata string (no objects, no pickles)")
    nbytes = math.prod(shape) * dtype.itemsize
    if stream.tell() + nbytes != size:
        raise CheckpointMismatch(f"{what}: its header describes {nbytes} bytes of data but the file holds "
                                 f"{size - stream.tell()}; the file is damaged")
    data = stream.read(nbytes)
    if len(data) != nbytes:
        raise CheckpointMismatch(f"{what} is truncated ({len(data)} of {nbytes} bytes)")
    array = np.frombuffer(data, dtype).reshape(shape, order="F" if fortran_order else "C")
    return array.astype(dtype.newbyteorder("="), order="C")  # a writable copy in native byte order


_NUMERIC = "biuf"


def _metadata(array: NDArray[np.generic], path: str | Path) -> dict[str, Any]:
    """The checkpoint's metadata, checked for the fields and types :func:`save_checkpoint` writes."""
    try:
        meta = json.loads(str(array))
    except (ValueError, RecursionError) as exc:
        raise CheckpointMismatch(f"checkpoint '{path}': metadata is not valid JSON ({exc}); the file is "
                                 f"damaged: {_INTACT}") from None
    problem = _metadata_problem(meta)
    if problem:
        raise CheckpointMismatch(f"checkpoint '{path}': {problem}; the file is damaged or not a fedge "
                                 f"checkpoint: {_INTACT}")
    return meta  # type: ignore[no-any-return]


def _metadata_problem(meta: object) -> str:
    """What is wrong with ``meta`` ("" when nothing)."""
    if not isinstance(meta, dict):
        return "metadata is not a JSON object"
    if not _is_count(meta.get("round")):
        return f"metadata 'round' = {_shown(meta.get('round'))} is not an integer >= 0"
    if not isinstance(meta.get("fingerprint"), str):
        return f"metadata 'fingerprint' = {_shown(meta.get('fingerprint'))} is not a string"
    if not isinstance(meta.get("model_keys", {}), dict):
        return f"metadata 'model_keys' = {_shown(meta.get('model_keys'))} is not an object"
    history = meta.get("history")
    if not isinstance(history, list):
        return f"metadata 'history' = {_shown(history)} is not a list"
    for row in history:
        if not isinstance(row, dict) or not _is_count(row.get("round")):
            return f"metadata history row {_shown(row)} is not an object with an integer 'round'"
        clocks = [row[key] for key in ("sim_time_s", "wall_time_s") if key in row]
        if not all(isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t) for t in clocks):
            return f"metadata history row {_shown(row)} has a clock that is not a finite number"
    return ""


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shown(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
