"""Test vectors of fedge's device protocol, made with fedge's own functions.

``docs/device-protocol.md`` specifies the protocol; this module writes the files of
``docs/protocol-vectors/`` that a port (Kotlin, Swift, JS) checks itself against, and
``tests/test_protocol_vectors.py`` rebuilds every vector with the same functions and compares
it with the shipped file byte for byte, so the wire cannot drift from the documents.

Every vector is deterministic: fixed keys (raw bytes written in the file), fixed seeds, and
where fedge draws randomness (a seal's nonce, Shamir's coefficients) the drawn values are
inputs of the vector and are fed to fedge's function in place of the random source.

Run it only to change the wire on purpose (never from a test)::

    .venv/bin/python docs/protocol-vectors/make_vectors.py            # rewrite the JSON vectors
    .venv/bin/python docs/protocol-vectors/make_vectors.py --bundle   # also export and sign a new bundle.zip

``--bundle`` needs torch (it exports the tiny model's graphs); the bundle's bytes then change
(its manifest records library versions), and so does ``training.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import io
import json
import sys
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedge.batching import batch_order
from fedge.clients.gateway.protocol import (
    assemble_frame,
    b64,
    check_in_message,
    encode_frame,
    encode_task,
    from_int8_delta,
    int8_delta,
    records_to_json,
    request_mac,
)
from fedge.clients.secagg_device import Trained, encode_noised, encode_update
from fedge.codec import TASK_ENCODINGS, task_capability
from fedge.edge.signing import fingerprint
from fedge.edge.trainer import MomentumUpdate, OnnxTrainer
from fedge.edge.training_bundle import read_training_bundle
from fedge.preprocessing import prepare_device_inputs
from fedge.secagg import (
    FixedPoint,
    Received,
    arrays_digest,
    config_digest,
    derive,
    expand_mask,
    masked_input,
    public_bytes,
    rebuild_secret,
    received_message,
    seal,
    share_secret,
    sign_received,
    sign_survivors,
    signing_public_bytes,
    survivors_message,
)

HERE = Path(__file__).resolve().parent
BUNDLE = HERE / "bundle.zip"

# the fixed secrets of the vectors (never use them for anything else)
CHECK_IN_SEED = bytes(range(32))  # the device's Ed25519 private key (raw seed)
SIGNING_SEED = bytes(range(100, 132))  # the coordinator's bundle signing key (raw seed)
SESSION_KEY = bytes(range(200, 232))  # a check-in's session key
X25519_A = bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")  # RFC 7748 §6.1
X25519_B = bytes.fromhex("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb")
G_SEED = bytes(range(50, 82))  # a device's round signing key (Ed25519 seed)


# --------------------------------------------------------------------------- helpers
def hexed(data: bytes) -> str:
    """Lower-case hex."""
    return data.hex()


def f32(values: Any) -> list[float]:
    """float32 values as JSON numbers (each is exactly the float32: a float64 that rounds to it)."""
    return [float(v) for v in np.asarray(values, np.float32).ravel()]


def render(vector: dict[str, Any]) -> str:
    """A vector's file text (what the test compares byte for byte)."""
    return json.dumps(vector, indent=1, ensure_ascii=True) + "\n"


def raw_public(key: Ed25519PrivateKey | X25519PrivateKey) -> bytes:
    """The raw 32-byte public key."""
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@contextmanager
def fixed(target: str, values: list[Any]) -> Iterator[None]:
    """Patch the random source ``target`` to return ``values`` in turn (a vector's drawn values)."""
    queue = list(values)
    with mock.patch(target, side_effect=lambda *_: queue.pop(0)):
        yield
    if queue:
        raise AssertionError(f"{target}: {len(queue)} fixed values were not drawn")


