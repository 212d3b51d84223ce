"""Fuzzing the parsers that read untrusted input (security issue 12).

Each fuzz test starts from valid inputs made by fedge's own writers (the codec encoder,
a fleet TOML, a run-config string, a checkpoint file), mutates them (flip, insert, delete
and overwrite bytes, change types and shapes, drop keys, huge/negative/NaN/inf numbers)
or draws them at random, and checks the parser's contract: either a valid result, or an
error from :mod:`fedge.errors` naming the problem; never another exception, never a hang
and never a huge allocation. Every crash found is pinned by a regular regression test
below its fuzz test (a parametrize table of the inputs that used to crash).

``FEDGE_FUZZ_EXAMPLES=50000`` runs more cases (see ``tests/fuzzing.py``).
"""

from __future__ import annotations

import ast
import datetime
import functools
import io
import json
import math
import struct
import tempfile
import tomllib
import warnings
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from hypothesis import given
from hypothesis import strategies as st
from numpy.typing import NDArray

from fedge import wire
from fedge.codec import decode_update, encode_tensor, encode_update, parse_codec
from fedge.config import DEFAULTS, parse_run_config_args, resolve_run_config
from fedge.errors import CheckpointMismatch, ConfigError, UpdateRejected
from fedge.profiles import MAX_FLEET_SIZE, Fleet, parse_fleet
from fedge.server.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fedge.strategies.validation import ReplyValidator, spec_of
from fuzzing import FUZZ_EXAMPLES, bounded, fuzz
from fuzzing import mutated as fuzzing_mutated

# --------------------------------------------------------------------------- shared mutation helpers

# Values that break parsers: bit patterns of NaN, +/-inf, 0, -1, the largest finite float32,
# and integer counts at the edges of their types.
INTERESTING_BYTES = [
    struct.pack("<f", math.nan), struct.pack("<f", math.inf), struct.pack("<f", -math.inf),
    struct.pack("<f", 0.0), struct.pack("<f", -1.0), struct.pack("<f", 3.4e38), struct.pack("<f", 1e-45),
    struct.pack("<e", math.nan), struct.pack("<e", math.inf), struct.pack("<e", 65504.0),
    struct.pack("<I", 0), struct.pack("<I", 1), struct.pack("<I", 2**32 - 1), struct.pack("<I", 10**9),
    struct.pack("<I", 65536), struct.pack("<H", 0), struct.pack("<H", 65535), b"\x00", b"\xff", b"\x7f", b"\x80",
]


def mutated(original: bytes, max_ops: int = 4) -> st.SearchStrategy[bytes]:
    """:func:`fuzzing.mutated` with this file's interesting field values."""
    return fuzzing_mutated(original, max_ops, interesting=INTERESTING_BYTES)


# --------------------------------------------------------------------------- 1. reply decoding (codecs)

# Global models: small tensors, a scalar, an empty tensor, and one with > 65536 entries
# (top-k then uses uint32 indices instead of uint16).
MODELS: list[dict[str, tuple[int, ...]]] = [
    {"w": (4, 3), "b": (3,)},
    {"conv": (2, 1, 3, 3), "scale": (), "empty": (0, 4)},
    {"big": (300, 256), "b": (5,)},
]
CODECS = ["fp32", "fp32-delta", "fp16", "int8", "int8:channel", "topk:0.1", "topk:1", "topk:0.01+int8", "topk:0.3+fp16",
          "topk:0.5+int8:channel", "topk:0.001"]
DOWNLINK_CODECS = ["fp16", "int8", "int8:channel", "fp32-full"]
STYPES = ["fedge.delta/fp32", "fedge.full/fp32", "fedge.delta/fp16", "fedge.full/int8", "fedge.delta/int8:channel",
          "fedge.delta/topk:0.1", "fedge.full/topk:0.1", "fedge.delta/topk:0.1+int8", "fedge.delta/topk:nan",
          "fedge.delta/topk:1e-50", "fedge.delta/topk:0.1+zip", "fedge.delta/", "fedge.delta", "fedge.full/ int8 ",
          "numpy.ndarray", "", "fedge.delta/int8+fp16", "fedge.delta/topk:inf+int8"]
DTYPES = ["float32", "float16", "float64", "int8", "int64", "bool", "object", "<U5", "bogus", ""]
DIM = st.one_of(st.integers(0, 6), st.sampled_from([-1, -7, 2**31 - 1, -(2**31), 65536, 65537, 10**6]))


@functools.cache
def _model(index: int) -> dict[str, np.ndarray]:
    """Global model ``index`` of :data:`MODELS` (cached: decoding never writes to it)."""
    rng = np.random.default_rng(index)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in MODELS[index].items()}


@functools.cache
def _encoded(model: int, codec_name: str, seed: int, magnitude: float) -> ArrayRecord:
    """A valid encoded reply (uplink delta) or downlink record (full weights) under ``codec_name``
    (cached: the fuzz tests build new ``Array`` objects instead of changing these)."""
    base = _model(model)
    rng = np.random.default_rng(seed)
    local = {name: np.asarray(value + rng.standard_normal(value.shape) * magnitude, np.float32)
             for name, value in base.items()}
    if codec_name == "fp32":  # lossless: plain Flower arrays of the trained weights
        return ArrayRecord({name: Array(value) for name, value in local.items()})
    if codec_name == "fp32-full":
        return ArrayRecord({name: encode_tensor(value, parse_codec("fp32"), rng, full=True)
                            for name, value in local.items()})
    if codec_name == "fp32-delta":  # what a device that trained from a lossy downlink sends
        record, _ = encode_update(local, base, parse_codec("fp32"), rng)
        return record
    if codec_name in DOWNLINK_CODECS and seed % 2:  # the coordinator's downlink encoding
        return ArrayRecord({name: encode_tensor(value, parse_codec(codec_name), rng, full=True)
                            for name, value in local.items()})
    record, _ = encode_update(local, base, parse_codec(codec_name), rng)
    return record


