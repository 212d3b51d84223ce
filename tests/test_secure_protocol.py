"""Secure aggregation: the protocol's guarantees (exactness, privacy of inputs, replay) and bad settings."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from flwr.app import ConfigRecord, Context, Message, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from fedge.cli.main import main
from fedge.clients.app import make_default_client_app
from fedge.clients.secure import STATE
from fedge.config import resolve_run_config
from fedge.secagg import (
    FixedPoint,
    derive,
    masked_input,
    neighbour_graph,
    public_bytes,
    ring_add,
    ring_dtype,
    unmask,
)
from fedge.server.app import run_coordinator
from fedge.server.report import read_jsonl
from fedge.simulation.grid import InlineGrid
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


# --------------------------------------------------------------------------- over the message API


class RecordingGrid(InlineGrid):
    """fedge's inline grid, keeping the bytes of every message the coordinator sent or received."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[bytes] = []
        self.device_secrets: list[bytes] = []

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
        messages = list(messages)
        replies = list(super().send_and_receive(messages, timeout=timeout))
        for message in messages + replies:
            if not message.has_error():
                self.seen.append(_all_bytes(message.content))
        for context in self.contexts.values():
            state = context.state.config_records.get(STATE)
            if state is not None:
                self.device_secrets += [bytes(state[k]) for k in ("c-sk", "s-sk", "b") if k in state]  # type: ignore[arg-type]
        return replies


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


def _share(round_: int, peer_keys: dict[int, bytes]) -> Message:
    record = ConfigRecord({"server-round": round_, "threshold": 1, "neighbours": sorted(peer_keys)})
    for peer, key in peer_keys.items():
        record[f"c-pk/{peer}"], record[f"s-pk/{peer}"] = key, key
    return Message(RecordDict({"peers": record}), dst_node_id=7, message_type="train.secagg_share")


@pytest.mark.parametrize("replayed", ["share-from-another-round", "unmask-before-masked", "setup-replayed-share"])
def test_a_replayed_or_reordered_step_is_refused(replayed: str) -> None:
    # Prepare: a device that went through setup of round 2
    app, context = _device()
    peers = {8: public_bytes(X25519PrivateKey.generate()), 9: public_bytes(X25519PrivateKey.generate())}
    assert not app(_setup(2), context).has_error()
    # Execute: a message that belongs to another round or to a later step
    if replayed == "share-from-another-round":
        message = _share(1, peers)
    elif replayed == "unmask-before-masked":
        ask = ConfigRecord({"survivors": [8], "dropped": [0], "server-round": 2})
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
    (0.5, 2, 2), (0.5, 3, 2), (0.5, 4, 3), (0.5, 9, 5), (0.5, 14, 8), (0.1, 9, 2), (1.0, 5, 5), (0.9, 10, 10),
])
def test_a_secret_always_needs_a_majority_and_at_least_two_shares(fraction: float, neighbours: int,
                                                                  expected: int) -> None:
    from fedge.server.secure import shares_needed

    assert shares_needed(fraction, neighbours) == expected


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


@pytest.mark.parametrize(("step", "lie", "aggregated"), [
    ("secagg_unmask", _flip_shares, False),        # a wrong share: caught, the model is kept
    ("secagg_share", lambda c: c.config_records["sealed"].clear(), True),  # no shares: a dropout
    ("secagg_unmask", lambda c: c.config_records["revealed"].clear(), True),  # the others' shares suffice
])
def test_a_device_lying_in_the_protocol_cannot_corrupt_the_model_or_stop_the_run(
    step: str, lie: Any, aggregated: bool, tmp_path: Path
) -> None:
    # Prepare: 6 devices, all pairs (5 neighbours, 3 shares needed), device 2 lies at `step`
    config = resolve_run_config({**BASE, "fleet": "laptop=6", "clients-per-round": 6,
                                 "secure-aggregation": True, "run-dir": str(tmp_path / "r")})
    nodes = [{"partition-id": i, "num-partitions": 6, "profile": "laptop"} for i in range(6)]
    # Execute
    run_coordinator(InlineGrid(tampered_app(2, step, lie), nodes, config), config, progress=False)
    # Assert: every round either aggregated or kept the model; the run completed; the model is finite
    rows = read_jsonl(tmp_path / "r" / "metrics.jsonl")[1:]
    assert len(rows) == 2 and all(row["aggregated"] == aggregated for row in rows)
    assert rows[-1]["accuracy"] >= 0.05