# --------------------------------------------------------------------------- the wire
def frame_vector() -> dict[str, Any]:
    """A result frame with a float32, an int64 and an int8 (scaled) tensor."""

    header = {"task": "t-1", "kind": "train", "num-examples": 3, "encoding": "fp32"}
    tensors = {"w": np.array([[1.0, -2.5], [0.125, 3.0]], np.float32), "n": np.array([7], np.int64),
               "q": np.array([-127, 0, 5], np.int8)}
    frame = encode_frame(header, tensors, {"q": 0.5})
    length = int.from_bytes(frame[4:8], "little")
    return {
        "what": "a frame: b'FDG1', u32 LE header length, compact UTF-8 JSON header, tensor bytes (C order, LE)",
        "header": header,
        "tensors": [{"name": "w", "dtype": "float32", "shape": [2, 2], "values": f32(tensors["w"])},
                    {"name": "n", "dtype": "int64", "shape": [1], "values": [7]},
                    {"name": "q", "dtype": "int8", "shape": [3], "scale": 0.5, "values": [-127, 0, 5]}],
        "header_length": length,
        "header_json": frame[8:8 + length].decode(),
        "frame_hex": hexed(frame),
    }


def check_in_vector() -> dict[str, Any]:
    """The bytes an Ed25519 device signs at check-in, and the signature (Ed25519 is deterministic)."""

    key = Ed25519PrivateKey.from_private_bytes(CHECK_IN_SEED)
    nonce = b64(bytes(range(16)))
    message = check_in_message(device="phone-017", gateway="gw1", issued_at=1764950400, nonce=nonce)
    spki = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    body = {"protocol": 1, "device": "phone-017", "time": 1764950400, "nonce": nonce,
            "signature": b64(key.sign(message)), "capabilities": ["fp32", "int8-delta", "secure-aggregation"]}
    return {
        "what": "POST /v1/check-in: the message signed (fedge-check-in/1, device, gateway, time, nonce; joined by "
                "\\n, no trailing newline) and an Ed25519 signature over it",
        "ed25519_private_seed_hex": hexed(CHECK_IN_SEED),
        "public_key_pem": spki.decode(),
        "device": "phone-017", "gateway": "gw1", "time": 1764950400, "nonce": nonce,
        "message_hex": hexed(message),
        "message_text": message.decode(),
        "body": body,
    }


def request_mac_vector() -> dict[str, Any]:
    """The MAC of three authenticated requests under one session key."""

    cases = []
    for method, path, counter, body in (("GET", "/v1/task", 1, b""), ("GET", "/v1/bundles/training", 2, b""),
                                        ("POST", "/v1/result", 3, b"FDG1\x02\x00\x00\x00{}")):
        message = b"\n".join([b"fedge-request/1", method.encode(), path.encode(), str(counter).encode(),
                              hashlib.sha256(body).hexdigest().encode()])
        cases.append({"method": method, "path": path, "counter": counter, "body_hex": hexed(body),
                      "message_text": message.decode(),
                      "mac": request_mac(SESSION_KEY, method=method, path=path, counter=counter, body=body)})
    return {"what": "X-Fedge-Mac = base64(HMAC-SHA256(session key, fedge-request/1 \\n METHOD \\n path \\n counter "
                    "\\n sha256(body) hex))",
            "session_key": b64(SESSION_KEY), "requests": cases}


def int8_delta_vector() -> dict[str, Any]:
    """``int8-delta`` uplinks: the worked example of the document, a zero delta, float32 arithmetic."""

    cases = []
    for name, base, trained in (
            ("worked", [0.25] * 5, [1.2421875, -0.25, 0.26171875, 0.25390625, 0.23046875]),
            ("unchanged", [0.5, -0.25], [0.5, -0.25]),
            ("float32", [0.1, 0.2, 0.3], [0.35, 0.2, -0.9])):
        base32, trained32 = np.array(base, np.float32), np.array(trained, np.float32)
        quantised, scales = int8_delta({"x": trained32}, {"x": base32})
        restored = from_int8_delta(quantised, scales, {"x": base32})["x"]
        cases.append({"name": name, "global": f32(base32), "trained": f32(trained32),
                      "q": [int(v) for v in quantised["x"]], "scale": scales["x"], "restored": f32(restored)})
    return {"what": "q = round-half-even((trained - global) / scale) in float64, scale = max|trained - global| / 127 "
                    "(0 when the delta is 0: q all 0); restored = global + q * float32(scale) in float32",
            "cases": cases}