@st.composite
def _topk_payload(draw: st.DrawFn, size: int) -> bytes:
    """A top-k payload built field by field with hostile counts and indices."""
    k = draw(st.one_of(st.integers(0, size + 2), st.sampled_from([2**32 - 1, 10**9, 65536, 65537])))
    width = "<u2" if size <= 65536 else "<u4"
    limit = 2**16 - 1 if width == "<u2" else 2**32 - 1
    count = min(k, draw(st.integers(0, 64)))
    indices = draw(st.lists(st.integers(0, min(size + 2, limit)), min_size=count, max_size=count))
    if draw(st.booleans()):
        indices.sort()
    values = draw(st.binary(max_size=4 * count + 8))
    return struct.pack("<I", k) + np.array(indices, width).tobytes() + values


HOSTILE_SHAPES = st.one_of(st.lists(DIM, max_size=4).map(tuple),
                           st.sampled_from([(10**6, 10**6), (2**31 - 1, 2**31 - 1, 2**31 - 1), (3, -3, -1)]))
TOPK_STYPES = ["fedge.delta/topk:0.1", "fedge.delta/topk:0.1+int8", "fedge.full/topk:0.5+fp16",
               "fedge.delta/topk:0.2+int8:channel"]


@st.composite
def _mutated_array(draw: st.DrawFn, array: Array) -> Array:
    """``array`` with its bytes, shape, dtype and/or stype changed."""
    dtype, shape, stype, data = str(array.dtype), tuple(array.shape), str(array.stype), bytes(array.data)
    for field in draw(st.sets(st.sampled_from(["data", "shape", "dtype", "stype", "topk"]), min_size=1)):
        if field == "data":
            data = draw(mutated(data))
        elif field == "shape":
            variant = draw(st.integers(0, 3))
            shape = (draw(HOSTILE_SHAPES) if variant == 0 else shape[::-1] if variant == 1
                     else shape + (1,) if variant == 2 else shape[1:])
        elif field == "dtype":
            dtype = draw(st.sampled_from(DTYPES))
        elif field == "stype":
            variant = draw(st.integers(0, 3))
            if variant == 0:
                stype = draw(st.sampled_from(STYPES))
            elif variant == 1:
                stype = draw(st.text(max_size=30))
            elif variant == 2:  # full weights <-> delta
                stype = stype.replace("delta", "full") if "delta" in stype else stype.replace("full", "delta")
            else:
                stype = draw(mutated(stype.encode())).decode("utf-8", "replace")
        elif field == "topk":
            size = math.prod(max(d, 0) for d in shape)
            data = draw(_topk_payload(min(size, 10**6)))
            stype = draw(st.sampled_from(TOPK_STYPES))
    return Array(dtype=dtype, shape=shape, stype=stype, data=data)


EXTRA = Array(dtype="float32", shape=(3,), stype="fedge.delta/fp32", data=b"\x00" * 12)


@st.composite
def hostile_records(draw: st.DrawFn) -> tuple[ArrayRecord, int]:
    """A valid encoded record for a random model and codec, then mutated; and the model's index."""
    model = draw(st.integers(0, len(MODELS) - 1))
    record = _encoded(model, draw(st.sampled_from(CODECS + DOWNLINK_CODECS)), draw(st.integers(0, 3)),
                      draw(st.sampled_from([0.0, 1e-3, 1.0, 1e4, 1e30])))
    arrays = dict(record.items())
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(sorted(arrays))) if arrays else "w"
        op = draw(st.sampled_from(["mutate", "mutate", "mutate", "drop", "extra", "swap"]))
        if op == "mutate" and name in arrays:
            arrays[name] = draw(_mutated_array(arrays[name]))
        elif op == "drop":
            arrays.pop(name, None)
        elif op == "extra":
            arrays[draw(st.sampled_from(["w", "x", "b", "", "big"]))] = draw(_mutated_array(EXTRA))
        elif op == "swap" and len(arrays) >= 2:
            first, second = draw(st.permutations(sorted(arrays)))[:2]
            arrays[first], arrays[second] = arrays[second], arrays[first]
    return ArrayRecord(arrays), model


def _reply(record: ArrayRecord, num_examples: int | float = 10) -> RecordDict:
    return RecordDict({wire.ARRAYS: record, wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: num_examples}),
                       wire.REPLY_META: ConfigRecord({wire.SERVER_ROUND: 1})})


def _assert_decoded(arrays: Mapping[str, NDArray[np.generic]], base: Mapping[str, np.ndarray] | None) -> None:
    """A decoded update: finite floats, and exactly the model's names and shapes when it is known."""
    if base is not None:
        assert sorted(arrays) == sorted(base)
    for name, value in arrays.items():
        assert isinstance(value, np.ndarray) and value.dtype == np.float32
        assert np.all(np.isfinite(value)), name
        if base is not None:
            assert value.shape == base[name].shape


@functools.cache
def _spec(model: int) -> dict[str, tuple[tuple[int, ...], str]]:
    return spec_of(ArrayRecord({name: Array(value) for name, value in _model(model).items()}))


