"""Update compression: what devices encode and the coordinator decodes (one wire format).

Codecs, by name (run config ``codec.<profile>``, ``downlink.<profile>``):

* ``fp32``: no compression (plain Flower numpy arrays of the full weights);
* ``fp16``: half precision (values beyond +/-65504 saturate);
* ``int8`` / ``int8:channel``: 8-bit integers with one scale per tensor / per output
  channel, stochastic rounding (unbiased: ``E[decode(encode(x))] = x``); the device
  protocol's ``int8-delta`` is the same quantiser with deterministic round-half-even
  (:data:`ENCODINGS`);
* ``topk:<fraction>``: the largest-magnitude ``fraction`` of the update's entries, one
  threshold across all tensors (Aji & Heafield, EMNLP 2017), with error feedback: what was
  not sent is kept on the device and added to the next update (Stich et al., "Sparsified
  SGD with Memory", NeurIPS 2018);
* compositions ``topk:<fraction>+<quantiser>`` (e.g. ``topk:0.05+int8``): sparsify, then
  quantise the kept values. At most one sparsifier and one quantiser, sparsifier first.

Quantisers are a registry, not string branches: each is one small :class:`Quantiser`
subclass, registered by name with :func:`register_quantiser`, that declares how its name
parses, how many bytes a tensor of a given shape takes, how to encode and how to decode
(behind the one length check every decode goes through). ``fp32``, ``fp16``, ``int8`` and
``int8:channel`` below are the built-in ones; a new quantiser is one more such class, and
:func:`parse_codec`, :func:`encode_update` and :func:`decode_update` then accept its name,
alone or after top-k (:class:`TopK`, the one sparsifier).

Uplink tensors are deltas from the global model the device trained from (deltas are small
and centred, so they quantise and sparsify far better than weights); downlink tensors are
the full global weights (dense codecs only: a device needs the whole model). Each encoded
tensor travels as a Flower ``Array`` with the original ``dtype`` and ``shape``, ``stype``
``fedge.delta/<codec>`` or ``fedge.full/<codec>``, and this layout in ``data``
(little-endian):

* fp32: ``n`` float32; fp16: ``n`` float16; int8: float32 scale(s) (1, or one per
  channel), then ``n`` int8;
* topk: uint32 ``k``, ``k`` indices (uint16 when the tensor has <= 65536 entries, else
  uint32, strictly increasing), then the ``k`` values in the quantiser's layout (fp32 when
  the name has no quantiser).

The device protocol's update encodings (``docs/device-protocol.md``: a result's ``encoding``)
are entries of this module too, :data:`ENCODINGS`: ``fp32`` and ``int8-delta`` (:class:`Int8`
with round-half-even, computed in the delta's own float64), so there is one int8 quantiser.

Every decode checks lengths, index ranges, order and finiteness and raises
:class:`~fedge.errors.UpdateRejected` naming the problem, so a malformed payload is
rejected like any bad update.
"""

from __future__ import annotations

import inspect
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, TypeVar

import numpy as np
from numpy.typing import NDArray

from fedge.errors import ConfigError, UpdateRejected

if TYPE_CHECKING:  # Flower is imported where a record is built: the device protocol's devices have none
    from flwr.app import Array, ArrayRecord

DELTA, FULL = "fedge.delta/", "fedge.full/"
FP16_MAX = float(np.finfo(np.float16).max)
Floats = NDArray[np.floating]
Shape = tuple[int, ...]


# --------------------------------------------------------------------------- quantisers