def task_encodings_vector() -> dict[str, Any]:
    """A round's model in each task (downlink) encoding: the task frame's tensors and what a device reads from them."""

    weights = {"w": np.array([[0.5, -1.0], [2.0, 0.25]], np.float32),
               "b": np.array([1e-3, -3.0, 70000.0, 1e-7], np.float32)}
    cases = []
    for encoding in TASK_ENCODINGS:
        task = encode_task(weights, encoding)
        cases.append({"encoding": encoding, "capability": task_capability(encoding),
                      "frame_hex": hexed(assemble_frame({"kind": "train"}, task.entries, task.data)),
                      "received": {name: f32(value) for name, value in task.received.items()}})
    return {"what": "fp32 as is; fp16: float16, saturating at +/-65504; int8: q = round-half-even(w / scale), "
                    "scale = max|w| / 127 per tensor (float32), read as float32(q) * float32(scale)",
            "weights": {name: f32(value) for name, value in weights.items()}, "cases": cases}


def batching_vector() -> dict[str, Any]:
    """Mini-batch index order: one numpy ``default_rng(seed)``, a permutation per epoch."""

    cases = []
    for size, batch, seed, epochs in ((10, 4, 42, 2), (5, 5, 1234567, 1), (7, 3, 2**53 - 1, 1)):
        cases.append({"examples": size, "batch-size": batch, "seed": seed, "local-epochs": epochs,
                      "batches": [[int(i) for i in b] for b in batch_order(size, batch, seed, epochs)]})
    return {"what": "rng = numpy.random.default_rng(seed) once; each epoch rng.permutation(n), cut into batch-size "
                    "pieces, the last partial piece kept",
            "first_words_of_pcg64": {"seed": 42, "next_uint64": [
                int(w) for w in np.random.default_rng(42).bit_generator.random_raw(4)]},
            "cases": cases}


def preprocessing_vector() -> dict[str, Any]:
    """A declared affine preprocessing applied to raw inputs; preprocessed inputs left as they are."""

    spec = {"kind": "affine", "scale": 0.0625, "offset": -0.5, "raw-range": [0, 16]}
    raw = np.array([[0.0, 3.0, 16.0], [8.0, 15.0, 1.0]], np.float32)
    prepared, verdict = prepare_device_inputs((raw,), spec)
    ready = np.array([[-0.5, 0.25, 0.4]], np.float32)
    kept, kept_verdict = prepare_device_inputs((ready,), spec)
    return {"what": "affine: float32(x) * float32(scale) + float32(offset) in float32, applied when every value of "
                    "an input lies in the raw range (5 % slack) and not in the preprocessed one",
            "preprocessing": spec,
            "raw": {"inputs": f32(raw), "verdict": verdict, "prepared": f32(prepared[0])},
            "preprocessed": {"inputs": f32(ready), "verdict": kept_verdict, "prepared": f32(kept[0])}}


def optimiser_vector() -> dict[str, Any]:
    """Three optimiser steps from given gradients (momentum and FedProx), float32 throughout."""

    start = np.array([0.5, -1.0, 2.0], np.float32)
    grads = [np.array(g, np.float32) for g in ([0.1, -0.2, 0.3], [0.05, 0.0, -0.4], [-0.3, 0.1, 0.2])]
    cases = []
    for lr, momentum, mu in ((0.05, 0.9, 0.0), (0.05, 0.9, 0.01), (0.1, 0.0, 0.0)):
        update = MomentumUpdate(learning_rate=lr, momentum=momentum, proximal_mu=mu, anchor={"p": start.copy()})
        state, after = {"p": start.copy()}, []
        for grad in grads:
            update.step(state, {"p": grad})
            after.append(f32(state["p"]))
        cases.append({"learning-rate": lr, "momentum": momentum, "proximal-mu": mu, "after_each_step": after})
    return {"what": "g' = g + float32(mu) * (p - p_start) when mu > 0; v = g' at the first step, then v = "
                    "float32(m) * v + g'; p = p - float32(lr) * v; every operation in float32",
            "start": f32(start), "gradients": [f32(g) for g in grads], "cases": cases}


