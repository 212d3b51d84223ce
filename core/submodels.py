"""Width-scaled sub-models: which entries of the global model a device of width ``r`` holds, and
how their updates are averaged back. Numpy only (no torch, no Flower).

A model's arrays have *hidden* axes (a layer's channels or hidden units) and *fixed* ones (the
input layer's input, the output layer's classes). A device of width ``r`` holds, on every
hidden axis of size ``S``, a window of ``r * S`` consecutive indices (mod ``S``) that starts at
``offset * S``; fixed axes are whole. :class:`WidthPlan` says which axes are hidden;
:meth:`WidthPlan.window` gives a device's window.

* HeteroFL (Diao, Ding and Tarokh, "HeteroFL: Computation and Communication Efficient Federated
  Learning for Heterogeneous Clients", ICLR 2021) takes the leading indices: offset 0, so the
  sub-models are nested.
* FedRolex (Alam, Liu, Yan and Zhang, "FedRolex: Model-Heterogeneous Federated Learning with
  Rolling Sub-Model Extraction", NeurIPS 2022) rolls the window from round to round, so every
  part of the global model is trained: as in the paper's Algorithm 1, the window of a layer of
  ``K`` units starts at unit ``t mod K`` in round ``t`` (``Offset(index=t * stride)``; stride 1
  is the paper's). fedge also offers a window that moves by its own length
  (``Offset(fraction=t * r mod 1)``), which trains every entry within ``ceil(1 / r)`` rounds.

An axis is made of :class:`Segment` s: a layer's own units, a channel-major flatten of them
(``C * H * W`` features from ``C`` channels: ``C`` units of ``H * W`` entries), or several of
those concatenated (two branches joined by ``torch.cat``; an unscaled input joined to hidden
features). A window takes the same units of every scaled segment, so a segment fed by a layer
holds exactly that layer's window, wherever it lands in the concatenation; fixed segments are
whole. :class:`CoverageMean` then averages each entry over the devices whose window holds
it, weighted by their examples (HeteroFL's aggregation, the same for FedRolex); entries no
device held keep the global model's value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
from numpy.typing import NDArray

from fedge.errors import ConfigError

Arrays = Mapping[str, NDArray[np.generic]]
AxisIndex = slice | NDArray[np.intp]  # a window on one axis: a slice when it does not wrap around

MAX_DENOMINATOR = 1024  # widths are simple fractions (1/2, 1/4, 3/8); a float's binary noise is not


def as_fraction(width: float) -> Fraction:
    """``width`` as the simple fraction it stands for (``0.25`` -> 1/4, ``0.3`` -> 3/10).

    Raises
    ------
    ConfigError
        When ``width`` is not in (0, 1].
    """
    if isinstance(width, bool) or not isinstance(width, int | float | Fraction) or not 0 < width <= 1:
        raise ConfigError(f"model width {width!r} must be a number in (0, 1], e.g. 0.5 or 0.25")
    return Fraction(width).limit_denominator(MAX_DENOMINATOR)


@dataclass(frozen=True)
class Offset:
    """Where a window starts on every scaled segment: at ``fraction`` of its units, then ``index`` units
    further (mod its units). HeteroFL's is ``Offset()``: the leading units."""

    fraction: Fraction = Fraction(0)
    index: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.fraction < 1 or self.index < 0:
            raise ValueError(f"window offset {self.fraction} + {self.index} units must have a fraction in [0, 1) "
                             "and a whole number of units >= 0")

    def start(self, units: int, quantum: int = 1) -> int:
        """The first unit of a segment of ``units`` units (a whole number: the width's check makes it one),
        ``index`` counted in steps of ``quantum`` units (a GroupNorm's group: a window holds whole groups)."""
        return (int(self.fraction * units) + self.index * quantum) % units

    def __str__(self) -> str:
        parts = [str(self.fraction)] if self.fraction or not self.index else []
        return " + ".join([*parts, *([f"{self.index} units"] if self.index else [])])


def rolling_offset(width: float, server_round: int, stride: int = 0) -> Offset:
    """FedRolex's window start in round ``server_round`` (1, 2, ...).

    ``stride`` units a round (the paper's Algorithm 1 is ``stride = 1``: unit ``round - 1`` mod the
    layer's units); ``stride = 0``: the window moves by its own length, ``(round - 1) * width`` mod 1.
    """
    steps = max(server_round - 1, 0)
    if stride:
        return Offset(index=steps * stride)
    return Offset(fraction=(steps * as_fraction(width)) % 1)