@dataclass(frozen=True)
class Quantiser(ABC):
    """How the values of one tensor travel: one registered name, one byte layout.

    Subclasses set :attr:`name` and implement :meth:`payload_bytes`, :meth:`encode` and
    :meth:`unpack`; :func:`register_quantiser` makes the name usable in codec names. Two
    quantisers are equal when they are of the same class (and, for a dataclass subclass
    with parameters, have the same parameters).
    """

    name: ClassVar[str]
    """The name in codec names and stypes (``"int8:channel"``)."""

    @classmethod
    def parse(cls, spec: str) -> Quantiser | None:
        """The quantiser ``spec`` names, or None if it is not one of this class's.

        :func:`parse_codec` asks the class registered under ``spec`` (or, for a spec like
        ``"name:argument"``, under ``"name"``), so a quantiser with parameters overrides this
        and returns an instance whose :attr:`spec` reproduces ``spec``.
        """
        return cls() if spec == cls.name else None

    @property
    def spec(self) -> str:
        """This quantiser as written in a codec name (its :attr:`name` unless it has parameters)."""
        return self.name

    @abstractmethod
    def payload_bytes(self, shape: Shape) -> int:
        """Bytes an encoded tensor of ``shape`` takes (computed without allocating anything)."""

    @abstractmethod
    def encode(self, values: NDArray[np.float32], rng: np.random.Generator) -> bytes:
        """``values`` (float32, the tensor's shape) as exactly ``payload_bytes(values.shape)`` bytes.

        ``rng`` is for stochastic rounding; a deterministic quantiser ignores it (and must not
        draw from it: the draws of later tensors would change).
        """

    @abstractmethod
    def unpack(self, data: bytes, shape: Shape, name: str) -> Floats:
        """The ``prod(shape)`` values (flat, float32) in ``data``, whose length :meth:`decode` checked.

        Raises
        ------
        UpdateRejected
            Anything besides the length that makes ``data`` invalid (e.g. a negative scale).
        """

    def decode(self, data: bytes, shape: Shape, name: str) -> Floats:
        """The ``prod(shape)`` values (flat, float32) that ``data`` carries for array ``name``.

        Raises
        ------
        UpdateRejected
            ``data`` has the wrong length for ``shape`` (checked here, for every quantiser,
            before anything is allocated), or :meth:`unpack` refuses it.
        """
        expected = self.payload_bytes(shape)
        if len(data) != expected:
            raise UpdateRejected(f"array '{name}' carries {len(data)} bytes; {self.spec} of {math.prod(shape)} "
                                 f"values needs {expected}")
        return self.unpack(data, shape, name)


_REGISTRY: dict[str, type[Quantiser]] = {}
QUANTISERS: Mapping[str, type[Quantiser]] = MappingProxyType(_REGISTRY)
"""The registered quantisers by name, in registration order (read-only)."""

Q = TypeVar("Q", bound=type[Quantiser])
_NAME = re.compile(r"[a-z][a-z0-9_.-]*(:[a-z0-9_.-]+)?")


def register_quantiser(cls: Q) -> Q:
    """Class decorator: make ``cls.name`` a quantiser name that codec names may use.

    Raises
    ------
    ValueError
        A name that is taken, is not lower-case ``name`` or ``name:variant`` (``+`` joins
        codec parts), or starts like the sparsifier (``topk``); or an abstract class.
    """
    if inspect.isabstract(cls):
        raise ValueError(f"quantiser {cls.__qualname__} leaves {', '.join(sorted(cls.__abstractmethods__))} "
                         "unimplemented")
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.startswith(TopK.prefix):
        raise ValueError(f"quantiser {cls.__qualname__}: name {name!r} must look like 'int8' or 'int8:channel' "
                         f"and not start with '{TopK.prefix}'")
    if name in _REGISTRY:
        raise ValueError(f"quantiser {cls.__qualname__}: '{name}' is already {_REGISTRY[name].__qualname__}")
    _REGISTRY[name] = cls
    return cls


def unregister_quantiser(name: str) -> None:
    """Forget the quantiser registered as ``name`` (tests that register their own).

    Raises
    ------
    KeyError
        No quantiser is registered as ``name``.
    """
    del _REGISTRY[name]


