"""Secure aggregation math shared by coordinator and devices (SecAgg / SecAgg+).

Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning",
CCS 2017; Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead", CCS 2020. Pieces:

* fixed-point quantisation of a clipped vector into Z_{2^32};
* masks expanded from 256-bit seeds with the ChaCha20 keystream (a CSPRNG;
  Flower 1.42's SecAgg+ folds its seed to 32 bits for numpy's RandomState);
* X25519 key agreement, HKDF-SHA256 key derivation, AES-256-GCM for shares in transit;
* Shamir t-of-n sharing of 32-byte secrets (two 16-byte halves, pycryptodome's
  GF(2^128) implementation, which Flower already depends on);
* a seeded k-regular neighbour graph (SecAgg+), or all pairs for small n.

Threat model: an honest-but-curious coordinator that relays every message learns only
the sum of the masked vectors of devices that finished; pairwise masks cancel in the
sum and self-masks are removed with shares from surviving neighbours. A device is never
asked for both shares of one peer (self-mask seed and mask key), which would unmask it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from numpy.typing import NDArray

MODULUS_BITS = 32
Vector = NDArray[np.uint32]


# --------------------------------------------------------------------------- fixed point


@dataclass(frozen=True)
class FixedPoint:
    """Clip to ``[-clip, clip]`` and scale by ``scale`` into Z_{2^32}.

    A sum of ``n`` encoded vectors decodes correctly while ``n * clip * scale < 2^31``.
    """

    clip: float
    scale: float

    def encode(self, values: NDArray[np.floating]) -> Vector:
        """Quantise (round to nearest) into uint32 two's complement."""
        clipped = np.clip(np.asarray(values, np.float64), -self.clip, self.clip)
        return np.rint(clipped * self.scale).astype(np.int64).astype(np.uint32)

    def decode_sum(self, total: Vector, count: int) -> NDArray[np.float64]:
        """Decode a modular sum of ``count`` encodings back to floats."""
        if count * self.clip * self.scale >= 2**31:
            raise ValueError(f"{count} vectors of clip {self.clip} at scale {self.scale} overflow 32 bits; "
                             "lower the scale or the clipping range")
        return total.astype(np.int32).astype(np.float64) / self.scale


# --------------------------------------------------------------------------- masks


def expand_mask(seed: bytes, length: int) -> Vector:
    """``length`` uint32 words of ChaCha20 keystream keyed by the 32-byte ``seed``."""
    if len(seed) != 32:
        raise ValueError("mask seeds are 32 bytes")
    encryptor = Cipher(algorithms.ChaCha20(seed, b"\x00" * 16), mode=None).encryptor()
    return np.frombuffer(encryptor.update(b"\x00" * (4 * length)), dtype="<u4").astype(np.uint32)


def masked_input(encoded: Vector, self_seed: bytes, pair_seeds: Mapping[int, bytes], me: int) -> Vector:
    """``x + PRG(b_i) + sum_{j > i} PRG(s_ij) - sum_{j < i} PRG(s_ij)`` in Z_{2^32}."""
    total = encoded.astype(np.uint32) + expand_mask(self_seed, len(encoded))
    for peer, seed in pair_seeds.items():
        mask = expand_mask(seed, len(encoded))
        total = total + mask if me < peer else total - mask
    return total.astype(np.uint32)


def unmask(masked_sum: Vector, self_seeds: Iterable[bytes], dropped_pairs: Iterable[tuple[int, int, bytes]]) -> Vector:
    """Remove survivors' self-masks and the pair masks that dropped devices left behind.

    ``dropped_pairs`` holds ``(survivor, dropped, seed)``: the survivor added
    ``+PRG(seed)`` if ``survivor < dropped`` else ``-PRG(seed)``, which nothing cancelled.
    """
    total = masked_sum.astype(np.uint32).copy()
    for seed in self_seeds:
        total = total - expand_mask(seed, len(total))
    for survivor, dropped, seed in dropped_pairs:
        mask = expand_mask(seed, len(total))
        total = total - mask if survivor < dropped else total + mask
    return total.astype(np.uint32)


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


def share_secret(secret: bytes, threshold: int, holders: Sequence[int]) -> dict[int, bytes]:
    """Split a 32-byte ``secret`` so that any ``threshold`` of ``holders`` can rebuild it.

    Holder ids must be 1..255 distinct (pycryptodome's share index); returns id -> 32 bytes.
    """
    if len(secret) != 32 or not 1 <= threshold <= len(holders):
        raise ValueError("need a 32-byte secret and 1 <= threshold <= number of holders")
    halves = [Shamir.split(threshold, len(holders), secret[i:i + 16], False) for i in (0, 16)]
    by_index = {index: first + second for (index, first), (_, second) in zip(*halves, strict=True)}
    return {holder: bytes([index]) + by_index[index] for index, holder in enumerate(holders, start=1)}


def rebuild_secret(shares: Iterable[bytes]) -> bytes:
    """The 32-byte secret from at least ``threshold`` shares made by :func:`share_secret`."""
    parsed = [(share[0], share[1:17], share[17:33]) for share in shares]
    first = Shamir.combine([(index, a) for index, a, _ in parsed], False)
    second = Shamir.combine([(index, b) for index, _, b in parsed], False)
    return bytes(first) + bytes(second)


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
