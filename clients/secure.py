"""Device side of fedge's secure aggregation (see :mod:`fedge.secagg` and
:mod:`fedge.strategies.drivers.secure`): five train actions of the ClientApp, after SecAgg
(Bonawitz et al., CCS 2017, §4) and SecAgg+ (Bell et al., CCS 2020).

``secagg_setup``: make two X25519 key pairs (share encryption, pairwise masks) and an
Ed25519 signing key pair for this round, send the public halves. ``secagg_share``:
check the threshold (``t >= 2`` and ``t > neighbours / 2``) and that the neighbours'
keys are distinct, Shamir-share the self-mask seed and the mask key among the
neighbours, each share sealed for its recipient (the coordinator relays ciphertext
only). ``secagg_masked``: open each relayed share; if any does not open or is malformed
(AES-GCM bound to sender, receiver and round), name its senders and mask nothing (the
coordinator starts the round again without them); refuse with shares from fewer than
``t`` neighbours; else train, encode ``w * (local - global)`` and ``w`` in fixed point,
add the masks, send with a signature over ``(round, SHA-256 of the global arrays,
SHA-256 of the training config)`` it was sent; the plaintext meta keeps the round and
profile only (samples processed and steps would give the weight away).
``secagg_consistency`` (the paper's ConsistencyCheck): refuse a survivor set that
leaves this device out, names a neighbour whose shares never arrived or holds fewer
than ``t`` neighbours, or holds a neighbour whose signature over what it was sent is
missing or over other digests; else sign ``(round, survivors)``; at most once a round.
``secagg_unmask``: refuse without ``t`` neighbours' valid signatures over the set this
device signed, else reveal, for each neighbour whose shares it holds, the self-mask
share if that neighbour is in the set and the mask-key share if not: decided here,
never from a list the coordinator sends.
Secrets live in the node's ``Context.state`` between the steps of one round and are
deleted after the unmask step.

Threat model: a coordinator that deviates from the protocol on its own (withholds or
alters shares, sends different survivor sets to different devices, asks for a threshold
of 1, sends one device a different model or config than its neighbours) learns no more
than the sum; with ``c`` colluding devices among a device's ``k`` neighbours this holds
while ``c < 2t - k``. A device that seals bad shares is named by its recipients and left
out of the round. Not stopped (see :mod:`fedge.secagg`): key substitution in the share
step without a PKI (the signing keys included), Sybil devices, a neighbourhood made of
colluders, and weaker per-neighbourhood guarantees with sparse SecAgg+ graphs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedge import wire
from fedge.aggregate import fednova_norm
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
STATE = "secagg"
UNMASKED = "secagg-unmasked"  # the last round this device unmasked in (outlives the round's secrets)
TrainContent = Callable[[Message, Context], RecordDict]


def _raw(key: X25519PrivateKey | Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def _ad(sender: int, receiver: int, server_round: int) -> bytes:
    return f"{sender}->{receiver}/{server_round}".encode()


STAGES = STEPS


def _advance(state: ConfigRecord, stage: str, server_round: int) -> None:
    """Refuse a step from another round or out of order (a replayed or reordered message).

    Each step runs at most once a round, so a device signs at most one survivor set.
    """
    expected = STAGES[STAGES.index(str(state["stage"])) + 1] if state["stage"] != STAGES[-1] else None
    if int(state["round"]) != server_round or stage != expected:  # type: ignore[arg-type]
        raise ProtocolViolation(f"refusing {stage} for round {server_round}: this device is at {state['stage']!s} of "
                         f"round {state['round']!s} (a replayed or reordered message)")
    state["stage"] = stage


def _state(context: Context, stage: str) -> ConfigRecord:
    """This round's secrets, or a refusal when no round is in progress (its secrets are spent)."""
    if STATE not in context.state.config_records:
        raise ProtocolViolation(f"refusing {stage}: this device has no secure-aggregation round in progress "
                         "(a replayed or reordered message)")
    return context.state.config_records[STATE]


