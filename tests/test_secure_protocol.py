"""Secure aggregation: the protocol's guarantees (exactness, privacy of inputs, replay) and bad settings."""

from __future__ import annotations

import contextlib
import copy
import os
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from fedge import wire
from fedge.cli.main import main
from fedge.clients.app import make_default_client_app
from fedge.clients.secure import STATE, add_secure_handlers
from fedge.config import resolve_run_config
from fedge.errors import RunFailed
from fedge.secagg import (
    FixedPoint,
    ProtocolViolation,
    Received,
    derive,
    expand_mask,
    masked_input,
    minimum_threshold,
    neighbour_graph,
    public_bytes,
    rebuild_secret,
    ring_add,
    ring_dtype,
    sign_received,
    signing_public_bytes,
    unmask,
)
from fedge.server.app import run_coordinator
from fedge.server.report import read_jsonl
from fedge.simulation.grid import InlineGrid
from fedge.strategies.drivers.base import RoundReport
from fedge.strategies.drivers.secure import SecureAggregation, _Expected
from replies import tampered_app

BASE = {"fleet": "phone=6,laptop=3,gpu-box=1", "clients-per-round": 6, "num-rounds": 2, "model": "mlp",
        "local-epochs": 1, "export-onnx": False}


# --------------------------------------------------------------------------- the math, end to end