def _lookup_quantiser(spec: str) -> Quantiser | None:
    """The quantiser ``spec`` names: the class registered as ``spec``, else as the part before ``:``."""
    cls = _REGISTRY.get(spec) or _REGISTRY.get(spec.split(":", 1)[0])
    return cls.parse(spec) if cls is not None else None


# --------------------------------------------------------------------------- the sparsifier


@dataclass(frozen=True)
class TopK:
    """Top-k sparsification (Aji & Heafield, EMNLP 2017): keep the ``fraction`` of entries of
    largest magnitude; the caller keeps the rest as error feedback (Stich et al., NeurIPS 2018).

    Layout: uint32 ``k``, ``k`` strictly increasing indices (uint16 for tensors of <= 65536
    entries, else uint32), then the ``k`` kept values in a quantiser's layout.
    """

    fraction: float
    prefix: ClassVar[str] = "topk"

    @classmethod
    def parse(cls, part: str, key: str, text: str) -> TopK:
        """``"topk:0.01"`` -> ``TopK(0.01)``; ``key`` and ``text`` name the setting in errors.

        Raises
        ------
        ConfigError
            Not ``topk:<number>``, or a fraction outside (0, 1].
        """
        match = re.fullmatch(rf"{cls.prefix}:(.+)", part)
        if match is None:
            raise ConfigError(f"{key} = '{text}': write top-k as '{cls.prefix}:<fraction>', e.g. '{cls.prefix}:0.01'")
        raw = match.group(1)
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{key} = '{text}': '{raw}' is not a number") from None
        if not 0 < value <= 1:
            raise ConfigError(f"{key} = '{text}': the top-k fraction must be in (0, 1], got {value:g}")
        return cls(value)

    @property
    def spec(self) -> str:
        """As written in a codec name."""
        return f"{self.prefix}:{self.fraction:g}"

    def keep(self, size: int) -> int:
        """Entries kept of a tensor of ``size`` entries sent alone (at least one when there are any)."""
        return max(1, math.ceil(self.fraction * size)) if size else 0

    def budget(self, deltas: Mapping[str, Floats]) -> dict[str, int]:
        """Entries each tensor keeps when the ``fraction`` largest of the whole update are sent
        (one threshold for all tensors, so the budget goes where the update is large)."""
        sizes = [delta.size for delta in deltas.values()]
        total = sum(sizes)
        if not total:
            return dict.fromkeys(deltas, 0)
        magnitudes = np.concatenate([np.abs(delta).ravel() for delta in deltas.values()])
        k = self.keep(total)
        chosen = np.argpartition(magnitudes, total - k)[total - k:]  # exactly k, ties broken arbitrarily
        per_tensor = np.bincount(np.searchsorted(np.cumsum(sizes), chosen, side="right"), minlength=len(sizes))
        return {name: int(count) for name, count in zip(deltas, per_tensor, strict=True)}

    @staticmethod
    def index_dtype(size: int) -> str:
        """The dtype of the indices into a tensor of ``size`` entries."""
        return "<u2" if size <= 65536 else "<u4"

    def payload_bytes(self, size: int, k: int, quantiser: Quantiser) -> int:
        """Bytes of ``k`` entries of a tensor of ``size`` entries, values under ``quantiser``."""
        return 4 + np.dtype(self.index_dtype(size)).itemsize * k + quantiser.payload_bytes((k,))

    def encode(self, flat: NDArray[np.float32], quantiser: Quantiser, rng: np.random.Generator,
               keep: int | None = None) -> bytes:
        """The ``keep`` (default :meth:`keep`) largest-magnitude entries of ``flat``."""
        size = flat.size
        k = min(self.keep(size) if keep is None else keep, size)
        indices = np.sort(np.argpartition(np.abs(flat), size - k)[size - k:]) if k else np.zeros(0, np.int64)
        return (np.uint32(k).astype("<u4").tobytes() + indices.astype(self.index_dtype(size)).tobytes()
                + quantiser.encode(flat[indices], rng))

    def decode(self, data: bytes, size: int, quantiser: Quantiser, name: str) -> Floats:
        """The ``size`` values (flat, float32; zero where nothing was sent) in ``data``.

        Raises
        ------
        UpdateRejected
            A count, index or value section that does not fit ``size`` or ``data``.
        """
        if len(data) < 4:
            raise UpdateRejected(f"array '{name}' is too short to hold a top-k count")
        k = int(np.frombuffer(data[:4], "<u4")[0])
        if k > size:
            raise UpdateRejected(f"array '{name}' claims {k} kept entries of {size}")
        index_dtype = self.index_dtype(size)
        end = 4 + np.dtype(index_dtype).itemsize * k
        if len(data) < end:
            raise UpdateRejected(f"array '{name}' is too short for {k} indices")
        indices = np.frombuffer(data[4:end], index_dtype).astype(np.int64)
        if k and (indices.max() >= size):
            raise UpdateRejected(f"array '{name}' has an index {int(indices.max())} out of range (size {size})")
        if np.any(np.diff(indices) <= 0):
            raise UpdateRejected(f"array '{name}' has duplicated or unsorted indices")
        flat = np.zeros(size, np.float32)
        flat[indices] = quantiser.decode(data[end:], (k,), name)
        return flat