# --------------------------------------------------------------------------- secure aggregation
def secagg_keys_vector() -> dict[str, Any]:
    """Key agreement and HKDF: the share key and a round's pair mask seed of two devices."""

    a, b = X25519PrivateKey.from_private_bytes(X25519_A), X25519PrivateKey.from_private_bytes(X25519_B)
    shared = a.exchange(b.public_key())
    return {"what": "X25519 raw keys; HKDF-SHA256(shared, salt none, info 'fedge-secagg/' purpose '/' context, 32 B)",
            "a_private_hex": hexed(X25519_A), "a_public_hex": hexed(public_bytes(a)),
            "b_private_hex": hexed(X25519_B), "b_public_hex": hexed(public_bytes(b)),
            "shared_hex": hexed(shared),
            "share_key_hex": hexed(derive(a, public_bytes(b), "share")),
            "share_key_other_side_hex": hexed(derive(b, public_bytes(a), "share")),
            "mask_seed_round_3_hex": hexed(derive(a, public_bytes(b), "mask", b"3")),
            "ed25519_seed_hex": hexed(G_SEED),
            "ed25519_public_hex": hexed(signing_public_bytes(Ed25519PrivateKey.from_private_bytes(G_SEED)))}


def secagg_shares_vector() -> dict[str, Any]:
    """Shamir shares of a seed and a mask key over GF(2^521 - 1), and the AES-GCM seal of one pair of them."""

    seed, mask_key = bytes(range(1, 33)), X25519_B
    holders, threshold = [11, 4, 29], 2
    seed_coefficients, key_coefficients = [2**520 + 12345], [987654321987654321]
    with fixed("fedge.secagg.secrets.randbelow", seed_coefficients):
        seed_shares = share_secret(seed, threshold, holders)
    with fixed("fedge.secagg.secrets.randbelow", key_coefficients):
        key_shares = share_secret(mask_key, threshold, holders)
    a = X25519PrivateKey.from_private_bytes(X25519_A)
    key = derive(a, public_bytes(X25519PrivateKey.from_private_bytes(X25519_B)), "share")
    nonce = bytes(range(12))
    sender, receiver, server_round = 7, 11, 3
    plaintext = seed_shares[receiver] + key_shares[receiver]
    associated = f"{sender}->{receiver}/{server_round}".encode()
    with fixed("fedge.secagg.os.urandom", [nonce]):
        sealed = seal(key, plaintext, associated)
    return {"what": "share_secret: f(x) = secret + c1 x + ... mod 2^521-1 (secret: 32 bytes big-endian), holder k "
                    "(in list order, from 1) gets u16 BE x || 66-byte BE f(x); sealed = nonce || AES-256-GCM(share "
                    "key, seed share || key share, AD 'sender->receiver/round')",
            "threshold": threshold, "holders": holders,
            "self_seed_hex": hexed(seed), "self_seed_coefficients": [str(c) for c in seed_coefficients],
            "self_seed_shares_hex": {str(h): hexed(s) for h, s in seed_shares.items()},
            "mask_key_hex": hexed(mask_key), "mask_key_coefficients": [str(c) for c in key_coefficients],
            "mask_key_shares_hex": {str(h): hexed(s) for h, s in key_shares.items()},
            "rebuilt_from_holders_29_4_hex": hexed(rebuild_secret([seed_shares[29], seed_shares[4]])),
            "seal": {"sender": sender, "receiver": receiver, "server-round": server_round,
                     "share_key_hex": hexed(key), "nonce_hex": hexed(nonce),
                     "associated_text": associated.decode(), "plaintext_hex": hexed(plaintext),
                     "sealed_hex": hexed(sealed)}}


