"""The device protocol's test vectors (``docs/protocol-vectors/``) against fedge and against the spec.

Issue 39 §2: a device written from ``docs/device-protocol.md`` alone must reach the reference
client's bytes. Two kinds of check keep the documents and the wire together:

- **fedge makes the shipped bytes.** Every vector is rebuilt with fedge's own functions
  (``docs/protocol-vectors/make_vectors.py``) and compared with the shipped file byte for
  byte: a change of the wire fails here until the vectors (and the document) are rewritten.
  The training vector's graph outputs are onnxruntime's float32 arithmetic and are compared
  to 1e-6; everything else in it exactly.
- **The spec makes them too.** A small port written from the document only (stdlib, numpy and
  cryptography; no fedge import) recomputes each deterministic step from the vector's inputs,
  and worked examples from the document (int8 rounding, the encoded secure update) are
  asserted with values computed by hand.

The generator is never run here: ``.venv/bin/python docs/protocol-vectors/make_vectors.py``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import importlib.util
import io
import json
import re
import shutil
import struct
import subprocess
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

ROOT = Path(__file__).resolve().parents[1]
VECTORS = ROOT / "docs" / "protocol-vectors"
SPEC = ROOT / "docs" / "device-protocol.md"
PRIME = 2**521 - 1


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fedge_protocol_vectors", VECTORS / "make_vectors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKE = _generator()
EXACT = [name for name in MAKE.VECTORS if name != "training"]


def _vector(name: str) -> dict[str, Any]:
    return json.loads((VECTORS / f"{name}.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- fedge makes the shipped bytes
@pytest.mark.parametrize("name", EXACT)
def test_fedge_makes_each_shipped_vector_byte_for_byte(name: str) -> None:
    # Prepare
    shipped = (VECTORS / f"{name}.json").read_text(encoding="utf-8")

    # Execute
    rebuilt = MAKE.render(MAKE.VECTORS[name]())

    # Assert: the parsed objects first (a readable diff), then every byte
    assert json.loads(rebuilt) == json.loads(shipped), f"{name}.json: the wire changed; see make_vectors.py"
    assert rebuilt == shipped


def _close(rebuilt: Any, shipped: Any, where: str = "") -> None:
    """Equal, floats within 1e-6 (relative) or 1e-7: the training vector's onnxruntime numbers."""
    if isinstance(shipped, dict):
        assert isinstance(rebuilt, dict) and rebuilt.keys() == shipped.keys(), where
        for key in shipped:
            _close(rebuilt[key], shipped[key], f"{where}/{key}")
    elif isinstance(shipped, list):
        assert isinstance(rebuilt, list) and len(rebuilt) == len(shipped), where
        for index, (a, b) in enumerate(zip(rebuilt, shipped, strict=True)):
            _close(a, b, f"{where}[{index}]")
    elif isinstance(shipped, float):
        assert rebuilt == pytest.approx(shipped, rel=1e-6, abs=1e-7), where
    else:
        assert rebuilt == shipped, where


def test_fedge_trains_the_shipped_bundle_as_the_training_vector_says() -> None:
    # Prepare
    shipped = _vector("training")

    # Execute
    rebuilt = json.loads(MAKE.render(MAKE.training_vector()))

    # Assert: batches, counts, the task and the int8 codes exactly; onnxruntime's floats to 1e-6
    assert [step["batch"] for step in rebuilt["steps"]] == [step["batch"] for step in shipped["steps"]]
    assert rebuilt["task"] == shipped["task"] and rebuilt["inputs"] == shipped["inputs"]
    assert {k: v for k, v in rebuilt["result_header"].items() if k != "metrics"} == \
        {k: v for k, v in shipped["result_header"].items() if k != "metrics"}
    _close(rebuilt, shipped)