# --------------------------------------------------------------------------- built-in quantisers


@register_quantiser
class Fp32(Quantiser):
    """Single precision, exact: ``n`` little-endian float32."""

    name = "fp32"

    def payload_bytes(self, shape: Shape) -> int:
        return 4 * math.prod(shape)

    def encode(self, values: NDArray[np.float32], rng: np.random.Generator) -> bytes:
        return values.astype("<f4").tobytes()

    def unpack(self, data: bytes, shape: Shape, name: str) -> Floats:
        return np.frombuffer(data, "<f4").astype(np.float32)


@register_quantiser
class Fp16(Quantiser):
    """Half precision: ``n`` little-endian float16; values beyond +/-65504 saturate instead of
    overflowing to inf."""

    name = "fp16"

    def payload_bytes(self, shape: Shape) -> int:
        return 2 * math.prod(shape)

    def encode(self, values: NDArray[np.float32], rng: np.random.Generator) -> bytes:
        return np.clip(values, -FP16_MAX, FP16_MAX).astype("<f2").tobytes()

    def unpack(self, data: bytes, shape: Shape, name: str) -> Floats:
        return np.frombuffer(data, "<f2").astype(np.float32)


STOCHASTIC, NEAREST_EVEN = "stochastic", "nearest-even"
ROUNDINGS = (STOCHASTIC, NEAREST_EVEN)