@settings(max_examples=40, deadline=None)
@given(n=st.integers(3, 9), dim=st.integers(1, 40), bits=st.sampled_from([24, 32, 48, 64]),
       dropped=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_unmasked_sum_equals_the_weighted_plaintext_sum(n: int, dim: int, bits: int, dropped: int, seed: int) -> None:
    # Prepare: n devices with weighted updates; `dropped` of them vanish after the key exchange
    rng = np.random.default_rng(seed)
    nodes = list(range(1, n + 1))
    precision = 1e-3
    codec = FixedPoint(clip=50.0, scale=1 / precision, bits=bits)
    if not codec.fits(n):
        codec = FixedPoint(clip=50.0, scale=(2 ** (bits - 1) - 1) / (n * 50.0), bits=bits)
    weights = {i: float(rng.integers(1, 50)) for i in nodes}
    updates = {i: rng.uniform(-1, 1, dim) * weights[i] for i in nodes}
    keys = {i: X25519PrivateKey.generate() for i in nodes}
    self_seeds = {i: os.urandom(32) for i in nodes}
    graph = neighbour_graph(nodes, n - 1, seed=seed)
    survivors = nodes[dropped:]
    # Execute: mask, sum mod 2^bits, remove survivors' self-masks and the dropped devices' pair masks
    total = np.zeros(dim, ring_dtype(bits))
    for i in survivors:
        pairs = {j: derive(keys[i], public_bytes(keys[j]), "mask") for j in graph[i]}
        total = ring_add(total, masked_input(codec.encode(updates[i]), self_seeds[i], pairs, i, bits), bits)
    leftovers = [(s, gone, derive(keys[gone], public_bytes(keys[s]), "mask"))
                 for gone in nodes[:dropped] for s in survivors]
    result = codec.decode_sum(unmask(total, [self_seeds[i] for i in survivors], leftovers, bits), len(survivors))
    # Assert: within half a quantisation step per device
    expected = sum(updates[i] for i in survivors)
    assert np.max(np.abs(result - expected)) <= len(survivors) * 0.5 / codec.scale + 1e-9


def _masked(update: np.ndarray, bits: int = 32) -> np.ndarray:
    """One device's masked input among 5, as the coordinator receives it."""
    keys = [X25519PrivateKey.generate() for _ in range(5)]
    pairs = {j: derive(keys[0], public_bytes(keys[j]), "mask") for j in range(1, 5)}
    return masked_input(FixedPoint(10.0, 1e4, bits).encode(update), os.urandom(32), pairs, 0, bits)


def test_a_masked_input_is_uniform_whatever_the_update() -> None:
    # Prepare: an all-zero update and a large structured one
    size = 200_000
    zeros, ramp = np.zeros(size), np.linspace(-10, 10, size)
    # Execute
    a, b = _masked(zeros), _masked(ramp)
    # Assert: each is uniform over Z_{2^32} (chi-square over the top byte) and the two are
    # indistinguishable (two-sample Kolmogorov-Smirnov); the unmasked encodings are anything but
    for vector in (a, b):
        counts = np.bincount((vector >> 24).astype(np.int64), minlength=256)
        assert stats.chisquare(counts).pvalue > 1e-4
    assert stats.ks_2samp(a.astype(np.float64), b.astype(np.float64)).pvalue > 1e-4
    plain = FixedPoint(10.0, 1e4).encode(ramp)
    assert stats.chisquare(np.bincount((plain >> 24).astype(np.int64), minlength=256)).pvalue < 1e-10


# --------------------------------------------------------------------------- the coordinator's sum


SENT = Received(arrays=bytes(32), config=bytes(range(32)))  # the digests of what each device was sent


def _masked_reply(node: int, vector: np.ndarray, key: Ed25519PrivateKey) -> Message:
    """A masked input with its sender's signature over :data:`SENT` (round 1)."""
    instruction = Message(RecordDict(), dst_node_id=node, message_type="train.secagg_masked")
    received = ConfigRecord({"arrays": SENT.arrays, "config": SENT.config,
                             "signature": sign_received(key, server_round=1, received=SENT)})
    return Message(RecordDict({"masked": ArrayRecord({"vector": Array(vector)}), wire.SECAGG_RECEIVED: received}),
                   reply_to=instruction)


def test_the_coordinator_folds_masked_inputs_in_as_they_come_and_keeps_none_of_them() -> None:
    # Prepare: 40 well-formed masked inputs; then one from a device that was never asked, a second one
    # from a device already summed, one of the wrong length and an error
    strategy, length = SecureAggregation(), 50_000
    rng = np.random.default_rng(0)
    vectors = {10_000 + i: rng.integers(0, 2**32, length, dtype=np.uint64).astype(np.uint32) for i in range(40)}
    signing = {node: Ed25519PrivateKey.generate() for node in [*vectors, 10_040, 10_041, 99_999]}
    replies = [_masked_reply(node, vector, signing[node]) for node, vector in vectors.items()]
    replies += [_masked_reply(99_999, vectors[10_000], signing[99_999]),
                _masked_reply(10_001, vectors[10_002], signing[10_001]),
                _masked_reply(10_040, vectors[10_000][:-1], signing[10_040]),
                Message(Error(code=2, reason="gone"), reply_to=Message(RecordDict(), dst_node_id=10_041,
                                                                        message_type="train.secagg_masked"))]
    report = RoundReport(server_round=1, selected=42)
    # Execute, measuring what the fold allocates
    tracemalloc.start()
    try:
        asked = set(vectors) | {10_040, 10_041}
        expected_of = _Expected(asked, dict.fromkeys(asked, SENT),
                                {node: {"g-pk": signing_public_bytes(key)} for node, key in signing.items()}, {}, 1)
        folded = strategy._sum_masked(iter(replies), expected_of, length, 1, report)
        total, summed = folded.total, set(folded.received)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Assert: the exact sum mod 2^32 of the 40 asked-for inputs, each once; the malformed one and the
    # error named; no reply still carries its input; a few vectors' worth of memory, not one per device
    expected = np.zeros(length, np.uint64)
    for vector in vectors.values():
        expected += vector
    assert summed == set(vectors) and np.array_equal(total, (expected % 2**32).astype(np.uint32))
    assert sorted(rejection.node_id for rejection in report.failed) == [10_040, 10_041]
    assert not any("masked" in reply.content for reply in replies if not reply.has_error())
    assert peak < 6 * vectors[10_000].nbytes < 40 * vectors[10_000].nbytes


# --------------------------------------------------------------------------- over the message API


class RecordingGrid(InlineGrid):
    """fedge's inline grid, keeping the bytes of every message the coordinator sent or received."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[bytes] = []
        self.device_secrets: list[bytes] = []

    # push and pull: the metering Grid may exchange through them rather than send_and_receive, and
    # a device may run when its message is pushed or when its reply is pulled
    def push_messages(self, messages: Any) -> Any:
        messages = list(messages)
        self.seen += [_all_bytes(message.content) for message in messages]
        ids = list(super().push_messages(messages))
        self._note_secrets()
        return ids

    def pull_messages(self, message_ids: Any) -> Any:
        replies = list(super().pull_messages(message_ids))
        self.seen += [_all_bytes(reply.content) for reply in replies if not reply.has_error()]
        self._note_secrets()
        return replies

    def _note_secrets(self) -> None:
        for context in self.contexts.values():
            state = context.state.config_records.get(STATE)
            if state is not None:
                self.device_secrets += [bytes(state[k]) for k in ("c-sk", "s-sk", "b") if k in state]  # type: ignore[arg-type]


def _all_bytes(content: RecordDict) -> bytes:
    parts = []
    for record in content.values():
        for value in record.values():
            if isinstance(value, bytes):
                parts.append(value)
            elif hasattr(value, "data"):
                parts.append(bytes(value.data))
    return b"|".join(parts)


def test_the_coordinator_only_relays_ciphertext_and_never_sees_a_secret(tmp_path: Path) -> None:
    # Prepare
    config = resolve_run_config({**BASE, "fleet": "laptop=5", "clients-per-round": 5, "num-rounds": 1,
                                 "secure-aggregation": True, "run-dir": str(tmp_path / "r")})
    nodes = [{"partition-id": i, "num-partitions": 5, "profile": "laptop"} for i in range(5)]
    grid = RecordingGrid(make_default_client_app(), nodes, config)
    # Execute
    run_coordinator(grid, config, progress=False)
    # Assert: the round aggregated; no private key or self-mask seed of any device appears in
    # anything the coordinator handled (shares travel AES-GCM sealed under device-to-device keys)
    assert read_jsonl(tmp_path / "r" / "metrics.jsonl")[-1]["aggregated"]
    secrets = set(grid.device_secrets)
    assert len(secrets) >= 10
    traffic = b"".join(grid.seen)
    assert not any(secret in traffic for secret in secrets)


def _device() -> tuple[Any, Context]:
    app = make_default_client_app()
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 4}, state=RecordDict(),
                      run_config={"fleet": "laptop=4", "model": "mlp"})
    return app, context


def _setup(round_: int) -> Message:
    return Message(RecordDict({"config": ConfigRecord({"server-round": round_})}), dst_node_id=7,
                   message_type="train.secagg_setup")


def _share(round_: int, peer_keys: dict[int, tuple[bytes, bytes]]) -> Message:
    record = ConfigRecord({"server-round": round_, "threshold": 2, "neighbours": sorted(peer_keys)})
    for peer, (key, signing) in peer_keys.items():
        record[f"c-pk/{peer}"], record[f"s-pk/{peer}"], record[f"g-pk/{peer}"] = key, key, signing
    return Message(RecordDict({"peers": record}), dst_node_id=7, message_type="train.secagg_share")


@pytest.mark.parametrize("replayed", ["share-from-another-round", "unmask-before-masked", "setup-replayed-share"])
def test_a_replayed_or_reordered_step_is_refused(replayed: str) -> None:
    # Prepare: a device that went through setup of round 2
    app, context = _device()
    peers = {peer: (public_bytes(X25519PrivateKey.generate()), signing_public_bytes(Ed25519PrivateKey.generate()))
             for peer in (8, 9)}
    assert not app(_setup(2), context).has_error()
    # Execute: a message that belongs to another round or to a later step
    if replayed == "share-from-another-round":
        message = _share(1, peers)
    elif replayed == "unmask-before-masked":
        ask = ConfigRecord({"survivors": [7, 8, 9], "server-round": 2})
        message = Message(RecordDict({"ask": ask}), dst_node_id=7, message_type="train.secagg_unmask")
    else:
        assert not app(_share(2, peers), context).has_error()
        message = _share(2, peers)
    # Assert: refused (the grid turns this into an error reply); the device's secrets stay in place
    with pytest.raises(ValueError, match="replayed or reordered"):
        app(message, context)
    assert STATE in context.state


def test_deadline_rounds_treat_late_devices_as_dropouts(tmp_path: Path) -> None:
    # Prepare: 4 wanted, 6 selected (over-selection 1.5), a deadline only the faster devices meet
    config = resolve_run_config({**BASE, "fleet": "phone=6,laptop=3,gpu-box=1", "clients-per-round": 4,
                                 "round-policy": "deadline", "over-selection": 1.5, "deadline-s": 6.0,
                                 "secure-aggregation": True, "run-dir": str(tmp_path / "r")})
    from fedge.simulation.runner import simulate

    # Execute
    run_dir, _ = simulate(config, progress=False)
    # Assert: every round aggregated the 4 first on-time devices; the other 2 were dropouts, unmasked
    rows = read_jsonl(run_dir / "metrics.jsonl")[1:]
    assert all(row["aggregated"] for row in rows)
    assert [row["late"] for row in rows] == [2, 2]
    assert [row["participants"] for row in rows] == [4, 4]


@pytest.mark.parametrize(("overrides", "reason"), [
    ({"secagg-bits": 16}, "secagg-bits = 16 is too small"),
    ({"secagg-clip": 1e6, "clients-per-round": 8},  # 8 x 1e6 / 1e-4 = 8e10 < 2^37: 37 + sign
     "needs 38 bits"),
    ({"clients-per-round": 2}, "at least 3 devices"),
    ({"secagg-bits": 70}, "must be in [8, 64]"),
])
def test_impossible_secure_settings_are_refused_at_start(
    overrides: dict[str, Any], reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Execute
    args = " ".join(f"{k}={v}" for k, v in {"secure-aggregation": "true", **overrides}.items())
    code = main(["simulate", "--quiet", "--fleet", "laptop=10", "--run-config", args,
                 "--run-dir", str(tmp_path / "r")])
    # Assert: refused before anything ran
    assert code == 2 and reason in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("fraction", "neighbours", "expected"), [
    (0.5, 2, 2), (0.5, 3, 2), (0.5, 4, 3), (0.5, 9, 5), (0.5, 14, 8), (1.0, 5, 5), (0.9, 10, 10),
    (0.1, 9, 5), (0.1, 2, 2), (0.3, 10, 6),  # a fraction under one half is raised to the devices' floor
])
def test_a_secret_always_needs_a_majority_and_at_least_two_shares(fraction: float, neighbours: int,
                                                                  expected: int) -> None:
    from fedge.strategies.drivers.secure import shares_needed

    assert shares_needed(fraction, neighbours) == expected
    assert expected >= minimum_threshold(neighbours)  # what devices accept


@pytest.mark.parametrize("bits", [40, 62, 63])
def test_negative_sums_decode_at_any_ring_width(bits: int) -> None:
    codec = FixedPoint(clip=4.0, scale=2.0**10, bits=bits)
    values = np.array([-4.0, -1.5, 0.0, 2.25, 4.0])
    total = ring_add(codec.encode(values), codec.encode(values), bits)
    np.testing.assert_allclose(codec.decode_sum(total, 2), 2 * values)


def _flip_shares(content: RecordDict) -> None:
    revealed = content.config_records["revealed"]
    for name in list(revealed):
        share = bytearray(revealed[name])  # type: ignore[arg-type]
        share[-1] ^= 0xFF
        revealed[name] = bytes(share)


def _flip_signature(content: RecordDict) -> None:
    record = content.config_records["consistency"]
    signature = bytearray(record["signature"])  # type: ignore[arg-type]
    signature[0] ^= 0x01
    record["signature"] = bytes(signature)


@pytest.mark.parametrize(("step", "lie", "aggregated"), [
    ("secagg_unmask", _flip_shares, False),        # a wrong share: caught, the model is kept
    ("secagg_share", lambda c: c.config_records["sealed"].clear(), True),  # no shares: a dropout
    ("secagg_unmask", lambda c: c.config_records["revealed"].clear(), True),  # the others' shares suffice
    ("secagg_consistency", _flip_signature, True),  # a bad signature: it cannot unmask, its input still counts
])
def test_a_device_lying_in_the_protocol_cannot_corrupt_the_model_or_stop_the_run(
    step: str, lie: Any, aggregated: bool, tmp_path: Path
) -> None:
    # Prepare: 6 devices, all pairs (5 neighbours, 3 shares needed), device 2 lies at `step`
    config = resolve_run_config({**BASE, "fleet": "laptop=6", "clients-per-round": 6,
                                 "secure-aggregation": True, "run-dir": str(tmp_path / "r")})
    nodes = [{"partition-id": i, "num-partitions": 6, "profile": "laptop"} for i in range(6)]
    # Execute: a run in which no round aggregated ends failed (nothing signed), after its last round
    with contextlib.nullcontext() if aggregated else pytest.raises(RunFailed, match="no device update was accepted"):
        run_coordinator(InlineGrid(tampered_app(2, step, lie), nodes, config), config, progress=False)
    # Assert: every round either aggregated or kept the model; the run completed; the model is finite
    rows = read_jsonl(tmp_path / "r" / "metrics.jsonl")[1:]
    assert len(rows) == 2 and all(row["aggregated"] == aggregated for row in rows)
    assert rows[-1]["accuracy"] >= 0.05


# --------------------------------------------------------------------------- a coordinator that lies (issue 12)


class Fleet:
    """Devices running fedge's own secure-aggregation handlers, driven message by message by
    the test as the coordinator, honest or not. Each device's update is known (a stub
    trainer returns it), so a test can tell whether the coordinator recovered it."""

    ROUND = 3

    def __init__(self, n: int, *, dim: int = 6, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.nodes = list(range(1, n + 1))
        self.updates = {node: np.round(rng.uniform(-1, 1, dim), 3) for node in self.nodes}
        self.codec = FixedPoint(clip=10.0, scale=2.0**16)
        self.app = ClientApp()
        add_secure_handlers(self.app, self._train)
        self.contexts = {node: Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})
                         for node in self.nodes}
        self.keys: dict[int, ConfigRecord] = {}
        self.sealed: dict[int, ConfigRecord] = {}
        self.received: dict[int, bytes] = {}  # each device's signature over what it was sent for its masked step
        self.metas: dict[int, ConfigRecord] = {}  # the reply meta each masked input carried in plaintext
        self.threshold = 0

    def _train(self, msg: Message, context: Context) -> RecordDict:
        """The device's update times the config's learning rate ``lr`` (1 unless the coordinator says)."""
        rate = float(msg.content.config_records["config"].get("lr", 1.0))  # type: ignore[arg-type]
        node = context.node_id
        return RecordDict({wire.ARRAYS: ArrayRecord({"w": Array(rate * self.updates[node])}),  # global is 0
                           wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: 1}),
                           wire.REPLY_META: ConfigRecord({wire.SERVER_ROUND: self.ROUND, wire.PROFILE: "phone",
                                                          wire.SAMPLES_PROCESSED: 37 * node, wire.STEPS: 3})})

    def send(self, node: int, action: str, **records: ConfigRecord | ArrayRecord) -> RecordDict:
        """Deliver one request to ``node``'s ClientApp; a refusal raises."""
        message = Message(RecordDict(records), dst_node_id=node, message_type=f"train.{action}")  # type: ignore[arg-type]
        return self.app(message, self.contexts[node]).content

    def setup(self) -> None:
        for node in self.nodes:
            config = ConfigRecord({"server-round": self.ROUND})
            self.keys[node] = self.send(node, "secagg_setup", config=config).config_records["keys"]

    def share(self, node: int, threshold: int, neighbours: list[int] | None = None) -> None:
        neighbours = [p for p in self.nodes if p != node] if neighbours is None else neighbours
        peers = ConfigRecord({"server-round": self.ROUND, "threshold": threshold, "neighbours": neighbours})
        for peer in neighbours:
            for kind in ("c-pk", "s-pk", "g-pk"):
                peers[f"{kind}/{peer}"] = self.keys[peer][kind]
        self.sealed[node] = self.send(node, "secagg_share", peers=peers).config_records["sealed"]
        self.threshold = threshold

    def masked(self, node: int, senders: list[int] | None = None, *, lr: float = 1.0) -> np.ndarray:
        """``node``'s masked input, given the sealed shares of ``senders`` (default: all its neighbours),
        trained at learning rate ``lr``."""
        senders = [p for p in self.nodes if p != node] if senders is None else senders
        inbox = ConfigRecord({f"from/{p}": self.sealed[p][f"to/{node}"] for p in senders})
        params = ConfigRecord({"clip": self.codec.clip, "scale": self.codec.scale, "bits": 32, "weight-clip": 10.0,
                               "weight-scale": 2.0**16, "work-clip": 10.0, "work-scale": 2.0**16, "work-cap": 1.0,
                               "work-momentum": -1.0})
        reply = self.send(node, "secagg_masked", arrays=ArrayRecord({"w": Array(np.zeros_like(self.updates[node]))}),
                          config=ConfigRecord({"server-round": self.ROUND, "lr": lr}), inbox=inbox, secagg=params)
        if wire.SECAGG_RECEIVED in reply.config_records:
            self.received[node] = bytes(reply.config_records[wire.SECAGG_RECEIVED]["signature"])  # type: ignore[arg-type]
        self.metas[node] = reply.config_records[wire.REPLY_META]
        return reply.array_records["masked"]["vector"].numpy()

    def consistency(self, node: int, survivors: list[int]) -> bytes:
        """``node``'s signature over ``survivors``, shown its surviving neighbours' signatures over what
        they were sent (as an honest coordinator relays them)."""
        check = ConfigRecord({"survivors": survivors, "server-round": self.ROUND,
                              **{f"received/{p}": self.received[p] for p in survivors
                                 if p != node and p in self.received}})
        return bytes(self.send(node, "secagg_consistency", check=check).config_records["consistency"]["signature"])  # type: ignore[arg-type]

    def unmask(self, node: int, survivors: list[int], signatures: dict[int, bytes]) -> ConfigRecord:
        ask = ConfigRecord({"survivors": survivors, "server-round": self.ROUND,
                            **{f"sig/{p}": sig for p, sig in signatures.items()}})
        return self.send(node, "secagg_unmask", ask=ask).config_records["revealed"]

    def through_masked(self, threshold: int, *, skip_inbox: int | None = None) -> dict[int, np.ndarray]:
        """Setup, share and masked steps for every device (``skip_inbox`` gets no shares at all)."""
        self.setup()
        for node in self.nodes:
            self.share(node, threshold)
        return {node: self.masked(node, [] if node == skip_inbox else None) for node in self.nodes}

    def recover(self, target: int, vector: np.ndarray, revealed: list[ConfigRecord]) -> np.ndarray:
        """What a coordinator holding ``revealed`` learns of ``target``'s input on its own:
        its masked vector less the self mask and the pair masks it can rebuild."""
        b_shares = [bytes(r[f"b/{target}"]) for r in revealed if f"b/{target}" in r]  # type: ignore[arg-type]
        total = ring_add(vector, expand_mask(rebuild_secret(b_shares), len(vector)), 32, subtract=True)
        s_of = {peer: [bytes(r[f"s/{peer}"]) for r in revealed if f"s/{peer}" in r] for peer in self.nodes}  # type: ignore[arg-type]
        s_of[target] = [bytes(r[f"s/{target}"]) for r in revealed if f"s/{target}" in r]  # type: ignore[arg-type]
        for peer in (p for p in self.nodes if p != target):
            if len(s_of[target]) >= self.threshold:  # the target's own mask key: every pair mask
                private, public = rebuild_secret(s_of[target]), bytes(self.keys[peer]["s-pk"])  # type: ignore[arg-type]
            elif len(s_of[peer]) >= self.threshold:
                private, public = rebuild_secret(s_of[peer]), bytes(self.keys[target]["s-pk"])  # type: ignore[arg-type]
            else:
                continue
            seed = derive(X25519PrivateKey.from_private_bytes(private), public, "mask", str(self.ROUND).encode())
            total = ring_add(total, expand_mask(seed, len(total)), 32, subtract=target < peer)
        return self.codec.decode_sum(total[:-2], 1)


