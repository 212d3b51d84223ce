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
``t`` neighbours; else train, encode ``w * clip(local - global)`` (the update clipped per
entry, then weighted), ``w`` and what was clipped (counts) in fixed point, add the masks,
send with a signature over ``(round, SHA-256 of the global arrays, SHA-256 of the training
config)`` it was sent; the plaintext meta keeps the round and
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

from collections.abc import Callable

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedge import wire
from fedge.clients import secagg_device as steps
from fedge.secagg import ProtocolViolation

STATE = "secagg"
UNMASKED = "secagg-unmasked"  # the last round this device unmasked in (outlives the round's secrets)
TrainContent = Callable[[Message, Context], RecordDict]


def _state(context: Context, stage: str) -> ConfigRecord:
    """This round's secrets, or a refusal when no round is in progress (its secrets are spent)."""
    if STATE not in context.state.config_records:
        raise ProtocolViolation(f"refusing {stage}: this device has no secure-aggregation round in progress "
                                "(a replayed or reordered message)")
    return context.state.config_records[STATE]


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
    steps.check_not_unmasked(None if done is None else int(done["round"]),  # type: ignore[arg-type]
                             server_round=server_round)


def _public_meta(meta: ConfigRecord) -> ConfigRecord:
    """The reply meta a masked input may carry: round and profile, not the samples processed or the
    steps (either would reveal the device's weight, which travels masked)."""
    return ConfigRecord({key: meta[key] for key in (wire.SERVER_ROUND, wire.PROFILE) if key in meta})


def _trained(content: RecordDict) -> steps.Trained:
    """What a train reply's content holds, as the masked step needs it."""
    local = content.array_records[wire.ARRAYS]
    return steps.Trained(arrays={name: array.numpy() for name, array in local.items()},
                         num_examples=float(content.metric_records[wire.METRICS][wire.NUM_EXAMPLES]),  # type: ignore[arg-type]
                         steps=int(content.config_records[wire.REPLY_META].get(wire.STEPS, 1)))  # type: ignore[arg-type]


def add_secure_handlers(app: ClientApp, train_content: TrainContent) -> None:
    """Register the five secure-aggregation train actions on ``app`` (the steps are
    :mod:`fedge.clients.secagg_device`'s; this is the Flower plumbing around them)."""

    @app.train("secagg_setup")
    def setup(msg: Message, context: Context) -> Message:
        server_round = int(msg.content.config_records[wire.CONFIG][wire.SERVER_ROUND])  # type: ignore[arg-type]
        check_not_unmasked(context, server_round=server_round)
        state, keys = steps.setup(server_round=server_round)
        context.state[STATE] = ConfigRecord(state)
        return Message(RecordDict({"keys": ConfigRecord(keys)}), reply_to=msg)

    @app.train("secagg_share")
    def share(msg: Message, context: Context) -> Message:
        state, peers = _state(context, "secagg_share"), msg.content.config_records["peers"]
        sealed = steps.share(state, peers, me=context.node_id)
        return Message(RecordDict({"sealed": ConfigRecord(sealed)}), reply_to=msg)

    @app.train("secagg_masked")
    def masked(msg: Message, context: Context) -> Message:
        state = _state(context, "secagg_masked")
        records = msg.content.config_records
        global_arrays = msg.content.array_records[wire.ARRAYS]
        kept: dict[str, RecordDict] = {}

        def train() -> steps.Trained:
            kept["content"] = train_content(msg, context)
            return _trained(kept["content"])

        answer = steps.masked(state, inbox=records["inbox"], params=records["secagg"], config=records[wire.CONFIG],
                              global_arrays={name: array.numpy() for name, array in global_arrays.items()},
                              me=context.node_id, train=train)
        if answer.bad:  # name the senders and mask nothing: the coordinator reruns the round without them
            del context.state[STATE]
            return Message(RecordDict({wire.SECAGG_BAD_SHARES: ConfigRecord({"senders": list(answer.bad)})}),
                           reply_to=msg)
        trained = kept["content"]
        context.state[wire.LOCAL_WORK] = ConfigRecord(  # kept here, never sent (the simulation's clock reads it)
            {wire.SAMPLES_PROCESSED: trained.config_records[wire.REPLY_META].get(wire.SAMPLES_PROCESSED, 0)})
        content = RecordDict({
            "masked": ArrayRecord({"vector": Array(answer.vector)}),
            wire.SECAGG_RECEIVED: ConfigRecord(answer.received),
            wire.REPLY_META: _public_meta(trained.config_records[wire.REPLY_META])})
        return Message(content, reply_to=msg)

    @app.train("secagg_consistency")
    def consistency(msg: Message, context: Context) -> Message:
        state = _state(context, "secagg_consistency")
        signature = steps.consistency(state, msg.content.config_records["check"], me=context.node_id)
        return Message(RecordDict({"consistency": ConfigRecord({"signature": signature})}), reply_to=msg)

    @app.train("secagg_unmask")
    def unmask(msg: Message, context: Context) -> Message:
        state = _state(context, "secagg_unmask")
        revealed = steps.unmask(state, msg.content.config_records["ask"], me=context.node_id)
        server_round = int(state["round"])  # type: ignore[arg-type]
        del context.state[STATE]  # this round's secrets are spent
        context.state[UNMASKED] = ConfigRecord({"round": server_round})
        return Message(RecordDict({"revealed": ConfigRecord(revealed)}), reply_to=msg)