@register_quantiser
@dataclass(frozen=True)
class Int8(Quantiser):
    """8-bit integers with one float32 scale ``max|x| / 127`` per group of values (one group:
    the whole tensor), stochastic rounding ``floor(x / s + u)``, ``u ~ U[0, 1)`` (unbiased), or
    with ``rounding = "nearest-even"`` deterministic round-half-even ``rint(x / s)`` (the device
    protocol's ``int8-delta``, :data:`ENCODINGS`).

    Layout: the scales (float32), then ``n`` int8.
    """

    name = "int8"
    rounding: str = STOCHASTIC

    def __post_init__(self) -> None:
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"int8 rounding {self.rounding!r}: use one of {', '.join(ROUNDINGS)}")

    def groups(self, shape: Shape) -> int:
        """How many scales a tensor of ``shape`` gets (rows of the values in C order)."""
        return 1

    def payload_bytes(self, shape: Shape) -> int:
        return 4 * self.groups(shape) + math.prod(shape)

    def quantise(self, values: NDArray[np.floating], rng: np.random.Generator | None = None
                 ) -> tuple[NDArray[np.int8], NDArray[np.floating]]:
        """``values`` as int8 (their shape) and each group's scale, computed in ``values``' own precision.

        ``scale = max|group| / 127``; ``q = round(x / scale)`` clipped to [-127, 127] (0 where the
        scale is 0), rounded as :attr:`rounding` says: stochastic draws ``values.size`` uniforms
        from ``rng``; round-half-even draws nothing. ``value = q * scale`` reads it back.

        Raises
        ------
        ValueError
            Stochastic rounding without an ``rng``.
        """
        groups, flat = self.groups(values.shape), values.ravel()
        rows = flat.reshape(groups, -1) if flat.size else flat.reshape(groups, 0)
        scales = np.abs(rows).max(axis=1, initial=0.0) / 127.0
        safe = np.where(scales > 0, scales, 1.0)[:, None]
        if self.rounding == NEAREST_EVEN:
            rounded = np.rint(rows / safe)
        elif rng is None:
            raise ValueError("stochastic int8 rounding draws from a generator; pass rng")
        else:  # floor(x / s + u), u ~ U[0, 1): unbiased, and |x / s| <= 127 keeps it in range
            rounded = np.floor(rows / safe + rng.random(rows.shape))
        return rounded.clip(-127, 127).astype("<i1").reshape(values.shape), scales

    def encode(self, values: NDArray[np.float32], rng: np.random.Generator) -> bytes:
        quantised, scales = self.quantise(values, rng)
        return scales.astype("<f4").tobytes() + quantised.tobytes()

    def unpack(self, data: bytes, shape: Shape, name: str) -> Floats:
        groups = self.groups(shape)
        scales = np.frombuffer(data[:4 * groups], "<f4").astype(np.float32)
        if not np.all(np.isfinite(scales)) or np.any(scales < 0):
            raise UpdateRejected(f"array '{name}' has an invalid int8 scale")
        values = np.frombuffer(data[4 * groups:], "<i1").astype(np.float32).reshape(groups, -1)
        return (values * scales[:, None]).ravel()


@register_quantiser
class Int8Channel(Int8):
    """:class:`Int8` with one scale per output channel (the first dimension) of a 2-D+ tensor;
    a 1-D tensor, e.g. a bias, gets one scale (a scale per entry would outweigh the entries)."""

    name = "int8:channel"

    def groups(self, shape: Shape) -> int:
        return shape[0] if len(shape) >= 2 and shape[0] > 0 else 1


FP32 = Fp32()
"""What values travel as when a codec names no quantiser."""


# --------------------------------------------------------------------------- the device protocol's encodings

_ENCODINGS: dict[str, Quantiser] = {}
ENCODINGS: Mapping[str, Quantiser] = MappingProxyType(_ENCODINGS)
"""The device protocol's update encodings by their wire names (a result's ``encoding``,
``docs/device-protocol.md``), in registration order (read-only): ``fp32`` (the trained weights
as they are) and ``int8-delta`` (the delta from the global model, :class:`Int8` with
round-half-even, one scale per tensor)."""
INT8_DELTA = "int8-delta"


def register_encoding(name: str, quantiser: Quantiser) -> Quantiser:
    """Make ``quantiser`` the device protocol's encoding ``name``.

    Raises
    ------
    ValueError
        A name that is taken.
    """
    return _registered(_ENCODINGS, "encoding", name, quantiser)


def _registered(table: dict[str, Quantiser], what: str, name: str, quantiser: Quantiser) -> Quantiser:
    """``quantiser`` entered in ``table`` under ``name`` (ValueError naming the taken ``what``)."""
    if name in table:
        raise ValueError(f"device-protocol {what} '{name}' is already {table[name]!r}")
    table[name] = quantiser
    return quantiser


register_encoding(FP32.spec, FP32)
register_encoding(INT8_DELTA, Int8(rounding=NEAREST_EVEN))