def secagg_masks_vector() -> dict[str, Any]:
    """Mask expansion (ChaCha20) in three rings, fixed-point encoding and a masked input."""

    seed = bytes(range(32, 64))
    masks = {str(bits): [int(w) for w in expand_mask(seed, 5, bits)] for bits in (32, 20, 64)}
    point = FixedPoint(clip=2.0, scale=1000.0, bits=32)
    values = [0.0, 1.0, -1.0, 0.0015, 0.0025, -0.0025, 5.0, -7.5]
    encoded = point.encode(np.array(values))
    self_seed, pair_low, pair_high = bytes(range(64, 96)), bytes(range(96, 128)), bytes(range(128, 160))
    masked = masked_input(encoded[:4], self_seed, {3: pair_low, 9: pair_high}, me=5, bits=32)
    return {"what": "expand_mask: ChaCha20(key seed, 16-byte counter||nonce block all 0) keystream over zeros, read as "
                    "LE u32 words (u64 when bits > 32), each reduced mod 2^bits; FixedPoint.encode: clip, times scale, "
                    "round half to even, two's complement mod 2^bits; masked = x + PRG(b) + PRG(s_ij) for j > me - "
                    "PRG(s_ij) for j < me",
            "mask_seed_hex": hexed(seed), "masks_by_bits": masks,
            "fixed_point": {"clip": 2.0, "scale": 1000.0, "bits": 32, "values": values,
                            "encoded": [int(w) for w in encoded]},
            "masked_input": {"me": 5, "encoded": [int(w) for w in encoded[:4]], "self_seed_hex": hexed(self_seed),
                             "pair_seeds_hex": {"3": hexed(pair_low), "9": hexed(pair_high)},
                             "masked": [int(w) for w in masked]}}


SECAGG_PARAMS = {"clip": 2000.0, "scale": 1048576.0, "bits": 32, "update-clip": 0.5, "count-clip": 1000.0,
                 "weight-clip": 100.0, "weight-scale": 1024.0, "work-clip": 1000.0, "work-scale": 1024.0,
                 "work-cap": 1000.0, "work-momentum": -1.0}


def secagg_update_vector() -> dict[str, Any]:
    """The vector a device masks: its encoded update, weight, work and clipping counts."""

    global_arrays = {"b": np.array([0.5, -0.5], np.float32), "a": np.array([[1.0, 2.0]], np.float32)}
    trained = {"b": np.array([0.25, 0.5], np.float32), "a": np.array([[1.125, 2.0]], np.float32)}
    cases = []
    for momentum, steps in ((-1.0, 4), (0.9, 4)):
        params = {**SECAGG_PARAMS, "work-momentum": momentum}
        vector = encode_update(global_arrays, Trained(arrays=trained, num_examples=120, steps=steps), params)
        cases.append({"secagg": params, "num-examples": 120, "steps": steps, "vector": [int(w) for w in vector]})
    return {"what": "delta (float64, tensors in name order, C order) / a, clipped at update-clip, times w; then w, "
                    "w * a, and the counts (entries clipped, any clipped, weight capped), each FixedPoint-encoded",
            "global": {k: {"shape": list(v.shape), "values": f32(v)} for k, v in global_arrays.items()},
            "trained": {k: {"shape": list(v.shape), "values": f32(v)} for k, v in trained.items()},
            "cases": cases}


