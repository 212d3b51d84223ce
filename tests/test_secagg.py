"""Secure-aggregation math: quantisation, masks, keys, shares, and a whole round with dropouts."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.secagg import (
    MASK_BLOCK,
    FixedPoint,
    InvalidPublicKey,
    add_mask,
    check_ed25519_public,
    check_x25519_public,
    derive,
    expand_mask,
    masked_input,
    minimum_threshold,
    neighbour_graph,
    open_sealed,
    public_bytes,
    rebuild_secret,
    reveal_plan,
    ring_accumulate,
    ring_add,
    ring_dtype,
    seal,
    share_secret,
    sign_survivors,
    signing_public_bytes,
    survivors_message,
    unmask,
    valid_survivors_signature,
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


@pytest.mark.parametrize("bits", [8, 31, 32, 33, 64])
@pytest.mark.parametrize("length", [0, 1, 1001, MASK_BLOCK // 4 + 3])  # the last crosses a keystream block
def test_masks_added_in_place_are_the_chacha20_keystream_in_the_ring(bits: int, length: int) -> None:
    # Prepare: the mask by definition, the ChaCha20 keystream of the seed (zero nonce) read as words, mod 2^bits
    seed, word = os.urandom(32), 4 if bits <= 32 else 8
    raw = Cipher(algorithms.ChaCha20(seed, b"\x00" * 16), mode=None).encryptor().update(b"\x00" * (word * length))
    reference = (np.frombuffer(raw, f"<u{word}").astype(np.uint64) & np.uint64(2**bits - 1)).astype(ring_dtype(bits))
    start = np.random.default_rng(length).integers(0, 2**bits, length, dtype=np.uint64).astype(ring_dtype(bits))
    # Execute
    expanded = expand_mask(seed, length, bits)
    added = add_mask(start.copy(), seed, bits)
    removed = add_mask(added.copy(), seed, bits, subtract=True)
    # Assert: the same mask whichever way it is made, added and removed exactly in Z_2^bits
    assert expanded.dtype == ring_dtype(bits) and np.array_equal(expanded, reference)
    assert np.array_equal(added, ring_add(start, reference, bits))
    assert np.array_equal(removed, start)


@pytest.mark.parametrize("bits", [8, 31, 32, 33, 64])
def test_a_sum_folded_in_place_equals_the_ring_sum(bits: int) -> None:
    rng = np.random.default_rng(bits)
    vectors = [rng.integers(0, 2**bits, 500, dtype=np.uint64).astype(ring_dtype(bits)) for _ in range(7)]
    total, expected = np.zeros(500, ring_dtype(bits)), np.zeros(500, ring_dtype(bits))
    for index, vector in enumerate(vectors):
        ring_accumulate(total, vector, bits, subtract=index == 3)
        expected = ring_add(expected, vector, bits, subtract=index == 3)
    assert total.dtype == ring_dtype(bits) and np.array_equal(total, expected)
    with pytest.raises(ValueError, match="writeable"):
        ring_accumulate(np.zeros(500, np.float64), vectors[0], bits)  # type: ignore[arg-type]


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


ED25519_P = 2**255 - 19
ORDER_8_Y = 2707385501144840649318225287225658788936804267575313519463743609750303402022  # libsodium's list


@pytest.mark.parametrize(("check", "raw", "reason"), [
    (check_x25519_public, bytes(32), "small order"),
    (check_x25519_public, (1).to_bytes(32, "little"), "small order"),
    (check_x25519_public, (ED25519_P - 1).to_bytes(32, "little"), "small order"),
    (check_x25519_public, b"\x09" * 31, "not 32 bytes"),
    (check_x25519_public, None, "not 32 bytes"),
    (check_ed25519_public, bytes(32), "small order"),  # y = 0: order 4
    (check_ed25519_public, (1).to_bytes(32, "little"), "small order"),  # the identity
    (check_ed25519_public, (ED25519_P - 1).to_bytes(32, "little"), "small order"),  # order 2
    (check_ed25519_public, ORDER_8_Y.to_bytes(32, "little"), "small order"),
    (check_ed25519_public, (ED25519_P - ORDER_8_Y).to_bytes(32, "little"), "small order"),
    (check_ed25519_public, (ED25519_P + 1).to_bytes(32, "little"), "does not encode a curve point"),  # non-canonical
    (check_ed25519_public, (2).to_bytes(32, "little"), "does not encode a curve point"),  # y = 2 has no x
    (check_ed25519_public, b"\x01" * 33, "not 32 bytes"),
])
def test_public_keys_of_small_order_or_off_the_curve_are_refused(check: Any, raw: Any, reason: str) -> None:
    with pytest.raises(InvalidPublicKey, match=reason):
        check(raw)


def test_generated_public_keys_pass_the_checks() -> None:
    for _ in range(50):
        assert check_x25519_public(public_bytes(X25519PrivateKey.generate()))
        assert check_ed25519_public(signing_public_bytes(Ed25519PrivateKey.generate()))


def test_a_consistency_signature_binds_the_round_and_the_exact_survivor_set() -> None:
    key = Ed25519PrivateKey.generate()
    public = signing_public_bytes(key)
    signature = sign_survivors(key, server_round=4, survivors=[3, 1, 2])
    assert valid_survivors_signature(public, signature, server_round=4, survivors=[1, 2, 3])  # order-free
    assert not valid_survivors_signature(public, signature, server_round=5, survivors=[1, 2, 3])
    assert not valid_survivors_signature(public, signature, server_round=4, survivors=[1, 2])
    assert not valid_survivors_signature(public, signature, server_round=4, survivors=[1, 2, 3, 4])
    assert not valid_survivors_signature(public, signature[:-1], server_round=4, survivors=[1, 2, 3])
    assert not valid_survivors_signature(signing_public_bytes(Ed25519PrivateKey.generate()), signature,
                                         server_round=4, survivors=[1, 2, 3])
    assert survivors_message(server_round=1, survivors=[12]) != survivors_message(server_round=11, survivors=[2])


@pytest.mark.parametrize(("neighbours", "floor"), [(2, 2), (3, 2), (4, 3), (5, 3), (6, 4), (13, 7), (14, 8)])
def test_the_threshold_floor_is_a_strict_majority_and_at_least_two(neighbours: int, floor: int) -> None:
    assert minimum_threshold(neighbours) == floor
    assert 2 * floor > neighbours and floor >= 2


# The coordinator's fast Ed25519 key check (a Jacobi symbol and the torsion points' y) must give the
# verdict of RFC 8032's decoding (_ed25519_point) and the doubling test (_ed25519_small_order).

ED25519_ORDER = 2**252 + 27742317777372353535851937790883648493  # the prime order of the base point's group


def _edwards_add(p: tuple[int, int], q: tuple[int, int]) -> tuple[int, int]:
    """Affine addition on -x^2 + y^2 = 1 + d x^2 y^2 (complete: d is not a square)."""
    from fedge.secagg import _ED_D

    (x1, y1), (x2, y2) = p, q
    t = _ED_D * x1 * x2 * y1 * y2 % ED25519_P
    return ((x1 * y2 + y1 * x2) * pow(1 + t, -1, ED25519_P) % ED25519_P,
            (y1 * y2 + x1 * x2) * pow(1 - t, -1, ED25519_P) % ED25519_P)


def _times(scalar: int, point: tuple[int, int]) -> tuple[int, int]:
    result, addend = (0, 1), point
    while scalar:
        if scalar & 1:
            result = _edwards_add(result, addend)
        addend, scalar = _edwards_add(addend, addend), scalar >> 1
    return result


def _encode(point: tuple[int, int]) -> bytes:
    return (point[1] | ((point[0] & 1) << 255)).to_bytes(32, "little")


def test_the_torsion_points_are_the_keys_refused_as_small_order() -> None:
    """The 8-torsion subgroup derived from scratch (order-l multiples of random points) has exactly the
    y coordinates the fast check refuses, and each of its points is refused, whichever x sign."""
    import random

    from fedge.secagg import _ED_TORSION_Y, _ed25519_point, _ed25519_small_order

    rng, torsion = random.Random(7), set()
    while len(torsion) < 8:
        point = _ed25519_point(rng.randbytes(32))
        if point is not None:
            torsion.add(_times(ED25519_ORDER, point))
    assert {y for _, y in torsion} == _ED_TORSION_Y
    for point in torsion:
        assert _ed25519_small_order(point)
        with pytest.raises(InvalidPublicKey, match="small order"):
            check_ed25519_public(_encode(point))


def test_the_fast_ed25519_check_gives_the_rfc_decodings_verdict() -> None:
    import random

    from fedge.secagg import _ED_TORSION_Y, _ed25519_point, _ed25519_small_order

    def reference(raw: bytes) -> str:
        point = _ed25519_point(raw)
        return "off" if point is None else "small" if _ed25519_small_order(point) else "ok"

    def fast(raw: bytes) -> str:
        try:
            check_ed25519_public(raw)
        except InvalidPublicKey as exc:
            return "off" if "curve point" in str(exc) else "small"
        return "ok"

    rng = random.Random(3)
    edges = [*_ED_TORSION_Y, 2, 3, *range(ED25519_P - 3, ED25519_P + 20), 2**255 - 1]
    raws = [rng.randbytes(32) for _ in range(3000)] + [
        (y | sign << 255).to_bytes(32, "little") for y in edges for sign in (0, 1)] + [
        signing_public_bytes(Ed25519PrivateKey.generate()) for _ in range(100)]
    verdicts = [(reference(raw), fast(raw)) for raw in raws]
    assert all(a == b for a, b in verdicts)
    assert {a for a, _ in verdicts} == {"off", "small", "ok"}


def test_a_secret_rebuilds_from_any_threshold_of_its_shares_in_any_order() -> None:
    """Lagrange weights are cached by the holders' indices: any subset, any order, same secret."""
    import itertools
    import random

    rng = random.Random(5)
    for threshold, holders in ((2, 3), (3, 5), (7, 12)):
        secret = rng.randbytes(32)
        shares = list(share_secret(secret, threshold, list(range(100, 100 + holders))).values())
        subsets = list(itertools.combinations(shares, threshold))[:40] + [tuple(shares)]
        for subset in subsets:
            picked = list(subset)
            rng.shuffle(picked)
            assert rebuild_secret(picked) == secret
        assert rebuild_secret(shares[:threshold - 1]) != secret