_TASK_ENCODINGS: dict[str, Quantiser] = {}
TASK_ENCODINGS: Mapping[str, Quantiser] = MappingProxyType(_TASK_ENCODINGS)
"""The device protocol's task (downlink) encodings by name, in registration order (read-only):
how a gateway sends a round's model to its devices (``fedge gateway start --downlink``). ``fp32``
is exact; ``fp16`` halves the bytes, ``int8`` (one scale per tensor, round-half-even) quarters
them. A device names the lossy ones it reads in its check-in's capabilities
(:func:`task_capability`); the gateway keeps the copy each device received, so the device's
update is taken against what it trained from and nothing of the downlink's rounding reaches
the model (``docs/device-protocol.md``, "Task encodings")."""
TASK_CAPABILITY_PREFIX = "task:"


def register_task_encoding(name: str, quantiser: Quantiser) -> Quantiser:
    """Make ``quantiser`` the device protocol's task encoding ``name``.

    Raises
    ------
    ValueError
        A name that is taken.
    """
    return _registered(_TASK_ENCODINGS, "task encoding", name, quantiser)


def task_capability(name: str) -> str:
    """The check-in capability with which a device says it reads tasks in encoding ``name``."""
    return TASK_CAPABILITY_PREFIX + name


register_task_encoding(FP32.spec, FP32)
register_task_encoding(Fp16.name, Fp16())
register_task_encoding(Int8.name, Int8(rounding=NEAREST_EVEN))


# --------------------------------------------------------------------------- codecs


@dataclass(frozen=True)
class Codec:
    """A parsed codec: an optional top-k fraction, then an optional quantiser (None: fp32)."""

    fraction: float | None = None
    quantiser: Quantiser | None = None
    delta: bool = False  # fp32 as a delta (what a device trained from a lossy downlink copy sends)

    def __post_init__(self) -> None:
        if self.quantiser == FP32:  # one spelling: no quantiser means fp32 values
            object.__setattr__(self, "quantiser", None)

    @property
    def values(self) -> Quantiser:
        """The quantiser the values travel in."""
        return self.quantiser or FP32

    @property
    def topk(self) -> TopK | None:
        """The sparsifier, if any."""
        return TopK(self.fraction) if self.fraction is not None else None

    @property
    def name(self) -> str:
        """The canonical name (what ``stype`` carries)."""
        parts = ([self.topk.spec] if self.topk is not None else []) + (
            [self.quantiser.spec] if self.quantiser is not None else [])
        return "+".join(parts) or FP32.spec

    @property
    def lossless(self) -> bool:
        """``fp32`` as plain Flower arrays of the weights."""
        return self.fraction is None and self.quantiser is None and not self.delta

    @property
    def sparse(self) -> bool:
        """Whether this codec drops entries (and so needs error feedback)."""
        return self.fraction is not None

    def payload_bytes(self, shape: Shape, *, keep: int | None = None) -> int:
        """Bytes of an encoded tensor of ``shape`` (``keep``: entries top-k keeps, default its fraction)."""
        size = math.prod(shape)
        if self.topk is None:
            return self.values.payload_bytes(shape)
        return self.topk.payload_bytes(size, min(self.topk.keep(size) if keep is None else keep, size), self.values)

    def encode(self, values: NDArray[np.float32], rng: np.random.Generator, keep: int | None = None) -> bytes:
        """The payload of one float32 tensor (``keep``: entries top-k keeps, default its fraction)."""
        if self.topk is None:
            return self.values.encode(values, rng)
        return self.topk.encode(values.ravel(), self.values, rng, keep)

    def decode(self, data: bytes, shape: Shape, name: str) -> Floats:
        """The ``prod(shape)`` values (flat, float32) of payload ``data`` of array ``name``.

        Raises
        ------
        UpdateRejected
            A payload that disagrees with ``shape``.
        """
        if self.topk is None:
            return self.values.decode(data, shape, name)
        return self.topk.decode(data, math.prod(shape), self.values, name)


