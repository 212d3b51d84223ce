"""A device's five secure-aggregation steps with no Flower: state and messages are plain mappings.

SecAgg (Bonawitz et al., CCS 2017, §4) and SecAgg+ (Bell et al., CCS 2020). Two runtimes run
these same functions: a SuperNode's ClientApp (:mod:`fedge.clients.secure`, which keeps the
state in Flower's ``Context.state`` and reads Flower records) and a protocol device behind a
gateway (:mod:`fedge.clients.protocol_device`, no Flower, no torch), whose gateway runs the
coordinator's side over its pool (:mod:`fedge.clients.gateway.secure_pool`). What each step checks,
and the threat model, is in :mod:`fedge.clients.secure`.

``state`` is one round's secrets (keys ``c-sk``, ``s-sk``, ``g-sk``, ``round``, ``stage``,
then the neighbours' public keys, the shares held, the digests signed): values are bytes,
ints and lists of ints, so a Flower ``ConfigRecord`` holds them as they are.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from numpy.typing import NDArray

from fedge.aggregate import fednova_norm
from fedge.distributed_noise import (
    DP_CLIP,
    DP_MIN_SURVIVORS,
    DP_SCALE,
    DP_STDDEV,
    DistributedNoise,
    noise_generator,
)
from fedge.secagg import (
    PUBLIC_KEYS,
    SHARE_BYTES,
    STEPS,
    FixedPoint,
    ProtocolViolation,
    Received,
    Vector,
    arrays_digest,
    config_digest,
    derive,
    masked_input,
    minimum_threshold,
    open_sealed,
    public_bytes,
    seal,
    share_secret,
    sign_received,
    sign_survivors,
    signing_public_bytes,
    valid_received_signature,
    valid_survivors_signature,
)

log = logging.getLogger("fedge.clients.secure")
State = MutableMapping[str, Any]
SHARE_KEY = "k-share"
"""``state["k-share/PEER"]``: the AES-GCM key of this device's pair with PEER (X25519 + HKDF), derived once at the
share step: the masked and unmask steps open PEER's shares with it (deriving it again cost ~0.1 ms a neighbour)."""
Arrays = Mapping[str, NDArray[Any]]


@dataclass(frozen=True)
class Trained:
    """What local training gave the masked step: the trained arrays, the weight ``w`` and the steps."""

    arrays: Arrays
    num_examples: float
    steps: int


@dataclass(frozen=True)
class Masked:
    """The masked step's answer: a masked vector and the signed digests of what was received, or
    (``bad``) the neighbours whose relayed shares did not open, and nothing masked."""

    vector: Vector | None = None
    received: dict[str, bytes] | None = None
    bad: tuple[int, ...] = ()