# --------------------------------------------------------------------------- the spec makes them too
def test_a_frame_read_as_the_spec_says_gives_the_vectors_header_and_tensors() -> None:
    # Prepare
    vector = _vector("frame")
    data = bytes.fromhex(vector["frame_hex"])
    dtypes = {"float32": "<f4", "float64": "<f8", "int8": "i1", "int32": "<i4", "int64": "<i8", "uint32": "<u4",
              "uint64": "<u8"}

    # Execute: magic, u32 LE header length, JSON header, tensors in order with nothing after
    assert data[:4] == b"FDG1"
    (length,) = struct.unpack_from("<I", data, 4)
    header = json.loads(data[8:8 + length])
    offset, tensors = 8 + length, []
    for entry in header.pop("tensors"):
        dtype = np.dtype(dtypes[entry["dtype"]])
        count = int(np.prod(entry["shape"]))
        tensors.append({**entry, "values": np.frombuffer(data, dtype, count, offset).tolist()})
        offset += count * dtype.itemsize

    # Assert
    assert offset == len(data)
    assert length == vector["header_length"] and data[8:8 + length].decode() == vector["header_json"]
    assert header == vector["header"]
    assert tensors == vector["tensors"]
    assert b" " not in data[8:8 + length]  # compact JSON: separators "," and ":"


def test_the_check_in_signature_verifies_over_the_message_the_spec_describes() -> None:
    # Prepare
    vector = _vector("check-in")
    public = serialization.load_pem_public_key(vector["public_key_pem"].encode())
    assert isinstance(public, Ed25519PublicKey)

    # Execute
    message = "\n".join(["fedge-check-in/1", vector["device"], vector["gateway"], str(vector["time"]),
                         vector["nonce"]]).encode()

    # Assert: the bytes, and a signature the registered key verifies (raises if not)
    assert message.hex() == vector["message_hex"]
    public.verify(base64.b64decode(vector["body"]["signature"]), message)
    assert len(base64.b64decode(vector["body"]["nonce"])) == 16


def test_request_macs_follow_the_spec() -> None:
    # Prepare
    vector = _vector("request-mac")
    key = base64.b64decode(vector["session_key"])

    for request in vector["requests"]:
        # Execute
        body = bytes.fromhex(request["body_hex"])
        message = "\n".join(["fedge-request/1", request["method"], request["path"], str(request["counter"]),
                             hashlib.sha256(body).hexdigest()]).encode()
        mac = base64.b64encode(hmac.new(key, message, hashlib.sha256).digest()).decode()

        # Assert
        assert message.decode() == request["message_text"]
        assert mac == request["mac"]


def test_the_int8_worked_example_is_the_documents_hand_computed_one() -> None:
    # Prepare: global 0.25 everywhere; deltas 127/128, -1/2, 1.5/128, 0.5/128, -2.5/128: scale 1/128
    case = next(c for c in _vector("int8-delta")["cases"] if c["name"] == "worked")

    # Execute: nothing: the numbers below are worked by hand in docs/device-protocol.md

    # Assert: 1.5 -> 2, 0.5 -> 0, -2.5 -> -2 (half to even); restored = global + q / 128
    assert case["scale"] == 1 / 128
    assert case["q"] == [127, -64, 2, 0, -2]
    assert case["restored"] == [1.2421875, -0.25, 0.265625, 0.25, 0.234375]
    documented = " ".join(SPEC.read_text(encoding="utf-8").split())
    assert "`q = [127, −64, 2, 0, −2]`" in documented and "scale `1/128 = 0.0078125`" in documented


def test_int8_delta_as_the_spec_says_gives_every_case() -> None:
    for case in _vector("int8-delta")["cases"]:
        # Prepare
        base, trained = np.array(case["global"], np.float32), np.array(case["trained"], np.float32)

        # Execute: in float64; scale 0 (and q all 0) for an unchanged tensor; restored in float32
        delta = trained.astype(np.float64) - base.astype(np.float64)
        peak = float(np.max(np.abs(delta)))
        scale = peak / 127 if peak > 0 else 0.0
        q = np.rint(delta / scale).astype(np.int8) if scale else np.zeros(len(delta), np.int8)
        restored = base + q.astype(np.float32) * np.float32(scale)

        # Assert
        assert scale == case["scale"] and q.tolist() == case["q"]
        assert restored.astype(np.float64).tolist() == case["restored"]


