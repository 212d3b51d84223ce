"""A task's declared preprocessing, applied the same way on every runtime (numpy only).

A task says what a caller does to raw inputs before its model sees them (``Task.preprocessing``,
carried by inference and training bundles). ``affine`` is ``x * scale + offset`` in float32;
``raw-range`` (optional, ``[low, high]``) says what raw inputs span, e.g. ``[0, 16]`` for the
digits' grey levels. Torch devices, onnx devices, ``EdgeModel`` and ``fedge predict`` use
this one module, so a raw 0..16 pixel becomes the same 0.0625-step value everywhere.

A device's own file may hold raw inputs (what its sensor gives) or inputs already
preprocessed (what simulation trains on). :func:`prepare_device_inputs` tells which from the
declared ranges: inside the preprocessed range, they are used as they are; inside the raw
range, the preprocessing is applied; outside both, the device warns and says so in its
replies (``inputs`` in the reply meta), which the coordinator counts. Without a declared
range nothing is guessed: the inputs are used as they are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedge.errors import ConfigError

NONE, AFFINE = "none", "affine"
RAW_RANGE = "raw-range"
# what a device's inputs looked like, as its replies report it (wire.INPUTS)
AS_GIVEN, RAW_SCALED, OUTSIDE = "preprocessed", "raw", "outside"
TOLERANCE = 0.05  # of the range's width: rounding and a sensor's small overshoot are inside


@dataclass(frozen=True)
class Preprocessing:
    """The checked preprocessing entry of a task or bundle manifest.

    Attributes
    ----------
    kind : str
        ``none``, ``affine``, or a task's own (a tokenizer, standardisation) that only the
        task applies.
    scale, offset : float
        ``affine``: ``x * scale + offset``.
    raw_range : tuple[float, float] | None
        What raw inputs span, when declared.
    description : str
        The task's words for it.
    """

    kind: str = NONE
    scale: float = 1.0
    offset: float = 0.0
    raw_range: tuple[float, float] | None = None
    description: str = ""

    @classmethod
    def of(cls, spec: Mapping[str, Any] | None) -> Preprocessing:
        """Read a ``preprocessing`` entry (a task's or a manifest's).

        Raises
        ------
        ConfigError
            A scale, offset or range that is not a finite number, or a range whose low end is
            not below its high end, naming the field.
        """
        spec = spec or {}
        kind = spec.get("kind", AFFINE if {"scale", "offset"} & set(spec) else NONE)
        if not isinstance(kind, str):
            raise ConfigError(f"preprocessing 'kind' must be a string (affine, none, ...), got {kind!r:.40}")
        description = str(spec.get("description", ""))
        if kind not in (NONE, AFFINE):  # the task's own (a tokenizer, per-feature statistics): its fields are its own
            return cls(kind, description=description)
        scale, offset = _number(spec, "scale", 1.0), _number(spec, "offset", 0.0)
        if kind == AFFINE and scale == 0:
            raise ConfigError("preprocessing 'scale' is 0: every input would become the offset; give the factor "
                              "raw inputs are multiplied by")
        return cls(kind, scale, offset, _range(spec.get(RAW_RANGE)), description)

    def apply(self, raw: Any) -> NDArray[Any]:
        """Raw inputs as the model takes them (``affine``: ``x * scale + offset`` as float32).

        Raises
        ------
        ConfigError
            A kind only the task can apply (a tokenizer, say): apply it yourself.
        """
        if self.kind == NONE:
            return np.asarray(raw)
        if self.kind != AFFINE:
            raise ConfigError(f"preprocessing '{self.kind}' ({self.description or 'no description'}) is the task's "
                              "own; apply it to the raw inputs yourself")
        return (np.asarray(raw, np.float32) * np.float32(self.scale) + np.float32(self.offset)).astype(np.float32)

    def model_range(self) -> tuple[float, float] | None:
        """What preprocessed inputs span (the raw range through the affine map), when declared."""
        if self.raw_range is None or self.kind not in (NONE, AFFINE):
            return None
        ends = [value * self.scale + self.offset if self.kind == AFFINE else value for value in self.raw_range]
        return min(ends), max(ends)

    def judge(self, values: NDArray[Any]) -> str:
        """Whether one input's values are preprocessed already, raw, or outside both declared ranges."""
        model = self.model_range()
        if model is None or not np.asarray(values).size:
            return AS_GIVEN
        low, high = float(np.min(values)), float(np.max(values))
        if _within(low, high, model):
            return AS_GIVEN
        if self.kind == AFFINE and self.raw_range is not None and _within(low, high, self.raw_range):
            return RAW_SCALED
        return OUTSIDE

    def describe_ranges(self) -> str:
        """``raw 0..16, 0..1 after x * 0.0625 + 0`` (for messages)."""
        model = self.model_range()
        if model is None or self.raw_range is None:
            return "no declared range"
        after = f" after x * {self.scale:g} + {self.offset:g}" if self.kind == AFFINE else ""
        return f"raw {self.raw_range[0]:g}..{self.raw_range[1]:g}, {model[0]:g}..{model[1]:g}{after}"


def prepare_device_inputs(inputs: tuple[NDArray[Any], ...], spec: Mapping[str, Any] | None,
                          ) -> tuple[tuple[NDArray[Any], ...], str]:
    """A device's own inputs as the model takes them, and what they were (:data:`AS_GIVEN`,
    :data:`RAW_SCALED` or :data:`OUTSIDE`: the worst of its inputs).

    Each floating-point input (in its declared dtype, as the loaders cast it) is judged on its
    own; raw ones get the declared preprocessing (float32 for affine). Integer inputs (token
    ids, categories) are what the model takes and are left as they are, as ``fedge predict
    --raw`` leaves them.
    """
    preprocessing = Preprocessing.of(spec)
    prepared, verdicts = [], set()
    for array in inputs:
        verdict = preprocessing.judge(array) if np.asarray(array).dtype.kind == "f" else AS_GIVEN
        verdicts.add(verdict)
        prepared.append(preprocessing.apply(array) if verdict == RAW_SCALED else array)
    worst = OUTSIDE if OUTSIDE in verdicts else RAW_SCALED if RAW_SCALED in verdicts else AS_GIVEN
    return tuple(prepared), worst


def _number(spec: Mapping[str, Any], key: str, default: float) -> float:
    value = spec.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"preprocessing '{key}' must be a finite number, got {value!r:.40}")
    return float(value)


def _range(value: object) -> tuple[float, float] | None:
    if value is None:
        return None
    if (not isinstance(value, list | tuple) or len(value) != 2
            or not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value)
            or not value[0] < value[1]):
        raise ConfigError(f"preprocessing '{RAW_RANGE}' must be [low, high] with low < high, got {value!r:.60}")
    return float(value[0]), float(value[1])


def _within(low: float, high: float, bounds: tuple[float, float]) -> bool:
    slack = TOLERANCE * (bounds[1] - bounds[0])
    return bounds[0] - slack <= low and high <= bounds[1] + slack