def _raw(key: X25519PrivateKey | Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def _ad(sender: int, receiver: int, server_round: int) -> bytes:
    return f"{sender}->{receiver}/{server_round}".encode()


def ids(values: object) -> list[int]:
    """Node ids from a list value (a malformed one is a protocol violation)."""
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ProtocolViolation("refusing: a node list is malformed")
    return [int(v) for v in values]


def advance(state: State, stage: str, server_round: int) -> None:
    """Refuse a step from another round or out of order (a replayed or reordered message).

    Each step runs at most once a round, so a device signs at most one survivor set.
    """
    expected = STEPS[STEPS.index(str(state["stage"])) + 1] if state["stage"] != STEPS[-1] else None
    if int(state["round"]) != server_round or stage != expected:
        raise ProtocolViolation(f"refusing {stage} for round {server_round}: this device is at {state['stage']!s} of "
                                f"round {state['round']!s} (a replayed or reordered message)")
    state["stage"] = stage


def check_not_unmasked(last_unmasked: int | None, *, server_round: int) -> None:
    """Refuse to start a round at or before the last one this device unmasked in.

    Threat model: a coordinator that runs the protocol twice in one round over two device
    sets, unmasks both sums and subtracts them, learns the updates of the devices in one
    set only (see :func:`fedge.clients.secure.check_not_unmasked`).

    Raises
    ------
    ProtocolViolation
        If this device already unmasked in ``server_round`` or a later round.
    """
    if last_unmasked is not None and server_round <= last_unmasked:
        raise ProtocolViolation(f"refusing secagg_setup for round {server_round}: this device already unmasked "
                                f"in round {last_unmasked} (a second sum of the same updates would reveal "
                                "differences between device sets)")


def setup(*, server_round: int) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Round 0 (AdvertiseKeys): this round's fresh secrets and the public keys to send."""
    cipher_key, mask_key = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    signing_key = Ed25519PrivateKey.generate()
    state = {"c-sk": _raw(cipher_key), "s-sk": _raw(mask_key), "g-sk": _raw(signing_key), "round": server_round,
             "stage": "secagg_setup"}
    keys = {"c-pk": public_bytes(cipher_key), "s-pk": public_bytes(mask_key),
            "g-pk": signing_public_bytes(signing_key)}
    return state, keys


def check_threshold(*, threshold: int, neighbours: list[int], me: int) -> None:
    """Refuse a threshold or neighbourhood a device must not share its secrets under.

    Threat model: a coordinator that asks for ``t = 1`` (every share is the secret) or for
    ``t`` at most half the neighbours (two disjoint groups of ``t`` could then be told
    different survivor sets and reveal both secrets of one device). Bonawitz et al.,
    CCS 2017, §4 (round 1); see :func:`fedge.secagg.minimum_threshold`.

    Raises
    ------
    ProtocolViolation
        If ``neighbours`` repeats a node or holds this device, or ``threshold`` is below
        the floor or above the number of neighbours.
    """
    if len(set(neighbours)) != len(neighbours) or me in neighbours:
        raise ProtocolViolation("refusing secagg_share: the neighbour list repeats a node or holds this device")
    floor = minimum_threshold(len(neighbours))
    if not floor <= threshold <= len(neighbours):
        raise ProtocolViolation(
            f"refusing secagg_share: threshold {threshold} with {len(neighbours)} neighbours; a device needs "
            f"{floor} <= t <= {len(neighbours)} (at least 2 and more than half its neighbours)")


def share(state: State, peers: Mapping[str, Any], *, me: int) -> dict[str, bytes]:
    """Round 1 (ShareKeys): Shamir shares of the self-mask seed and the mask key, one sealed for each neighbour."""
    server_round = int(peers["server-round"])
    advance(state, "secagg_share", server_round)
    neighbours = ids(peers["neighbours"])
    threshold = int(peers["threshold"])
    check_threshold(threshold=threshold, neighbours=neighbours, me=me)
    # Bonawitz et al. round 1: all public keys distinct. (The coordinator refuses keys of small
    # order at setup; a small-order X25519 key here makes `derive` raise; checking every
    # neighbour's keys again would cost ~0.3 ms each and stop nothing a coordinator that
    # substitutes keys cannot do with valid ones: see the module's threat model.)
    for kind in PUBLIC_KEYS:
        if len({bytes(peers[f"{kind}/{peer}"]) for peer in neighbours}) != len(neighbours):
            raise ProtocolViolation(f"refusing secagg_share: two neighbours have the same {kind}")
    self_seed = os.urandom(32)
    seed_shares = share_secret(self_seed, threshold, neighbours)
    key_shares = share_secret(bytes(state["s-sk"]), threshold, neighbours)
    cipher_key = X25519PrivateKey.from_private_bytes(bytes(state["c-sk"]))
    sealed = {}
    for peer in neighbours:
        key = derive(cipher_key, bytes(peers[f"c-pk/{peer}"]), "share")
        sealed[f"to/{peer}"] = seal(key, seed_shares[peer] + key_shares[peer], _ad(me, peer, server_round))
        state[f"{SHARE_KEY}/{peer}"] = key  # kept: the masked and unmask steps open this pair's shares with it
        for kind in PUBLIC_KEYS:
            state[f"{kind}/{peer}"] = bytes(peers[f"{kind}/{peer}"])
    state["b"], state["neighbours"], state["threshold"] = self_seed, neighbours, threshold
    return sealed


def open_shares(state: State, inbox: Mapping[str, Any], *, me: int, server_round: int) -> tuple[list[int], list[int]]:
    """Neighbours whose relayed shares open and are well formed (kept in ``state``), and those whose do not.

    A share is sealed with AES-GCM under the pair's X25519 key, with the sender, receiver and
    round as associated data: one that was altered, cut, emptied, sealed for another device
    or another round does not open, and one that opens but is not two shares of the same
    index is malformed. Either is attributed to its sender (the coordinator, which relays,
    could also have altered it: it can drop any device from a round anyway).
    """
    holding, bad = [], []
    for peer in ids(state["neighbours"]):
        sealed = inbox.get(f"from/{peer}")
        if sealed is None:  # not relayed: the peer did not share (a dropout)
            continue
        key = bytes(state[f"{SHARE_KEY}/{peer}"])
        if isinstance(sealed, bytes) and _well_formed(_opened(key, sealed, _ad(peer, me, server_round))):
            holding.append(peer)
            state[f"from/{peer}"] = sealed
        else:
            bad.append(peer)
    return holding, bad


def _opened(key: bytes, sealed: bytes, associated: bytes) -> bytes | None:
    try:
        return open_sealed(key, sealed, associated)
    except (InvalidTag, ValueError):  # ValueError: a nonce shorter than 8 bytes (an empty or cut share)
        return None


def _well_formed(opened: bytes | None) -> bool:
    """Two Shamir shares (self-mask seed, mask key) of one nonzero index."""
    return (opened is not None and len(opened) == 2 * SHARE_BYTES and opened[:2] == opened[SHARE_BYTES:SHARE_BYTES + 2]
            and int.from_bytes(opened[:2], "big") >= 1)


COUNTS = ("clipped-entries", "clipped-devices", "capped-weights")
"""What a device counts of its own clipping, appended to its masked vector after ``w`` and ``w * a``
(summed securely with the rest: the coordinator learns each count's total over the round, no device's)."""


def encode_update(global_arrays: Arrays, trained: Trained, params: Mapping[str, Any]) -> Vector:
    """``w * clip(delta / a)`` on the update's scale, then ``w`` and ``w * a`` each on its own scale,
    then the device's clipping counts (:data:`COUNTS`).

    ``a`` is FedNova's normalised local work when the coordinator sends ``work-momentum >= 0``
    (Wang et al., NeurIPS 2020), else 1 (FedAvg / FedProx weighting). The clip is applied to
    the update, per entry, at ``update-clip`` (secagg-clip), before the weight: a device with
    many examples is clipped where one with few is, and ``w`` (capped at ``weight-clip``, the
    weight the tail carries too) scales what was clipped. ``clip`` is the range of the weighted
    value (``update-clip x weight-clip``, or what the ring holds if that is less): an entry
    beyond it is clipped there too. The counts: entries clipped (either way), 1 if any was,
    1 if the weight was capped.

    A coordinator that sends no ``update-clip`` (before issue 39) gets the old layout:
    ``w * delta / a`` clipped at ``clip``, no counts. One that sends ``dp-stddev`` runs distributed
    DP (:func:`encode_noised`).
    """
    if DP_STDDEV in params:
        return encode_noised(global_arrays, trained, params)
    weight, momentum = float(trained.num_examples), float(params["work-momentum"])
    work = min(fednova_norm(max(trained.steps, 1), momentum), float(params["work-cap"])) if momentum >= 0 else 1.0
    delta = np.concatenate([(np.asarray(trained.arrays[k]).astype(np.float64) - global_arrays[k]).ravel()
                            for k in sorted(global_arrays)])
    bits = int(params["bits"])
    values = FixedPoint(float(params["clip"]), float(params["scale"]), bits)
    weights = FixedPoint(float(params["weight-clip"]), float(params["weight-scale"]), bits)
    works = FixedPoint(float(params["work-clip"]), float(params["work-scale"]), bits)
    if "update-clip" not in params:
        return np.concatenate([values.encode(delta * weight / work), weights.encode(np.array([weight])),
                               works.encode(np.array([weight * work]))])
    capped = weight > weights.clip
    weight = min(weight, weights.clip)
    limit = float(params["update-clip"])
    update = delta / work
    clipped = np.abs(update) > limit
    np.clip(update, -limit, limit, out=update)
    update *= weight
    clipped |= np.abs(update) > values.clip
    entries = int(np.count_nonzero(clipped))
    counts = FixedPoint(float(params["count-clip"]), 1.0, bits)
    if entries:
        log.info("this device's update was clipped in %d of %d entries for secure aggregation (|delta| above "
                 "secagg-clip = %g, or |w * delta| above the ring's range %g at %g examples); the round's total "
                 "is counted by the coordinator", entries, len(update), limit, values.clip, weight)
    return np.concatenate([values.encode(update), weights.encode(np.array([weight])),
                           works.encode(np.array([weight * work])),
                           counts.encode(np.array([entries, float(entries > 0), float(capped)]))])


def dp_noise(params: Mapping[str, Any]) -> DistributedNoise:
    """The distributed-DP encoding the coordinator's ``secagg`` parameters name."""
    return DistributedNoise(clip=float(params[DP_CLIP]), scale=float(params[DP_SCALE]),
                            stddev=float(params[DP_STDDEV]), bits=int(params["bits"]),
                            min_survivors=int(params[DP_MIN_SURVIVORS]))


def encode_noised(global_arrays: Arrays, trained: Trained, params: Mapping[str, Any]) -> Vector:
    """Distributed DP (Kairouz, Liu and Steinke, ICML 2021): the update clipped to L2 norm
    ``dp-clip``, scaled, rounded and noised with this device's discrete Gaussian share; then
    weight 1 and work 1 (DP averages devices uniformly, over a fixed denominator) and zero
    clipping counts (whether this device clipped is a statistic of its data: it stays here).
    """
    delta = np.concatenate([(np.asarray(trained.arrays[k]).astype(np.float64) - global_arrays[k]).ravel()
                            for k in sorted(global_arrays)])
    bits = int(params["bits"])
    noised, clipped = dp_noise(params).encode(delta, rng=noise_generator())
    if clipped:
        log.info("this device's update was clipped to L2 norm %g for distributed DP (not reported: a device's "
                 "norm is private)", float(params[DP_CLIP]))
    weights = FixedPoint(float(params["weight-clip"]), float(params["weight-scale"]), bits)
    works = FixedPoint(float(params["work-clip"]), float(params["work-scale"]), bits)
    counts = FixedPoint(float(params["count-clip"]), 1.0, bits)
    return np.concatenate([noised, weights.encode(np.array([1.0])), works.encode(np.array([1.0])),
                           counts.encode(np.zeros(len(COUNTS)))])


def masked(state: State, *, inbox: Mapping[str, Any], params: Mapping[str, Any], config: Mapping[str, Any],
           global_arrays: Arrays, me: int, train: Callable[[], Trained]) -> Masked:
    """Round 2 (MaskedInputCollection): open the relayed shares, train, mask the encoded update, sign
    the digests of the model and config received.

    A share that does not open names its sender and nothing is masked (the coordinator starts
    the round again without it); shares from fewer than ``t`` neighbours are refused.
    """
    advance(state, "secagg_masked", int(config["server-round"]))
    server_round, threshold = int(state["round"]), int(state["threshold"])
    holding, bad = open_shares(state, inbox, me=me, server_round=server_round)
    if bad:
        log.warning("round %d: the shares relayed from neighbours %s do not open or are malformed; reported, "
                    "nothing masked", server_round, bad)
        return Masked(bad=tuple(bad))
    if len(holding) < threshold:  # Bonawitz et al. round 2: |U2| >= t, else the self-mask alone hides x
        raise ProtocolViolation(f"refusing secagg_masked: shares from only {len(holding)} neighbours reached "
                                f"this device, fewer than the threshold {threshold}")
    state["holding"] = holding
    state[DP_MIN_SURVIVORS] = int(params.get(DP_MIN_SURVIVORS, 0))
    trained = train()
    encoded = encode_update(global_arrays, trained, params)
    mask_key = X25519PrivateKey.from_private_bytes(bytes(state["s-sk"]))
    pair_seeds = {peer: derive(mask_key, bytes(state[f"s-pk/{peer}"]), "mask", str(server_round).encode())
                  for peer in holding}
    vector = masked_input(encoded, bytes(state["b"]), pair_seeds, me, int(params["bits"]))
    received = Received(arrays_digest(global_arrays), config_digest(config, params))
    state["r-arrays"], state["r-config"] = received.arrays, received.config
    signing_key = Ed25519PrivateKey.from_private_bytes(bytes(state["g-sk"]))
    return Masked(vector=vector, received={
        "arrays": received.arrays, "config": received.config,
        "signature": sign_received(signing_key, server_round=server_round, received=received)})


def check_survivors(*, survivors: list[int], me: int, holding: list[int], neighbours: list[int],
                    threshold: int, min_survivors: int = 0) -> None:
    """The device's checks on a survivor set before it signs it (the ConsistencyCheck round).

    Bonawitz et al., CCS 2017, §4 round 3: ``U3 subset of U2`` and ``|U3| >= t``, here per
    neighbourhood (Bell et al., CCS 2020): this device is a survivor, every surviving
    neighbour is one whose shares it holds, and at least ``t`` neighbours survive. Under
    distributed DP, the set also holds at least ``min_survivors`` devices: the noise was
    calibrated for that many shares, and a smaller sum would carry less than accounted for.

    Raises
    ------
    ProtocolViolation
        If any check fails.
    """
    alive = set(survivors)
    if me not in alive:
        raise ProtocolViolation("refusing the survivor set: this device sent its masked input but is not in it")
    foreign = sorted((alive & set(neighbours)) - set(holding))
    if foreign:
        raise ProtocolViolation(f"refusing the survivor set: it names neighbour {foreign[0]}, whose shares never "
                                "reached this device (it cannot have masked with it)")
    if len(alive) < min_survivors:
        raise ProtocolViolation(f"refusing the survivor set: it holds {len(alive)} devices, fewer than the "
                                f"{min_survivors} the distributed-DP noise was calibrated for (their sum would "
                                "carry less noise than accounted for)")
    count = len(alive & set(holding))
    if count < threshold:
        raise ProtocolViolation(f"refusing the survivor set: it holds {count} of this device's neighbours, "
                                f"fewer than the threshold {threshold}")


def check_same_received(state: State, check: Mapping[str, Any], *, survivors: list[int]) -> None:
    """Refuse a survivor set unless every surviving neighbour signed the model and config this device got.

    Threat model: a coordinator that sends every device but a target a different global model
    or config (learning rate 0, or a zero-update config: the model-inconsistency attack,
    Pasquini et al., CCS 2022) makes the masked sum the target's update alone. Each device
    signs the digests of what it received at its masked step (:class:`fedge.secagg.Received`);
    the coordinator relays each surviving neighbour's signature here. One missing or over
    other digests, and this device signs nothing, so it never unmasks: every neighbour of a
    target that was sent something else refuses, and the target's self mask stays secret.
    Every neighbour, not ``t`` of them: the coordinator could otherwise withhold the target's
    signature and let its other neighbours unmask it.

    Raises
    ------
    ProtocolViolation
        Naming the first neighbour whose signature is missing or over other digests.
    """
    received = Received(bytes(state["r-arrays"]), bytes(state["r-config"]))
    server_round = int(state["round"])
    for peer in sorted(set(survivors) & set(ids(state["neighbours"]))):
        if not valid_received_signature(bytes(state[f"g-pk/{peer}"]), check.get(f"received/{peer}"),
                                        server_round=server_round, received=received):
            log.warning("round %d: neighbour %d did not sign the global model and training config this device "
                        "received; refusing to sign the survivor set (nothing will be unmasked)", server_round, peer)
            raise ProtocolViolation(
                f"refusing the survivor set: neighbour {peer} did not sign the global model and training config "
                "this device received (it was sent a different model or config: a coordinator isolating one "
                "device's update, Pasquini et al., CCS 2022)")


def consistency(state: State, check: Mapping[str, Any], *, me: int) -> bytes:
    """Round 3 (ConsistencyCheck): check the survivor set, sign it (at most once a round)."""
    advance(state, "secagg_consistency", int(check["server-round"]))
    survivors = sorted(set(ids(check["survivors"])))
    check_survivors(survivors=survivors, me=me, holding=ids(state["holding"]), neighbours=ids(state["neighbours"]),
                    threshold=int(state["threshold"]), min_survivors=int(state.get(DP_MIN_SURVIVORS, 0)))
    check_same_received(state, check, survivors=survivors)
    signing_key = Ed25519PrivateKey.from_private_bytes(bytes(state["g-sk"]))
    signature = sign_survivors(signing_key, server_round=int(state["round"]), survivors=survivors)
    state["signed"] = survivors
    return signature


def unmask(state: State, ask: Mapping[str, Any], *, me: int) -> dict[str, bytes]:
    """Round 4 (Unmasking): with ``t`` neighbours' signatures over the set this device signed, reveal
    one share per neighbour held: the self-mask share of a survivor, the mask-key share of a
    dropout, decided here from the signed set, never from a list the coordinator sends."""
    advance(state, "secagg_unmask", int(ask["server-round"]))
    server_round = int(state["round"])
    if "signed" not in state:
        raise ProtocolViolation("refusing secagg_unmask: this device signed no survivor set this round")
    survivors = ids(state["signed"])
    if sorted(set(ids(ask["survivors"]))) != survivors:
        raise ProtocolViolation("refusing secagg_unmask: its survivor set is not the one this device signed")
    threshold = int(state["threshold"])
    signers = 0
    for peer in ids(state["neighbours"]):  # stop at t: that is all the check needs
        signers += valid_survivors_signature(bytes(state[f"g-pk/{peer}"]), ask.get(f"sig/{peer}"),
                                             server_round=server_round, survivors=survivors)
        if signers == threshold:
            break
    if signers < threshold:  # Bonawitz et al. round 4: |U5| >= t valid signatures over the same U3
        raise ProtocolViolation(f"refusing secagg_unmask: {signers} neighbours signed the survivor set this "
                                f"device signed, fewer than the threshold {threshold} (inconsistent dropouts?)")
    alive = set(survivors)
    revealed = {}
    for peer in ids(state["holding"]):  # one share per neighbour, chosen here from the signed set
        key = bytes(state[f"{SHARE_KEY}/{peer}"])
        shares = open_sealed(key, bytes(state[f"from/{peer}"]), _ad(peer, me, server_round))
        if peer in alive:
            revealed[f"b/{peer}"] = shares[:SHARE_BYTES]
        else:
            revealed[f"s/{peer}"] = shares[SHARE_BYTES:]
    return revealed