@dataclass(frozen=True)
class Segment:
    """A stretch of one axis fed by one source: ``units`` units of ``size // units`` consecutive entries
    each (a flatten of ``units`` channels is channel-major), scaled with the width unless it is ``fixed``
    (the model's input joined to hidden features)."""

    size: int
    units: int
    fixed: bool = False

    def scaled_size(self, width: Fraction) -> int:
        """Entries a device of ``width`` holds of this segment."""
        return self.size if self.fixed else int(width * self.units) * (self.size // self.units)


@dataclass(frozen=True)
class Window:
    """The entries one device holds: per array, per axis, the indices (a slice, or an index array
    when the window wraps around), ``None`` for a whole axis.

    Attributes
    ----------
    width : Fraction
        The width ratio.
    offset : Offset
        The window's start on every scaled segment.
    axes : Mapping[str, tuple[AxisIndex | None, ...]]
        Each array's per-axis indices.
    """

    width: Fraction
    offset: Offset
    axes: Mapping[str, tuple[AxisIndex | None, ...]]

    @property
    def full(self) -> bool:
        """Whether this window is the whole model."""
        return self.width == 1

    def take(self, arrays: Arrays) -> dict[str, NDArray[np.generic]]:
        """The window's part of ``arrays`` (the global model's shapes): contiguous copies."""
        return {name: np.ascontiguousarray(_take(np.asarray(value), self.axes[name]))
                for name, value in arrays.items()}

    def outer_index(self, name: str, shape: tuple[int, ...]) -> tuple[slice | NDArray[np.intp], ...]:
        """An index into the full array ``name`` (of ``shape``) that selects the window's block."""
        axes = self.axes[name]
        if all(index is None or isinstance(index, slice) for index in axes):
            return tuple(slice(None) if index is None else index for index in axes)  # type: ignore[misc]
        grids = [np.arange(size) if index is None else np.arange(size)[index] for index, size in zip(axes, shape,
                                                                                                      strict=True)]
        return np.ix_(*grids)

    def describe(self) -> str:
        """``width 1/4 at offset 1/2``."""
        return f"width {self.width} at offset {self.offset}"


def _take(value: NDArray[np.generic], axes: tuple[AxisIndex | None, ...]) -> NDArray[np.generic]:
    for axis, index in enumerate(axes):
        if isinstance(index, slice):
            value = value[(slice(None),) * axis + (index,)]
        elif index is not None:
            value = np.take(value, index, axis=axis)
    return value


@dataclass(frozen=True)
class WidthPlan:
    """Which axes of each array scale with the width (the rest are the model's input and output).

    Attributes
    ----------
    shapes : Mapping[str, tuple[int, ...]]
        The full model's array shapes.
    hidden : Mapping[str, tuple[int, ...]]
        Each array's hidden axes (empty: the array is whole at every width).
    layouts : Mapping[str, Mapping[int, tuple[Segment, ...]]]
        The segments of the hidden axes that are more than one layer's own units (a flatten,
        a concatenation); an axis not named here is one segment of its own entries.
    quanta : Mapping[int, int]
        The step a rolling window takes on a segment of so many units (1 unless named): a
        GroupNorm of ``C`` channels in ``G`` groups makes it ``C // G`` for every ``C``-unit
        segment, so that every window holds whole groups (as the whole model normalises them).
    """

    shapes: Mapping[str, tuple[int, ...]]
    hidden: Mapping[str, tuple[int, ...]]
    layouts: Mapping[str, Mapping[int, tuple[Segment, ...]]] = field(default_factory=dict)
    quanta: Mapping[int, int] = field(default_factory=dict)

    def segments(self, name: str, axis: int) -> tuple[Segment, ...]:
        """The segments of hidden ``axis`` of array ``name``."""
        size = self.shapes[name][axis]
        return self.layouts.get(name, {}).get(axis, (Segment(size, size),))

    def check_width(self, width: float) -> Fraction:
        """``width`` as a fraction, refused unless it cuts every hidden axis into whole units.

        Raises
        ------
        ConfigError
            Naming the first array and axis the width does not divide.
        """
        ratio = as_fraction(width)
        for name, axes in self.hidden.items():
            for axis in axes:
                for segment in self.segments(name, axis):
                    if not segment.fixed and (ratio * segment.units).denominator != 1:
                        size = self.shapes[name][axis]
                        what = (f"the {size} entries" if segment.units == size
                                else f"the {segment.units} units (of {segment.size} entries)")
                        raise ConfigError(
                            f"model width {width:g} gives {float(ratio * segment.units):g} of {what} of axis {axis} of "
                            f"'{name}'; use a width w with w * {segment.units} a whole number (1/2, 1/4, 1/8 for "
                            "powers of two)")
        return ratio

    def sub_shapes(self, width: float) -> dict[str, tuple[int, ...]]:
        """The shapes a device of ``width`` holds."""
        ratio = self.check_width(width)
        return {name: tuple(sum(segment.scaled_size(ratio) for segment in self.segments(name, axis))
                            if axis in self.hidden[name] else size for axis, size in enumerate(shape))
                for name, shape in self.shapes.items()}

    def window(self, width: float, offset: Offset | Fraction = Offset()) -> Window:
        """The entries a device of ``width`` holds when its window starts at ``offset`` (a Fraction is
        ``Offset(fraction=...)``).

        Raises
        ------
        ValueError
            An offset that does not start every segment at a whole unit.
        """
        ratio = self.check_width(width)
        start = offset if isinstance(offset, Offset) else Offset(fraction=offset)
        return Window(ratio, start, {name: tuple(_axis_window(self.segments(name, axis), ratio, start, self.quanta)
                                                 if axis in self.hidden[name] else None
                                                 for axis, _ in enumerate(shape))
                                     for name, shape in self.shapes.items()})

    def parameters_at(self, width: float) -> int:
        """Entries a device of ``width`` holds."""
        return sum(int(np.prod(shape, dtype=np.int64)) for shape in self.sub_shapes(width).values())


def _axis_window(segments: tuple[Segment, ...], width: Fraction, offset: Offset,
                 quanta: Mapping[int, int]) -> AxisIndex | None:
    """The entries of an axis a window holds: per scaled segment, ``width * units`` consecutive units from
    ``offset``'s start (wrapping around), each unit's entries in order; fixed segments whole."""
    parts, base = [], 0
    for segment in segments:
        if segment.fixed:
            parts.append(base + np.arange(segment.size, dtype=np.intp))
        else:
            if (offset.fraction * segment.units).denominator != 1:
                raise ValueError(f"window offset {offset} does not start a segment of {segment.units} units at a "
                                 "whole unit")
            per = segment.size // segment.units
            first = offset.start(segment.units, quanta.get(segment.units, 1))
            units = (first + np.arange(int(width * segment.units), dtype=np.intp)) % segment.units
            parts.append(base + (units[:, None] * per + np.arange(per, dtype=np.intp)).ravel())
        base += segment.size
    entries = np.concatenate(parts)
    if entries.size == base and np.array_equal(entries, np.arange(base)):
        return None
    if entries.size and np.array_equal(entries, np.arange(entries[0], entries[0] + entries.size)):
        return slice(int(entries[0]), int(entries[0]) + entries.size)
    return entries


class CoverageMean:
    """Each entry's weighted mean over the updates whose window holds it; streaming, O(model) memory.

    HeteroFL's aggregation (Diao et al., ICLR 2021, eq. 3): a parameter entry is averaged over
    the devices that trained it, weighted by their examples. Two float64 buffers per array (the
    weighted sums and the weights that reached each entry), whatever the number of updates.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.shapes = dict(shapes)
        self._sums = {name: np.zeros(shape, np.float64) for name, shape in self.shapes.items()}
        self._weights = {name: np.zeros(shape, np.float64) for name, shape in self.shapes.items()}
        self.count = 0

    def add(self, update: Arrays, window: Window, weight: float) -> None:
        """Add ``weight * update`` (the window's part of the model) to the entries the window holds.

        Raises
        ------
        ValueError
            A weight that is not positive and finite, or an update whose names or shapes are
            not the window's.
        """
        if not np.isfinite(weight) or weight <= 0:
            raise ValueError(f"weight must be positive and finite, got {weight}")
        if update.keys() != self._sums.keys():
            raise ValueError(f"update names {sorted(update)} differ from {sorted(self._sums)}")
        for name, value in update.items():
            index = window.outer_index(name, self.shapes[name])
            block = self._sums[name][index]
            if np.shape(value) != block.shape:
                raise ValueError(f"'{name}' has shape {np.shape(value)}; {window.describe()} holds {block.shape}")
            self._sums[name][index] = block + np.multiply(value, weight, dtype=np.float64)
            self._weights[name][index] += weight
        self.count += 1

    def coverage(self) -> dict[str, NDArray[np.float64]]:
        """The total weight that reached each entry (0: no update held it)."""
        return self._weights

    def result(self, base: Arrays) -> dict[str, NDArray[np.generic]]:
        """The per-entry mean, ``base``'s value where no update held an entry, in ``base``'s dtypes."""
        if self.count == 0:
            raise ValueError("no updates were added; nothing to average")
        out: dict[str, NDArray[np.generic]] = {}
        for name, sums in self._sums.items():
            weights, start = self._weights[name], np.asarray(base[name])
            mean = np.divide(sums, weights, out=start.astype(np.float64), where=weights > 0)
            if np.issubdtype(start.dtype, np.integer):
                mean = np.rint(mean)
            out[name] = np.asarray(mean).astype(start.dtype)
        return out


def covered_within(plan: WidthPlan, width: float, rounds: Iterable[int],
                   stride: int = 0) -> dict[str, NDArray[np.bool_]]:
    """Which entries FedRolex's window of ``width`` (moving ``stride`` units a round, 0: its own length)
    holds in at least one of ``rounds``."""
    seen = {name: np.zeros(shape, bool) for name, shape in plan.shapes.items()}
    for server_round in rounds:
        window = plan.window(width, rolling_offset(width, server_round, stride))
        for name, shape in plan.shapes.items():
            seen[name][window.outer_index(name, shape)] = True
    return seen
