"""The quantiser registry: the contract every registered quantiser meets, registration rules,
and a new quantiser added from outside ``fedge.codec`` (one class, registered in this file)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from numpy.typing import NDArray

from fedge.codec import (
    QUANTISERS,
    Floats,
    Quantiser,
    Shape,
    decode_tensor,
    decode_update,
    encode_tensor,
    encode_update,
    parse_codec,
    register_quantiser,
    unregister_quantiser,
)
from fedge.errors import ConfigError, UpdateRejected

SHAPES: list[Shape] = [(6, 7), (5,), (), (0, 4), (3, 0), (2, 3, 4), (1,)]


# --------------------------------------------------------------------------- a toy quantiser, added here


class Int4(Quantiser):
    """4-bit integers: one float32 scale ``max|x| / 7``, stochastic rounding to -7..7 (as :class:`~fedge.codec.Int8`),
    stored as ``q + 8`` two to a byte, low nibble first (an odd count pads the last byte with 0)."""

    name = "int4"

    def payload_bytes(self, shape: Shape) -> int:
        return 4 + (math.prod(shape) + 1) // 2

    def encode(self, values: NDArray[np.float32], rng: np.random.Generator) -> bytes:
        flat = values.ravel()
        scale = np.float32(np.abs(flat).max(initial=0.0) / 7.0)
        quantised = np.floor(flat / (scale or 1.0) + rng.random(flat.size)).clip(-7, 7).astype(np.int64) + 8
        nibbles = np.append(quantised, 0) if flat.size % 2 else quantised
        packed = (nibbles[0::2] | nibbles[1::2] << 4).astype(np.uint8)
        return scale.astype("<f4").tobytes() + packed.tobytes()

    def unpack(self, data: bytes, shape: Shape, name: str) -> Floats:
        scale = np.frombuffer(data[:4], "<f4")[0]
        if not np.isfinite(scale) or scale < 0:
            raise UpdateRejected(f"array '{name}' has an invalid int4 scale")
        packed = np.frombuffer(data[4:], np.uint8)
        nibbles = np.stack([packed & 0x0F, packed >> 4], axis=1).ravel()[:math.prod(shape)]
        return (nibbles.astype(np.float32) - 8) * scale


@pytest.fixture
def int4() -> Iterator[type[Int4]]:
    """``int4`` registered for one test (and unknown again after it)."""
    register_quantiser(Int4)
    try:
        yield Int4
    finally:
        unregister_quantiser(Int4.name)


# --------------------------------------------------------------------------- the contract


def _check_contract(quantiser: Quantiser, shape: Shape) -> None:
    """What every quantiser promises for a tensor of ``shape``."""
    values = (np.random.default_rng(5).standard_normal(shape) * 3).astype(np.float32)
    payload = quantiser.encode(values, np.random.default_rng(0))
    assert len(payload) == quantiser.payload_bytes(shape)
    assert payload == quantiser.encode(values, np.random.default_rng(0))  # the rng is the only randomness
    decoded = quantiser.decode(payload, shape, "w")
    assert decoded.shape == (math.prod(shape),) and decoded.dtype == np.float32
    assert np.all(np.isfinite(decoded))
    for wrong in [payload + b"\x00"] + ([payload[:-1]] if payload else []):
        with pytest.raises(UpdateRejected, match=f"carries {len(wrong)} bytes; {quantiser.spec} of "
                                                 f"{math.prod(shape)} values needs {len(payload)}"):
            quantiser.decode(wrong, shape, "w")


@pytest.mark.parametrize("name", list(QUANTISERS))
@pytest.mark.parametrize("shape", SHAPES)
def test_every_registered_quantiser_keeps_the_contract(name: str, shape: Shape) -> None:
    quantiser = parse_codec(name).values
    assert quantiser.spec == name
    _check_contract(quantiser, shape)


@pytest.mark.parametrize("name", ["fp32", "fp16", "int8", "int8:channel", "topk:0.1", "topk:0.3+int8",
                                  "topk:1+fp16", "topk:0.5+int8:channel"])
@pytest.mark.parametrize("shape", SHAPES + [(300, 256)])
def test_payload_bytes_is_what_encode_writes(name: str, shape: Shape) -> None:
    codec = parse_codec(name)
    array = encode_tensor(np.ones(shape, np.float32), codec, np.random.default_rng(0))
    assert len(bytes(array.data)) == codec.payload_bytes(shape)
    if codec.sparse and math.prod(shape):
        assert len(bytes(encode_tensor(np.ones(shape, np.float32), codec, np.random.default_rng(0),
                                       keep=1).data)) == codec.payload_bytes(shape, keep=1)


# --------------------------------------------------------------------------- registration


@pytest.mark.parametrize(("name", "reason"), [
    ("int8", "already"), ("fp32", "already"), ("topk4", "not start with 'topk'"), ("a+b", "must look like"),
    ("Int4", "must look like"), ("", "must look like"), ("x:y:z", "must look like"),
])
def test_bad_or_taken_names_are_refused(name: str, reason: str) -> None:
    quantiser = type("Bad", (Int4,), {"name": name})
    with pytest.raises(ValueError, match=reason):
        register_quantiser(quantiser)
    assert QUANTISERS.get(name) is not quantiser


def test_an_incomplete_quantiser_is_refused() -> None:
    incomplete = type("Incomplete", (Quantiser,), {"name": "half-done"})
    with pytest.raises(ValueError, match="leaves encode, payload_bytes, unpack unimplemented"):
        register_quantiser(incomplete)


def test_the_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        QUANTISERS["int4"] = Int4  # type: ignore[index]


# --------------------------------------------------------------------------- a new quantiser, end to end


def test_a_registered_quantiser_travels_through_the_public_api(int4: type[Int4]) -> None:
    # Prepare: a two-tensor model and a trained copy of it
    rng = np.random.default_rng(1)
    base = {"w": rng.standard_normal((8, 5)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}
    delta = {name: rng.standard_normal(value.shape).astype(np.float32) for name, value in base.items()}
    local = {name: base[name] + delta[name] for name in base}
    # Execute: encode and decode by name, as a device and the coordinator do
    codec = parse_codec("int4", key="codec.phone")
    record, residual = encode_update(local, base, codec, np.random.default_rng(2))
    decoded = decode_update(record, base)
    # Assert: the stype names it, 4 + ceil(n / 2) bytes, within one step max|delta| / 7 of the truth
    assert codec.values == int4() and codec.name == "int4" and not codec.lossless and residual == {}
    assert {str(array.stype) for array in record.values()} == {"fedge.delta/int4"}
    assert len(bytes(record["w"].data)) == 4 + 20 and len(bytes(record["b"].data)) == 4 + 3
    for name in base:
        step = np.abs(delta[name]).max() / 7
        assert np.all(np.abs(decoded[name] - local[name]) <= step * (1 + 1e-5) + 1e-6)


def test_a_registered_quantiser_composes_with_topk_and_carries_full_weights(int4: type[Int4]) -> None:
    # Prepare
    base = {"w": np.zeros(100, np.float32)}
    delta = np.linspace(-1, 1, 100, dtype=np.float32)
    # Execute: top-k 10% with int4 values (error feedback keeps the rest); the full weights in int4
    record, residual = encode_update({"w": delta}, base, parse_codec("topk:0.1+int4"), np.random.default_rng(0))
    sent = decode_update(record, base)["w"]
    full = ArrayRecord({"w": encode_tensor(delta, parse_codec("int4"), np.random.default_rng(0), full=True)})
    # Assert: 10 entries, 2-byte indices, 4 + 5 bytes of int4; what was not sent is in the residual
    assert str(record["w"].stype) == "fedge.delta/topk:0.1+int4"
    assert len(bytes(record["w"].data)) == 4 + 10 * 2 + 4 + 5
    assert np.count_nonzero(sent) <= 10
    np.testing.assert_allclose(sent + residual["w"], delta, atol=1e-6)
    assert str(full["w"].stype) == "fedge.full/int4"
    assert np.all(np.abs(decode_update(full, None)["w"] - delta) <= 1 / 7 + 1e-6)


def test_a_registered_quantiser_keeps_the_contract_and_is_rejected_when_malformed(int4: type[Int4]) -> None:
    for shape in SHAPES:
        _check_contract(int4(), shape)
    bad_length = Array(dtype="float32", shape=(10,), stype="fedge.delta/int4", data=b"\x00" * 8)
    bad_scale = Array(dtype="float32", shape=(10,), stype="fedge.delta/int4",
                      data=np.float32(-1).tobytes() + b"\x88" * 5)
    with pytest.raises(UpdateRejected, match="carries 8 bytes; int4 of 10 values needs 9"):
        decode_update(ArrayRecord({"w": bad_length}), {"w": np.zeros(10, np.float32)})
    with pytest.raises(UpdateRejected, match="invalid int4 scale"):
        decode_tensor(bad_scale, "w")
    with pytest.raises(ConfigError, match="at most one quantiser"):
        parse_codec("int4+int8")


def test_an_unregistered_quantiser_is_an_unknown_codec() -> None:
    assert "int4" not in QUANTISERS  # the fixture above unregistered it
    with pytest.raises(ConfigError, match="unknown codec 'int4'"):
        parse_codec("topk:0.1+int4")
    with pytest.raises(UpdateRejected, match="unknown codec 'int4'"):
        decode_tensor(Array(dtype="float32", shape=(2,), stype="fedge.delta/int4", data=b"\x00" * 5), "w")


# --------------------------------------------------------------------------- the device protocol's encodings


def test_the_device_protocols_encodings_are_the_codec_registrys_entries() -> None:
    from fedge import codec  # noqa: PLC0415
    from fedge.clients.gateway import protocol as device_protocol  # noqa: PLC0415

    # The protocol's list of encodings is the registry's, and its int8-delta is fedge's one int8 quantiser
    assert device_protocol.ENCODINGS == tuple(codec.ENCODINGS) == ("fp32", "int8-delta")
    entry = codec.ENCODINGS[codec.INT8_DELTA]
    assert type(entry) is codec.Int8 and entry.rounding == codec.NEAREST_EVEN
    assert codec.ENCODINGS["fp32"] == codec.FP32


def test_int8_delta_is_the_registry_entry_and_rounds_half_to_even(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedge import codec  # noqa: PLC0415
    from fedge.clients.gateway import protocol as device_protocol  # noqa: PLC0415

    # Prepare: deltas of exactly 0.5, 1.5, 2.5 and -2.5 scale steps (scale = 127 / 127 = 1)
    base = {"w": np.zeros(5, np.float64)}
    trained = {"w": np.array([0.5, 1.5, 2.5, -2.5, 127.0])}
    # Execute
    quantised, scales = device_protocol.int8_delta(trained, base)
    # Assert: round half to even, the registry entry's own output
    assert scales == {"w": 1.0}
    assert quantised["w"].tolist() == [0, 2, 2, -2, 127]
    q, s = codec.ENCODINGS[codec.INT8_DELTA].quantise(trained["w"])  # type: ignore[attr-defined]
    assert np.array_equal(q, quantised["w"]) and float(s[0]) == scales["w"]
    # Execute: the entry swapped for the stochastic quantiser; the protocol follows the registry
    monkeypatch.setitem(codec._ENCODINGS, codec.INT8_DELTA, codec.Int8())
    with pytest.raises(ValueError, match="pass rng"):
        device_protocol.int8_delta(trained, base)


def test_int8_rounding_is_a_parameter_with_checked_values() -> None:
    from fedge.codec import NEAREST_EVEN, Int8  # noqa: PLC0415

    with pytest.raises(ValueError, match="stochastic, nearest-even"):
        Int8(rounding="up")
    # The deterministic variant draws nothing and does not change what a codec name parses to
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    Int8(rounding=NEAREST_EVEN).encode(np.array([0.25, -1.0], np.float32), rng)
    assert rng.bit_generator.state == state
    assert parse_codec("int8").quantiser == Int8() != Int8(rounding=NEAREST_EVEN)