# Half the default count: one case is expensive (~9 ms: a record encoded, mutated, then decoded twice
# under tracemalloc), and the FEDGE_FUZZ_EXAMPLES override still scales it.
@fuzz(FUZZ_EXAMPLES // 2)
@given(case=hostile_records(), num_examples=st.sampled_from([10, 10, 10, 0, -1, 10**12, 2.5, math.nan]))
def test_fuzz_reply_decoding_decodes_or_rejects(case: tuple[ArrayRecord, int], num_examples: int | float) -> None:
    # Prepare: a mutated reply to the global model `base`
    record, model = case
    base, spec = _model(model), _spec(model)
    # Execute: check it as the coordinator does (the global model as reference)
    try:
        with bounded():
            arrays, weight = ReplyValidator().check(_reply(record, num_examples), server_round=1, spec=spec,
                                                    reference=base)
    except UpdateRejected as exc:
        # Assert: a rejection says why
        assert exc.reason
    else:
        # Assert: or an update matching the global spec, all finite
        _assert_decoded(arrays, base)
        assert 1 <= weight <= 100_000
    # Execute: decode it as a device decodes its downlink (no reference: only full weights decode)
    try:
        with bounded():
            arrays = decode_update(record, None)
    except UpdateRejected as exc:
        assert exc.reason
    else:
        # Assert: finite float32 values of the declared shapes
        _assert_decoded(arrays, None)
        assert {name: value.shape for name, value in arrays.items()} == {
            name: tuple(array.shape) for name, array in record.items()}


# Inputs the fuzzing found that used to crash or over-allocate (regression tests).


def _raw(stype: str, shape: tuple[int, ...], data: bytes) -> Array:
    return Array(dtype="float32", shape=shape, stype=stype, data=data)


NO_KEPT_ENTRIES = struct.pack("<I", 0)
# (case, arrays, reference model or None for a device decoding its downlink, reason); each used to raise
# MemoryError (a 37 GiB np.zeros), ValueError or TypeError instead of UpdateRejected
CODEC_CRASHES: list[tuple[str, dict[str, Array], dict[str, np.ndarray] | None, str]] = [
    ("top-k bomb as full weights", {"w": _raw("fedge.full/topk:0.1", (10**5, 10**5), NO_KEPT_ENTRIES)}, None,
     "top-k carries a delta"),
    ("top-k bomb as a delta, no reference", {"w": _raw("fedge.delta/topk:0.1", (10**5, 10**5), NO_KEPT_ENTRIES)},
     None, "no model to add it to"),
    ("top-k bomb as full weights, with reference", {"w": _raw("fedge.full/topk:1", (4,), NO_KEPT_ENTRIES)},
     {"w": np.zeros(4, np.float32)}, "top-k carries a delta"),
    ("negative dimensions", {"w": _raw("fedge.full/fp32", (-2, -2), b"\x00" * 16)}, None, "invalid shape"),
    ("negative dimensions, odd count", {"w": _raw("fedge.full/fp16", (3, -3, -1), b"\x00" * 18)}, None,
     "invalid shape"),
    ("bool dimension", {"w": _raw("fedge.full/fp32", (True, 3), b"\x00" * 12)}, None, "invalid shape"),
]


@pytest.mark.parametrize(("arrays", "reference", "reason"), [case[1:] for case in CODEC_CRASHES],
                         ids=[case[0] for case in CODEC_CRASHES])
def test_hostile_payloads_found_by_fuzzing_are_rejected(arrays: dict[str, Array],
                                                        reference: dict[str, np.ndarray] | None, reason: str) -> None:
    # Execute / Assert: rejected with the reason, without allocating for the claimed shape
    with pytest.raises(UpdateRejected, match=reason), bounded():
        decode_update(ArrayRecord(arrays), reference)


def test_a_scalar_tensor_decodes_to_an_array() -> None:
    # Prepare: a model with a 0-d tensor (a learned temperature, say) and an fp16 delta for it
    base = {"t": np.array(1.5, np.float32)}
    record, _ = encode_update({"t": np.array(2.0, np.float32)}, base, parse_codec("fp16"), np.random.default_rng(0))
    # Execute
    decoded = decode_update(record, base)
    # Assert: an ndarray like every other tensor (it used to be a numpy scalar, np.float32)
    assert isinstance(decoded["t"], np.ndarray) and decoded["t"].shape == () and decoded["t"] == 2.0


@pytest.mark.parametrize(("scale", "delta"), [(3.4e38, 1.0), (1.0, 3.4e38)], ids=["int8 scale", "base + delta"])
def test_values_that_overflow_to_inf_are_rejected_quietly(scale: float, delta: float) -> None:
    # Prepare: an int8 delta whose scale * 127 overflows, or a finite delta that overflows the model
    data = struct.pack("<f", scale) + bytes([127]) if scale > 1 else struct.pack("<f", delta)
    array = _raw("fedge.delta/int8" if scale > 1 else "fedge.delta/fp32", (1,), data)
    # Execute / Assert: rejected, and no RuntimeWarning from numpy on the way
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UpdateRejected, match="Inf"):
            decode_update(ArrayRecord({"w": array}), {"w": np.full(1, 3.4e38, np.float32)})


def test_a_long_stype_is_cut_in_the_rejection() -> None:
    # Execute
    with pytest.raises(UpdateRejected) as caught:
        decode_update(ArrayRecord({"w": _raw("x" * 100_000, (1,), b"")}), {"w": np.zeros(1, np.float32)})
    # Assert: the reason (logged per reply) does not echo 100 kB a device chose
    assert len(caught.value.reason) < 300


def test_a_plain_fp32_reply_cannot_claim_gigabytes_in_its_npy_header() -> None:
    # Prepare: a lossless (plain numpy) reply of 51 data bytes whose header claims 2.5e9 float32 values
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((4, 3), np.float32))
    data = buffer.getvalue().replace(b"(4, 3), }    ", b"(2500000000,), }")
    record = ArrayRecord({"w": Array(dtype="float32", shape=(4, 3), stype="numpy.ndarray", data=data)})
    base = {"w": np.zeros((4, 3), np.float32)}
    # Execute / Assert: rejected without allocating 9.3 GiB on the coordinator
    with pytest.raises(UpdateRejected, match=r"bytes hold shape \(2500000000,\)"), bounded():
        ReplyValidator().check(_reply(record), server_round=1, spec={"w": ((4, 3), "float32")}, reference=base)


@pytest.mark.parametrize("descr", [b"','", b"',f'", b"'(,)'"])
def test_a_reply_whose_npy_dtype_breaks_numpys_parser_is_rejected(descr: bytes) -> None:
    # Prepare: numpy's comma-string dtype parser raises SyntaxError on these (found fuzzing checkpoints)
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((4, 3), np.float32))
    data = buffer.getvalue().replace(b"'<f4'", descr.ljust(5))  # the header keeps its length
    record = ArrayRecord({"w": Array(dtype="float32", shape=(4, 3), stype="numpy.ndarray", data=data)})
    # Execute / Assert: an UpdateRejected naming the header, not a SyntaxError out of the strategy
    with pytest.raises(UpdateRejected, match="unreadable .npy header"):
        ReplyValidator().check(_reply(record), server_round=1, spec={"w": ((4, 3), "float32")},
                               reference={"w": np.zeros((4, 3), np.float32)})