def _fork(context: Context) -> Context:
    """A copy of a device's state: a device colluding with the coordinator can act twice."""
    return Context(run_id=context.run_id, node_id=context.node_id, node_config=dict(context.node_config),
                   state=copy.deepcopy(context.state), run_config=dict(context.run_config))


def test_an_honest_coordinator_gets_the_exact_sum_and_nothing_else() -> None:
    # Prepare: 5 devices, all pairs, t = 3; device 5 drops after its masked input, before signing
    fleet = Fleet(5)
    vectors = fleet.through_masked(3)
    survivors = fleet.nodes
    signatures = {node: fleet.consistency(node, survivors) for node in fleet.nodes[:4]}
    # Execute
    revealed = [fleet.unmask(node, survivors, signatures) for node in fleet.nodes[:4]]
    # Assert: each device revealed the self-mask share of every survivor and nothing else; the
    # self masks rebuild, the pair masks cancel, and the sum is exact
    assert all(sorted(r) == sorted(f"b/{p}" for p in survivors if p != node)
               for node, r in zip(fleet.nodes, revealed, strict=False))
    total = np.zeros(len(vectors[1]), np.uint32)
    for vector in vectors.values():
        total = ring_add(total, vector, 32)
    seeds = [rebuild_secret([bytes(r[f"b/{u}"]) for r in revealed if f"b/{u}" in r]) for u in survivors]  # type: ignore[arg-type]
    result = fleet.codec.decode_sum(unmask(total, seeds, [], 32)[:-2], 5)
    np.testing.assert_allclose(result, sum(fleet.updates.values()), atol=5 / 2**16)