def secagg_signatures_vector() -> dict[str, Any]:
    """The digests and messages a device signs (masked step, consistency check), with its round key."""

    key = Ed25519PrivateKey.from_private_bytes(G_SEED)
    arrays: dict[str, np.ndarray] = {"b": np.array([0.5, -0.5], np.float32), "a": np.array([[1, 2]], np.int64)}
    config = {"server-round": 3, "local-epochs": 2, "batch-size": 32, "learning-rate": 0.05, "momentum": 0.9,
              "proximal-mu": 0.0, "note": "x", "flag": True}
    received = Received(arrays_digest(arrays), config_digest(config, SECAGG_PARAMS))
    survivors = [12, 3, 7]
    return {"what": "arrays_digest and config_digest (SHA-256, length-prefixed parts), the received and survivors "
                    "messages, Ed25519 signatures (deterministic); records as JSON",
            "arrays": {k: {"dtype": v.dtype.str, "shape": list(v.shape), "values": v.ravel().tolist()}
                       for k, v in arrays.items()},
            "config": config, "secagg": SECAGG_PARAMS,
            "arrays_digest_hex": hexed(received.arrays), "config_digest_hex": hexed(received.config),
            "received_message_text": received_message(server_round=3, received=received).decode(),
            "received_signature_hex": hexed(sign_received(key, server_round=3, received=received)),
            "survivors": survivors,
            "survivors_message_text": survivors_message(server_round=3, survivors=survivors).decode(),
            "survivors_signature_hex": hexed(sign_survivors(key, server_round=3, survivors=survivors)),
            "records_json": records_to_json({"consistency": {"signature": bytes(range(4))},
                                             "keys": {"c-pk": bytes(2), "n": [1, 2]}})}


# --------------------------------------------------------------------------- the training bundle
TRAIN_CONFIG = {"local-epochs": 2, "batch-size": 4, "learning-rate": 0.1, "momentum": 0.9, "proximal-mu": 0.01}
TRAIN_SEED = 1234567


def training_data() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """The tiny model's global weights, a device's raw inputs (grey levels 0..16) and targets."""
    rng = np.random.default_rng(7)
    weights = {"weight": rng.normal(0, 0.5, (2, 3)).astype(np.float32),
               "bias": np.array([0.1, -0.1], np.float32),
               "shift": np.array([0.25, 0.0, -0.25], np.float32)}
    raw = rng.integers(0, 17, (10, 3)).astype(np.float32)
    targets = (raw[:, 0] > raw[:, 1]).astype(np.int64)
    return weights, raw, targets


def make_bundle() -> None:
    """Export the tiny model's graphs (torch) and write ``bundle.zip``, signed with :data:`SIGNING_SEED`."""
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    from fedge.edge.training_bundle import write_training_bundle  # noqa: PLC0415
    from fedge.edge.training_graph import export_training_graphs  # noqa: PLC0415
    from fedge.signature import InputSpec  # noqa: PLC0415

    class Tiny(nn.Module):
        """``Linear(features - shift)``: two trainable weights and one non-trainable buffer."""

        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(2, 3))
            self.bias = nn.Parameter(torch.zeros(2))
            self.register_buffer("shift", torch.zeros(3))

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            shift: torch.Tensor = self.shift  # type: ignore[assignment]  # a registered buffer
            return nn.functional.linear(features - shift, self.weight, self.bias)

    weights, raw, targets = training_data()
    model = Tiny()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    graphs = export_training_graphs(model, nn.functional.cross_entropy, [raw * np.float32(0.0625)], targets,
                                    inputs=[InputSpec("features", ("batch", 3))], parity_steps=2)
    write_training_bundle(BUNDLE, graphs, task="protocol-vectors", metrics=["loss", "accuracy"],
                          model_id="protocol-vectors", version=1, issued_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
                          private_key=Ed25519PrivateKey.from_private_bytes(SIGNING_SEED),
                          preprocessing={"kind": "affine", "scale": 0.0625, "offset": 0.0, "raw-range": [0, 16]})
    BUNDLE.chmod(0o644)  # a public test file (written 0600 like every bundle)