def test_the_encoder_refuses_full_weights_under_top_k() -> None:
    # Execute / Assert: what every decoder now refuses is not produced either
    with pytest.raises(ConfigError, match="top-k cannot carry full weights"):
        encode_tensor(np.ones(4, np.float32), parse_codec("topk:0.5"), np.random.default_rng(0), full=True)


# --------------------------------------------------------------------------- 2. fleets (spec strings, TOML files)

PROFILE_NAMES = ["phone", "laptop", "gpu-box", "watch", "car", ""]
NUMBERS = st.one_of(st.integers(-3, 10**4), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, 1, -1, 0.5, 2**63 - 1, -(2**63), 1e308, math.nan, math.inf]))
TOML_VALUES = st.one_of(NUMBERS, st.booleans(), st.text(max_size=8), st.lists(NUMBERS, max_size=3),
                        st.lists(st.lists(NUMBERS, max_size=3), max_size=3), st.dates())
PROFILE_KEYS = ["compute-rate", "uplink-mbps", "downlink-mbps", "memory-mb", "availability", "dropout", "online-hours"]


def _toml_value(value: object) -> str:
    """``value`` as TOML (the subset the fuzz tests draw: numbers, bools, strings, dates, lists)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, int | datetime.date):
        return str(value)
    if isinstance(value, str):
        return '"' + "".join(c if c.isalnum() or c in " -_.=," else f"\\u{ord(c):04x}" for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(value)


@st.composite
def fleet_files(draw: st.DrawFn) -> str:
    """TOML text of a fleet file: valid-looking profile tables and a [fleet] mix, fields dropped,
    added or given values of any type."""
    lines = []
    for name in draw(st.lists(st.sampled_from(PROFILE_NAMES[:5] + ["x y", "ph\u00f6ne"]), max_size=3, unique=True)):
        lines.append(f'[profiles."{name}"]')
        table = {"compute-rate": 100.0, "uplink-mbps": 2, "downlink-mbps": 10.5, "memory-mb": 1024,
                 "availability": 0.5, "dropout": 0.1, "online-hours": [[0, 7], [19, 24]]}
        for key in draw(st.lists(st.sampled_from(PROFILE_KEYS), max_size=3)):
            if draw(st.booleans()):
                table.pop(key, None)
            else:
                table[key] = draw(TOML_VALUES)
        if draw(st.integers(0, 4)) == 0:
            table[draw(st.sampled_from(["wat", "compute_rate", "memory"]))] = 1
        lines += [f'"{key}" = {_toml_value(value)}' for key, value in table.items()]
    variant = draw(st.integers(0, 5))
    if variant < 4:
        lines.append("[fleet]")
        for name in draw(st.lists(st.sampled_from(PROFILE_NAMES + ["x y"]), max_size=3, unique=True)):
            count = draw(st.one_of(st.integers(0, 50), TOML_VALUES))
            lines.append(f'"{name}" = {_toml_value(count)}')
    elif variant == 4:  # a key of the wrong kind where a table belongs
        lines.insert(0, f"{draw(st.sampled_from(['fleet', 'profiles']))} = {_toml_value(draw(TOML_VALUES))}")
    return "\n".join(lines) + "\n"


def _assert_valid_fleet(fleet: Fleet) -> None:
    """A usable fleet: known profiles, integer counts, at least one device, sane profiles."""
    assert 1 <= fleet.size <= MAX_FLEET_SIZE
    for name, count in fleet.mix:
        assert name in fleet.profiles
        assert type(count) is int and count >= 0
    for profile in fleet.profiles.values():
        for value in (profile.compute_rate, profile.uplink_mbps, profile.downlink_mbps):
            assert type(value) in (int, float) and math.isfinite(value) and value > 0
        assert type(profile.memory_mb) is int and profile.memory_mb > 0
        assert 0 < profile.availability <= 1 and 0 <= profile.dropout < 1
        for start, end in profile.online_hours:
            assert 0 <= start < end <= 24
    if fleet.size <= 10_000:  # every device gets a profile (shuffling a million takes seconds)
        assert sorted(fleet.assignment(0)) == sorted(name for name, count in fleet.mix for _ in range(count))


VALID_SPEC = "phone=60,laptop=30,gpu-box=10"


@fuzz()
@given(spec=st.one_of(st.text(max_size=40),
                      mutated(VALID_SPEC.encode()).map(lambda b: b.decode("utf-8", "replace")),
                      st.lists(st.tuples(st.sampled_from(PROFILE_NAMES), st.sampled_from(["=", "==", ":", ""]),
                                         st.one_of(st.integers(-5, 10**30).map(str),
                                                   st.sampled_from(["\u00b2", "\u0661", "1.5", "1e3", " 7 ", "0x10"]))),
                               max_size=4).map(lambda parts: ",".join(n + s + c for n, s, c in parts))))
def test_fuzz_fleet_spec_strings(spec: str) -> None:
    # Execute
    try:
        fleet = parse_fleet(spec)
    except ConfigError as exc:
        # Assert: a refusal names the problem
        assert str(exc)
        return
    # Assert: or a usable fleet
    _assert_valid_fleet(fleet)


# Half the default count: one case is expensive (~8 ms: a TOML file drawn field by field, written, parsed).
@fuzz(FUZZ_EXAMPLES // 2)
@given(text=fleet_files(), raw=st.data())
def test_fuzz_fleet_files(text: str, raw: st.DataObject, tmp_path: Path) -> None:
    # Prepare: a random fleet file, sometimes with its bytes mutated (which may break UTF-8 or TOML)
    content = text.encode()
    if raw.draw(st.booleans()):
        content = raw.draw(mutated(content))
    path = tmp_path / "fleet.toml"
    path.write_bytes(content)
    # Execute
    try:
        fleet = parse_fleet("phone=1", str(path))
    except ConfigError as exc:
        # Assert: a refusal names the problem
        assert str(exc)
        return
    # Assert: or a usable fleet
    _assert_valid_fleet(fleet)


# Fleet specs and files the fuzzing found that used to crash (ValueError, TypeError, AttributeError,
# UnicodeDecodeError, RecursionError), hang (a fleet of 10^20 devices) or yield NaN/bool rates.
SPEC_CRASHES = [
    ("phone=\u00b2", "not NAME=COUNT"),  # str.isdigit() accepts superscripts; int() does not
    ("phone=99999999999999999999", "at most 1,000,000"),
    ("phone=" + "9" * 5000, "too many devices"),
    ("=\x1f0", "unknown profile ''"),  # str.strip() drops "\x1f"; int() does not
]


@pytest.mark.parametrize(("spec", "message"), SPEC_CRASHES,
                         ids=["superscript", "10^20 devices", "5000 digits", "unit separator"])
def test_fleet_specs_found_by_fuzzing_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_fleet(spec)


_PROFILE = 'compute-rate = 1\nuplink-mbps = 1\ndownlink-mbps = 1\nmemory-mb = 64\n'
FILE_CRASHES: list[tuple[str, bytes, str]] = [
    ("not UTF-8", b"\xff\xfe[fleet]\n", "not UTF-8 text"),
    ("profiles is a number", b"profiles = 3\n", "'profiles' must hold one table per profile"),
    ("a profile is a number", b"[profiles]\nphone = 3\n", "'profiles' must hold one table per profile"),
    ("fleet is a number", b"fleet = 3\n", "'fleet' must be a table"),
    ("fleet is a string", b"fleet = 'ab'\n", "'fleet' must be a table"),
    ("rate is a string", b"[profiles.x]\n" + _PROFILE.replace("= 1\nup", "= 'fast'\nup", 1).encode(),
     "compute-rate must be a number"),
    ("rate is NaN", b"[profiles.x]\n" + _PROFILE.replace("= 1\nup", "= nan\nup", 1).encode(),
     "compute-rate must be > 0"),
    ("rate is inf", b"[profiles.x]\n" + _PROFILE.replace("uplink-mbps = 1", "uplink-mbps = inf").encode(),
     "uplink-mbps must be > 0"),
    ("rate is a bool", b"[profiles.x]\n" + _PROFILE.replace("downlink-mbps = 1", "downlink-mbps = true").encode(),
     "downlink-mbps must be a number"),
    ("memory is negative", b"[profiles.x]\n" + _PROFILE.replace("64", "-1.5").encode(), "memory-mb must be an integer"),
    ("memory is text", b"[profiles.x]\n" + _PROFILE.replace("64", "'lots'").encode(), "memory-mb must be a number"),
    ("availability is a bool", b"[profiles.x]\n" + _PROFILE.encode() + b"availability = true\n",
     "availability must be a number"),
    ("online-hours is a number", b"[profiles.x]\n" + _PROFILE.encode() + b"online-hours = 5\n",
     "online-hours must be a list"),
    ("online-hours of numbers", b"[profiles.x]\n" + _PROFILE.encode() + b"online-hours = [1, 2]\n",
     "online-hours must be a list"),
    ("online-hours of text", b"[profiles.x]\n" + _PROFILE.encode() + b"online-hours = [['a', 'b']]\n",
     "online-hours window"),
    ("nested too deeply", b"a = " + b"[" * 5000, "not valid TOML"),
    ("5000-digit count", b"[fleet]\nphone = " + b"9" * 5000 + b"\n", "not valid TOML"),
    ("10^18 devices", b"[fleet]\nphone = 1000000000000000000\n", "at most 1,000,000"),
]


@pytest.mark.parametrize(("content", "message"), [case[1:] for case in FILE_CRASHES],
                         ids=[case[0] for case in FILE_CRASHES])
def test_fleet_files_found_by_fuzzing_are_refused(content: bytes, message: str, tmp_path: Path) -> None:
    # Prepare
    (tmp_path / "fleet.toml").write_bytes(content)
    # Execute / Assert
    with pytest.raises(ConfigError, match=message):
        parse_fleet("x=1", str(tmp_path / "fleet.toml"))


@pytest.mark.parametrize("path", ["", "a\x00b"], ids=["a directory", "NUL in the path"])
def test_unreadable_fleet_file_paths_are_refused(path: str, tmp_path: Path) -> None:
    # Execute / Assert: IsADirectoryError and ValueError used to escape
    with pytest.raises(ConfigError, match="cannot read fleet file"):
        parse_fleet("phone=1", path or str(tmp_path))


# --------------------------------------------------------------------------- 3. run config

CONFIG_KEYS = sorted(DEFAULTS) + ["codec.watch", "downlink.car", "codec.", "downlink.default", "num_rounds",
                                  "unknown-key", "", "NUM-ROUNDS", "seed "]
ANY_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2**63, -(2**63) - 1, 10**400, 0.5, 1e-300, 1e308, math.nan, math.inf, -math.inf]),
    st.text(max_size=12), st.sampled_from(["fp16", "topk:0.1+int8", "topk:nan", "int8:channel", "fedavg", "a\x00b"]),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.dates(), st.binary(max_size=3),
)


def _plausible(key: str) -> st.SearchStrategy[Any]:
    """Values near the default of ``key``: the same type, scaled, negated, or at the edges."""
    default = DEFAULTS.get(key, "fp32")
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int | float):
        return st.sampled_from([default, -default, default * 10**6, 0, type(default)(1), default + 1])
    return st.sampled_from([default, default.upper(), default + "x", ""])


@st.composite
def overrides(draw: st.DrawFn) -> dict[Any, Any]:
    """Run-config overrides: known and unknown keys (some not strings), plausible and hostile values."""
    result: dict[Any, Any] = {}
    for _ in range(draw(st.integers(0, 5))):
        key = draw(st.one_of(st.sampled_from(CONFIG_KEYS), st.text(max_size=10), st.integers(), st.none()))
        result[key] = draw(_plausible(key) if isinstance(key, str) and draw(st.booleans()) else ANY_VALUES)
    return result


def _assert_valid_config(config: dict[str, Any]) -> None:
    """A usable config: every default key with the default's type, finite numbers, re-validates."""
    for key, default in DEFAULTS.items():
        assert type(config[key]) is type(default), key
        if isinstance(default, float):
            assert math.isfinite(config[key]), key
        if isinstance(default, int) and not isinstance(default, bool):
            assert -(2**63) <= config[key] < 2**63, key  # Flower's config values are int64
        if isinstance(default, str):
            assert "\x00" not in config[key], key
    assert resolve_run_config(config) == config