def _empty_inbox(fleet: Fleet) -> np.ndarray:
    """Issue 12 (4a): the target gets no shares, so it masks with its self mask only; the
    normal unmask request then makes its neighbours reveal that self mask."""
    vectors = fleet.through_masked(3, skip_inbox=1)
    signatures = {node: fleet.consistency(node, fleet.nodes) for node in fleet.nodes}
    revealed = [fleet.unmask(node, fleet.nodes, signatures) for node in fleet.nodes[1:]]
    return fleet.recover(1, vectors[1], revealed)


def _only_the_target_survived(fleet: Fleet) -> np.ndarray:
    """Issue 12 (4b): every device is told survivors = [target]: they would reveal the target's
    self-mask shares and everyone else's mask-key shares."""
    vectors = fleet.through_masked(3)
    signatures = {}
    for node in fleet.nodes:
        with contextlib.suppress(ProtocolViolation):  # the refusal is asserted below
            signatures[node] = fleet.consistency(node, [1])
    revealed = [fleet.unmask(node, [1], signatures) for node in fleet.nodes[1:]]
    return fleet.recover(1, vectors[1], revealed)


def _inconsistent_dropouts(fleet: Fleet) -> np.ndarray:
    """Inconsistent dropout claims with one colluding device (4 devices, t = 2 of 3): device 3
    is told the target survived (it reveals the target's self-mask share), device 4 that it
    dropped (its mask-key share); colluding device 2 signs and reveals for both stories."""
    vectors = fleet.through_masked(2)
    story_a, story_b = [1, 2, 3, 4], [2, 3, 4]
    twin = _fork(fleet.contexts[2])
    signed_a = {node: fleet.consistency(node, story_a) for node in (1, 2, 3)}
    fleet.contexts[2], spare = twin, fleet.contexts[2]
    signed_b = {node: fleet.consistency(node, story_b) for node in (2, 4)}
    revealed = [fleet.unmask(4, story_b, signed_b), fleet.unmask(2, story_b, signed_b)]
    fleet.contexts[2] = spare
    revealed += [fleet.unmask(3, story_a, signed_a), fleet.unmask(2, story_a, signed_a)]
    return fleet.recover(1, vectors[1], revealed)