def bundle_vector() -> dict[str, Any]:
    """What a device checks of ``bundle.zip`` (file names, signed bytes, signer fingerprint): exact."""

    data = BUNDLE.read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        files = {info.filename: archive.read(info) for info in archive.infolist()}
    manifest = json.loads(files["manifest.json"])
    envelope = json.loads(files["manifest.sig"])
    public = Ed25519PrivateKey.from_private_bytes(SIGNING_SEED).public_key()
    return {"what": "bundle.zip: the files, manifest.sig's envelope over the raw manifest.json bytes, the signer's "
                    "fingerprint sha256:hex(SHA-256(raw 32-byte Ed25519 public key)), the graphs' architecture",
            "bundle_sha256": hashlib.sha256(data).hexdigest(),
            "files": sorted(files),
            "signing_private_seed_hex": hexed(SIGNING_SEED),
            "signing_public_raw_hex": hexed(raw_public(Ed25519PrivateKey.from_private_bytes(SIGNING_SEED))),
            "signing_public_pem": public.public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo).decode(),
            "fingerprint": fingerprint(public),
            "manifest_sha256": hashlib.sha256(files["manifest.json"]).hexdigest(),
            "manifest_sig_envelope": envelope,
            "files_listed": manifest["files"],
            "architecture": manifest["architecture"],
            "train_graph": {"inputs": ["state:weight", "state:bias", "state:shift", "features", "targets"],
                            "outputs": ["loss", "grad:weight", "grad:bias"]},
            "eval_graph": {"inputs": ["state:weight", "state:bias", "state:shift", "features", "targets"],
                           "outputs": ["loss", "output"]},
            "state": manifest["state"], "inputs": manifest["inputs"], "targets": manifest["targets"],
            "preprocessing": manifest["preprocessing"]}


def training_vector() -> dict[str, Any]:
    """One train task on ``bundle.zip``: batches, per-step loss and gradients, weights after each step, result.

    The graphs' arithmetic is onnxruntime's (float32; a port's runtime may differ in the last
    bits); everything after the gradients is exact (:func:`optimiser_vector`).
    """

    public = Ed25519PrivateKey.from_private_bytes(SIGNING_SEED).public_key()
    bundle = read_training_bundle(BUNDLE.read_bytes(), trusted_keys=[public])
    trainer = OnnxTrainer(bundle.train_onnx, bundle.eval_onnx, bundle.manifest)
    weights, raw, targets = training_data()
    (inputs,), verdict = prepare_device_inputs((raw,), bundle.manifest["preprocessing"])
    config = TRAIN_CONFIG
    state = {k: v.copy() for k, v in weights.items()}
    anchor = {k: weights[k].copy() for k in ("weight", "bias")}
    update = MomentumUpdate(learning_rate=config["learning-rate"], momentum=config["momentum"],
                            proximal_mu=config["proximal-mu"], anchor=anchor)
    steps = []
    for index in batch_order(len(targets), config["batch-size"], TRAIN_SEED, config["local-epochs"]):
        loss, grads = trainer.gradients(state, [inputs[index]], targets[index])
        update.step(state, grads)
        steps.append({"batch": [int(i) for i in index], "loss": loss,
                      "gradients": {k: f32(g) for k, g in grads.items()},
                      "after": {k: f32(state[k]) for k in ("weight", "bias")}})
    trained, work = trainer.train(weights, [inputs], targets, epochs=config["local-epochs"],
                                  batch_size=config["batch-size"], learning_rate=config["learning-rate"],
                                  momentum=config["momentum"], seed=TRAIN_SEED, proximal_mu=config["proximal-mu"])
    quantised, scales = int8_delta(trained, weights)
    scores = trainer.evaluate(weights, [inputs], targets)
    return {"what": "a train task on bundle.zip's graphs: raw inputs preprocessed, batches of seed, per step the "
                    "graph's loss and gradients and the weights after the update; the result header; int8-delta",
            "task": {"kind": "train", "server-round": 3, "graph": bundle.architecture, "config": config,
                     "seed": TRAIN_SEED, "uplink": "int8-delta"},
            "global": {k: {"shape": list(v.shape), "values": f32(v)} for k, v in weights.items()},
            "raw_inputs": f32(raw), "inputs_verdict": verdict, "inputs": f32(inputs),
            "targets": [int(t) for t in targets],
            "steps": steps,
            "trained": {k: f32(v) for k, v in trained.items()},
            "result_header": {"kind": "train", "num-examples": work.num_examples,
                              "samples-processed": work.samples_processed, "steps": work.steps,
                              "metrics": {"train-loss": float(work.loss)}, "encoding": "int8-delta"},
            "int8_delta": {k: {"q": [int(v) for v in quantised[k].ravel()], "scale": scales[k]} for k in quantised},
            "evaluate": {"num-examples": len(targets), "metrics": scores}}


