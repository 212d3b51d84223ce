"""Device side of fedge's secure aggregation (see :mod:`fedge.secagg` and
:mod:`fedge.server.secure`): four train actions of the ClientApp.

``secagg_setup``: make X25519 key pairs, send the public halves. ``secagg_share``:
Shamir-share the self-mask seed and the mask key among the neighbours, each share
sealed for its recipient (the coordinator relays ciphertext only). ``secagg_masked``:
train, encode ``w * (local - global)`` and ``w`` in fixed point, add the masks, send.
``secagg_unmask``: reveal, for each neighbour, the one share the protocol allows.
Secrets live in the node's ``Context.state`` between the steps of one round.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedge import wire
from fedge.secagg import (
    SHARE_BYTES,
    FixedPoint,
    Vector,
    derive,
    masked_input,
    open_sealed,
    public_bytes,
    seal,
    share_secret,
)
from fedge.strategies.aggregate import fednova_norm

STATE = "secagg"
TrainContent = Callable[[Message, Context], RecordDict]


def _raw(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def _ad(sender: int, receiver: int, server_round: int) -> bytes:
    return f"{sender}->{receiver}/{server_round}".encode()


STAGES = ("secagg_setup", "secagg_share", "secagg_masked", "secagg_unmask")


def _advance(state: ConfigRecord, stage: str, server_round: int) -> None:
    """Refuse a step from another round or out of order (a replayed or reordered message)."""
    expected = STAGES[STAGES.index(str(state["stage"])) + 1] if state["stage"] != STAGES[-1] else None
    if int(state["round"]) != server_round or stage != expected:  # type: ignore[arg-type]
        raise ValueError(f"refusing {stage} for round {server_round}: this device is at {state['stage']!s} of "
                         f"round {state['round']!s} (a replayed or reordered message)")
    state["stage"] = stage


def _encode_update(global_arrays: ArrayRecord, trained: RecordDict, params: ConfigRecord) -> Vector:
    """``w * delta / a`` on the update's scale, then ``w`` and ``w * a`` each on its own scale.

    ``a`` is FedNova's normalised local work when the coordinator sends ``work-momentum >= 0``
    (Wang et al., NeurIPS 2020), else 1 (FedAvg / FedProx weighting).
    """
    local = trained.array_records[wire.ARRAYS]
    weight = float(trained.metric_records[wire.METRICS][wire.NUM_EXAMPLES])  # type: ignore[arg-type]
    momentum = float(params["work-momentum"])  # type: ignore[arg-type]
    steps = int(trained.config_records[wire.REPLY_META].get("steps", 1))  # type: ignore[arg-type]
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
    """Register the four secure-aggregation train actions on ``app``."""

    @app.train("secagg_setup")
    def setup(msg: Message, context: Context) -> Message:
        cipher_key, mask_key = X25519PrivateKey.generate(), X25519PrivateKey.generate()
        server_round = int(msg.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
        context.state[STATE] = ConfigRecord({"c-sk": _raw(cipher_key), "s-sk": _raw(mask_key),
                                             "round": server_round, "stage": "secagg_setup"})
        keys = ConfigRecord({"c-pk": public_bytes(cipher_key), "s-pk": public_bytes(mask_key)})
        return Message(RecordDict({"keys": keys}), reply_to=msg)

    @app.train("secagg_share")
    def share(msg: Message, context: Context) -> Message:
        state, peers = context.state.config_records[STATE], msg.content.config_records["peers"]
        me, server_round = context.node_id, int(peers["server-round"])  # type: ignore[arg-type]
        neighbours = [int(n) for n in peers["neighbours"]]  # type: ignore[union-attr]
        threshold = int(peers["threshold"])  # type: ignore[arg-type]
        _advance(state, "secagg_share", server_round)
        self_seed = os.urandom(32)
        seed_shares = share_secret(self_seed, threshold, neighbours)
        key_shares = share_secret(bytes(state["s-sk"]), threshold, neighbours)  # type: ignore[arg-type]
        cipher_key = X25519PrivateKey.from_private_bytes(bytes(state["c-sk"]))  # type: ignore[arg-type]
        sealed = ConfigRecord()
        for peer in neighbours:
            key = derive(cipher_key, bytes(peers[f"c-pk/{peer}"]), "share")  # type: ignore[arg-type]
            sealed[f"to/{peer}"] = seal(key, seed_shares[peer] + key_shares[peer], _ad(me, peer, server_round))
            state[f"s-pk/{peer}"] = peers[f"s-pk/{peer}"]
            state[f"c-pk/{peer}"] = peers[f"c-pk/{peer}"]
        state["b"], state["neighbours"] = self_seed, neighbours
        return Message(RecordDict({"sealed": sealed}), reply_to=msg)

    @app.train("secagg_masked")
    def masked(msg: Message, context: Context) -> Message:
        state = context.state.config_records[STATE]
        inbox, params = msg.content.config_records["inbox"], msg.content.config_records["secagg"]
        _advance(state, "secagg_masked", int(msg.content.config_records["config"][wire.SERVER_ROUND]))  # type: ignore[arg-type]
        known_peers = {f"from/{int(peer)}" for peer in state["neighbours"]}  # type: ignore[union-attr]
        for name, value in inbox.items():  # only sealed shares from this device's neighbours
            if name in known_peers and isinstance(value, bytes):
                state[name] = value
        trained = train_content(msg, context)
        bits = int(params["bits"])  # type: ignore[arg-type]
        encoded = _encode_update(msg.content.array_records[wire.ARRAYS], trained, params)
        mask_key = X25519PrivateKey.from_private_bytes(bytes(state["s-sk"]))  # type: ignore[arg-type]
        me, server_round = context.node_id, int(state["round"])  # type: ignore[arg-type]
        # pair masks only with peers that completed the share step (their shares reached us)
        known = [int(peer) for peer in state["neighbours"]]  # type: ignore[union-attr]
        neighbours = [peer for peer in known if f"from/{peer}" in inbox]
        pair_seeds = {peer: derive(mask_key, bytes(state[f"s-pk/{peer}"]), "mask",  # type: ignore[arg-type]
                                   str(server_round).encode())
                      for peer in neighbours}
        vector = masked_input(encoded, bytes(state["b"]), pair_seeds, me, bits)  # type: ignore[arg-type]
        content = RecordDict({"masked": ArrayRecord({"vector": Array(vector)}),
                              wire.REPLY_META: trained.config_records[wire.REPLY_META]})
        return Message(content, reply_to=msg)

    @app.train("secagg_unmask")
    def unmask(msg: Message, context: Context) -> Message:
        state, ask = context.state.config_records[STATE], msg.content.config_records["ask"]
        _advance(state, "secagg_unmask", int(ask["server-round"]))  # type: ignore[arg-type]
        survivors = {int(n) for n in ask["survivors"]}  # type: ignore[union-attr]
        dropped = {int(n) for n in ask["dropped"]}  # type: ignore[union-attr]
        if survivors & dropped:
            raise ValueError("refusing to reveal both shares of one device (the safety rule)")
        me, server_round = context.node_id, int(state["round"])  # type: ignore[arg-type]
        cipher_key = X25519PrivateKey.from_private_bytes(bytes(state["c-sk"]))  # type: ignore[arg-type]
        revealed = ConfigRecord()
        for peer in [int(p) for p in state["neighbours"]]:  # type: ignore[union-attr]
            if f"from/{peer}" not in state or (peer not in survivors and peer not in dropped):
                continue
            key = derive(cipher_key, bytes(state[f"c-pk/{peer}"]), "share")  # type: ignore[arg-type]
            shares = open_sealed(key, bytes(state[f"from/{peer}"]), _ad(peer, me, server_round))  # type: ignore[arg-type]
            revealed[f"b/{peer}" if peer in survivors else f"s/{peer}"] = shares[:SHARE_BYTES] \
                if peer in survivors else shares[SHARE_BYTES:]
        del context.state[STATE]  # this round's secrets are spent
        return Message(RecordDict({"revealed": revealed}), reply_to=msg)