@pytest.mark.parametrize(("attack", "devices", "refusal"), [
    (_empty_inbox, 5, "shares from only 0 neighbours reached this device, fewer than the threshold 3"),
    (_only_the_target_survived, 5, "signed no survivor set"),
    (_inconsistent_dropouts, 4, "1 neighbours signed the survivor set this device signed, fewer than the threshold 2"),
])
def test_a_coordinator_that_deviates_cannot_recover_one_devices_update(attack: Any, devices: int,
                                                                       refusal: str) -> None:
    # Prepare: fedge's real device handlers, the coordinator played by the test
    fleet = Fleet(devices)
    # Execute: the attack runs to the end unless an honest device refuses a step
    with pytest.raises(ProtocolViolation, match=refusal):
        recovered = attack(fleet)
        # Assert (reached only if every device played along): the coordinator holds the target's exact update
        pytest.fail(f"the coordinator recovered device 1's update {recovered} (true {fleet.updates[1]})")


@pytest.mark.parametrize(("threshold", "neighbours"), [(1, 4), (2, 4), (1, 2), (1, 3), (3, 6), (5, 4)])
def test_a_device_refuses_a_threshold_below_a_majority_of_its_neighbours(threshold: int, neighbours: int) -> None:
    # Prepare: keys for the device and its neighbours
    fleet = Fleet(neighbours + 1)
    fleet.setup()
    # Execute / Assert: t = 1 (every share is the secret), t <= neighbours / 2, t > neighbours are refused
    with pytest.raises(ProtocolViolation, match=f"threshold {threshold} with {neighbours} neighbours"):
        fleet.share(1, threshold)


