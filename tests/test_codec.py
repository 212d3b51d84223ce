"""Update compression codecs: error bounds, unbiasedness, error feedback, malformed payloads,
and the wire format, frozen byte for byte."""

from __future__ import annotations

import hashlib
import sys
from types import ModuleType

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedge import codec as codec_module
from fedge.codec import (
    Codec,
    Fp16,
    Fp32,
    Int8,
    Int8Channel,
    decode_tensor,
    decode_update,
    encode_tensor,
    encode_update,
    parse_codec,
)
from fedge.errors import ConfigError, UpdateRejected

SHAPES = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=12)
MAGNITUDE = st.sampled_from([0.0, 1e-30, 1e-6, 1.0, 1e6, 1e30])


def _tensor(draw: st.DrawFn) -> np.ndarray:
    """Random values at one of many magnitudes, sometimes all zero or constant."""
    shape = draw(SHAPES)
    scale = draw(MAGNITUDE)
    kind = draw(st.sampled_from(["random", "constant", "zeros"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if kind == "zeros":
        return np.zeros(shape, np.float32)
    if kind == "constant":
        return np.full(shape, scale * draw(st.sampled_from([-1.0, 1.0])), np.float32)
    return (rng.standard_normal(shape) * scale).astype(np.float32)


tensors = st.composite(_tensor)()


def _roundtrip(values: np.ndarray, name: str) -> np.ndarray:
    return decode_tensor(encode_tensor(values, parse_codec(name), np.random.default_rng(0)))[0]


@settings(max_examples=60, deadline=None)
@given(values=tensors)
def test_fp32_is_exact_and_fp16_within_half_precision(values: np.ndarray) -> None:
    assert np.array_equal(_roundtrip(values, "fp32"), values)
    fp16 = _roundtrip(values, "fp16")
    in_range = np.abs(values) <= 65504
    # relative error 2^-11 for normal halves, absolute 2^-25 below them; beyond 65504 saturates
    bound = np.maximum(np.abs(values) * 2.0**-11, 2.0**-25)
    assert np.all(np.abs(fp16 - values)[in_range] <= bound[in_range])
    assert np.all(np.abs(fp16[~in_range]) == 65504)


@settings(max_examples=60, deadline=None)
@given(values=tensors, per_channel=st.booleans())
def test_int8_is_within_one_step_of_its_scale(values: np.ndarray, per_channel: bool) -> None:
    # Execute
    decoded = _roundtrip(values, "int8:channel" if per_channel else "int8")
    # Assert: stochastic rounding moves each value by less than one step max|x| / 127 of its group
    # one scale per output channel of a 2-D+ tensor; 1-D tensors get one scale either way
    groups = values.reshape(values.shape[0], -1) if per_channel and values.ndim >= 2 else values.reshape(1, -1)
    step = np.abs(groups).max(axis=1, keepdims=True).astype(np.float64) / 127
    error = np.abs(decoded.reshape(groups.shape).astype(np.float64) - groups)
    assert np.all(error <= step * (1 + 1e-6))
    if not values.any():
        assert not decoded.any()


@settings(max_examples=60, deadline=None)
@given(values=tensors, fraction=st.sampled_from([0.01, 0.1, 0.5, 1.0]), quantiser=st.sampled_from(["", "+int8"]))
def test_topk_keeps_the_largest_entries(values: np.ndarray, fraction: float, quantiser: str) -> None:
    # Execute
    decoded = _roundtrip(values, f"topk:{fraction}{quantiser}")
    # Assert: at most ceil(f n) entries survive; the error of each entry is at most the k-th largest
    # magnitude (dropped) or one int8 step (kept); with fp32 values, entries above it are exact
    flat, out = values.ravel().astype(np.float64), decoded.ravel().astype(np.float64)
    k = max(1, int(np.ceil(fraction * flat.size)))
    threshold = np.sort(np.abs(flat))[-k]
    step = np.abs(flat).max() / 127 if quantiser else 0.0
    assert np.count_nonzero(out) <= k
    assert np.all(np.abs(out - flat) <= max(threshold, step) * (1 + 1e-6))
    if not quantiser:
        above = np.abs(flat) > threshold
        assert np.array_equal(out[above], flat[above])


def test_stochastic_int8_is_unbiased() -> None:
    # Prepare: values between quantisation levels (scale 1/127 of max 1.0)
    values = np.array([1.0, 0.3333, -0.5071, 0.00213, -0.9999, 0.0], np.float32)
    rng = np.random.default_rng(7)
    # Execute: the mean of many encodings
    mean = np.mean([decode_tensor(encode_tensor(values, parse_codec("int8"), rng))[0] for _ in range(20_000)], axis=0)
    # Assert: within 5 standard errors (each draw is off by < 1/127, so sigma <= 0.5/127)
    assert np.all(np.abs(mean - values) <= 5 * (0.5 / 127) / np.sqrt(20_000))


def test_error_feedback_sends_everything_eventually() -> None:
    # Prepare: 20 rounds of random deltas on two tensors
    rng = np.random.default_rng(3)
    codec = parse_codec("topk:0.05+int8")
    base = {"w": np.zeros((30, 20), np.float32), "b": np.zeros(20, np.float32)}
    residual: dict[str, np.ndarray] | None = None
    sent = {name: np.zeros_like(value, np.float64) for name, value in base.items()}
    true = {name: np.zeros_like(value, np.float64) for name, value in base.items()}
    for _ in range(20):
        delta = {name: rng.standard_normal(value.shape).astype(np.float32) for name, value in base.items()}
        # Execute
        record, residual = encode_update({n: base[n] + delta[n] for n in base}, base, codec, rng, residual)
        decoded = decode_update(record, base)
        for name in base:
            sent[name] += decoded[name]
            true[name] += delta[name]
    # Assert: transmitted + residual == true, up to float32 rounding
    assert residual is not None
    for name in base:
        np.testing.assert_allclose(sent[name] + residual[name], true[name], atol=1e-4)


def _array(stype: str, data: bytes, shape: tuple[int, ...] = (10,)) -> Array:
    return Array(dtype="float32", shape=shape, stype=stype, data=data)


def _topk(k: int, indices: list[int], values: list[float]) -> bytes:
    return (np.uint32(k).astype("<u4").tobytes() + np.array(indices, "<u2").tobytes()
            + np.array(values, "<f4").tobytes())


@pytest.mark.parametrize(("array", "reason"), [
    (_array("fedge.delta/zip", b""), "unknown codec 'zip'"),
    (_array("pickle", b"\x80\x04"), "cannot decode"),
    (_array("fedge.delta/int8", b"\x00" * 7), "needs 14"),
    (_array("fedge.delta/fp16", b"\x00" * 21), "needs 20"),
    (_array("fedge.delta/topk:0.5", _topk(11, list(range(11)), [1.0] * 11)), "claims 11 kept entries of 10"),
    (_array("fedge.delta/topk:0.5", _topk(2, [3, 10], [1.0, 2.0])), "out of range"),
    (_array("fedge.delta/topk:0.5", _topk(2, [4, 4], [1.0, 2.0])), "duplicated or unsorted"),
    (_array("fedge.delta/topk:0.5", _topk(2, [5, 1], [1.0, 2.0])), "duplicated or unsorted"),
    (_array("fedge.delta/topk:0.5", _topk(2, [1, 5], [1.0])), "needs 8"),
    (_array("fedge.delta/int8", np.float32(np.nan).tobytes() + b"\x01" * 10), "invalid int8 scale"),
    (_array("fedge.delta/fp32", np.full(10, np.inf, "<f4").tobytes()), "NaN or Inf"),
])
def test_malformed_payloads_are_rejected_with_the_reason(array: Array, reason: str) -> None:
    with pytest.raises(UpdateRejected, match=reason.replace("(", r"\(")):
        decode_update(ArrayRecord({"w": array}), {"w": np.zeros(10, np.float32)})


def test_a_delta_needs_a_reference_of_the_same_shape() -> None:
    record = ArrayRecord({"w": encode_tensor(np.ones(4, np.float32), parse_codec("fp16"), np.random.default_rng())})
    with pytest.raises(UpdateRejected, match="shape"):
        decode_update(record, {"w": np.zeros(5, np.float32)})
    with pytest.raises(UpdateRejected, match="no model to add it to"):
        decode_update(record, None)


@pytest.mark.parametrize(("text", "expected"), [
    ("fp32", Codec()), ("", Codec()), ("int8", Codec(None, Int8())), ("topk:0.01+int8", Codec(0.01, Int8())),
    ("topk:1", Codec(1.0, None)), ("topk:0.05+fp16", Codec(0.05, Fp16())),
    ("int8:channel", Codec(None, Int8Channel())),
    ("topk:0.1+fp32", Codec(0.1)),  # fp32 is the quantiser a name without one means
])
def test_codec_names_parse(text: str, expected: Codec) -> None:
    assert parse_codec(text) == expected
    assert parse_codec(expected.name) == expected


def test_fp32_has_one_spelling() -> None:
    assert Codec(None, Fp32()) == Codec() and Codec(None, Fp32()).lossless
    assert Codec(0.1, Fp32()).name == "topk:0.1"
    assert Codec(None, Int8()) != Codec(None, Int8Channel())


@pytest.mark.parametrize(("text", "reason"), [
    ("zstd", "unknown codec 'zstd'"),
    ("topk:0", r"fraction must be in \(0, 1\]"),
    ("topk:1.5", r"fraction must be in \(0, 1\]"),
    ("topk:abc", "not a number"),
    ("topk", "write top-k as 'topk:<fraction>'"),
    ("int8+topk:0.1", "top-k must come first"),
    ("topk:0.1+topk:0.2", "top-k must come first and only once"),
    ("fp16+int8", "at most one quantiser"),
    ("int8+fp32", "at most one quantiser"),
    ("int8:foo", "unknown codec 'int8:foo'"),
    ("int8+", "unknown codec ''"),
])
def test_bad_codec_names_are_refused(text: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        parse_codec(text, key="codec.phone")


def test_topk_sends_exactly_k_entries_even_when_most_are_zero() -> None:
    # Prepare: 1000 entries of which 990 are exactly zero (a threshold of 0 would keep them all)
    delta = np.zeros(1000, np.float32)
    delta[:10] = np.arange(1, 11)
    # Execute
    record, _ = encode_update({"w": delta}, {"w": np.zeros(1000, np.float32)}, parse_codec("topk:0.05"),
                              np.random.default_rng(0))
    # Assert: k = 50 entries travel (10 non-zero + 40 zeros), 4 + 50 * (2 + 4) bytes
    assert len(bytes(record["w"].data)) == 4 + 50 * 6
    np.testing.assert_array_equal(decode_update(record, {"w": np.zeros(1000, np.float32)})["w"], delta)


def test_per_channel_int8_gives_a_bias_one_scale() -> None:
    bias = np.linspace(-1, 1, 64, dtype=np.float32)
    encoded = encode_tensor(bias, parse_codec("int8:channel"), np.random.default_rng(0))
    assert len(bytes(encoded.data)) == 4 + 64


def test_a_huge_declared_shape_is_rejected_before_anything_is_allocated() -> None:
    huge = Array(dtype="float32", shape=(2**42,), stype="fedge.delta/topk:0.1", data=b"\x00" * 8)
    with pytest.raises(UpdateRejected, match="has shape"):
        decode_update(ArrayRecord({"w": huge}), {"w": np.zeros(10, np.float32)})
    with pytest.raises(UpdateRejected, match="not part of the model"):
        decode_update(ArrayRecord({"x": huge}), {"w": np.zeros(10, np.float32)})


# --------------------------------------------------------------------------- the wire format, frozen

WIRE_CODECS = ["fp32", "fp32-delta", "fp16", "int8", "int8:channel", "topk:0.1", "topk:1", "topk:0.001",
               "topk:0.1+fp16", "topk:0.1+int8", "topk:0.1+int8:channel"]

# sha256 of wire_digest(module, codec) below, made with the implementation before the quantiser registry
# (string branches, commit cf353d3), in the repository root:
#     git show cf353d3:core/codec.py > /tmp/old_codec.py
#     .venv/bin/python -c 'import importlib.util as u, sys; from tests.test_codec import WIRE_CODECS, wire_digest
#     s = u.spec_from_file_location("old_codec", "/tmp/old_codec.py"); m = u.module_from_spec(s)
#     sys.modules["old_codec"] = m; s.loader.exec_module(m); [print(n, wire_digest(m, n)) for n in WIRE_CODECS]'
# A changed digest means changed bytes on the wire (or a change in what they decode to): devices and
# coordinators of different versions would no longer understand each other. Never update one to make
# this test pass; a new quantiser adds its own codec names and digests (made by its first version).
WIRE_DIGESTS = {
    "fp32": "33d87162ec2946675012a09981e8799cec0419c22c4eb09f6f5974278fa460c5",
    "fp32-delta": "33d87162ec2946675012a09981e8799cec0419c22c4eb09f6f5974278fa460c5",
    "fp16": "ec2d48e9fb11b6518d359fa21098c4bc05cb5259c99d61016a1f23223ffbac9e",
    "int8": "7c05c3915f29b91aefd1361973d2dc0df96eb04730078158c3410103c1e9a309",
    "int8:channel": "44919fe7ddc576247c31e263b67ca87be72f5fdea01b780fe3cf7d52fb73af1a",
    "topk:0.1": "d47ec13e0ebcf93c3a398b6e71ddd826e98e7036393b96788f9c11fb962d6c88",
    "topk:1": "f62afa9ef02d100c2dce05227f69341998a1c1f6c89575047d655dcee1985b9b",
    "topk:0.001": "2073c2a247bdb975a6383597c7969d883348f0f908de9d7209c61da13301acec",
    "topk:0.1+fp16": "521bb7675492c455685888fe99fa893774da0b5b6e780c20af82ea725330d4ba",
    "topk:0.1+int8": "cc8eae139205bd91c9877cf27815cdddeb5779fc1ba2987c6558eb07e8b7fde3",
    "topk:0.1+int8:channel": "f5b1ba139c07a957c9cf2c1c97cb14317445a3748cbb1fb35768455aa6113b1d",
}


def _wire_tensors() -> dict[str, np.ndarray]:
    """Fixed tensors: 2-D, 3-D float64, a bias, a scalar, empty ones, one > 65536 entries (uint32 indices),
    values over fp16's range, and exact zeros and ties."""
    rng = np.random.default_rng(20240613)
    tensors: dict[str, np.ndarray] = {
        "w": rng.standard_normal((6, 7)).astype(np.float32), "conv": rng.standard_normal((4, 2, 3)),
        "b": rng.standard_normal(5).astype(np.float32), "scalar": np.array(-2.5, np.float32),
        "empty": np.zeros((0, 4), np.float32), "rows": np.zeros((3, 0), np.float32),
        "big": rng.standard_normal((300, 256)).astype(np.float32),
        "huge": np.array([1e5, -7e4, 3.0, 0.0, 0.0, 3.0], np.float32),
    }
    return tensors


def wire_digest(codec_module: ModuleType, codec_name: str) -> str:
    """sha256 over every Array (name, stype, dtype, shape, data) ``codec_module`` writes for ``codec_name``
    and what it decodes from them: each tensor alone (as a delta, and as full weights for dense codecs),
    then one update with an error-feedback residual, its new residual and the weights it decodes to."""
    if codec_name == "fp32-delta":  # what a device that trained from a lossy downlink sends
        codec = codec_module.Codec(quantiser=None, fraction=None, delta=True)
    else:
        codec = codec_module.parse_codec(codec_name)
    digest = hashlib.sha256()

    def feed(name: str, array: Array) -> None:
        digest.update(repr((name, str(array.stype), str(array.dtype), tuple(array.shape))).encode())
        digest.update(bytes(array.data))

    tensors = _wire_tensors()
    for full in (False,) if codec.sparse else (False, True):
        for seed, (name, tensor) in enumerate(tensors.items()):
            array = codec_module.encode_tensor(tensor, codec, np.random.default_rng(seed), full=full)
            feed(name, array)
            values, is_full = codec_module.decode_tensor(array, name)
            digest.update(repr((values.dtype.str, values.shape, is_full)).encode() + values.tobytes())
    base = {name: np.full(np.shape(tensor), 0.25, np.float32) for name, tensor in tensors.items()}
    residual = {name: np.full(np.shape(tensor), 0.01, np.float32) for name, tensor in tensors.items()}
    record, kept = codec_module.encode_update(tensors, base, codec, np.random.default_rng(99), residual)
    for name, array in record.items():
        feed(name, array)
    for name in sorted(kept):
        digest.update(name.encode() + np.asarray(kept[name], "<f4").tobytes())
    for name, values in codec_module.decode_update(record, base).items():
        digest.update(repr((name, values.dtype.str, values.shape)).encode() + values.tobytes())
    return digest.hexdigest()


@pytest.mark.skipif(sys.byteorder != "little", reason="digests of native-order decoded values")
@pytest.mark.parametrize("name", WIRE_CODECS)
def test_every_codec_writes_and_reads_the_same_bytes_as_before_the_registry(name: str) -> None:
    assert wire_digest(codec_module, name) == WIRE_DIGESTS[name]


def test_the_frozen_wire_format_covers_every_quantiser() -> None:
    assert {parse_codec(name).values.name for name in WIRE_CODECS if name != "fp32-delta"} == set(
        codec_module.QUANTISERS)