def parse_codec(text: str, *, key: str = "codec") -> Codec:
    """``"topk:0.01+int8"`` -> :class:`Codec`.

    Each ``+``-separated part is the sparsifier (``topk:<fraction>``) or a registered
    quantiser (:data:`QUANTISERS`).

    Raises
    ------
    ConfigError
        Unknown name, a fraction outside (0, 1], or an impossible composition.
    """
    text = text.strip()
    if not text:
        return Codec()
    topk: TopK | None = None
    quantiser: Quantiser | None = None
    for part in text.split("+"):
        if part.startswith(TopK.prefix):
            if quantiser is not None or topk is not None:
                raise ConfigError(f"{key} = '{text}': top-k must come first and only once (sparsify, then "
                                  "quantise the kept values), e.g. 'topk:0.01+int8'")
            topk = TopK.parse(part, key, text)
            continue
        found = _lookup_quantiser(part)
        if found is None:
            raise ConfigError(f"{key} = '{text}': unknown codec '{part}'; use {', '.join(QUANTISERS)}, "
                              "topk:<fraction>, or a composition such as 'topk:0.05+int8'")
        if quantiser is not None:
            raise ConfigError(f"{key} = '{text}': at most one quantiser ({', '.join(QUANTISERS)})")
        quantiser = found
    return Codec(topk.fraction if topk is not None else None, quantiser)


# --------------------------------------------------------------------------- one tensor


def encode_tensor(values: Floats, codec: Codec, rng: np.random.Generator, *, full: bool = False,
                  keep: int | None = None) -> Array:
    """Encode one tensor (a delta, or full weights with ``full``) as a Flower ``Array``.

    ``keep``: how many entries top-k keeps here (default: the codec's fraction of this tensor).

    Raises
    ------
    ConfigError
        Full weights under top-k (which only carries deltas; decoders refuse it).
    """
    if full and codec.sparse:
        raise ConfigError(f"codec '{codec.name}': top-k cannot carry full weights (a device needs the whole "
                          "model); use fp32, fp16 or int8")
    from flwr.app import Array  # noqa: PLC0415 - see the TYPE_CHECKING import

    payload = codec.encode(np.asarray(values, np.float32), rng, keep)
    return Array(dtype=str(values.dtype), shape=tuple(values.shape), stype=(FULL if full else DELTA) + codec.name,
                 data=payload)


def decode_tensor(array: Array, name: str = "array") -> tuple[Floats, bool]:
    """The float32 values an encoded ``Array`` carries, and whether they are full weights.

    Only as many values as the payload's bytes (dense codecs) or the declared shape
    (top-k deltas, whose shape the caller has checked against the model) are allocated.

    Raises
    ------
    UpdateRejected
        Unknown stype, an invalid shape, top-k full weights, or a payload that disagrees
        with its declared size.
    """
    stype = str(array.stype)
    if not stype.startswith((DELTA, FULL)):
        raise UpdateRejected(f"array '{name}' has stype {_shown(stype)}, which fedge cannot decode")
    try:
        codec = parse_codec(stype.split("/", 1)[1])
    except ConfigError as exc:
        raise UpdateRejected(f"array '{name}': {str(exc)[:200]}") from None
    full = stype.startswith(FULL)
    if full and codec.sparse:  # a device needs the whole model: full weights are never top-k
        raise UpdateRejected(f"array '{name}' has stype {_shown(stype)}: top-k carries a delta, "
                             "full weights must be dense (fp32, fp16, int8)")
    shape = _shape(array.shape, name)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is rejected just below
        flat = codec.decode(bytes(array.data), shape, name)
    if not np.all(np.isfinite(flat)):
        raise UpdateRejected(f"array '{name}' decodes to NaN or Inf")
    return flat.reshape(shape), full


def _shape(declared: object, name: str) -> Shape:
    """``declared`` as a tuple of ints >= 0 (Flower's wire format allows negative dimensions)."""
    dims: list[int] = []
    for dim in declared if isinstance(declared, tuple | list) else [None]:
        if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim < 0:
            raise UpdateRejected(f"array '{name}' has an invalid shape {_shown(declared)}; dimensions must "
                                 "be integers >= 0")
        dims.append(int(dim))
    return tuple(dims)