@pytest.mark.parametrize(("threshold", "neighbours"), [(2, 2), (2, 3), (3, 4), (3, 5), (4, 6), (6, 6)])
def test_a_device_shares_under_a_majority_threshold(threshold: int, neighbours: int) -> None:
    fleet = Fleet(neighbours + 1)
    fleet.setup()
    fleet.share(1, threshold)
    assert len(fleet.sealed[1]) == neighbours


@pytest.mark.parametrize(("survivors", "senders", "refusal"), [
    ([2, 3, 4, 5], None, "this device sent its masked input but is not in it"),
    ([1, 2], None, "it holds 1 of this device's neighbours, fewer than the threshold 3"),
    ([1, 2, 3, 4, 5], [2, 3, 4], "it names neighbour 5, whose shares never reached this device"),
])
def test_a_device_refuses_to_sign_a_survivor_set_that_contradicts_what_it_saw(
    survivors: list[int], senders: list[int] | None, refusal: str
) -> None:
    # Prepare: device 1 masked with the shares of `senders` (t = 3 of 4)
    fleet = Fleet(5)
    fleet.setup()
    for node in fleet.nodes:
        fleet.share(node, 3)
    fleet.masked(1, senders)
    # Execute / Assert: no signature, and then no unmasking either
    with pytest.raises(ProtocolViolation, match=refusal):
        fleet.consistency(1, survivors)
    with pytest.raises(ProtocolViolation, match="signed no survivor set"):
        fleet.unmask(1, survivors, {})