def test_batches_are_one_generator_and_a_permutation_per_epoch() -> None:
    vector = _vector("batching")
    for case in vector["cases"]:
        # Prepare
        rng = np.random.default_rng(case["seed"])

        # Execute
        batches = []
        for _ in range(case["local-epochs"]):
            order = rng.permutation(case["examples"])
            batches += [order[i:i + case["batch-size"]].tolist() for i in range(0, case["examples"],
                                                                                case["batch-size"])]

        # Assert
        assert batches == case["batches"]
    assert np.random.default_rng(42).bit_generator.random_raw(4).tolist() == \
        vector["first_words_of_pcg64"]["next_uint64"]


def test_preprocessing_as_the_spec_says() -> None:
    # Prepare
    vector = _vector("preprocessing")
    spec = vector["preprocessing"]

    # Execute
    raw = np.array(vector["raw"]["inputs"], np.float32)
    prepared = raw * np.float32(spec["scale"]) + np.float32(spec["offset"])

    # Assert
    assert prepared.astype(np.float64).tolist() == vector["raw"]["prepared"]
    assert vector["raw"]["verdict"] == "raw"
    assert vector["preprocessed"]["prepared"] == vector["preprocessed"]["inputs"]


def _spec_step(param: np.ndarray, grad: np.ndarray, velocity: np.ndarray | None, anchor: np.ndarray, *,
               lr: float, momentum: float, mu: float) -> tuple[np.ndarray, np.ndarray | None]:
    """The optimiser step as docs/device-protocol.md writes it, float32 throughout."""
    if mu > 0:
        grad = grad + np.float32(mu) * (param - anchor)
    if momentum:
        velocity = grad.copy() if velocity is None else np.float32(momentum) * velocity + grad
        return param - np.float32(lr) * velocity, velocity
    return param - np.float32(lr) * grad, None


def test_the_optimiser_as_the_spec_says_replays_every_step_exactly() -> None:
    vector = _vector("optimiser")
    for case in vector["cases"]:
        # Prepare
        start = np.array(vector["start"], np.float32)
        param, velocity, after = start.copy(), None, []

        # Execute
        for grad in vector["gradients"]:
            param, velocity = _spec_step(param, np.array(grad, np.float32), velocity, start,
                                         lr=case["learning-rate"], momentum=case["momentum"], mu=case["proximal-mu"])
            after.append(param.astype(np.float64).tolist())

        # Assert
        assert after == case["after_each_step"]


def test_the_bundle_verifies_as_the_spec_says() -> None:
    # Prepare
    vector = _vector("bundle")
    data = (VECTORS / "bundle.zip").read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        files = {info.filename: archive.read(info) for info in archive.infolist()}
    raw = bytes.fromhex(vector["signing_public_raw_hex"])
    envelope = json.loads(files["manifest.sig"])

    # Execute: the documented checks in order
    assert hashlib.sha256(data).hexdigest() == vector["bundle_sha256"]
    assert sorted(files) == vector["files"] == ["eval.onnx", "manifest.json", "manifest.sig", "train.onnx"]
    assert envelope["algorithm"] == "ed25519"
    fingerprint = "sha256:" + hashlib.sha256(raw).hexdigest()
    assert envelope["key_fingerprint"] == fingerprint == vector["fingerprint"]
    Ed25519PublicKey.from_public_bytes(raw).verify(base64.b64decode(envelope["signature"]), files["manifest.json"])
    manifest = json.loads(files["manifest.json"])

    # Assert
    assert manifest["format"] == "fedge-training-bundle/1" and manifest["kind"] == "training"
    for name, entry in manifest["files"].items():
        assert hashlib.sha256(files[name]).hexdigest() == entry["sha256"] and len(files[name]) == entry["bytes"]
    assert hashlib.sha256(files["train.onnx"] + files["eval.onnx"]).hexdigest() == manifest["architecture"]
    assert manifest["expires_at"] is None and manifest["optimizer"] == "sgd-momentum"
    private = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(vector["signing_private_seed_hex"]))
    assert private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw) == raw


def test_fedge_signs_the_shipped_manifest_into_the_shipped_envelope() -> None:
    # Prepare
    from fedge.edge.bundle import sign_manifest  # noqa: PLC0415

    with zipfile.ZipFile(VECTORS / "bundle.zip") as archive:
        manifest, envelope = archive.read("manifest.json"), archive.read("manifest.sig")
    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(_vector("bundle")["signing_private_seed_hex"]))

    # Execute: Ed25519 is deterministic, so signing the raw manifest bytes again gives the same envelope
    signed = sign_manifest(manifest, key)

    # Assert
    assert signed == envelope


