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
from fedge.secagg import FixedPoint, derive, masked_input, open_sealed, public_bytes, seal, share_secret

STATE = "secagg"
TrainContent = Callable[[Message, Context], RecordDict]


def _raw(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def _ad(sender: int, receiver: int, server_round: int) -> bytes:
    return f"{sender}->{receiver}/{server_round}".encode()


def add_secure_handlers(app: ClientApp, train_content: TrainContent) -> None:
    """Register the four secure-aggregation train actions on ``app``."""

    @app.train("secagg_setup")
    def setup(msg: Message, context: Context) -> Message:
        cipher_key, mask_key = X25519PrivateKey.generate(), X25519PrivateKey.generate()
        context.state[STATE] = ConfigRecord({"c-sk": _raw(cipher_key), "s-sk": _raw(mask_key)})
        keys = ConfigRecord({"c-pk": public_bytes(cipher_key), "s-pk": public_bytes(mask_key)})
        return Message(RecordDict({"keys": keys}), reply_to=msg)

    @app.train("secagg_share")
    def share(msg: Message, context: Context) -> Message:
        state, peers = context.state.config_records[STATE], msg.content.config_records["peers"]
        me, server_round = context.node_id, int(peers["server-round"])  # type: ignore[arg-type]
        neighbours = [int(n) for n in peers["neighbours"]]  # type: ignore[union-attr]
        threshold = int(peers["threshold"])  # type: ignore[arg-type]
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
        state["b"], state["neighbours"], state["round"] = self_seed, neighbours, server_round
        return Message(RecordDict({"sealed": sealed}), reply_to=msg)

    @app.train("secagg_masked")
    def masked(msg: Message, context: Context) -> Message:
        state = context.state.config_records[STATE]
        inbox, params = msg.content.config_records["inbox"], msg.content.config_records["secagg"]
        for name, value in inbox.items():
            state[name] = value  # sealed shares addressed to this device ("from/<peer>")
        trained = train_content(msg, context)
        global_arrays, local = msg.content.array_records[wire.ARRAYS], trained.array_records[wire.ARRAYS]
        weight = float(trained.metric_records[wire.METRICS][wire.NUM_EXAMPLES])  # type: ignore[arg-type]
        delta = np.concatenate([(local[k].numpy().astype(np.float64) - global_arrays[k].numpy()).ravel()
                                for k in sorted(global_arrays)])
        codec = FixedPoint(clip=float(params["clip"]), scale=float(params["scale"]))  # type: ignore[arg-type]
        encoded = codec.encode(np.append(delta * weight, weight))
        mask_key = X25519PrivateKey.from_private_bytes(bytes(state["s-sk"]))  # type: ignore[arg-type]
        me, server_round = context.node_id, int(state["round"])  # type: ignore[arg-type]
        # pair masks only with peers that completed the share step (their shares reached us)
        known = [int(peer) for peer in state["neighbours"]]  # type: ignore[union-attr]
        neighbours = [peer for peer in known if f"from/{peer}" in inbox]
        pair_seeds = {peer: derive(mask_key, bytes(state[f"s-pk/{peer}"]), "mask",  # type: ignore[arg-type]
                                   str(server_round).encode())
                      for peer in neighbours}
        vector = masked_input(encoded, bytes(state["b"]), pair_seeds, me)  # type: ignore[arg-type]
        content = RecordDict({"masked": ArrayRecord({"vector": Array(vector)}),
                              wire.REPLY_META: trained.config_records[wire.REPLY_META]})
        return Message(content, reply_to=msg)

    @app.train("secagg_unmask")
    def unmask(msg: Message, context: Context) -> Message:
        state, ask = context.state.config_records[STATE], msg.content.config_records["ask"]
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
            revealed[f"b/{peer}" if peer in survivors else f"s/{peer}"] = shares[:33] if peer in survivors \
                else shares[33:]
        del context.state[STATE]  # this round's secrets are spent
        return Message(RecordDict({"revealed": revealed}), reply_to=msg)