def _shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters (a device chooses it)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# --------------------------------------------------------------------------- a whole update


def encode_update(
    local: Mapping[str, Floats], base: Mapping[str, Floats], codec: Codec, rng: np.random.Generator,
    residual: Mapping[str, Floats] | None = None,
) -> tuple[ArrayRecord, dict[str, Floats]]:
    """Encode ``local - base`` (+ ``residual`` for top-k); return the record and the new residual.

    Error feedback: for a sparse codec, ``residual' = (delta + residual) - decoded(sent)``,
    so what was not sent is sent later; the sum of what is sent plus the last residual equals
    the sum of the true deltas.
    """
    from flwr.app import ArrayRecord  # noqa: PLC0415 - see the TYPE_CHECKING import

    deltas = {}
    for name in local:
        delta = np.asarray(local[name], np.float32) - np.asarray(base[name], np.float32)
        if codec.sparse and residual is not None and name in residual and residual[name].shape == delta.shape:
            delta = (delta + residual[name]).astype(np.float32)
        deltas[name] = delta
    budget = codec.topk.budget(deltas) if codec.topk is not None else {}
    record, kept = ArrayRecord(), {}
    for name, delta in deltas.items():
        encoded = encode_tensor(delta, codec, rng, keep=budget.get(name))
        record[name] = encoded
        if codec.sparse:
            kept[name] = (delta - decode_tensor(encoded, name)[0]).astype(np.float32)
    return record, kept


def decode_update(record: ArrayRecord, reference: Mapping[str, NDArray[np.generic]] | None) -> dict[str, Floats]:
    """Full weights from an encoded record: ``reference + delta`` (or the full weights sent).

    Raises
    ------
    UpdateRejected
        A payload that does not decode, or a delta with no reference to add it to.
    """
    out = {}
    for name, array in record.items():
        if reference is not None:  # check the declared shape before allocating anything for it
            if name not in reference:
                raise UpdateRejected(f"array {_shown(name)} is not part of the model")
            if tuple(array.shape) != tuple(np.shape(reference[name])):
                raise UpdateRejected(f"array '{name}' has shape {_shown(tuple(array.shape))}, expected "
                                     f"{tuple(np.shape(reference[name]))}")
        elif not str(array.stype).startswith(FULL):  # before decoding: a delta's shape is unchecked
            raise UpdateRejected(f"array {_shown(name)} has stype {_shown(str(array.stype))}, not full weights: "
                                 "a delta, but the receiver has no model to add it to")
        values, full = decode_tensor(array, name)
        if full:
            out[name] = values
            continue
        assert reference is not None  # deltas without a reference were refused above
        base = np.asarray(reference[name])
        if base.shape != values.shape:
            raise UpdateRejected(f"array '{name}' has shape {values.shape}, expected {base.shape}")
        with np.errstate(over="ignore", invalid="ignore"):
            summed = np.asarray(base.astype(np.float32) + values, np.float32)  # 0-d stays an array
        if not np.all(np.isfinite(summed)):
            raise UpdateRejected(f"array '{name}' overflows to Inf when added to the model")
        out[name] = summed
    return out


def is_encoded(record: ArrayRecord) -> bool:
    """Whether any array in ``record`` uses a fedge codec stype."""
    return any(str(array.stype).startswith((DELTA, FULL)) for array in record.values())


def codec_for(profile: str, policy: Mapping[str, object], prefix: str = "codec") -> Codec:
    """The codec ``policy`` (run-config keys ``<prefix>.<profile>`` / ``<prefix>.default``) names for ``profile``."""
    text = str(policy.get(f"{prefix}.{profile}", "") or policy.get(f"{prefix}.default", "") or "fp32")
    return parse_codec(text, key=f"{prefix}.{profile}")