def _ids(values: object) -> list[int]:
    """Node ids from a record's list value (a malformed one is a protocol violation)."""
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ProtocolViolation("refusing: a node list is malformed")
    return [int(v) for v in values]


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


def check_survivors(*, survivors: list[int], me: int, holding: list[int], neighbours: list[int],
                    threshold: int) -> None:
    """The device's checks on a survivor set before it signs it (the ConsistencyCheck round).

    Bonawitz et al., CCS 2017, §4 round 3: ``U3 subset of U2`` and ``|U3| >= t``, here per
    neighbourhood (Bell et al., CCS 2020): this device is a survivor, every surviving
    neighbour is one whose shares it holds, and at least ``t`` neighbours survive.

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
    count = len(alive & set(holding))
    if count < threshold:
        raise ProtocolViolation(f"refusing the survivor set: it holds {count} of this device's neighbours, "
                                f"fewer than the threshold {threshold}")


def check_not_unmasked(context: Context, *, server_round: int) -> None:
    """Refuse to start the protocol for a round at or before the last one this device unmasked in.

    Threat model: a coordinator that runs the protocol twice in one round (the device trains
    the same update twice) over two device sets, unmasks both sums and subtracts them, learns
    the updates of the devices in one set only. fedge's coordinator starts a round again only
    when devices named bad shares, before anything was unmasked. The record lives in the
    node's state: a device that restarts forgets it.

    Raises
    ------
    ProtocolViolation
        If this device already unmasked in ``server_round`` or a later round.
    """
    done = context.state.config_records.get(UNMASKED)
    if done is not None and server_round <= int(done["round"]):  # type: ignore[arg-type]
        raise ProtocolViolation(f"refusing secagg_setup for round {server_round}: this device already unmasked "
                                f"in round {done['round']!s} (a second sum of the same updates would reveal "
                                "differences between device sets)")


def check_same_received(state: ConfigRecord, check: ConfigRecord, *, survivors: list[int]) -> None:
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
    received = Received(bytes(state["r-arrays"]), bytes(state["r-config"]))  # type: ignore[arg-type]
    server_round = int(state["round"])  # type: ignore[arg-type]
    for peer in sorted(set(survivors) & set(_ids(state["neighbours"]))):
        if not valid_received_signature(bytes(state[f"g-pk/{peer}"]), check.get(f"received/{peer}"),  # type: ignore[arg-type]
                                        server_round=server_round, received=received):
            log.warning("round %d: neighbour %d did not sign the global model and training config this device "
                        "received; refusing to sign the survivor set (nothing will be unmasked)", server_round, peer)
            raise ProtocolViolation(
                f"refusing the survivor set: neighbour {peer} did not sign the global model and training config "
                "this device received (it was sent a different model or config: a coordinator isolating one "
                "device's update, Pasquini et al., CCS 2022)")


def _open_shares(state: ConfigRecord, inbox: ConfigRecord, *, me: int,
                 server_round: int) -> tuple[list[int], list[int]]:
    """Neighbours whose relayed shares open and are well formed (kept in ``state``), and those whose do not.

    A share is sealed with AES-GCM under the pair's X25519 key, with the sender, receiver and
    round as associated data: one that was altered, cut, emptied, sealed for another device
    or another round does not open, and one that opens but is not two shares of the same
    index is malformed. Either is attributed to its sender (the coordinator, which relays,
    could also have altered it: it can drop any device from a round anyway).
    """
    cipher_key = X25519PrivateKey.from_private_bytes(bytes(state["c-sk"]))  # type: ignore[arg-type]
    holding, bad = [], []
    for peer in _ids(state["neighbours"]):
        sealed = inbox.get(f"from/{peer}")
        if sealed is None:  # not relayed: the peer did not share (a dropout)
            continue
        key = derive(cipher_key, bytes(state[f"c-pk/{peer}"]), "share")  # type: ignore[arg-type]
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


def _public_meta(meta: ConfigRecord) -> ConfigRecord:
    """The reply meta a masked input may carry: round and profile, not the samples processed or the
    steps (either would reveal the device's weight, which travels masked)."""
    return ConfigRecord({key: meta[key] for key in (wire.SERVER_ROUND, wire.PROFILE) if key in meta})


def _encode_update(global_arrays: ArrayRecord, trained: RecordDict, params: ConfigRecord) -> Vector:
    """``w * delta / a`` on the update's scale, then ``w`` and ``w * a`` each on its own scale.

    ``a`` is FedNova's normalised local work when the coordinator sends ``work-momentum >= 0``
    (Wang et al., NeurIPS 2020), else 1 (FedAvg / FedProx weighting).
    """
    local = trained.array_records[wire.ARRAYS]
    weight = float(trained.metric_records[wire.METRICS][wire.NUM_EXAMPLES])  # type: ignore[arg-type]
    momentum = float(params["work-momentum"])  # type: ignore[arg-type]
    steps = int(trained.config_records[wire.REPLY_META].get(wire.STEPS, 1))  # type: ignore[arg-type]
    work = min(fednova_norm(max(steps, 1), momentum), float(params["work-cap"])) if momentum >= 0 else 1.0  # type: ignore[arg-type]
    delta = np.concatenate([(local[k].numpy().astype(np.float64) - global_arrays[k].numpy()).ravel()
                            for k in sorted(global_arrays)])
    bits = int(params["bits"])  # type: ignore[arg-type]
    values = FixedPoint(float(params["clip"]), float(params["scale"]), bits)  # type: ignore[arg-type]
    weights = FixedPoint(float(params["weight-clip"]), float(params["weight-scale"]), bits)  # type: ignore[arg-type]
    works = FixedPoint(float(params["work-clip"]), float(params["work-scale"]), bits)  # type: ignore[arg-type]
    return np.concatenate([values.encode(delta * weight / work), weights.encode(np.array([weight])),
                           works.encode(np.array([weight * work]))])


def add_secure_handlers(app: ClientApp, train_content: TrainContent) -> None:
    """Register the five secure-aggregation train actions on ``app``."""

    @app.train("secagg_setup")
    def setup(msg: Message, context: Context) -> Message:
        server_round = int(msg.content.config_records[wire.CONFIG][wire.SERVER_ROUND])  # type: ignore[arg-type]
        check_not_unmasked(context, server_round=server_round)
        cipher_key, mask_key = X25519PrivateKey.generate(), X25519PrivateKey.generate()
        signing_key = Ed25519PrivateKey.generate()
        context.state[STATE] = ConfigRecord({"c-sk": _raw(cipher_key), "s-sk": _raw(mask_key),
                                             "g-sk": _raw(signing_key), "round": server_round,
                                             "stage": "secagg_setup"})
        keys = ConfigRecord({"c-pk": public_bytes(cipher_key), "s-pk": public_bytes(mask_key),
                             "g-pk": signing_public_bytes(signing_key)})
        return Message(RecordDict({"keys": keys}), reply_to=msg)

    @app.train("secagg_share")
    def share(msg: Message, context: Context) -> Message:
        state, peers = _state(context, "secagg_share"), msg.content.config_records["peers"]
        me, server_round = context.node_id, int(peers[wire.SERVER_ROUND])  # type: ignore[arg-type]
        _advance(state, "secagg_share", server_round)
        neighbours = _ids(peers["neighbours"])
        threshold = int(peers["threshold"])  # type: ignore[arg-type]
        check_threshold(threshold=threshold, neighbours=neighbours, me=me)
        # Bonawitz et al. round 1: all public keys distinct. (The coordinator refuses keys of small
        # order at setup; a small-order X25519 key here makes `derive` raise; checking every
        # neighbour's keys again would cost ~0.3 ms each and stop nothing a coordinator that
        # substitutes keys cannot do with valid ones: see the module's threat model.)
        for kind in PUBLIC_KEYS:
            if len({bytes(peers[f"{kind}/{peer}"]) for peer in neighbours}) != len(neighbours):  # type: ignore[arg-type]
                raise ProtocolViolation(f"refusing secagg_share: two neighbours have the same {kind}")
        self_seed = os.urandom(32)
        seed_shares = share_secret(self_seed, threshold, neighbours)
        key_shares = share_secret(bytes(state["s-sk"]), threshold, neighbours)  # type: ignore[arg-type]
        cipher_key = X25519PrivateKey.from_private_bytes(bytes(state["c-sk"]))  # type: ignore[arg-type]
        sealed = ConfigRecord()
        for peer in neighbours:
            key = derive(cipher_key, bytes(peers[f"c-pk/{peer}"]), "share")  # type: ignore[arg-type]
            sealed[f"to/{peer}"] = seal(key, seed_shares[peer] + key_shares[peer], _ad(me, peer, server_round))
            for kind in PUBLIC_KEYS:
                state[f"{kind}/{peer}"] = peers[f"{kind}/{peer}"]
        state["b"], state["neighbours"], state["threshold"] = self_seed, neighbours, threshold
        return Message(RecordDict({"sealed": sealed}), reply_to=msg)

    @app.train("secagg_masked")
    def masked(msg: Message, context: Context) -> Message:
        state = _state(context, "secagg_masked")
        inbox, params = msg.content.config_records["inbox"], msg.content.config_records["secagg"]
        _advance(state, "secagg_masked", int(msg.content.config_records[wire.CONFIG][wire.SERVER_ROUND]))  # type: ignore[arg-type]
        me, server_round = context.node_id, int(state["round"])  # type: ignore[arg-type]
        threshold = int(state["threshold"])  # type: ignore[arg-type]
        holding, bad = _open_shares(state, inbox, me=me, server_round=server_round)
        if bad:  # name the senders and mask nothing: the coordinator reruns the round without them
            del context.state[STATE]
            log.warning("round %d: the shares relayed from neighbours %s do not open or are malformed; reported, "
                        "nothing masked", server_round, bad)
            return Message(RecordDict({wire.SECAGG_BAD_SHARES: ConfigRecord({"senders": bad})}), reply_to=msg)
        if len(holding) < threshold:  # Bonawitz et al. round 2: |U2| >= t, else the self-mask alone hides x
            raise ProtocolViolation(f"refusing secagg_masked: shares from only {len(holding)} neighbours reached "
                                    f"this device, fewer than the threshold {threshold}")
        state["holding"] = holding
        trained = train_content(msg, context)
        bits = int(params["bits"])  # type: ignore[arg-type]
        global_arrays = msg.content.array_records[wire.ARRAYS]
        encoded = _encode_update(global_arrays, trained, params)
        mask_key = X25519PrivateKey.from_private_bytes(bytes(state["s-sk"]))  # type: ignore[arg-type]
        pair_seeds = {peer: derive(mask_key, bytes(state[f"s-pk/{peer}"]), "mask",  # type: ignore[arg-type]
                                   str(server_round).encode())
                      for peer in holding}
        vector = masked_input(encoded, bytes(state["b"]), pair_seeds, me, bits)  # type: ignore[arg-type]
        context.state[wire.LOCAL_WORK] = ConfigRecord(  # kept here, never sent (the simulation's clock reads it)
            {wire.SAMPLES_PROCESSED: trained.config_records[wire.REPLY_META].get(wire.SAMPLES_PROCESSED, 0)})
        received = Received(arrays_digest({name: array.numpy() for name, array in global_arrays.items()}),
                            config_digest(msg.content.config_records[wire.CONFIG], params))
        state["r-arrays"], state["r-config"] = received.arrays, received.config
        signing_key = Ed25519PrivateKey.from_private_bytes(bytes(state["g-sk"]))  # type: ignore[arg-type]
        content = RecordDict({
            "masked": ArrayRecord({"vector": Array(vector)}),
            wire.SECAGG_RECEIVED: ConfigRecord({"arrays": received.arrays, "config": received.config,
                                                "signature": sign_received(signing_key, server_round=server_round,
                                                                           received=received)}),
            wire.REPLY_META: _public_meta(trained.config_records[wire.REPLY_META])})
        return Message(content, reply_to=msg)

    @app.train("secagg_consistency")
    def consistency(msg: Message, context: Context) -> Message:
        state, check = _state(context, "secagg_consistency"), msg.content.config_records["check"]
        _advance(state, "secagg_consistency", int(check[wire.SERVER_ROUND]))  # type: ignore[arg-type]
        survivors = sorted(set(_ids(check["survivors"])))
        check_survivors(survivors=survivors, me=context.node_id, holding=_ids(state["holding"]),
                        neighbours=_ids(state["neighbours"]), threshold=int(state["threshold"]))  # type: ignore[arg-type]
        check_same_received(state, check, survivors=survivors)
        signing_key = Ed25519PrivateKey.from_private_bytes(bytes(state["g-sk"]))  # type: ignore[arg-type]
        signature = sign_survivors(signing_key, server_round=int(state["round"]), survivors=survivors)  # type: ignore[arg-type]
        state["signed"] = survivors
        return Message(RecordDict({"consistency": ConfigRecord({"signature": signature})}), reply_to=msg)

    @app.train("secagg_unmask")
    def unmask(msg: Message, context: Context) -> Message:
        state, ask = _state(context, "secagg_unmask"), msg.content.config_records["ask"]
        _advance(state, "secagg_unmask", int(ask[wire.SERVER_ROUND]))  # type: ignore[arg-type]
        me, server_round = context.node_id, int(state["round"])  # type: ignore[arg-type]
        if "signed" not in state:
            raise ProtocolViolation("refusing secagg_unmask: this device signed no survivor set this round")
        survivors = _ids(state["signed"])
        if sorted(set(_ids(ask["survivors"]))) != survivors:
            raise ProtocolViolation("refusing secagg_unmask: its survivor set is not the one this device signed")
        threshold = int(state["threshold"])  # type: ignore[arg-type]
        signers = 0
        for peer in _ids(state["neighbours"]):  # stop at t: that is all the check needs
            signers += valid_survivors_signature(bytes(state[f"g-pk/{peer}"]), ask.get(f"sig/{peer}"),  # type: ignore[arg-type]
                                                 server_round=server_round, survivors=survivors)
            if signers == threshold:
                break
        if signers < threshold:  # Bonawitz et al. round 4: |U5| >= t valid signatures over the same U3
            raise ProtocolViolation(f"refusing secagg_unmask: {signers} neighbours signed the survivor set this "
                                    f"device signed, fewer than the threshold {threshold} (inconsistent dropouts?)")
        alive = set(survivors)
        cipher_key = X25519PrivateKey.from_private_bytes(bytes(state["c-sk"]))  # type: ignore[arg-type]
        revealed = ConfigRecord()
        for peer in _ids(state["holding"]):  # one share per neighbour, chosen here from the signed set
            key = derive(cipher_key, bytes(state[f"c-pk/{peer}"]), "share")  # type: ignore[arg-type]
            shares = open_sealed(key, bytes(state[f"from/{peer}"]), _ad(peer, me, server_round))  # type: ignore[arg-type]
            if peer in alive:
                revealed[f"b/{peer}"] = shares[:SHARE_BYTES]
            else:
                revealed[f"s/{peer}"] = shares[SHARE_BYTES:]
        del context.state[STATE]  # this round's secrets are spent
        context.state[UNMASKED] = ConfigRecord({"round": server_round})
        return Message(RecordDict({"revealed": revealed}), reply_to=msg)
