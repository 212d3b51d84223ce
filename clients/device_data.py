"""A device's own examples, read for the training graph's inputs: numpy only (no Flower, no
torch), shared by the onnx runtime under a SuperNode and the protocol reference client."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedge.errors import ConfigError

DeviceArrays = tuple[tuple[np.ndarray, ...], np.ndarray]


def device_arrays(path: str | Path, manifest: Mapping[str, Any]) -> DeviceArrays:
    """A real device's own examples for the graph's inputs, without torch.

    ``.npz``: one array per input name (or ``x`` for a single input) and ``y``;
    ``.csv``: a header, a ``label`` column (else the last) and the features of a single input.
    Arrays are cast to the dtypes the graph declares.
    """
    specs: Sequence[Mapping[str, Any]] = manifest["inputs"]
    target_dtype = str(manifest["targets"]["dtype"])
    path = Path(path)
    if path.suffix == ".npz":
        from fedge.task.loaders import npz_arrays  # noqa: PLC0415 - numpy only

        inputs, targets = npz_arrays(path, [str(spec["name"]) for spec in specs], "the training graph")
    elif path.suffix == ".csv" and len(specs) == 1:
        from fedge.task.data import load_csv_table  # noqa: PLC0415 - numpy only

        features, labels = load_csv_table(path)
        inputs, targets = (features,), labels
    else:
        raise ConfigError(f"device data '{path}' must be a .npz (one array per input and 'y') or, for a "
                          "single-input task, a .csv with a header and a label column")
    cast = tuple(np.ascontiguousarray(array, dtype=str(spec["dtype"]))
                 for array, spec in zip(inputs, specs, strict=True))
    if any(len(array) != len(targets) for array in cast):
        raise ConfigError(f"'{path}': inputs and 'y' hold different numbers of examples "
                          f"({[len(a) for a in cast]} vs {len(targets)})")
    return cast, np.ascontiguousarray(targets, dtype=target_dtype)
