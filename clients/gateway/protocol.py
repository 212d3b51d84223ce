"""fedge's device protocol, version 1: the wire format both ends share (no Flower, no torch).

Phones, browsers and other devices that cannot run a Flower SuperNode talk to a fedge
gateway (:mod:`fedge.clients.gateway.service`) over HTTPS: JSON for control, and one small binary
container, the *frame*, for tensors. ``docs/device-protocol.md`` is the specification an
app developer implements (Kotlin, Swift, JS); this module is its one Python reading, used
by the gateway and by the reference client (:mod:`fedge.clients.protocol_device`).

Why not Flower's own Fleet API (gRPC, or its HTTP router with protobuf bodies)? Its node
authentication signs a timestamp header with the SuperNode's ECDSA key on every request,
and the signature does not cover the body; it needs protobuf in the device; and a
SuperLink keeps per-node state for every connected node. The probe in
``../shared/notes/device-gateway-probe.md`` measured the cost of per-request P-384
signatures at half the upload throughput of an HMAC session key. So: one signature at
check-in (ECDSA P-256 or Ed25519: both in WebCrypto), then a per-session HMAC over
method, path, counter and the body's SHA-256.

Written by hand because no maintained library defines a tensor container that is this
small, streamable, browser-friendly (``DataView`` reads it) and free of code execution
(numpy's ``.npy`` pickles object arrays; safetensors is close but is not a dependency
of a torch-free, Flower-free device).

Frame layout (all integers little-endian)::

    b"FDG1" | u32 header length H | H bytes of UTF-8 JSON header | tensor bytes...

The header's ``"tensors"`` lists ``{"name", "dtype", "shape"}`` (and ``"scale"`` for
``int8``) in the order their bytes follow; nothing else may follow the last tensor.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedge.codec import ENCODINGS as UPDATE_ENCODINGS
from fedge.codec import INT8_DELTA as INT8_DELTA
from fedge.codec import TASK_ENCODINGS, Fp16, Int8, task_capability
from fedge.errors import DeviceProtocolError
from fedge.listeners import GATEWAY_CN_PREFIX

VERSION = 1
PREFIX = "/v1"
MAGIC = b"FDG1"
FRAME_TYPE = "application/vnd.fedge.frame"
JSON_TYPE = "application/json"
MAX_HEADER = 1 << 20  # 1 MiB of JSON header: thousands of tensor entries
MAX_TENSORS = 4096
DTYPES: dict[str, np.dtype[Any]] = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8"), "float16": np.dtype("<f2"),
          "int8": np.dtype("i1"),
          "int32": np.dtype("<i4"), "int64": np.dtype("<i8"), "uint32": np.dtype("<u4"),
          "uint64": np.dtype("<u8")}  # unsigned: secure aggregation's masked vectors (a ring Z_2^bits)
CHECK_IN_CONTEXT = b"fedge-check-in/1"
MAC_CONTEXT = b"fedge-request/1"
CLOCK_SKEW_S = 300  # a check-in signed this long before or after the gateway's clock is refused
NONCE_BYTES = 16
SESSION_KEY_BYTES = 32
# the headers of an authenticated request
SESSION_HEADER = "authorization"  # "Fedge-Session <token>"
COUNTER_HEADER = "x-fedge-counter"
MAC_HEADER = "x-fedge-mac"
# what a device's update says it holds: the codec registry's device-protocol encodings (fedge.codec.ENCODINGS)
ENCODINGS = tuple(UPDATE_ENCODINGS)
SECURE_AGGREGATION = "secure-aggregation"  # the capability a device declares at check-in besides its encodings
# fields of the protocol's JSON whose words are also run-config keys (fedge.knobs), named here once
CHECK_IN_DEVICE = "device"  # a check-in's device name
TASK_ID = "task"  # a task's id (task and secagg step headers), echoed by the device's reply
DEVICE_SEED = "seed"  # a task's seed for this device and round (its config's seed is the run's)
NUM_ROUNDS = "num-rounds"  # the run's last round: in the coordinator's instruction to a gateway and in a task
DEADLINE_S = "deadline-s"  # a task's seconds left to reply
ASYNCHRONOUS = "asynchronous"  # true in an asynchronous run's train task: its model version may come again


@dataclass(frozen=True)
class Frame:
    """A decoded frame: its JSON header (without ``"tensors"``) and its tensors, in order."""

    header: dict[str, Any]
    tensors: dict[str, NDArray[np.generic]]


def encode_frame(header: Mapping[str, Any], tensors: Mapping[str, NDArray[np.generic]],
                 scales: Mapping[str, float] | None = None) -> bytes:
    """``header`` and ``tensors`` as one frame (``scales``: each ``int8`` tensor's scale)."""
    return assemble_frame(header, *frame_tensors(tensors, scales))


def frame_tensors(tensors: Mapping[str, NDArray[np.generic]], scales: Mapping[str, float] | None = None
                  ) -> tuple[list[dict[str, Any]], bytes]:
    """The tensor entries and bytes of a frame, to send under many headers (a round's task)."""
    entries, blobs = [], []
    for name, value in tensors.items():
        array = np.asarray(value)
        dtype = array.dtype.newbyteorder("<") if array.dtype.itemsize > 1 else array.dtype
        kind = next((key for key, known in DTYPES.items() if known == dtype), None)
        if kind is None:
            raise DeviceProtocolError(f"tensor '{name}' has dtype {array.dtype}; frames carry {', '.join(DTYPES)}")
        entry: dict[str, Any] = {"name": name, "dtype": kind, "shape": list(array.shape)}
        if kind == "int8":
            entry["scale"] = float((scales or {}).get(name, 1.0))
        entries.append(entry)
        blobs.append(np.ascontiguousarray(array, dtype=DTYPES[kind]).tobytes())
    return entries, b"".join(blobs)


def assemble_frame(header: Mapping[str, Any], entries: list[dict[str, Any]], data: bytes) -> bytes:
    """A frame from a header and :func:`frame_tensors`' entries and bytes."""
    text = json.dumps({**header, "tensors": entries}, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<I", len(text)), text, data])


def decode_frame(data: bytes, *, max_elements: int = 1 << 28) -> tuple[Frame, dict[str, float]]:
    """The frame in ``data`` and the scales of its ``int8`` tensors.

    Threat model: ``data`` comes from a device (or a gateway) that may be hostile. Every
    length is checked against what is left before anything is allocated; dtypes come from
    a fixed table (nothing executes); no tensor may overlap or leave bytes unaccounted for.

    Raises
    ------
    DeviceProtocolError
        Naming what is wrong with the frame.
    """
    if len(data) < 8 or data[:4] != MAGIC:
        raise DeviceProtocolError("the body is not a fedge frame (it must start with b'FDG1'); "
                                  f"send {FRAME_TYPE} as docs/device-protocol.md describes")
    (length,) = struct.unpack_from("<I", data, 4)
    if length > min(MAX_HEADER, len(data) - 8):
        raise DeviceProtocolError(f"frame header length {length} exceeds the body or {MAX_HEADER} bytes")
    header = _json_object(data[8:8 + length], "frame header")
    entries = header.pop("tensors", [])
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
        raise DeviceProtocolError(f"frame 'tensors' must be a list of at most {MAX_TENSORS} entries")
    offset, tensors, scales = 8 + length, {}, {}
    for entry in entries:
        name, dtype, shape, scale = _tensor_entry(entry, max_elements)
        size = math.prod(shape) * dtype.itemsize
        if offset + size > len(data):
            raise DeviceProtocolError(f"tensor '{name}' needs {size} bytes, the frame has {len(data) - offset} left")
        if name in tensors:
            raise DeviceProtocolError(f"tensor '{name}' appears twice in the frame")
        tensors[name] = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)
        if scale is not None:
            scales[name] = scale
        offset += size
    if offset != len(data):
        raise DeviceProtocolError(f"{len(data) - offset} bytes follow the last tensor of the frame")
    return Frame(header=header, tensors=tensors), scales


def _tensor_entry(entry: object, max_elements: int) -> tuple[str, np.dtype[Any], tuple[int, ...], float | None]:
    if not isinstance(entry, dict):
        raise DeviceProtocolError("each frame tensor entry must be an object with name, dtype and shape")
    name, kind, shape = entry.get("name"), entry.get("dtype"), entry.get("shape")
    if not isinstance(name, str) or not 0 < len(name) <= 256:
        raise DeviceProtocolError(f"a frame tensor name must be a string of 1-256 characters, got {name!r:.40}")
    if not isinstance(kind, str) or kind not in DTYPES:
        raise DeviceProtocolError(f"tensor '{name}': dtype {kind!r:.20} is not one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > 8 or \
            not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= max_elements for d in shape):
        raise DeviceProtocolError(f"tensor '{name}': shape must be a list of at most 8 non-negative integers")
    if math.prod(shape) > max_elements:
        raise DeviceProtocolError(f"tensor '{name}' has {math.prod(shape)} elements, more than {max_elements}")
    scale = entry.get("scale")
    if kind == "int8":
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale) or scale < 0:
            raise DeviceProtocolError(f"int8 tensor '{name}' needs a finite, non-negative 'scale'")
        return name, DTYPES[kind], tuple(shape), float(scale)
    return name, DTYPES[kind], tuple(shape), None


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as exc:  # not UTF-8, not JSON, or a number of more than 4,300 digits
        raise DeviceProtocolError(f"the {what} is not valid UTF-8 JSON ({str(exc)[:120]})") from None
    except RecursionError:  # "[[[[..." thousands deep: refused, not a crash of the handler
        raise DeviceProtocolError(f"the {what} nests too deeply") from None
    if not isinstance(value, dict):
        raise DeviceProtocolError(f"the {what} must be a JSON object")
    return value


def read_json(data: bytes, what: str = "request body") -> dict[str, Any]:
    """A JSON object from a device, or :class:`DeviceProtocolError` naming what is wrong."""
    return _json_object(data, what)


# --------------------------------------------------------------------------- records (secure aggregation's steps)
MAX_RECORD_KEYS = 1 << 16
Value = int | float | str | bool | bytes | list[Any]


def records_to_json(records: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Named records of plain values as JSON: bytes become ``{"b64": "..."}`` (in lists too).

    What the secure-aggregation steps exchange between a gateway and its devices (keys,
    sealed shares, signatures, node lists); ``docs/device-protocol.md`` specifies it.
    """
    def encode(value: Any) -> Any:
        if isinstance(value, bytes):
            return {"b64": b64(value)}
        if isinstance(value, list):
            return [encode(item) for item in value]
        return value
    return {name: {key: encode(value) for key, value in record.items()} for name, record in records.items()}


def records_from_json(raw: object, what: str = "records") -> dict[str, dict[str, Value]]:
    """:func:`records_to_json` read back, every value checked, or :class:`DeviceProtocolError` naming it.

    A list holds values of one type (as a Flower ``ConfigRecord`` does).
    """
    if not isinstance(raw, dict) or len(raw) > 64:
        raise DeviceProtocolError(f"'{what}' must be an object of at most 64 named records")
    records: dict[str, dict[str, Value]] = {}
    for name, record in raw.items():
        if not isinstance(record, dict) or len(record) > MAX_RECORD_KEYS:
            raise DeviceProtocolError(f"record '{name:.40}' must be an object of at most {MAX_RECORD_KEYS} keys")
        records[name] = {str(key): _record_value(value, f"{name:.40}/{key:.40}") for key, value in record.items()}
    return records


def _record_value(value: object, where: str) -> Value:
    if isinstance(value, dict):
        if set(value) != {"b64"}:
            raise DeviceProtocolError(f"'{where}': an object value must be {{\"b64\": ...}} (bytes)")
        return unb64(value["b64"], where, max_size=1 << 20)
    if isinstance(value, list):
        if any(isinstance(item, list) for item in value):  # before recursing: a deep nest is refused at once
            raise DeviceProtocolError(f"'{where}': a list holds values of one type, not lists")
        items = [_record_value(item, where) for item in value]
        if len({type(item) for item in items}) > 1:
            raise DeviceProtocolError(f"'{where}': a list holds values of one type, not lists")
        return items
    if isinstance(value, float) and not math.isfinite(value):
        raise DeviceProtocolError(f"'{where}': numbers must be finite")
    if isinstance(value, bool | int | float | str):
        return value
    raise DeviceProtocolError(f"'{where}': null is not a record value")


# --------------------------------------------------------------------------- task encodings (the downlink codecs)
TASK_CAPABILITIES = tuple(task_capability(name) for name in TASK_ENCODINGS if name != "fp32")


@dataclass(frozen=True)
class EncodedTask:
    """A round's model as one task encoding sends it: frame entries and bytes, and what a device reads back.

    ``received`` (float32, exactly what :func:`task_weights` gives the device) is what the
    device trains from; the gateway takes the device's update against it.
    """

    encoding: str
    entries: list[dict[str, Any]]
    data: bytes
    received: dict[str, NDArray[np.float32]]


def encode_task(weights: Mapping[str, NDArray[np.generic]], encoding: str) -> EncodedTask:
    """``weights`` in the task encoding ``encoding`` (:data:`fedge.codec.TASK_ENCODINGS`).

    ``fp32`` sends the tensors as they are; ``fp16`` as float16 (saturating at +/-65504);
    ``int8`` as int8 with one scale per tensor (``max|w| / 127``, round half to even).

    Raises
    ------
    DeviceProtocolError
        An encoding that is not registered.
    """
    quantiser = TASK_ENCODINGS.get(encoding)
    if quantiser is None:
        raise DeviceProtocolError(f"task encoding {encoding!r}: use one of {', '.join(TASK_ENCODINGS)}")
    if isinstance(quantiser, Int8):
        pairs = {name: quantiser.quantise(np.asarray(value, np.float32)) for name, value in weights.items()}
        entries, data = frame_tensors({name: q for name, (q, _) in pairs.items()},
                                      {name: float(scale[0]) for name, (_, scale) in pairs.items()})
    elif isinstance(quantiser, Fp16):
        entries, data = frame_tensors({name: np.clip(np.asarray(value, np.float32), -65504, 65504).astype("<f2")
                                       for name, value in weights.items()})
    else:
        entries, data = frame_tensors(weights)
    frame, scales = decode_frame(assemble_frame({}, entries, data))
    return EncodedTask(encoding=encoding, entries=entries, data=data, received=task_weights(frame, scales))


def task_weights(frame: Frame, scales: Mapping[str, float]) -> dict[str, NDArray[np.float32]]:
    """A task's weights as float32, whatever its encoding: float16 widened, int8 read as ``q * scale``
    (the product in float32, as the web SDK's reading of the same frame gives it); writable copies."""
    weights = {}
    for name, value in frame.tensors.items():
        if value.dtype == np.int8:
            weights[name] = value.astype(np.float32) * np.float32(scales[name])
        else:
            weights[name] = np.array(value, dtype=np.float32)
    return weights


# --------------------------------------------------------------------------- int8 delta (the uplink codec)
def int8_delta(trained: Mapping[str, NDArray[np.generic]], base: Mapping[str, NDArray[np.generic]]
               ) -> tuple[dict[str, NDArray[np.int8]], dict[str, float]]:
    """``trained - base`` per float tensor as int8 and a scale (``value = q * scale``, round half to even).

    The codec registry's ``int8-delta`` entry (:data:`fedge.codec.ENCODINGS`: fedge's one int8
    quantiser, deterministic here) on the delta in float64, one scale per tensor.
    """
    quantiser = UPDATE_ENCODINGS[INT8_DELTA]
    assert isinstance(quantiser, Int8)
    quantised, scales = {}, {}
    for name, value in trained.items():
        delta = np.asarray(value, np.float64) - np.asarray(base[name], np.float64)
        quantised[name], scale = quantiser.quantise(delta)
        scales[name] = float(scale[0])
    return quantised, scales


def from_int8_delta(tensors: Mapping[str, NDArray[np.generic]], scales: Mapping[str, float],
                    base: Mapping[str, NDArray[np.generic]]) -> dict[str, NDArray[np.generic]]:
    """The trained weights an ``int8-delta`` update stands for: ``base + q * scale``, in base's dtype."""
    restored = {}
    for name, value in tensors.items():
        if name not in base or name not in scales:
            raise DeviceProtocolError(f"int8 tensor '{name}' is not a tensor of the task's model (or has no scale)")
        if value.dtype != np.int8:
            raise DeviceProtocolError(f"an {INT8_DELTA} update holds int8 tensors; '{name}' is {value.dtype}")
        reference = np.asarray(base[name])
        if value.shape != reference.shape:
            raise DeviceProtocolError(f"tensor '{name}' has shape {value.shape}, the model's is {reference.shape}")
        if np.issubdtype(reference.dtype, np.floating):  # in the model's own precision: no float64 temporaries
            restored[name] = reference + value.astype(reference.dtype) * reference.dtype.type(scales[name])
        else:
            restored[name] = np.rint(reference + value.astype(np.float64) * scales[name]).astype(reference.dtype)
    return restored


# --------------------------------------------------------------------------- authentication
def certified_gateway_name(common_name: str) -> str | None:
    """The gateway name in a certificate's subject CN ``fedge gateway NAME``, or None when it names no gateway."""
    if common_name.startswith(GATEWAY_CN_PREFIX) and len(common_name) > len(GATEWAY_CN_PREFIX):
        return common_name[len(GATEWAY_CN_PREFIX):]
    return None


def check_in_message(*, device: str, gateway: str, issued_at: int, nonce: str) -> bytes:
    """What a device signs at check-in: who it is, which gateway it talks to, when, and a nonce."""
    return b"\n".join([CHECK_IN_CONTEXT, device.encode(), gateway.encode(), str(issued_at).encode(), nonce.encode()])


def request_mac(key: bytes, *, method: str, path: str, counter: int, body: bytes) -> str:
    """The HMAC-SHA256 of an authenticated request (base64): method, path, counter, SHA-256 of the body."""
    message = b"\n".join([MAC_CONTEXT, method.upper().encode(), path.encode(), str(counter).encode(),
                          hashlib.sha256(body).hexdigest().encode()])
    return b64(hmac.new(key, message, hashlib.sha256).digest())


def macs_equal(expected: str, given: str) -> bool:
    """Constant-time comparison of two MACs."""
    return hmac.compare_digest(expected.encode(), given.encode())


def b64(data: bytes) -> str:
    """Standard base64 (what ``btoa`` and WebCrypto users produce)."""
    return base64.b64encode(data).decode()


def unb64(text: object, what: str, *, size: int | None = None, max_size: int = 1024) -> bytes:
    """Decode base64 ``text``, or :class:`DeviceProtocolError` naming ``what``."""
    if not isinstance(text, str) or len(text) > max_size * 2:
        raise DeviceProtocolError(f"'{what}' must be a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise DeviceProtocolError(f"'{what}' is not valid base64") from None
    if size is not None and len(raw) != size:
        raise DeviceProtocolError(f"'{what}' must decode to {size} bytes, got {len(raw)}")
    return raw