@fuzz()
@given(values=overrides())
def test_fuzz_resolve_run_config(values: dict[Any, Any]) -> None:
    # Execute
    try:
        config = resolve_run_config(values)
    except ConfigError as exc:
        # Assert: a refusal names the problem
        assert str(exc)
        return
    # Assert: or a usable config
    _assert_valid_config(config)


VALID_ARGS = ("num-rounds=5 model='cnn' learning-rate=0.1 fleet=phone=3,laptop=2 codec.phone=\"topk:0.1+int8\" "
              "resume=true")


@fuzz()
@given(text=st.one_of(
    st.text(max_size=40),
    mutated(VALID_ARGS.encode(), max_ops=3).map(lambda b: b.decode("utf-8", "replace")),
    st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), st.sampled_from(["=", "==", " = ", ""]),
                       st.one_of(st.sampled_from(["5", "-1", "1e999", "nan", "inf", "'x", '"a b"', "[1, [2]]",
                                                  "{a=1}", "1979-05-27", "9" * 30, "true", "0x10", "[" * 50]),
                                 st.text(max_size=8))),
             max_size=4).map(lambda items: " ".join(k + s + v for k, s, v in items))))
def test_fuzz_run_config_args(text: str) -> None:
    # Execute: parse the overrides as `--run-config` does, then resolve them
    try:
        config = resolve_run_config(parse_run_config_args(text))
    except ConfigError as exc:
        # Assert: a refusal names the problem
        assert str(exc)
        return
    # Assert: or a usable config
    _assert_valid_config(config)