def test_the_bundles_graphs_take_and_give_the_documented_names() -> None:
    # Prepare
    onnxruntime = pytest.importorskip("onnxruntime")
    vector = _vector("bundle")
    with zipfile.ZipFile(VECTORS / "bundle.zip") as archive:
        graphs = {name: archive.read(name) for name in ("train.onnx", "eval.onnx")}

    for name, expected in (("train.onnx", vector["train_graph"]), ("eval.onnx", vector["eval_graph"])):
        # Execute
        session = onnxruntime.InferenceSession(graphs[name], providers=["CPUExecutionProvider"])

        # Assert
        assert [i.name for i in session.get_inputs()] == expected["inputs"]
        assert [o.name for o in session.get_outputs()] == expected["outputs"]
    assert [e["trainable"] for e in vector["state"]] == [True, True, False]


def test_the_training_vectors_update_and_result_follow_the_spec() -> None:
    # Prepare
    vector = _vector("training")
    config = vector["task"]["config"]
    start = {k: np.array(v["values"], np.float32) for k, v in vector["global"].items()}
    state, velocity = dict(start), dict[str, np.ndarray | None]()

    for step in vector["steps"]:
        # Execute: the documented update from each step's gradients (exact: numpy, float32)
        for name in ("weight", "bias"):
            state[name], velocity[name] = _spec_step(state[name], np.array(step["gradients"][name], np.float32),
                                                     velocity.get(name), start[name], lr=config["learning-rate"],
                                                     momentum=config["momentum"], mu=config["proximal-mu"])
            # Assert
            assert state[name].astype(np.float64).tolist() == step["after"][name]

    # Assert: the result header: counts, and train-loss as the example-weighted mean of the step losses
    header = vector["result_header"]
    sizes = [len(step["batch"]) for step in vector["steps"]]
    assert header["num-examples"] == len(vector["targets"])
    assert header["samples-processed"] == sum(sizes) == config["local-epochs"] * len(vector["targets"])
    assert header["steps"] == len(vector["steps"])
    loss = sum(step["loss"] * size for step, size in zip(vector["steps"], sizes, strict=True)) / sum(sizes)
    assert header["metrics"]["train-loss"] == loss
    assert vector["trained"]["shift"] == vector["global"]["shift"]["values"]  # non-trainable: sent unchanged
    for name, trained in vector["trained"].items():
        if name in state:
            assert trained == state[name].astype(np.float64).tolist()
        entry = vector["int8_delta"][name]
        delta = np.array(trained, np.float64) - np.array(vector["global"][name]["values"], np.float32)
        peak = float(np.max(np.abs(delta)))
        assert entry["scale"] == (peak / 127 if peak else 0.0)
        assert entry["q"] == (np.rint(delta / entry["scale"]) if peak else np.zeros_like(delta)).astype(int).tolist()


def _hkdf(shared: bytes, purpose: str, context: bytes = b"") -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=b"fedge-secagg/" + purpose.encode() + b"/" + context).derive(shared)


def test_secagg_key_agreement_and_kdf_follow_the_spec() -> None:
    # Prepare
    vector = _vector("secagg-keys")
    a = X25519PrivateKey.from_private_bytes(bytes.fromhex(vector["a_private_hex"]))
    b_public = bytes.fromhex(vector["b_public_hex"])

    # Execute
    shared = a.exchange(X25519PublicKey.from_public_bytes(b_public))

    # Assert: RFC 7748 §6.1's shared secret, then HKDF as documented
    assert shared.hex() == vector["shared_hex"] == "4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742"
    assert _hkdf(shared, "share").hex() == vector["share_key_hex"] == vector["share_key_other_side_hex"]
    assert _hkdf(shared, "mask", b"3").hex() == vector["mask_seed_round_3_hex"]
    signing = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(vector["ed25519_seed_hex"]))
    assert signing.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex() == \
        vector["ed25519_public_hex"]


