"""Update compression: what devices encode and the coordinator decodes (one wire format).

Codecs, by name (run config ``codec.<profile>``, ``downlink.<profile>``):

* ``fp32``: no compression (plain Flower numpy arrays of the full weights);
* ``fp16``: half precision (values beyond +/-65504 saturate);
* ``int8`` / ``int8:channel``: 8-bit integers with one scale per tensor / per output
  channel, stochastic rounding (unbiased: ``E[decode(encode(x))] = x``);
* ``topk:<fraction>``: the largest-magnitude ``fraction`` of the update's entries, one
  threshold across all tensors (Aji & Heafield, EMNLP 2017), with error feedback: what was
  not sent is kept on the device and added to the next update (Stich et al., "Sparsified
  SGD with Memory", NeurIPS 2018);
* compositions ``topk:<fraction>+fp16`` and ``topk:<fraction>+int8``: sparsify, then quantise
  the kept values. At most one sparsifier and one quantiser, sparsifier first.

Uplink tensors are deltas from the global model the device trained from (deltas are small
and centred, so they quantise and sparsify far better than weights); downlink tensors are
the full global weights (fp16/int8 only: a device needs the whole model). Each encoded
tensor travels as a Flower ``Array`` with the original ``dtype`` and ``shape``, ``stype``
``fedge.delta/<codec>`` or ``fedge.full/<codec>``, and this layout in ``data``
(little-endian):

* fp16: ``n`` float16; int8: float32 scale(s) (1, or one per channel), then ``n`` int8;
* topk: uint32 ``k``, ``k`` indices (uint16 when the tensor has <= 65536 entries, else
  uint32, strictly increasing), then the ``k`` values as fp32, fp16 or int8 (scale first).

Every decode checks lengths, index ranges, order and finiteness and raises
:class:`~fedge.errors.UpdateRejected` naming the problem, so a malformed payload is
rejected like any bad update.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord
from numpy.typing import NDArray

from fedge.errors import ConfigError, UpdateRejected

DELTA, FULL = "fedge.delta/", "fedge.full/"
QUANTISERS = ("fp16", "int8", "int8:channel")
FP16_MAX = float(np.finfo(np.float16).max)
Floats = NDArray[np.floating]


@dataclass(frozen=True)
class Codec:
    """A parsed codec: an optional top-k fraction, then an optional quantiser."""

    fraction: float | None = None
    quantiser: str | None = None
    delta: bool = False  # fp32 as a delta (what a device trained from a lossy downlink copy sends)

    @property
    def name(self) -> str:
        """The canonical name (what ``stype`` carries)."""
        parts = ([f"topk:{self.fraction:g}"] if self.fraction is not None else []) + (
            [self.quantiser] if self.quantiser else [])
        return "+".join(parts) or "fp32"

    @property
    def lossless(self) -> bool:
        """``fp32`` as plain Flower arrays of the weights."""
        return self.fraction is None and self.quantiser is None and not self.delta

    @property
    def sparse(self) -> bool:
        """Whether this codec drops entries (and so needs error feedback)."""
        return self.fraction is not None


def parse_codec(text: str, *, key: str = "codec") -> Codec:
    """``"topk:0.01+int8"`` -> :class:`Codec`.

    Raises
    ------
    ConfigError
        Unknown name, a fraction outside (0, 1], or an impossible composition.
    """
    text = text.strip()
    if text in ("", "fp32"):
        return Codec()
    fraction: float | None = None
    quantiser: str | None = None
    for part in text.split("+"):
        if part.startswith("topk"):
            match = re.fullmatch(r"topk:(.+)", part)
            if match is None:
                raise ConfigError(f"{key} = '{text}': write top-k as 'topk:<fraction>', e.g. 'topk:0.01'")
            if quantiser is not None or fraction is not None:
                raise ConfigError(f"{key} = '{text}': top-k must come first and only once (sparsify, then "
                                  "quantise the kept values), e.g. 'topk:0.01+int8'")
            fraction = _fraction(match.group(1), key, text)
        elif part in QUANTISERS:
            if quantiser is not None:
                raise ConfigError(f"{key} = '{text}': at most one quantiser ({', '.join(QUANTISERS)})")
            quantiser = part
        else:
            raise ConfigError(f"{key} = '{text}': unknown codec '{part}'; use fp32, fp16, int8, int8:channel, "
                              "topk:<fraction>, or a composition such as 'topk:0.05+int8'")
    return Codec(fraction, quantiser)


def _fraction(raw: str, key: str, text: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{key} = '{text}': '{raw}' is not a number") from None
    if not 0 < value <= 1:
        raise ConfigError(f"{key} = '{text}': the top-k fraction must be in (0, 1], got {value:g}")
    return value


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
    flat = np.asarray(values, np.float32).ravel()
    if codec.fraction is not None:
        payload = _encode_topk(flat, codec, rng, keep)
    else:
        payload = _encode_dense(flat, codec.quantiser, rng, channels=_channels(values.shape, codec.quantiser))
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
    size = math.prod(shape)
    data = bytes(array.data)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is rejected just below
        if codec.fraction is not None:
            flat = _decode_topk(data, size, codec.quantiser, name)
        else:
            flat = _decode_dense(data, size, codec.quantiser, _channels(shape, codec.quantiser), name)
    if not np.all(np.isfinite(flat)):
        raise UpdateRejected(f"array '{name}' decodes to NaN or Inf")
    return flat.reshape(shape), full


def _shape(declared: object, name: str) -> tuple[int, ...]:
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


def _channels(shape: tuple[int, ...], quantiser: str | None) -> int:
    """Scales per tensor: one per output channel for ``int8:channel`` on 2-D+ tensors (a 1-D
    tensor, e.g. a bias, gets one scale: a scale per entry would outweigh the entries)."""
    return shape[0] if quantiser == "int8:channel" and len(shape) >= 2 and shape[0] > 0 else 1


def _encode_dense(flat: Floats, quantiser: str | None, rng: np.random.Generator, *, channels: int = 1) -> bytes:
    if quantiser is None:
        return flat.astype("<f4").tobytes()
    if quantiser == "fp16":  # saturate instead of overflowing to inf
        return np.clip(flat, -FP16_MAX, FP16_MAX).astype("<f2").tobytes()
    rows = flat.reshape(channels, -1) if flat.size else flat.reshape(channels, 0)
    scales = np.abs(rows).max(axis=1, initial=0.0) / 127.0
    safe = np.where(scales > 0, scales, 1.0)[:, None]
    # stochastic rounding: floor(x / s + u), u ~ U[0, 1): unbiased, and |x / s| <= 127 keeps it in range
    quantised = np.floor(rows / safe + rng.random(rows.shape)).clip(-127, 127).astype("<i1")
    return scales.astype("<f4").tobytes() + quantised.tobytes()


def _decode_dense(data: bytes, size: int, quantiser: str | None, channels: int, name: str) -> Floats:
    width = {None: 4, "fp16": 2}.get(quantiser, 1)
    header = 4 * channels if quantiser in ("int8", "int8:channel") else 0
    if len(data) != header + width * size:
        raise UpdateRejected(f"array '{name}' carries {len(data)} bytes; {quantiser or 'fp32'} of {size} values "
                             f"needs {header + width * size}")
    if quantiser is None:
        return np.frombuffer(data, "<f4").astype(np.float32)
    if quantiser == "fp16":
        return np.frombuffer(data, "<f2").astype(np.float32)
    scales = np.frombuffer(data[:header], "<f4").astype(np.float32)
    if not np.all(np.isfinite(scales)) or np.any(scales < 0):
        raise UpdateRejected(f"array '{name}' has an invalid int8 scale")
    values = np.frombuffer(data[header:], "<i1").astype(np.float32).reshape(channels, -1)
    return (values * scales[:, None]).ravel()


def _index_dtype(size: int) -> str:
    return "<u2" if size <= 65536 else "<u4"


def _encode_topk(flat: Floats, codec: Codec, rng: np.random.Generator, keep: int | None = None) -> bytes:
    k = keep if keep is not None else max(1, math.ceil((codec.fraction or 1.0) * flat.size)) if flat.size else 0
    k = min(k, flat.size)
    if k == 0:
        return np.uint32(0).astype("<u4").tobytes() + _encode_dense(flat[:0], codec.quantiser, rng)
    indices = np.sort(np.argpartition(np.abs(flat), flat.size - k)[flat.size - k:]) if k else np.zeros(0, int)
    values = _encode_dense(flat[indices], codec.quantiser, rng)
    return np.uint32(k).astype("<u4").tobytes() + indices.astype(_index_dtype(flat.size)).tobytes() + values


def _decode_topk(data: bytes, size: int, quantiser: str | None, name: str) -> Floats:
    if len(data) < 4:
        raise UpdateRejected(f"array '{name}' is too short to hold a top-k count")
    k = int(np.frombuffer(data[:4], "<u4")[0])
    index_width = 2 if size <= 65536 else 4
    if k > size:
        raise UpdateRejected(f"array '{name}' claims {k} kept entries of {size}")
    end = 4 + index_width * k
    if len(data) < end:
        raise UpdateRejected(f"array '{name}' is too short for {k} indices")
    indices = np.frombuffer(data[4:end], _index_dtype(size)).astype(np.int64)
    if k and (indices.max() >= size):
        raise UpdateRejected(f"array '{name}' has an index {int(indices.max())} out of range (size {size})")
    if np.any(np.diff(indices) <= 0):
        raise UpdateRejected(f"array '{name}' has duplicated or unsorted indices")
    flat = np.zeros(size, np.float32)
    flat[indices] = _decode_dense(data[end:], k, quantiser, 1, name)
    return flat


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
    deltas = {}
    for name in local:
        delta = np.asarray(local[name], np.float32) - np.asarray(base[name], np.float32)
        if codec.sparse and residual is not None and name in residual and residual[name].shape == delta.shape:
            delta = (delta + residual[name]).astype(np.float32)
        deltas[name] = delta
    budget = _global_topk(deltas, codec.fraction) if codec.fraction is not None else {}
    record, kept = ArrayRecord(), {}
    for name, delta in deltas.items():
        encoded = encode_tensor(delta, codec, rng, keep=budget.get(name))
        record[name] = encoded
        if codec.sparse:
            kept[name] = (delta - decode_tensor(encoded, name)[0]).astype(np.float32)
    return record, kept


def _global_topk(deltas: Mapping[str, Floats], fraction: float) -> dict[str, int]:
    """Entries each tensor keeps when the ``fraction`` largest of the whole update are sent
    (one threshold for all tensors, so the budget goes where the update is large)."""
    sizes = [delta.size for delta in deltas.values()]
    total = sum(sizes)
    if not total:
        return dict.fromkeys(deltas, 0)
    magnitudes = np.concatenate([np.abs(delta).ravel() for delta in deltas.values()])
    k = max(1, math.ceil(fraction * total))
    chosen = np.argpartition(magnitudes, total - k)[total - k:]  # exactly k, ties broken arbitrarily
    per_tensor = np.bincount(np.searchsorted(np.cumsum(sizes), chosen, side="right"), minlength=len(sizes))
    return {name: int(count) for name, count in zip(deltas, per_tensor, strict=True)}


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