def _signed_by(fleet: Fleet, survivors: list[int]) -> dict[int, bytes]:
    """Every survivor's signature over ``survivors``."""
    return {node: fleet.consistency(node, survivors) for node in survivors}


@pytest.mark.parametrize(("ask", "signatures", "refusal"), [
    ([1, 2, 3, 4], lambda fleet: _signed_by(fleet, [1, 2, 3, 4, 5]), "not the one this device signed"),
    ([1, 2, 3, 4, 5], lambda fleet: {}, "0 neighbours signed"),
    ([1, 2, 3, 4, 5], lambda fleet: {p: s for p, s in _signed_by(fleet, [1, 2, 3, 4, 5]).items() if p < 4},
     "2 neighbours signed"),
    ([1, 2, 3, 4, 5], lambda fleet: {p: bytes(64) for p in fleet.nodes}, "0 neighbours signed"),
    ([1, 2, 3, 4, 5], lambda fleet: dict.fromkeys(fleet.nodes, fleet.consistency(1, [1, 2, 3, 4, 5])),  # 1's own
     "0 neighbours signed"),
])
def test_a_device_unmasks_only_with_t_neighbours_signatures_over_the_set_it_signed(
    ask: list[int], signatures: Any, refusal: str
) -> None:
    # Prepare: 5 devices through their masked inputs (t = 3); device 1's signature comes from a copy of
    # it, so that device 1 itself can still be asked to unmask
    fleet = Fleet(5)
    fleet.through_masked(3)
    original = fleet.contexts[1]
    fleet.contexts[1] = _fork(original)
    collected = signatures(fleet)
    fleet.contexts[1] = original
    fleet.consistency(1, [1, 2, 3, 4, 5])
    # Execute / Assert
    with pytest.raises(ProtocolViolation, match=refusal):
        fleet.unmask(1, ask, collected)