def _spec_shares(secret: bytes, coefficients: list[int], holders: list[int]) -> dict[str, str]:
    polynomial = [int.from_bytes(secret, "big"), *coefficients]
    shares = {}
    for x, holder in enumerate(holders, start=1):
        y = sum(c * pow(x, power, PRIME) for power, c in enumerate(polynomial)) % PRIME
        shares[str(holder)] = (x.to_bytes(2, "big") + y.to_bytes(66, "big")).hex()
    return shares


def test_secagg_shares_and_their_seal_follow_the_spec() -> None:
    # Prepare
    vector = _vector("secagg-shares")
    seal = vector["seal"]
    holders = vector["holders"]

    # Execute
    seed_shares = _spec_shares(bytes.fromhex(vector["self_seed_hex"]),
                               [int(c) for c in vector["self_seed_coefficients"]], holders)
    key_shares = _spec_shares(bytes.fromhex(vector["mask_key_hex"]),
                              [int(c) for c in vector["mask_key_coefficients"]], holders)
    sealed = bytes.fromhex(seal["sealed_hex"])
    opened = AESGCM(bytes.fromhex(seal["share_key_hex"])).decrypt(sealed[:12], sealed[12:],
                                                                   seal["associated_text"].encode())

    # Assert
    assert seed_shares == vector["self_seed_shares_hex"] and key_shares == vector["mask_key_shares_hex"]
    assert seal["associated_text"] == f"{seal['sender']}->{seal['receiver']}/{seal['server-round']}"
    receiver = str(seal["receiver"])
    assert opened == bytes.fromhex(seed_shares[receiver] + key_shares[receiver]) == bytes.fromhex(seal["plaintext_hex"])
    assert sealed[:12].hex() == seal["nonce_hex"] and len(sealed) == 12 + 136 + 16
    # Lagrange at 0 from holders 29 (x = 3) and 4 (x = 2) rebuilds the seed
    (x1, y1), (x2, y2) = ((int(s[:4], 16), int(s[4:], 16)) for s in (seed_shares["29"], seed_shares["4"]))
    secret = (y1 * x2 * pow(x2 - x1, -1, PRIME) + y2 * x1 * pow(x1 - x2, -1, PRIME)) % PRIME
    assert (secret % 2**256).to_bytes(32, "big").hex() == vector["rebuilt_from_holders_29_4_hex"] == \
        vector["self_seed_hex"]


def _spec_mask(seed: bytes, length: int, bits: int) -> np.ndarray:
    word = 4 if bits <= 32 else 8
    stream = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor().update(bytes(length * word))
    words = np.frombuffer(stream, f"<u{word}").astype(np.uint64)
    return words & np.uint64((1 << bits) - 1) if bits < 64 else words


def test_secagg_masks_and_fixed_point_follow_the_spec() -> None:
    # Prepare
    vector = _vector("secagg-masks")
    seed = bytes.fromhex(vector["mask_seed_hex"])
    point = vector["fixed_point"]
    masking = vector["masked_input"]

    # Execute
    masks = {bits: _spec_mask(seed, 5, int(bits)).tolist() for bits in vector["masks_by_bits"]}
    scaled = np.rint(np.clip(np.array(point["values"]), -point["clip"], point["clip"]) * point["scale"])
    encoded = (scaled.astype(np.int64).view(np.uint64) & np.uint64(2**32 - 1)).tolist()
    total = np.array(masking["encoded"], np.uint64) + _spec_mask(bytes.fromhex(masking["self_seed_hex"]), 4, 32)
    for peer, pair in masking["pair_seeds_hex"].items():
        mask = _spec_mask(bytes.fromhex(pair), 4, 32)
        total = total - mask if masking["me"] > int(peer) else total + mask

    # Assert: hand-checked encodings too: 0.0025 * 1000 = 2.5 -> 2 (half to even), 5 clipped to 2 -> 2000
    assert masks == vector["masks_by_bits"]
    assert encoded == point["encoded"]
    assert encoded[4] == 2 and encoded[5] == 2**32 - 2 and encoded[6] == 2000 and encoded[7] == 2**32 - 2000
    assert (total & np.uint64(2**32 - 1)).tolist() == masking["masked"]


