"""Secure-aggregation math: quantisation, masks, keys, shares, and a whole round with dropouts."""

from __future__ import annotations

import os

import numpy as np
import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.secagg import (
    FixedPoint,
    derive,
    expand_mask,
    masked_input,
    neighbour_graph,
    open_sealed,
    public_bytes,
    rebuild_secret,
    reveal_plan,
    seal,
    share_secret,
    unmask,
)


@settings(max_examples=50, deadline=None)
@given(values=st.lists(st.lists(st.floats(-2, 2, allow_nan=False), min_size=5, max_size=5), min_size=1, max_size=20))
def test_fixed_point_sum_is_exact_up_to_rounding(values: list[list[float]]) -> None:
    codec = FixedPoint(clip=1.0, scale=2.0**16)
    vectors = np.array(values)
    total = np.zeros(5, np.uint32)
    for vector in vectors:
        total = (total + codec.encode(vector)).astype(np.uint32)
    expected = np.clip(vectors, -1, 1).sum(axis=0)
    np.testing.assert_allclose(codec.decode_sum(total, len(vectors)), expected, atol=len(vectors) / 2**17 + 1e-12)


def test_fixed_point_refuses_overflowing_sums() -> None:
    with pytest.raises(ValueError, match="overflow"):
        FixedPoint(clip=1.0, scale=2.0**24).decode_sum(np.zeros(1, np.uint32), 200)


def test_masks_are_seeded_keystreams() -> None:
    seed = os.urandom(32)
    mask = expand_mask(seed, 10_000)
    assert mask.dtype == np.uint32 and np.array_equal(mask, expand_mask(seed, 10_000))
    assert not np.array_equal(mask, expand_mask(os.urandom(32), 10_000))
    assert abs(float(mask.mean()) / 2**32 - 0.5) < 0.02  # uniform over Z_2^32


def test_key_agreement_both_sides_and_purposes() -> None:
    a, b = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    assert derive(a, public_bytes(b), "mask", b"round-1") == derive(b, public_bytes(a), "mask", b"round-1")
    assert derive(a, public_bytes(b), "mask", b"round-1") != derive(a, public_bytes(b), "share", b"round-1")


def test_sealed_shares_detect_tampering() -> None:
    key = os.urandom(32)
    sealed = seal(key, b"share bytes", b"from=3;to=5;round=1")
    assert open_sealed(key, sealed, b"from=3;to=5;round=1") == b"share bytes"
    with pytest.raises(InvalidTag):
        open_sealed(key, sealed[:-1] + bytes([sealed[-1] ^ 1]), b"from=3;to=5;round=1")
    with pytest.raises(InvalidTag):
        open_sealed(key, sealed, b"from=3;to=6;round=1")  # relayed to the wrong device


def test_any_threshold_of_shares_rebuilds_and_fewer_do_not() -> None:
    secret = os.urandom(32)
    shares = share_secret(secret, threshold=3, holders=[11, 12, 13, 14, 15])
    assert rebuild_secret([shares[12], shares[15], shares[11]]) == secret
    assert rebuild_secret([shares[13], shares[14], shares[15], shares[11]]) == secret
    assert rebuild_secret([shares[12], shares[15]]) != secret


def test_neighbour_graph_is_symmetric_and_bounded() -> None:
    graph = neighbour_graph(list(range(100)), degree=8, seed=1)
    assert all(node not in peers for node, peers in graph.items())
    assert all(node in graph[peer] for node, peers in graph.items() for peer in peers)
    assert max(len(p) for p in graph.values()) <= 8 and min(len(p) for p in graph.values()) >= 8
    assert neighbour_graph([1, 2, 3], degree=8, seed=1) == {1: {2, 3}, 2: {1, 3}, 3: {1, 2}}


def test_a_round_with_dropouts_reveals_only_the_sum() -> None:
    # Prepare: 8 devices, 4 neighbours each, threshold 2; devices 2 and 5 drop after sharing
    # (every device keeps >= 2 surviving neighbours, so every secret can be rebuilt)
    rng = np.random.default_rng(0)
    nodes, threshold, dim = list(range(1, 9)), 2, 50
    codec = FixedPoint(clip=1.0, scale=2.0**16)
    updates = {n: rng.uniform(-1, 1, dim) for n in nodes}
    graph = neighbour_graph(nodes, degree=4, seed=7)
    keys = {n: X25519PrivateKey.generate() for n in nodes}
    self_seeds = {n: os.urandom(32) for n in nodes}
    raw_keys = {n: keys[n].private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                         serialization.NoEncryption()) for n in nodes}
    # every device shares its self-seed and its mask key among its neighbours
    seed_shares = {n: share_secret(self_seeds[n], threshold, sorted(graph[n])) for n in nodes}
    key_shares = {n: share_secret(raw_keys[n], threshold, sorted(graph[n])) for n in nodes}
    pair_seed = {(i, j): derive(keys[i], public_bytes(keys[j]), "mask") for i in nodes for j in graph[i]}
    dropped, survivors = {2, 5}, [n for n in nodes if n not in {2, 5}]
    assert min(len(graph[n] - dropped) for n in nodes) >= threshold
    # Execute: survivors send masked inputs; the server sums them
    masked = {n: masked_input(codec.encode(updates[n]), self_seeds[n], {j: pair_seed[(n, j)] for j in graph[n]}, n)
              for n in survivors}
    total = np.zeros(dim, np.uint32)
    for vector in masked.values():
        total = (total + vector).astype(np.uint32)
    plan = reveal_plan(graph, survivors)
    assert all(not (asked["self-seed"] & asked["mask-key"]) for asked in plan.values())  # safety rule
    rebuilt_seeds = [rebuild_secret([seed_shares[n][h] for h in survivors if n in plan[h]["self-seed"]])
                     for n in survivors]
    leftovers = []
    for gone in dropped:
        private = X25519PrivateKey.from_private_bytes(
            rebuild_secret([key_shares[gone][h] for h in survivors if gone in plan[h]["mask-key"]]))
        leftovers += [(s, gone, derive(private, public_bytes(keys[s]), "mask")) for s in graph[gone] if s in survivors]
    result = codec.decode_sum(unmask(total, rebuilt_seeds, leftovers), len(survivors))
    # Assert: the plaintext sum of survivors, and no single masked vector looks like its update
    np.testing.assert_allclose(result, sum(updates[n] for n in survivors), atol=len(survivors) / 2**17)
    one = masked[survivors[0]].astype(np.int32).astype(np.float64) / codec.scale
    assert np.abs(one - updates[survivors[0]]).mean() > 100