def test_a_device_reveals_one_share_per_neighbour_chosen_from_the_set_it_signed() -> None:
    # Prepare: 5 devices through their masked inputs (t = 3); the coordinator says device 5 dropped
    # (its masked input came late) and adds a `dropped` list naming everyone, which devices ignore
    fleet = Fleet(5)
    fleet.through_masked(3)
    signatures = _signed_by(fleet, [1, 2, 3, 4])
    ask = ConfigRecord({"survivors": [1, 2, 3, 4], "dropped": [1, 2, 3, 4, 5], "server-round": Fleet.ROUND,
                        **{f"sig/{p}": sig for p, sig in signatures.items()}})
    # Execute
    revealed = fleet.send(1, "secagg_unmask", ask=ask).config_records["revealed"]
    # Assert: the self-mask share of each survivor, the mask-key share of device 5; never both for one peer
    assert sorted(revealed) == ["b/2", "b/3", "b/4", "s/5"]


def test_a_device_signs_once_and_unmasks_once_a_round() -> None:
    # Prepare: an honest round up to the signatures
    fleet = Fleet(4)
    fleet.through_masked(2)
    signatures = _signed_by(fleet, [1, 2, 3, 4])
    # Execute / Assert: a second survivor set is not signed; after unmasking, the secrets are gone
    with pytest.raises(ValueError, match="replayed or reordered"):
        fleet.consistency(1, [1, 2, 3])
    fleet.unmask(1, [1, 2, 3, 4], signatures)
    with pytest.raises(ValueError, match="no secure-aggregation round in progress"):
        fleet.unmask(1, [1, 2, 3], signatures)


@pytest.mark.parametrize("relay", [
    lambda sealed: sealed[:-1] + bytes([sealed[-1] ^ 1]),   # altered in transit
    lambda sealed: b"\x00" * len(sealed),                    # made up
    lambda sealed: sealed[:5],                               # cut (shorter than a nonce)
])
def test_a_device_names_the_sender_of_a_share_that_does_not_open_and_masks_nothing(relay: Any) -> None:
    # Prepare: 5 devices, t = 3; device 2's share for device 1 is altered, so device 1 would pair
    # masks with (and later vouch for) a peer whose share it never really got
    fleet = Fleet(5)
    fleet.setup()
    for node in fleet.nodes:
        fleet.share(node, 3)
    fleet.sealed[2] = ConfigRecord({**fleet.sealed[2], "to/1": relay(bytes(fleet.sealed[2]["to/1"]))})  # type: ignore[arg-type]
    inbox = ConfigRecord({f"from/{p}": fleet.sealed[p]["to/1"] for p in (2, 3, 4, 5)})
    # Execute
    reply = fleet.send(1, "secagg_masked", arrays=ArrayRecord({"w": Array(np.zeros(6))}),
                       config=ConfigRecord({"server-round": Fleet.ROUND}), inbox=inbox, secagg=ConfigRecord())
    # Assert: it names neighbour 2, sends no masked input, and this round's secrets are gone
    assert reply.config_records[wire.SECAGG_BAD_SHARES]["senders"] == [2] and "masked" not in reply
    with pytest.raises(ProtocolViolation, match="no secure-aggregation round in progress"):
        fleet.consistency(1, fleet.nodes)