def test_the_encoded_secure_update_is_the_hand_computed_one() -> None:
    # Prepare: deltas in name order (a, then b): [0.125, 0, -0.25, 1.0]; 1.0 clipped at update-clip 0.5;
    # 120 examples capped at weight-clip 100; FedAvg weighting (work-momentum < 0: a = 1)
    case = _vector("secagg-update")["cases"][0]
    scale, weight_scale = case["secagg"]["scale"], case["secagg"]["weight-scale"]

    # Execute
    expected = [round(v * 100 * scale) % 2**32 for v in (0.125, 0.0, -0.25, 0.5)]
    expected += [100 * weight_scale, 100 * weight_scale, 1, 1, 1]  # w, w * a, entries clipped, any, capped

    # Assert
    assert case["vector"] == expected


def test_secagg_digests_and_signatures_follow_the_spec() -> None:
    # Prepare
    vector = _vector("secagg-signatures")
    seed = bytes.fromhex(_vector("secagg-keys")["ed25519_seed_hex"])
    public = Ed25519PrivateKey.from_private_bytes(seed).public_key()

    def absorb(digest: Any, part: bytes) -> None:
        digest.update(len(part).to_bytes(8, "big") + part)

    # Execute: arrays by name: name, dtype.str, repr(shape) length-prefixed, then u64 BE byte count and bytes
    arrays = hashlib.sha256(b"fedge-secagg/arrays/v1")
    for name in sorted(vector["arrays"]):
        entry = vector["arrays"][name]
        data = np.array(entry["values"], np.dtype(entry["dtype"])).tobytes()
        for part in (name.encode(), entry["dtype"].encode(), repr(tuple(entry["shape"])).encode()):
            absorb(arrays, part)
        arrays.update(len(data).to_bytes(8, "big") + data)
    config = hashlib.sha256(b"fedge-secagg/config/v1")
    for record in (vector["config"], vector["secagg"]):
        absorb(config, b"record")
        for key in sorted(k for k in record if k != "local-epochs"):
            value = record[key]
            for part in (key.encode(), type(value).__name__.encode(), repr(value).encode()):
                absorb(config, part)
    received = f"fedge-secagg/received/3/{arrays.hexdigest()}/{config.hexdigest()}"
    survivors = "fedge-secagg/consistency/3/" + ",".join(str(n) for n in sorted(vector["survivors"]))

    # Assert
    assert arrays.hexdigest() == vector["arrays_digest_hex"] and config.hexdigest() == vector["config_digest_hex"]
    assert received == vector["received_message_text"] and survivors == vector["survivors_message_text"]
    public.verify(bytes.fromhex(vector["received_signature_hex"]), received.encode())
    public.verify(bytes.fromhex(vector["survivors_signature_hex"]), survivors.encode())
    assert vector["records_json"] == {"consistency": {"signature": {"b64": "AAECAw=="}},
                                      "keys": {"c-pk": {"b64": "AAA="}, "n": [1, 2]}}


# --------------------------------------------------------------------------- sessions, as documented
def _sessions(tmp_path: Path, *, now: float) -> tuple[Any, str, bytes]:
    """A gateway's sessions (gateway ``gw1``) that admitted the check-in vector's device; (sessions, token, key)."""
    from fedge.clients.gateway.pool import AllowList, Sessions  # noqa: PLC0415 - the gateway's side, not the port's

    vector = _vector("check-in")
    (tmp_path / f"{vector['device']}.pub").write_text(vector["public_key_pem"], encoding="utf-8")
    sessions = Sessions(AllowList(tmp_path), vector["gateway"])
    token, key, _ = sessions.check_in(vector["body"], now=now)
    return sessions, token, key


def _signed(key: bytes, counter: int, path: str = "/v1/task") -> dict[str, Any]:
    message = "\n".join(["fedge-request/1", "GET", path, str(counter), hashlib.sha256(b"").hexdigest()]).encode()
    return {"authorization": "", "counter": str(counter), "method": "GET", "path": path, "body": b"",
            "mac": base64.b64encode(hmac.new(key, message, hashlib.sha256).digest()).decode()}


