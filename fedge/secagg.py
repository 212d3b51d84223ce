"""Secure aggregation math shared by coordinator and devices (SecAgg / SecAgg+).

Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning",
CCS 2017; Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead", CCS 2020. Pieces:

* fixed-point quantisation of a clipped vector into Z_{2^bits} (32 by default);
* masks expanded from 256-bit seeds with the ChaCha20 keystream (a CSPRNG;
  Flower 1.42's SecAgg+ folds its seed to 32 bits for numpy's RandomState);
* X25519 key agreement, HKDF-SHA256 key derivation, AES-256-GCM for shares in transit;
* Shamir t-of-n sharing of 32-byte secrets over GF(2^521 - 1) (see below why by hand);
* a seeded k-regular neighbour graph (SecAgg+), or all pairs for small n.

Threat model: an honest-but-curious coordinator that relays every message learns only
the sum of the masked vectors of devices that finished; pairwise masks cancel in the
sum and self-masks are removed with shares from surviving neighbours. A device is never
asked for both shares of one peer (self-mask seed and mask key), which would unmask it.
"""

from __future__ import annotations

import math
import os
import random
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from numpy.typing import NDArray

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
        clipped = np.clip(np.asarray(values, np.float64), -self.clip, self.clip)
        return to_ring(np.rint(clipped * self.scale).astype(np.int64).astype(np.uint64), self.bits)

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


# --------------------------------------------------------------------------- masks


def expand_mask(seed: bytes, length: int, bits: int = 32) -> Vector:
    """``length`` ring elements of ChaCha20 keystream keyed by the 32-byte ``seed``."""
    if len(seed) != 32:
        raise ValueError("mask seeds are 32 bytes")
    word = 4 if bits <= 32 else 8
    encryptor = Cipher(algorithms.ChaCha20(seed, b"\x00" * 16), mode=None).encryptor()
    stream = np.frombuffer(encryptor.update(b"\x00" * (word * length)), dtype=f"<u{word}")
    return to_ring(stream, bits)


def masked_input(encoded: Vector, self_seed: bytes, pair_seeds: Mapping[int, bytes], me: int,
                 bits: int = 32) -> Vector:
    """``x + PRG(b_i) + sum_{j > i} PRG(s_ij) - sum_{j < i} PRG(s_ij)`` in Z_{2^bits}."""
    total = ring_add(encoded, expand_mask(self_seed, len(encoded), bits), bits)
    for peer, seed in pair_seeds.items():
        total = ring_add(total, expand_mask(seed, len(encoded), bits), bits, subtract=me > peer)
    return total


def unmask(masked_sum: Vector, self_seeds: Iterable[bytes], dropped_pairs: Iterable[tuple[int, int, bytes]],
           bits: int = 32) -> Vector:
    """Remove survivors' self-masks and the pair masks that dropped devices left behind.

    ``dropped_pairs`` holds ``(survivor, dropped, seed)``: the survivor added
    ``+PRG(seed)`` if ``survivor < dropped`` else ``-PRG(seed)``, which nothing cancelled.
    """
    total = to_ring(masked_sum, bits)
    for seed in self_seeds:
        total = ring_add(total, expand_mask(seed, len(total), bits), bits, subtract=True)
    for survivor, dropped, seed in dropped_pairs:
        total = ring_add(total, expand_mask(seed, len(total), bits), bits, subtract=survivor < dropped)
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
    secret = 0
    for j, (x_j, y_j) in enumerate(points):
        numerator, denominator = 1, 1
        for m, (x_m, _) in enumerate(points):
            if m != j:
                numerator = numerator * x_m % PRIME
                denominator = denominator * (x_m - x_j) % PRIME
        secret = (secret + y_j * numerator * pow(denominator, -1, PRIME)) % PRIME
    return (secret % 2**256).to_bytes(32, "big")


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
    """Which shares each surviving device is asked to reveal, per SecAgg's safety rule.

    For a surviving neighbour ``j``: the share of ``j``'s self-mask seed; for a dropped
    neighbour ``j``: the share of ``j``'s mask key. Never both for the same peer.
    """
    alive = set(survivors)
    plan = {}
    for node in alive:
        plan[node] = {"self-seed": graph[node] & alive, "mask-key": graph[node] - alive}
    return plan
