"""A model's input signature: names, shapes (with named dynamic axes) and dtypes.

Tasks declare it (:class:`fedge.task.api.Task`), the ONNX exporter and signed bundles carry it
(:mod:`fedge.edge`), and devices check their inputs against it, so it lives in the core.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedge.errors import ConfigError

DTYPES = ("float32", "float16", "int64", "int32", "bool")


@dataclass(frozen=True)
class InputSpec:
    """One model input.

    Attributes
    ----------
    name : str
        The input's name in the ONNX graph and in the bundle manifest.
    shape : tuple[int | str, ...]
        Sizes by axis; a string names a dynamic axis (the first is the batch, e.g.
        ``("batch", 3, 32, 32)`` or ``("batch", "sequence")``).
    dtype : str
        One of :data:`DTYPES`.
    """

    name: str
    shape: tuple[int | str, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ConfigError(f"input name {self.name!r} must be an identifier like 'pixels'")
        if not self.shape or not isinstance(self.shape[0], str):
            raise ConfigError(f"input '{self.name}' shape {self.shape} must start with a named batch axis, "
                              "e.g. ('batch', 64)")
        if any(not isinstance(size, str) and (not isinstance(size, int) or size < 1) for size in self.shape):
            raise ConfigError(f"input '{self.name}' shape {self.shape}: sizes are positive ints or axis names")
        if self.dtype not in DTYPES:
            raise ConfigError(f"input '{self.name}' dtype {self.dtype!r} is not supported; use one of {DTYPES}")

    @property
    def dynamic_axes(self) -> dict[int, str]:
        """Axis index -> name, for the named (dynamic) axes."""
        return {axis: size for axis, size in enumerate(self.shape) if isinstance(size, str)}

    def matches(self, array: np.ndarray) -> bool:
        """Whether ``array`` has this input's rank, fixed sizes and dtype."""
        return (array.ndim == len(self.shape) and np.dtype(array.dtype) == np.dtype(self.dtype)
                and all(isinstance(size, str) or size == got for size, got in zip(self.shape, array.shape,
                                                                                   strict=True)))

    def describe(self) -> str:
        """``name[batch, 3, 32, 32] float32``."""
        return f"{self.name}[{', '.join(map(str, self.shape))}] {self.dtype}"

    def manifest(self) -> dict[str, Any]:
        """The bundle manifest's entry for this input."""
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_manifest(cls, entry: dict[str, Any]) -> InputSpec:
        """The inverse of :meth:`manifest`."""
        return cls(str(entry["name"]), tuple(entry["shape"]), str(entry.get("dtype", "float32")))


TASK_HINT = "make the data or the task's declared input signature match"


def check_inputs(specs: Sequence[InputSpec], arrays: Sequence[np.ndarray], *, source: str,
                 hint: str = TASK_HINT, declared_by: str = "the task") -> None:
    """Refuse ``arrays`` that do not match ``specs`` (count, rank, fixed sizes, dtype), naming the input.

    ``hint`` says what to do and ``declared_by`` who declared the signature: a task's author
    (the default) or, on a device, the bundle (``"the model"``, ``"pass arrays shaped as the
    bundle's manifest says"``).

    Raises
    ------
    ConfigError
        Naming the input, what it expects and what it got.
    """
    if len(arrays) != len(specs):
        raise ConfigError(f"{source}: {len(arrays)} input arrays for {len(specs)} declared inputs "
                          f"({', '.join(spec.describe() for spec in specs)})")
    for spec, array in zip(specs, arrays, strict=True):
        if not spec.matches(array):
            raise ConfigError(f"{source}: input '{spec.name}' has shape {tuple(array.shape)} {array.dtype}; "
                              f"{declared_by} declares {spec.describe()}: {hint}")
