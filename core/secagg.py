"""Secure aggregation math shared by coordinator and devices (SecAgg / SecAgg+).

Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning",
CCS 2017; Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead", CCS 2020. Pieces:

* fixed-point quantisation of a clipped vector into Z_{2^bits} (32 by default);
* masks expanded from 256-bit seeds with the ChaCha20 keystream (a CSPRNG;
  Flower 1.42's SecAgg+ folds its seed to 32 bits for numpy's RandomState);
* X25519 key agreement, HKDF-SHA256 key derivation, AES-256-GCM for shares in transit;
* Shamir t-of-n sharing of 32-byte secrets over GF(2^521 - 1) (see below why by hand);
* a seeded k-regular neighbour graph (SecAgg+), or all pairs for small n;
* public-key checks (X25519 and Ed25519 keys of small order are refused) and the
  Ed25519 signatures of the consistency check (Bonawitz et al. §4, round 3).

Threat model. The coordinator relays every message and may deviate from the protocol
(an active adversary, as in Bonawitz et al.'s security analysis): it may drop, withhold or reorder messages,
send different devices different survivor sets and choose the threshold. Deviating on its
own, with the devices' real keys, it learns only the sum of the masked inputs of devices
that finished, because every device enforces the paper's checks itself (see :mod:`fedge.clients.secure`): ``t >
neighbours / 2`` and ``t >= 2``; shares from at least ``t`` neighbours before masking;
a survivor set that contains it and at least ``t`` of its neighbours, signed once per
round; at least ``t`` neighbours' signatures over that same set before it reveals; and
for each neighbour exactly one share, chosen locally from that set (the self-mask seed
of a survivor, the mask key of a dropout). Honest devices sign one set a round, so two
different survivor sets can both collect ``t`` signatures among a device's ``k`` neighbours
only if ``c >= 2t - k`` of them collude with the coordinator (one colluder at ``t =
floor(k/2) + 1``): below that, no device's self-mask seed and mask key are both revealed.
The coordinator also chooses each device's neighbours (devices accept any list of 2 or
more), so it can surround a target with colluders.

Model inconsistency (Pasquini et al., "Eluding Secure Aggregation in Federated Learning
via Model Inconsistency", CCS 2022): a coordinator that sends every device but a target a
zero-update model or config (learning rate 0) would get the target's update as the sum.
Each device signs, with its round's Ed25519 key, ``(round, SHA-256 of the global arrays,
SHA-256 of the canonical training config)`` it was sent (:class:`Received`; per-device
keys, :data:`PER_DEVICE_CONFIG`, left out) and signs the survivor set only if every
surviving neighbour signed the same digests; so no neighbour of a device that was sent
something else unmasks, and its self mask stays secret. Every surviving neighbour, not
``t``: with ``t`` the coordinator could withhold the target's signature and let its other
neighbours unmask it. No dropout tolerance is lost: the signature travels with the
masked input, so every survivor has one. The per-device weight (examples, FedNova's
work) and counts of what the device clipped travel in the masked vector; only their sums are
revealed. The coordinator may still
give each connected part of a graph it made disconnected its own model: the guarantee is
then per connected part, like (3) below.

Bad shares: each share is sealed with AES-256-GCM under the X25519 key of its sender and
recipient, with ``sender->recipient/round`` as associated data, so a share that was
altered, cut, emptied, swapped between recipients or replayed from another round does not
open; its recipient names the sender (:mod:`fedge.clients.secure`) and the coordinator
starts the round again without it. A recipient's word is not proof (the coordinator
cannot check a share sealed for someone else): a lying device can have up to ``k - t``
honest neighbours sit one round out; naming more gets itself left out. A share that opens
but holds a wrong value (well-formed, not on the sender's polynomial) is not detected
before unmasking: without verifiable secret sharing (Feldman, FOCS 1987) the round then
fails when the rebuilt secrets disagree, with no one named.

Out of scope. (1) Without a PKI that binds the X25519 and Ed25519 keys to registered
devices, a coordinator that substitutes public keys in the share step (a
man-in-the-middle of the key exchange) or simulates Sybil devices is not stopped:
Bonawitz et al.'s active security assumes such a PKI. fedge's SuperNode authentication
keys identify devices to the SuperLink only; devices do not see each other's. So the
signing keys behind the consistency check and the model-inconsistency check are per-round
keys the coordinator relays; a coordinator that substitutes them can forge every signature
a device checks. (2)
``t > neighbours / 2`` means an honest majority among each device's neighbours, not among
all devices. (3) SecAgg+'s sparse neighbourhoods give Bell et al.'s per-neighbourhood
guarantee (with high probability over a random graph), not the global one of the complete
graph; and the coordinator picks the graph, so a graph it chose adversarially weakens it.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import random
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from numpy.typing import NDArray

from fedge.errors import ProtocolError
from fedge.wire import LOCAL_EPOCHS

Vector = NDArray[np.unsignedinteger]


# --------------------------------------------------------------------------- the ring Z_{2^bits}


def ring_dtype(bits: int) -> type[np.unsignedinteger]:
    """The smallest numpy word holding Z_{2^bits} (uint32 up to 32 bits, else uint64)."""
    if not 2 <= bits <= 64:
        raise ValueError(f"secure aggregation works in Z_(2^bits) with 2 <= bits <= 64, got {bits}")
    return np.uint32 if bits <= 32 else np.uint64


def to_ring(values: NDArray[np.unsignedinteger], bits: int) -> Vector:
    """Reduce unsigned words (arithmetic done mod 2^64) into Z_{2^bits}."""
    if bits in (32, 64):  # the word itself wraps at 2^bits
        return values.astype(ring_dtype(bits), copy=False)
    wide = values.astype(np.uint64, copy=False) & np.uint64((1 << bits) - 1)
    return wide.astype(ring_dtype(bits))


def ring_accumulate(total: Vector, vector: Vector, bits: int, *, subtract: bool = False) -> Vector:
    """``total += vector`` (or ``-=``) in Z_{2^bits}, in place; returns ``total``.

    ``total`` is a writeable :func:`ring_dtype` vector; ``vector`` holds ring elements of the
    same length. What the coordinator folds each masked input into as it arrives (one
    model-sized sum, not one array per device).
    """
    if total.dtype != ring_dtype(bits) or not total.flags.writeable:
        raise ValueError(f"ring_accumulate needs a writeable {np.dtype(ring_dtype(bits)).name} total")
    (np.subtract if subtract else np.add)(total, vector.astype(total.dtype, copy=False), out=total)
    if bits not in (32, 64):  # words wrap at 2^32 / 2^64, multiples of 2^bits: reduce once
        np.bitwise_and(total, total.dtype.type((1 << bits) - 1), out=total)
    return total


def ring_add(a: Vector, b: Vector, bits: int, *, subtract: bool = False) -> Vector:
    """``a + b`` (or ``a - b``) in Z_{2^bits}."""
    if bits in (32, 64):  # native wrap-around, no widening
        dtype = ring_dtype(bits)
        a, b = a.astype(dtype, copy=False), b.astype(dtype, copy=False)
        return np.subtract(a, b) if subtract else np.add(a, b)
    wide_a, wide_b = a.astype(np.uint64), b.astype(np.uint64)
    return to_ring(wide_a - wide_b if subtract else wide_a + wide_b, bits)


# --------------------------------------------------------------------------- fixed point


@dataclass(frozen=True)
class FixedPoint:
    """Clip to ``[-clip, clip]`` and scale by ``scale`` into Z_{2^bits} (two's complement).

    A sum of ``n`` encoded vectors decodes correctly while ``n * clip * scale < 2^(bits-1)``.
    """

    clip: float
    scale: float
    bits: int = 32

    def encode(self, values: NDArray[np.floating]) -> Vector:
        """Quantise (round to nearest) into the ring."""
        scaled = np.clip(np.asarray(values, np.float64), -self.clip, self.clip)  # a new array: scaled in place
        scaled *= self.scale
        np.rint(scaled, out=scaled)
        return to_ring(scaled.astype(np.int64).view(np.uint64), self.bits)  # two's complement, then mod 2^bits

    def fits(self, count: int) -> bool:
        """Whether a sum of ``count`` encodings cannot overflow."""
        return count * self.clip * self.scale < 2 ** (self.bits - 1)

    def decode_sum(self, total: Vector, count: int) -> NDArray[np.float64]:
        """Decode a modular sum of ``count`` encodings back to floats."""
        if not self.fits(count):
            raise ValueError(f"{count} vectors of clip {self.clip} at scale {self.scale} overflow {self.bits} "
                             "bits; raise secagg-bits, lower secagg-clip or coarsen secagg-precision")
        shift = np.uint64(64 - self.bits)  # sign-extend the top bit of each bits-wide word
        signed = (total.astype(np.uint64) << shift).view(np.int64) >> np.int64(64 - self.bits)
        return signed.astype(np.float64) / self.scale


def bits_needed(count: int, clip: float, precision: float) -> int:
    """Ring bits for ``count`` values in ``[-clip, clip]`` at ``precision`` to sum without overflow."""
    return math.ceil(math.log2(count * clip / precision + 1)) + 1


def ring_range(count: int, scale: float, bits: int) -> float:
    """The largest clip a :class:`FixedPoint` at ``scale`` in Z_{2^bits} can have so that a sum of
    ``count`` encodings cannot overflow: the ring's range shared by ``count`` devices, a whole
    number of steps (each encoding rounds to at most ``floor((2^(bits-1) - 1) / count)``).

    Above 2^50 steps a float64 no longer rounds ``clip * scale`` back to the whole number, so
    the range keeps a margin of 2^-40 of itself there (a 64-bit ring loses nothing that matters).
    """
    steps = (2 ** (bits - 1) - 1) // max(count, 1)
    if steps > 2**50:
        steps -= steps >> 40
    return steps / scale


# --------------------------------------------------------------------------- masks


def expand_mask(seed: bytes, length: int, bits: int = 32) -> Vector:
    """``length`` ring elements of ChaCha20 keystream keyed by the 32-byte ``seed``."""
    word = 4 if bits <= 32 else 8
    stream = np.empty(length, f"<u{word}")
    _keystream_into(seed, stream)
    return to_ring(stream, bits)


def add_mask(total: Vector, seed: bytes, bits: int = 32, *, subtract: bool = False) -> Vector:
    """``total += PRG(seed)`` (or ``-=``) in Z_{2^bits}, in place: :func:`expand_mask`'s mask,
    made block by block into a reused buffer (no mask-sized allocation); returns ``total``.

    ``total`` must be a :func:`ring_dtype` vector of its ring (as :func:`masked_input` and
    :func:`unmask` make). Words wrap at 2^32 or 2^64, a multiple of 2^bits, so adding the
    raw keystream and reducing once gives the same ring element as adding the reduced mask.
    """
    if total.dtype != ring_dtype(bits) or not total.flags.c_contiguous or not total.flags.writeable:
        raise ValueError(f"add_mask needs a writeable contiguous {np.dtype(ring_dtype(bits)).name} vector")
    word, encryptor = total.dtype.itemsize, _chacha20(seed)
    if not len(total):
        return total
    block = np.empty(min(len(total), MASK_BLOCK // word), total.dtype)
    zeros = _zeros(block.nbytes)
    operation = np.subtract if subtract else np.add
    for start in range(0, len(total), len(block)):
        part = total[start:start + len(block)]
        chunk = block[:len(part)]
        encryptor.update_into(zeros[:chunk.nbytes], chunk.view(np.uint8))
        operation(part, chunk, out=part)
    if bits not in (32, 64):
        np.bitwise_and(total, total.dtype.type((1 << bits) - 1), out=total)
    return total


MASK_BLOCK = 1 << 20
"""Bytes of keystream :func:`add_mask` makes at a time (a cache-friendly block)."""


def _chacha20(seed: bytes) -> Any:
    if len(seed) != 32:
        raise ValueError("mask seeds are 32 bytes")
    return Cipher(algorithms.ChaCha20(seed, b"\x00" * 16), mode=None).encryptor()


def _keystream_into(seed: bytes, out: NDArray[np.unsignedinteger]) -> None:
    """Fill ``out`` with the ChaCha20 keystream of ``seed`` (nonce and counter zero), block by block."""
    encryptor, raw = _chacha20(seed), out.view(np.uint8)
    if not len(raw):
        return
    zeros = _zeros(min(len(raw), MASK_BLOCK))
    for start in range(0, len(raw), len(zeros)):
        part = raw[start:start + len(zeros)]
        encryptor.update_into(zeros[:len(part)], part)


@functools.lru_cache(maxsize=4)
def _zeros(nbytes: int) -> memoryview:
    """``nbytes`` zero bytes to encrypt into keystream (read-only, shared)."""
    return memoryview(bytes(nbytes))


def masked_input(encoded: Vector, self_seed: bytes, pair_seeds: Mapping[int, bytes], me: int,
                 bits: int = 32) -> Vector:
    """``x + PRG(b_i) + sum_{j > i} PRG(s_ij) - sum_{j < i} PRG(s_ij)`` in Z_{2^bits}."""
    total = to_ring(encoded, bits).astype(ring_dtype(bits), copy=True)
    add_mask(total, self_seed, bits)
    for peer, seed in pair_seeds.items():
        add_mask(total, seed, bits, subtract=me > peer)
    return total


def unmask(masked_sum: Vector, self_seeds: Iterable[bytes], dropped_pairs: Iterable[tuple[int, int, bytes]],
           bits: int = 32) -> Vector:
    """Remove survivors' self-masks and the pair masks that dropped devices left behind.

    ``dropped_pairs`` holds ``(survivor, dropped, seed)``: the survivor added
    ``+PRG(seed)`` if ``survivor < dropped`` else ``-PRG(seed)``, which nothing cancelled.
    """
    total = to_ring(masked_sum, bits).astype(ring_dtype(bits), copy=True)
    for seed in self_seeds:
        add_mask(total, seed, bits, subtract=True)
    for survivor, dropped, seed in dropped_pairs:
        add_mask(total, seed, bits, subtract=survivor < dropped)
    return total


# --------------------------------------------------------------------------- keys


def public_bytes(key: X25519PrivateKey) -> bytes:
    """The raw 32-byte public key."""
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def derive(private: X25519PrivateKey, peer_public: bytes, purpose: str, context: bytes = b"") -> bytes:
    """32 bytes from X25519(private, peer) through HKDF-SHA256, bound to ``purpose`` and ``context``."""
    shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=b"fedge-secagg/" + purpose.encode() + b"/" + context).derive(shared)


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """AES-256-GCM with a random nonce (12 bytes, prepended)."""
    nonce = os.urandom(12)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def open_sealed(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    """Decrypt :func:`seal`'s output; raises ``cryptography.exceptions.InvalidTag`` if altered."""
    return AESGCM(key).decrypt(sealed[:12], sealed[12:], associated)


class InvalidPublicKey(ProtocolError, ValueError):
    """A public key that is malformed, not on its curve, or of small order.

    An X25519 key of small order makes every key agreement with it all zeros (its
    holder's neighbours could not derive their keys: the round would fail for them, not
    for its sender); an Ed25519 key of small order admits signatures that verify for many
    messages.
    """


@functools.cache
def _probe() -> X25519PrivateKey:
    """A throwaway private key for :func:`check_x25519_public` (the secrets it makes are discarded)."""
    return X25519PrivateKey.generate()


def check_x25519_public(raw: object, *, name: str = "X25519 public key") -> bytes:
    """``raw`` if it is a usable X25519 public key, else :class:`InvalidPublicKey`.

    A key agreement with a throwaway private key: ``cryptography`` refuses an all-zero
    shared secret (RFC 7748 §6.1), which every small-order point yields whatever the
    private key.
    """
    if not isinstance(raw, bytes) or len(raw) != 32:
        raise InvalidPublicKey(f"{name} is not 32 bytes")
    try:
        _probe().exchange(X25519PublicKey.from_public_bytes(raw))
    except ValueError as exc:
        raise InvalidPublicKey(f"{name} is of small order (its key agreements are all zeros)") from exc
    return raw


_ED_P = 2**255 - 19
_ED_D = -121665 * pow(121666, -1, _ED_P) % _ED_P


def _ed25519_point(raw: bytes) -> tuple[int, int] | None:
    """The affine point ``raw`` encodes (RFC 8032 §5.1.3), or ``None`` if it encodes none."""
    encoded = int.from_bytes(raw, "little")
    sign, y = encoded >> 255, encoded & ((1 << 255) - 1)
    if y >= _ED_P:
        return None
    u, v = (y * y - 1) % _ED_P, (_ED_D * y * y + 1) % _ED_P
    x = u * pow(v, 3, _ED_P) * pow(u * pow(v, 7, _ED_P), (_ED_P - 5) // 8, _ED_P) % _ED_P
    if (v * x * x - u) % _ED_P:
        x = x * pow(2, (_ED_P - 1) // 4, _ED_P) % _ED_P
        if (v * x * x - u) % _ED_P:
            return None
    if x == 0 and sign:
        return None
    return (_ED_P - x, y) if x & 1 != sign else (x, y)


def _ed25519_small_order(point: tuple[int, int]) -> bool:
    """Whether ``8 * point`` is the identity (three projective doublings, a = -1:
    Bernstein et al., "Twisted Edwards Curves", AFRICACRYPT 2008, dbl-2008-bbjlp)."""
    x, y, z = point[0], point[1], 1
    for _ in range(3):
        b, c, d = (x + y) ** 2 % _ED_P, x * x % _ED_P, y * y % _ED_P
        f = (d - c) % _ED_P
        j = (f - 2 * z * z) % _ED_P
        x, y, z = (b - c - d) * j % _ED_P, f * (-c - d) % _ED_P, f * j % _ED_P
    return x == 0 and y == z


def check_ed25519_public(raw: object, *, name: str = "Ed25519 public key") -> bytes:
    """``raw`` if it is a usable Ed25519 public key, else :class:`InvalidPublicKey`.

    ``cryptography`` loads any 32 bytes; this decodes the point (RFC 8032 §5.1.3) and
    refuses the 8 torsion points (``8 * A`` is the identity), whose signatures prove nothing.
    The verdict is :func:`_ed25519_point`'s and :func:`_ed25519_small_order`'s, reached without
    the square root (:func:`_ed25519_y`; the coordinator checks every device's key each round).
    """
    if not isinstance(raw, bytes) or len(raw) != 32:
        raise InvalidPublicKey(f"{name} is not 32 bytes")
    y = _ed25519_y(raw)
    if y is None:
        raise InvalidPublicKey(f"{name} does not encode a curve point")
    if y in _ED_TORSION_Y:
        raise InvalidPublicKey(f"{name} is of small order")
    Ed25519PublicKey.from_public_bytes(raw)
    return raw


_ED_ORDER_8_Y = 2707385501144840649318225287225658788936804267575313519463743609750303402022
_ED_TORSION_Y = frozenset({1, _ED_P - 1, 0, _ED_ORDER_8_Y, _ED_P - _ED_ORDER_8_Y})
"""The y coordinates of the 8 torsion points: the identity (1), order 2 (-1), order 4 (0), order 8
(libsodium's list; tests/test_secagg.py derives the subgroup from scratch). A curve point is of
small order iff its y is one of these (its negation, the other x, has the same order)."""


def _ed25519_y(raw: bytes) -> int | None:
    """The y of the point ``raw`` encodes, or ``None`` exactly when :func:`_ed25519_point` finds none.

    RFC 8032's decoding takes the square root ``x`` of ``u / v`` (``u = y^2 - 1``, ``v = d y^2 + 1``,
    never 0: ``d`` is not a square); a point exists iff ``u / v``, so ``u v``, is a square, which
    a Jacobi symbol tells ~4x faster than the root's exponentiation. ``x = 0`` (``u = 0``) with
    the sign bit set encodes nothing, as there.
    """
    encoded = int.from_bytes(raw, "little")
    sign, y = encoded >> 255, encoded & ((1 << 255) - 1)
    if y >= _ED_P:
        return None
    u, v = (y * y - 1) % _ED_P, (_ED_D * y * y + 1) % _ED_P
    if u == 0:
        return None if sign else y
    return y if _jacobi(u * v % _ED_P, _ED_P) == 1 else None


def _jacobi(a: int, n: int) -> int:
    """The Jacobi symbol (a / n) for odd ``n > 0`` (the Legendre symbol for a prime: 1 for a
    nonzero square, -1 for a non-square, 0 for a multiple of ``n``); the binary algorithm
    (Cohen, "A Course in Computational Algebraic Number Theory", Algorithm 1.4.10)."""
    a %= n
    result = 1
    while a:
        while not a & 1:
            a >>= 1
            if n & 7 in (3, 5):
                result = -result
        a, n = n, a
        if a & 3 == 3 and n & 3 == 3:
            result = -result
        a %= n
    return result if n == 1 else 0


def signing_public_bytes(key: Ed25519PrivateKey) -> bytes:
    """The raw 32-byte Ed25519 public key."""
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


# --------------------------------------------------------------------------- thresholds and consistency


STEPS = ("secagg_setup", "secagg_share", "secagg_masked", "secagg_consistency", "secagg_unmask")
"""The protocol's train actions, in order (Bonawitz et al. §4 rounds 0-4)."""
PUBLIC_KEYS = ("c-pk", "s-pk", "g-pk")
"""A device's per-round public keys: share encryption (X25519), masks (X25519), signatures (Ed25519)."""


class ProtocolViolation(ProtocolError, ValueError):
    """A request a device refuses because obeying it could reveal more than the sum.

    Raised by the device handlers (:mod:`fedge.clients.secure`); the device's reply is
    then an error and, for the coordinator, it dropped out.
    """


def minimum_threshold(neighbours: int) -> int:
    """The smallest threshold a device with ``neighbours`` neighbours accepts: a strict
    majority, and at least 2.

    With ``t > neighbours / 2`` two disjoint groups of ``t`` neighbours cannot exist, so
    the consistency check lets only one survivor set be acted on, and the shares of a
    self-mask seed and of a mask key cannot both reach ``t`` (Bonawitz et al., CCS 2017,
    §4 and its active-adversary analysis; Bell et al., CCS 2020). With ``t = 1`` every share
    is the secret.
    """
    return max(2, neighbours // 2 + 1)


def survivors_message(*, server_round: int, survivors: Iterable[int]) -> bytes:
    """What a device signs in the consistency check: the round and the sorted survivor set."""
    return f"fedge-secagg/consistency/{server_round}/".encode() + ",".join(
        str(node) for node in sorted(set(survivors))).encode()


def sign_survivors(key: Ed25519PrivateKey, *, server_round: int, survivors: Iterable[int]) -> bytes:
    """An Ed25519 signature over :func:`survivors_message` (64 bytes)."""
    return key.sign(survivors_message(server_round=server_round, survivors=survivors))


def valid_survivors_signature(public: bytes, signature: object, *, server_round: int,
                              survivors: Iterable[int]) -> bool:
    """Whether ``signature`` is ``public``'s signature over this round's ``survivors``."""
    return _valid_signature(public, signature, survivors_message(server_round=server_round, survivors=survivors))


def valid_signature(public: bytes, signature: object, message: bytes) -> bool:
    """Whether ``signature`` is ``public``'s Ed25519 signature over ``message`` (e.g. one
    :func:`survivors_message`, made once for a round's signatures rather than once per signer)."""
    return _valid_signature(public, signature, message)


def _valid_signature(public: bytes, signature: object, message: bytes) -> bool:
    """Whether ``signature`` is ``public``'s Ed25519 signature over ``message``."""
    if not isinstance(signature, bytes) or len(signature) != 64:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


# --------------------------------------------------------------------------- what a device received


PER_DEVICE_CONFIG = frozenset({LOCAL_EPOCHS})
"""Training-config keys a coordinator may legitimately set per device, left out of
:func:`config_digest`: FedProx's simulated stragglers train a random 1..E-1 of the E epochs."""


@dataclass(frozen=True)
class Received:
    """SHA-256 digests of what one device was sent for a round's masked step.

    ``arrays``: the global arrays (name, dtype, shape and bytes, by name); ``config``: its
    training config and the secure-aggregation parameters, canonically encoded, without
    :data:`PER_DEVICE_CONFIG`. Devices sign these with their round signing key, and one signs
    the survivor set only if every surviving neighbour signed the same two digests: a
    coordinator that sends one device a different model or config than its neighbours (the
    model-inconsistency attack, Pasquini et al., CCS 2022) gets no unmasking around it.
    """

    arrays: bytes
    config: bytes


def arrays_digest(arrays: Mapping[str, NDArray[Any]]) -> bytes:
    """SHA-256 over the named arrays, in name order (each name, dtype, shape and bytes, length-prefixed)."""
    digest = hashlib.sha256(b"fedge-secagg/arrays/v1")
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        for part in (name.encode(), array.dtype.str.encode(), repr(array.shape).encode()):
            _absorb(digest, part)
        digest.update(array.nbytes.to_bytes(8, "big"))
        digest.update(array.reshape(-1).view(np.uint8).data)
    return digest.digest()


def config_digest(*records: Mapping[str, object]) -> bytes:
    """SHA-256 over config records in order, each key in sorted order with its type and value
    (``repr``: exact for floats), leaving out :data:`PER_DEVICE_CONFIG`."""
    digest = hashlib.sha256(b"fedge-secagg/config/v1")
    for record in records:
        _absorb(digest, b"record")
        for key in sorted(k for k in record if k not in PER_DEVICE_CONFIG):
            value = record[key]
            for part in (key.encode(), type(value).__name__.encode(), repr(value).encode()):
                _absorb(digest, part)
    return digest.digest()


def _absorb(digest: Any, part: bytes) -> None:
    digest.update(len(part).to_bytes(8, "big"))
    digest.update(part)


def received_message(*, server_round: int, received: Received) -> bytes:
    """What a device signs at its masked step: the round and the digests of what it was sent."""
    return f"fedge-secagg/received/{server_round}/{received.arrays.hex()}/{received.config.hex()}".encode()


def sign_received(key: Ed25519PrivateKey, *, server_round: int, received: Received) -> bytes:
    """An Ed25519 signature over :func:`received_message` (64 bytes)."""
    return key.sign(received_message(server_round=server_round, received=received))


def valid_received_signature(public: bytes, signature: object, *, server_round: int, received: Received) -> bool:
    """Whether ``signature`` is ``public``'s signature over this round's ``received`` digests."""
    return _valid_signature(public, signature, received_message(server_round=server_round, received=received))


# --------------------------------------------------------------------------- Shamir


# Hand-written on purpose: pycryptodome's Shamir (what Flower uses) works in GF(2^128) in
# pure Python and needs two 16-byte halves per secret; rebuilding one 32-byte secret from 6
# shares took ~5 ms here, which dominated the coordinator's unmask step at 50 devices.
# Python's big integers in the Mersenne-prime field GF(2^521 - 1) hold a whole secret in
# one element and interpolate ~100x faster. The math is textbook Lagrange interpolation.
PRIME = 2**521 - 1
SHARE_BYTES = 2 + 66  # holder index (big-endian) + field element


def share_secret(secret: bytes, threshold: int, holders: Sequence[int]) -> dict[int, bytes]:
    """Split a 32-byte ``secret`` so that any ``threshold`` of ``holders`` can rebuild it.

    Shamir, "How to Share a Secret", CACM 1979: a random polynomial of degree
    ``threshold - 1`` over GF(2^521 - 1) with the secret as constant term, evaluated at
    ``1..len(holders)``; returns holder id -> :data:`SHARE_BYTES` bytes.
    """
    if len(secret) != 32 or not 1 <= threshold <= len(holders) < 2**16:
        raise ValueError("need a 32-byte secret and 1 <= threshold <= number of holders < 65536")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for x, holder in enumerate(holders, start=1):
        y = 0
        for coefficient in reversed(coefficients):  # Horner
            y = (y * x + coefficient) % PRIME
        shares[holder] = x.to_bytes(2, "big") + y.to_bytes(66, "big")
    return shares


def rebuild_secret(shares: Sequence[bytes]) -> bytes:
    """The 32-byte secret from at least ``threshold`` shares made by :func:`share_secret`.

    With fewer shares the result is a random-looking value, not the secret.
    """
    points = [(int.from_bytes(share[:2], "big"), int.from_bytes(share[2:SHARE_BYTES], "big")) for share in shares]
    if len({x for x, _ in points}) != len(points) or any(len(share) != SHARE_BYTES for share in shares):
        raise ValueError("shares must be distinct and SHARE_BYTES long")
    weights = _lagrange_at_zero(tuple(x for x, _ in points))
    secret = sum(y * weight for (_, y), weight in zip(points, weights, strict=True)) % PRIME
    return (secret % 2**256).to_bytes(32, "big")


@functools.lru_cache(maxsize=4096)
def _lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """The Lagrange basis polynomials of the distinct points ``xs`` at 0, in GF(2^521 - 1): the secret
    is ``sum(y_j * weight_j)``. They depend on the holders' indices only, which repeat across the
    secrets a coordinator rebuilds in a round (one modular inverse per point, made once)."""
    weights = []
    for j, x_j in enumerate(xs):
        numerator, denominator = 1, 1
        for m, x_m in enumerate(xs):
            if m != j:
                numerator = numerator * x_m % PRIME
                denominator = denominator * (x_m - x_j) % PRIME
        weights.append(numerator * pow(denominator, -1, PRIME) % PRIME)
    return tuple(weights)


# --------------------------------------------------------------------------- neighbours


def neighbour_graph(nodes: Sequence[int], degree: int, seed: int) -> dict[int, set[int]]:
    """An undirected graph where each node has about ``degree`` neighbours (all pairs if
    ``degree >= n - 1``): a seeded random ring-lattice, as SecAgg+ uses (k ~ O(log n))."""
    ordered = sorted(nodes)
    graph: dict[int, set[int]] = {node: set() for node in ordered}
    if degree >= len(ordered) - 1:
        for node in ordered:
            graph[node] = set(ordered) - {node}
        return graph
    shuffled = ordered[:]
    random.Random(seed).shuffle(shuffled)
    half = max(degree // 2, 1)
    for position, node in enumerate(shuffled):
        for step in range(1, half + 1):
            peer = shuffled[(position + step) % len(shuffled)]
            graph[node].add(peer)
            graph[peer].add(node)
    return graph


def reveal_plan(graph: Mapping[int, set[int]], survivors: Iterable[int]) -> dict[int, dict[str, set[int]]]:
    """Which shares each surviving device reveals, per SecAgg's safety rule.

    For a surviving neighbour ``j``: the share of ``j``'s self-mask seed; for a dropped
    neighbour ``j``: the share of ``j``'s mask key. Never both for the same peer. Devices
    apply this rule themselves to the survivor set they signed in the consistency check.
    """
    alive = set(survivors)
    plan = {}
    for node in alive:
        plan[node] = {"self-seed": graph[node] & alive, "mask-key": graph[node] - alive}
    return plan