DP_TAIL = {"bits": 32, "count-clip": 1000.0, "weight-clip": 100.0, "weight-scale": 1024.0, "work-clip": 1000.0,
           "work-scale": 1024.0}
DP_CASES = [  # dp-stddev 1e-3: the sampler returns 0 (P(|Y| = 1) is exp(-5e5)), so the encoding is deterministic
    {"dp-clip": 0.5, "dp-scale": 1048576.0},  # ||delta|| = 1.038: clipped
    {"dp-clip": 4.0, "dp-scale": 20.0},  # unclipped; 0.125 x 20 = 2.5 -> 2 (half to even, not away from zero)
    {"dp-clip": 4.0, "dp-scale": 10.0, "bits": 20},  # -0.25 x 10 = -2.5 -> -2; negatives wrap mod 2^20
    {"dp-clip": 0.75, "dp-scale": 3e9, "bits": 64},  # clipped, in a 64-bit ring
]


def secagg_dp_vector() -> dict[str, Any]:
    """Distributed DP's masked-step encoding (:func:`fedge.clients.secagg_device.encode_noised`) of a fixed update."""

    global_arrays = {"b": np.array([0.5, -0.5]), "a": np.array([[1.0, 2.0]])}
    trained = {"b": np.array([0.25, 0.5]), "a": np.array([[1.125, 2.0]])}
    cases = []
    for case in DP_CASES:
        params = {**DP_TAIL, **case, "dp-stddev": 1e-3, "dp-min-survivors": 3}
        vector = encode_noised(global_arrays, Trained(arrays=trained, num_examples=120, steps=4), params)
        cases.append({"secagg": params, "vector": [int(w) for w in vector]})
    return {"what": "distributed DP's masked-step encoding: delta (float64, tensors in name order, C order) clipped to "
                    "L2 norm dp-clip (times dp-clip / ||delta|| when larger), times dp-scale, rounded half to even, "
                    "plus discrete Gaussian noise of std dp-stddev (here 1e-3: always 0), mod 2^bits; then weight 1, "
                    "work 1 and three zero counts, each FixedPoint-encoded (num-examples and steps do not matter)",
            "global": {k: {"shape": list(v.shape), "values": v.ravel().tolist()} for k, v in global_arrays.items()},
            "trained": {k: {"shape": list(v.shape), "values": v.ravel().tolist()} for k, v in trained.items()},
            "cases": cases}


VECTORS: dict[str, Callable[[], dict[str, Any]]] = {
    "frame": frame_vector,
    "check-in": check_in_vector,
    "request-mac": request_mac_vector,
    "int8-delta": int8_delta_vector,
    "task-encodings": task_encodings_vector,
    "batching": batching_vector,
    "preprocessing": preprocessing_vector,
    "optimiser": optimiser_vector,
    "bundle": bundle_vector,
    "training": training_vector,
    "secagg-keys": secagg_keys_vector,
    "secagg-shares": secagg_shares_vector,
    "secagg-masks": secagg_masks_vector,
    "secagg-update": secagg_update_vector,
    "secagg-signatures": secagg_signatures_vector,
    "secagg-dp": secagg_dp_vector,
}
"""Each vector's file (``NAME.json``) and the function that makes it."""


def main(argv: list[str] | None = None) -> int:
    """Rewrite the vectors (and with ``--bundle`` the bundle first)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", action="store_true", help="export and sign a new bundle.zip first (torch)")
    options = parser.parse_args(argv)
    if options.bundle:
        make_bundle()
    for name, build in VECTORS.items():
        (HERE / f"{name}.json").write_text(render(build()), encoding="utf-8")
        print(f"wrote {name}.json")
    print(f"bundle.zip: sha256 {hashlib.sha256(BUNDLE.read_bytes()).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