# Overrides the fuzzing found that used to crash (AttributeError, OverflowError) or were accepted and
# broke a run later (inf timeouts and rates, seeds numpy refuses, ints Flower cannot send, NUL in paths).
CONFIG_CRASHES: list[tuple[str, dict[Any, Any], str]] = [
    ("non-string key", {0: None}, "key 0 is not a string"),
    ("int too big for a float", {"learning-rate": 10**400}, "must be a finite number"),
    ("inf timeout", {"round-timeout": math.inf}, "must be a finite number"),
    ("inf jitter", {"jitter": math.inf}, "must be a finite number"),
    ("negative seed", {"seed": -1}, "seed.*must be in \\[0, 2\\*\\*63\\)"),
    ("int beyond int64", {"num-rounds": 2**63}, "does not fit in a 64-bit integer"),
    ("NUL in a path", {"run-dir": "runs/a\x00b"}, "contains a NUL character"),
]


@pytest.mark.parametrize(("values", "message"), [case[1:] for case in CONFIG_CRASHES],
                         ids=[case[0] for case in CONFIG_CRASHES])
def test_run_configs_found_by_fuzzing_are_refused(values: dict[Any, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_run_config(values)


ARGS_CRASHES: list[tuple[str, Any, str]] = [
    ("unbalanced quote", '"', "No closing quotation"),
    ("unbalanced quote in a value", "model='cnn", "No closing quotation"),
    ("deeply nested value", "fleet=" + "[" * 5000, "nests too deeply"),
    ("5000-digit value", "num-rounds=" + "9" * 5000, "has type str"),
    ("None (shlex would read stdin)", None, "must be a string"),
]


@pytest.mark.parametrize(("text", "message"), [case[1:] for case in ARGS_CRASHES],
                         ids=[case[0] for case in ARGS_CRASHES])
def test_run_config_args_found_by_fuzzing_are_refused(text: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_run_config(parse_run_config_args(text))


# --------------------------------------------------------------------------- 4. checkpoints

UNPICKLED: list[str] = []


def _unpickled() -> None:
    """What a hostile pickle in a checkpoint would run; loading must never call it."""
    UNPICKLED.append("code ran")


class Hostile:
    """Pickles to a call of :func:`_unpickled` (the shape of a code-execution exploit)."""

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return _unpickled, ()


def _checkpoint() -> Checkpoint:
    rng = np.random.default_rng(0)
    return Checkpoint(
        server_round=3,
        arrays={"w": rng.standard_normal((4, 3)).astype(np.float32), "b": np.zeros(3, np.float32),
                "n": np.array(7, np.int64)},
        fingerprint="0123456789abcdef",
        history=[{"round": 0, "accuracy": 0.1, "sim_time_s": 0.0, "wall_time_s": 0.0},
                 {"round": 3, "accuracy": 0.5, "sim_time_s": 12.5, "wall_time_s": 2.0, "rejections": []}],
        model_keys={"model": "mlp", "seed": 42},
        strategy_state={"momentum/w": np.ones((4, 3), np.float32)},
    )


@functools.cache
def _checkpoint_bytes() -> bytes:
    """A real checkpoint file, as :func:`save_checkpoint` writes it."""
    with tempfile.TemporaryDirectory() as directory:
        save_checkpoint(Path(directory) / "c.npz", _checkpoint())
        return (Path(directory) / "c.npz").read_bytes()


def _members(content: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(content)) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def _zipped(members: dict[str, bytes]) -> bytes:
    """An .npz holding ``members`` (with correct CRCs, so the mutations reach the .npy parser)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def _npy(value: Any) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, value, allow_pickle=True)  # object arrays pickle: the loader must refuse them
    return buffer.getvalue()


def _json_containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3))


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
              st.text(max_size=6)),
    _json_containers, max_leaves=6)
HOSTILE_ARRAYS = st.sampled_from([
    np.array([Hostile()], dtype=object), np.array(["text"]), np.array([b"bytes"]), np.zeros(2, "V4"),
    np.zeros(2, [("a", "<f4"), ("b", "<i2")]), np.zeros(3, np.complex64), np.zeros((2, 0)), np.array(1.5),
    np.zeros(3, ">f8"), np.asfortranarray(np.ones((2, 3))), np.ones(2, bool), np.zeros(4, np.float16),
])
NPY_HEADER_EDITS = [
    ("'descr': '<f4'", ["'descr': '|O'", "'descr': '<U5'", "'descr': 'V8'", "'descr': '>f8'", "'descr': '<c8'",
                        "'descr': 'xx'", "'descr': ','  ", "'descr': [('a', '<f4')]",
                        "'descr': '<f4' , 'x': __import__('os')"]),
    ("'shape': (4, 3)", ["'shape': (4, 30000000000)", "'shape': (-4, 3)", "'shape': (3, 4)", "'shape': ()",
                         "'shape': (4,)", "'shape': (2**40,)", "'shape': 'x'", "'shape': (99999999999, 99999999999)"]),
    ("'fortran_order': False", ["'fortran_order': True", "'fortran_order': 1", "'fortran_order': None"]),
]


@st.composite
def hostile_checkpoints(draw: st.DrawFn) -> bytes:
    """A real checkpoint file, then mutated: its bytes, its members' bytes, the .npy headers,
    the metadata JSON, or its arrays (pickled objects, strings, structured, empty...)."""
    original = _checkpoint_bytes()
    variant = draw(st.sampled_from(["bytes", "member", "header", "meta", "arrays"]))
    if variant == "bytes":
        return draw(mutated(original))
    members = _members(original)
    name = draw(st.sampled_from(sorted(members)))
    if variant == "member":
        members[name] = draw(mutated(members[name]))
    elif variant == "header":
        text = members["w.npy"].decode("latin1")
        for old, news in NPY_HEADER_EDITS:
            if draw(st.booleans()):
                text = text.replace(old, draw(st.sampled_from(news)))
        members["w.npy"] = text.encode("latin1")
    elif variant == "meta":
        meta = json.loads(str(np.load(io.BytesIO(members["__fedge_meta__.npy"]))))
        for key in draw(st.lists(st.sampled_from(["round", "fingerprint", "history", "model_keys", "extra"]),
                                 min_size=1, max_size=3)):
            if draw(st.booleans()):
                meta.pop(key, None)
            else:
                meta[key] = draw(JSON_VALUES)
        if draw(st.booleans()):
            meta["history"] = [draw(st.dictionaries(st.sampled_from(["round", "sim_time_s", "wall_time_s", "x"]),
                                                    JSON_VALUES, max_size=3))]
        text = json.dumps(meta) if draw(st.booleans()) else draw(JSON_VALUES.map(json.dumps))
        if draw(st.integers(0, 3)) == 0:
            text = draw(mutated(text.encode())).decode("utf-8", "replace")
        members["__fedge_meta__.npy"] = _npy(np.array(text) if draw(st.integers(0, 5)) else np.array([text, text]))
    else:
        target = draw(st.sampled_from(["w.npy", "extra.npy", "__strategy__/momentum/w.npy", "__fedge_meta__.npy"]))
        members[target] = _npy(draw(HOSTILE_ARRAYS))
    return _zipped(members)


def _assert_valid_checkpoint(loaded: Checkpoint) -> None:
    """What resuming relies on: an int round, a string fingerprint, JSON-shaped history and
    model keys, numeric arrays."""
    assert type(loaded.server_round) is int and loaded.server_round >= 0
    assert isinstance(loaded.fingerprint, str)
    assert isinstance(loaded.model_keys, dict)
    assert isinstance(loaded.history, list) and all(isinstance(row, dict) for row in loaded.history)
    for row in loaded.history:
        assert type(row["round"]) is int
    for value in [*loaded.arrays.values(), *loaded.strategy_state.values()]:
        assert isinstance(value, np.ndarray) and value.dtype.kind in "biuf"


# Half the default count: one case is expensive (~7 ms: an .npz rebuilt, written and loaded under tracemalloc).
@fuzz(FUZZ_EXAMPLES // 2)
@given(content=hostile_checkpoints())
def test_fuzz_checkpoint_files(content: bytes, tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "checkpoint.npz"
    path.write_bytes(content)
    # Execute
    try:
        with bounded():
            loaded = load_checkpoint(path)
    except ConfigError as exc:  # CheckpointMismatch is a ConfigError
        # Assert: a refusal names the problem
        assert str(exc)
    else:
        # Assert: or a state a run can resume from
        _assert_valid_checkpoint(loaded)
    # Assert: and a pickled object in the file never ran
    assert not UNPICKLED


def _edited(member: str, old: bytes, new: bytes) -> bytes:
    """The real checkpoint with ``old`` replaced by ``new`` in one member (the zip rebuilt around it)."""
    members = _members(_checkpoint_bytes())
    assert old in members[member]
    members[member] = members[member].replace(old, new)
    return _zipped(members)


def _with_meta(meta: Any, raw: str | None = None) -> bytes:
    members = _members(_checkpoint_bytes())
    members["__fedge_meta__.npy"] = _npy(np.array(raw if raw is not None else json.dumps(meta)))
    return _zipped(members)


def _with_array(name: str, value: np.ndarray) -> bytes:
    members = _members(_checkpoint_bytes())
    members[name] = _npy(value)
    return _zipped(members)


def _flipped(offset_from: bytes) -> bytes:
    """The real checkpoint with one bit of array data flipped (the zip's CRC no longer matches)."""
    content = bytearray(_checkpoint_bytes())
    content[content.index(offset_from) + len(offset_from) + 3] ^= 1
    return bytes(content)


# Files the fuzzing found that used to crash load_checkpoint (EOFError, BadZipFile, KeyError, TypeError,
# ValueError, RecursionError, tokenize.TokenError, MemoryError from a lying .npy header) or that
# loaded arrays no model can take (text, complex, structured).
CHECKPOINT_CRASHES: list[tuple[str, Callable[[], bytes], str]] = [
    ("empty file", lambda: b"", "cannot read checkpoint"),
    ("truncated zip", lambda: _checkpoint_bytes()[:4], "cannot read checkpoint"),
    ("flipped data byte", lambda: _flipped(b"'shape': (4, 3), }"), "cannot read checkpoint.*CRC"),
    ("header claims 480 GB", lambda: _edited("w.npy", b"(4, 3), }    ", b"(4, 30000000000), }"),
     "header describes 480000000000 bytes"),
    ("header claims a negative shape", lambda: _edited("w.npy", b"(4, 3), } ", b"(-4, -3), }"), "negative dimension"),
    ("Python 2 header fallback", lambda: _edited("__fedge_meta__.npy", b"{'descr':", b"{'descr'{"),
     "unreadable .npy header"),
    ("descr a lone comma (numpy's dtype parser raises SyntaxError)",
     lambda: _edited("w.npy", b"'descr': '<f4'", b"'descr': ','  "), "unreadable .npy header \\(SyntaxError"),
    ("metadata without fields", lambda: _with_meta({}), "'round' = None is not an integer"),
    ("metadata null", lambda: _with_meta(None), "metadata is not a JSON object"),
    ("round is text", lambda: _with_meta({"round": "abc", "fingerprint": "f", "history": []}),
     "'round' = 'abc' is not an integer"),
    ("round is a bool", lambda: _with_meta({"round": True, "fingerprint": "f", "history": []}),
     "'round' = True is not an integer"),
    ("fingerprint is a number", lambda: _with_meta({"round": 1, "fingerprint": 5, "history": []}),
     "'fingerprint' = 5 is not a string"),
    ("history is a number", lambda: _with_meta({"round": 1, "fingerprint": "f", "history": 5}),
     "'history' = 5 is not a list"),
    ("history row without a round", lambda: _with_meta({"round": 1, "fingerprint": "f", "history": [{"x": 1}]}),
     "history row .* integer 'round'"),
    ("history clock is text", lambda: _with_meta({"round": 1, "fingerprint": "f",
                                                  "history": [{"round": 1, "sim_time_s": "late"}]}),
     "clock that is not a finite number"),
    ("model_keys is a list", lambda: _with_meta({"round": 1, "fingerprint": "f", "history": [], "model_keys": [1]}),
     "'model_keys' = \\[1\\] is not an object"),
    ("metadata nested too deeply", lambda: _with_meta(None, raw="[" * 100_000), "metadata is not valid JSON"),
    ("metadata is an array", lambda: _with_array("__fedge_meta__.npy", np.zeros(3)), "dtype float64 and shape"),
    ("text array", lambda: _with_array("w.npy", np.array(["text"])), "dtype <U4"),
    ("complex array", lambda: _with_array("w.npy", np.zeros(3, np.complex64)), "dtype complex64"),
    ("structured array", lambda: _with_array("w.npy", np.zeros(2, [("a", "<f4")])), "no objects, no pickles"),
]


@pytest.mark.parametrize(("make", "message"), [case[1:] for case in CHECKPOINT_CRASHES],
                         ids=[case[0] for case in CHECKPOINT_CRASHES])
def test_checkpoints_found_by_fuzzing_are_refused(make: Callable[[], bytes], message: str, tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "checkpoint.npz"
    path.write_bytes(make())
    # Execute / Assert: refused with the reason, without allocating what a header claims
    with pytest.raises(CheckpointMismatch, match=message) as caught, bounded():
        load_checkpoint(path)
    assert str(caught.value).count(str(path)) == 1  # said once, not wrapped twice


@pytest.mark.parametrize("member", ["w.npy", "__strategy__/momentum/w.npy", "__fedge_meta__.npy"])
def test_a_pickled_object_in_a_checkpoint_is_never_run(member: str, tmp_path: Path) -> None:
    # Prepare: an object array whose unpickling would call _unpickled()
    path = tmp_path / "checkpoint.npz"
    path.write_bytes(_with_array(member, np.array([Hostile()], dtype=object)))
    # Execute
    with pytest.raises(CheckpointMismatch, match="no objects, no pickles"):
        load_checkpoint(path)
    # Assert
    assert not UNPICKLED


def test_big_endian_and_fortran_arrays_load_as_native_c_arrays(tmp_path: Path) -> None:
    # Prepare: arrays as another machine may have written them
    value = np.asfortranarray(np.arange(6, dtype=">f8").reshape(2, 3))
    path = tmp_path / "checkpoint.npz"
    path.write_bytes(_with_array("w.npy", value))
    # Execute
    loaded = load_checkpoint(path).arrays["w"]
    # Assert: the same values, native byte order (torch.from_numpy refuses others), C order, writable
    np.testing.assert_array_equal(loaded, value)
    assert loaded.dtype == np.float64 and loaded.dtype.isnative and loaded.flags.c_contiguous
    assert loaded.flags.writeable


def _package_folders() -> list[str]:
    """Every folder pyproject maps onto the fedge package (the same list the architecture test reads)."""
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    return sorted(set(pyproject["tool"]["setuptools"]["package-dir"].values()))


PARSER_MODULES = _package_folders()


def test_nothing_unpickles_untrusted_files() -> None:
    # Prepare: every module of the package
    root = Path(__file__).resolve().parents[1]
    assert all((root / folder).is_dir() for folder in PARSER_MODULES), PARSER_MODULES
    sources = [path for folder in PARSER_MODULES for path in (root / folder).rglob("*.py")]
    # Execute: find imports of pickle-like modules and np.load / torch.load calls that allow pickles
    found = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                modules = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
                found += [f"{path.name}: import {m}" for m in modules
                          if m.split(".")[0] in {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
                keywords = {k.arg: k.value for k in node.keywords}
                allowed = keywords.get("allow_pickle")
                if isinstance(allowed, ast.Constant) and allowed.value is True:
                    found.append(f"{path.name}:{node.lineno}: load(allow_pickle=True)")
                weights_only = keywords.get("weights_only")
                if ast.unparse(node.func.value) == "torch" and not (
                        isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    found.append(f"{path.name}:{node.lineno}: torch.load without weights_only=True")
    # Assert
    assert len(sources) > 20 and not found