def test_a_gateway_admits_the_check_in_vector_and_a_bad_mac_spends_nothing(tmp_path: Path) -> None:
    # Prepare: the check-in vector, at its own time; a request with a wrong MAC
    from fedge.errors import DeviceProtocolError  # noqa: PLC0415

    vector = _vector("check-in")
    sessions, token, key = _sessions(tmp_path, now=vector["time"])
    header = f"Fedge-Session {token}"
    bad = {**_signed(key, 1), "mac": _signed(bytes(32), 1)["mac"], "authorization": header}

    # Execute
    with pytest.raises(DeviceProtocolError) as refusal:
        sessions.authenticate(**bad, now=vector["time"])
    first = sessions.authenticate(**{**_signed(key, 1), "authorization": header}, now=vector["time"]).counter
    with pytest.raises(DeviceProtocolError) as replay:
        sessions.authenticate(**{**_signed(key, 1), "authorization": header}, now=vector["time"])
    later = sessions.authenticate(**{**_signed(key, 7), "authorization": header}, now=vector["time"])

    # Assert: the bad MAC got 401 and kept the session and counter 1; a verified request spent it; gaps are fine
    assert refusal.value.status == 401 and "MAC does not verify" in str(refusal.value)
    assert first == 1
    assert replay.value.status == 401 and "counter 1 was used before" in str(replay.value)
    assert later.device == vector["device"] and later.counter == 7


def test_the_clock_answer_the_document_quotes_is_the_gateways(tmp_path: Path) -> None:
    # Prepare
    from fedge.errors import DeviceProtocolError  # noqa: PLC0415

    vector = _vector("check-in")

    # Execute: the device's clock 301 s behind the gateway's
    with pytest.raises(DeviceProtocolError) as refusal:
        _sessions(tmp_path, now=vector["time"] + 301)

    # Assert
    assert refusal.value.status == 401
    quoted = re.search(r"gets `401` with the error `([^`]+)`", SPEC.read_text(encoding="utf-8"))
    assert quoted is not None and " ".join(quoted.group(1).split()) == str(refusal.value)


# --------------------------------------------------------------------------- the web SDK on the same vectors
WEB_SCRIPT = """
import {readFileSync} from "node:fs";
const root = process.argv[2];
const frame = await import(root + "/web/frame.js");
const pre = await import(root + "/web/preprocessing.js");
await import(root + "/web/batch-order.js");
const v = (name) => JSON.parse(readFileSync(root + "/docs/protocol-vectors/" + name + ".json", "utf8"));
const f = v("frame"), p = v("preprocessing");
const decoded = frame.decodeFrame(Buffer.from(f.frame_hex, "hex"));
const tensors = {w: {data: Float32Array.from(f.tensors[0].values), shape: f.tensors[0].shape},
                 n: {data: BigInt64Array.from([7n]), shape: [1]},
                 q: {data: Int8Array.from(f.tensors[2].values), shape: f.tensors[2].shape, scale: f.tensors[2].scale}};
const prepared = pre.prepareDeviceInputs([{data: Float32Array.from(p.raw.inputs), dims: [2, 3]}], p.preprocessing);
console.log(JSON.stringify({
  frame_hex: Buffer.from(frame.encodeFrame(f.header, tensors)).toString("hex"),
  decoded: {header: decoded.header, tensors: Object.entries(decoded.tensors).map(([name, t]) => ({
    name: name, shape: t.shape, scale: t.scale, values: Array.from(t.data, Number)}))},
  batches: v("batching").cases.map((c) => globalThis.fedgeBatchOrder.batchOrder(c.examples, c["batch-size"], c.seed,
                                                                                c["local-epochs"])),
  preprocessing: {verdict: prepared.verdict, prepared: Array.from(prepared.inputs[0].data)},
  tasks: v("task-encodings").cases.map((c) => Object.fromEntries(
    Object.entries(frame.decodeFrame(Buffer.from(c.frame_hex, "hex")).tensors).map(
      ([name, t]) => [name, Array.from(frame.taskValues(t))]))),
  taskCapabilities: frame.TASK_CAPABILITIES,
  int8: v("int8-delta").cases.map((c) => {
    const r = frame.int8Delta(Float32Array.from(c.trained), Float32Array.from(c.global));
    return {q: Array.from(r.data), scale: r.scale};
  }),
}));
"""


@pytest.fixture(scope="module")
def web() -> dict[str, Any]:
    """What the web SDK's own modules (``web/*.js``, under Node) make of the vectors."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed: the web SDK's modules are not checked against the vectors")
    script = subprocess.run([node, "--input-type=module", "-", str(ROOT)], input=WEB_SCRIPT, capture_output=True,
                            text=True, timeout=60, check=False)
    assert script.returncode == 0, script.stderr[-2000:]
    return json.loads(script.stdout)  # type: ignore[no-any-return]


def test_the_web_sdk_reads_writes_and_batches_as_the_vectors_say(web: dict[str, Any]) -> None:
    # Prepare
    frame, batching, preprocessing = _vector("frame"), _vector("batching"), _vector("preprocessing")

    # Execute: the web SDK ran in the fixture (web/frame.js, web/batch-order.js, web/preprocessing.js)

    # Assert
    assert web["frame_hex"] == frame["frame_hex"]
    assert web["decoded"]["header"] == frame["header"]
    assert [{k: t[k] for k in ("name", "shape", "values")} for t in web["decoded"]["tensors"]] == \
        [{k: t[k] for k in ("name", "shape", "values")} for t in frame["tensors"]]
    assert web["batches"] == [case["batches"] for case in batching["cases"]]
    assert web["preprocessing"] == {"verdict": preprocessing["raw"]["verdict"],
                                    "prepared": preprocessing["raw"]["prepared"]}


def test_the_web_sdks_int8_delta_is_the_vectors(web: dict[str, Any]) -> None:
    # Prepare
    cases = _vector("int8-delta")["cases"]

    # Execute: the web SDK ran in the fixture

    # Assert
    assert web["int8"] == [{"q": case["q"], "scale": case["scale"]} for case in cases]


def test_the_web_sdk_reads_each_task_encoding_as_the_gateway_says_devices_read_it(web: dict[str, Any]) -> None:
    # Prepare
    from fedge.clients.gateway.protocol import TASK_CAPABILITIES  # noqa: PLC0415

    cases = _vector("task-encodings")["cases"]

    # Execute: the web SDK ran in the fixture (web/frame.js decodeFrame, then taskValues)

    # Assert: fp32, fp16 (a subnormal and a saturated value among them) and int8 read to the same float32 values
    assert web["tasks"] == [case["received"] for case in cases]
    assert web["taskCapabilities"] == list(TASK_CAPABILITIES)


def test_a_task_frame_read_as_the_spec_says_gives_the_vectors_weights() -> None:
    # Prepare
    vector = _vector("task-encodings")

    # Execute: the spec's reading, by hand: float16 widened, int8 times its scale in float32
    read = []
    for case in vector["cases"]:
        data = bytes.fromhex(case["frame_hex"])
        length = struct.unpack_from("<I", data, 4)[0]
        offset, values = 8 + length, {}
        for entry in json.loads(data[8:8 + length])["tensors"]:
            dtype = {"float32": "<f4", "float16": "<f2", "int8": "i1"}[entry["dtype"]]
            count = int(np.prod(entry["shape"]))
            raw = np.frombuffer(data, dtype, count, offset)
            offset += raw.nbytes
            scaled = raw.astype(np.float32) * np.float32(entry["scale"]) if dtype == "i1" else raw.astype(np.float32)
            values[entry["name"]] = [float(v) for v in scaled]
        read.append(values)

    # Assert: what devices read; fp32 is the weights exactly, and no value moved by more than its encoding's step
    assert read == [case["received"] for case in vector["cases"]]
    assert read[0] == vector["weights"]
    assert read[1]["b"][2] == 65504.0 and read[2]["w"] == pytest.approx(vector["weights"]["w"], abs=2.0 / 254)


# --------------------------------------------------------------------------- the document's index
def test_the_document_indexes_every_shipped_vector() -> None:
    # Prepare
    text = SPEC.read_text(encoding="utf-8")
    shipped = sorted(p.name for p in VECTORS.iterdir() if p.suffix in (".json", ".zip"))

    # Execute
    indexed = sorted(set(re.findall(r"`([\w-]+\.(?:json|zip))`", text)) & set(shipped))

    # Assert
    assert indexed == shipped
    assert sorted(f"{name}.json" for name in MAKE.VECTORS) == [n for n in shipped if n.endswith(".json")]
