"""Secure aggregation under attack (issue 23, findings 2 and 8), each attack replayed.

Finding 2, the model-inconsistency attack (Pasquini et al., CCS 2022): a coordinator that
runs every protocol step honestly but sends every device except a target a zero-update
config (a vanishing learning rate) or another model; the masked sum is then the target's
update alone, and its weight was readable from the plaintext ``samples-processed``. Now each
device signs the digests of the model and config it was sent, and signs the survivor set
only if every surviving neighbour signed the same digests: no unmasking, the round keeps the
model; masked replies carry no samples processed or steps.

Finding 8, malformed Shamir shares from one device (flipped, truncated, empty, swapped
between two recipients) made every honest recipient refuse the masked step, so every secure
round failed. Now each recipient names the sender, the coordinator leaves the sender out and
runs the protocol again with the rest: the round aggregates the honest devices.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from test_secure_protocol import Fleet

from fedge import wire
from fedge.clients.app import make_default_client_app
from fedge.config import resolve_run_config
from fedge.errors import RunFailed
from fedge.secagg import ProtocolViolation, rebuild_secret, ring_add, unmask
from fedge.server.app import run_coordinator
from fedge.server.checkpoint import load_checkpoint
from fedge.server.report import read_jsonl
from fedge.simulation.grid import FIRST_NODE_ID, InlineGrid
from fedge.simulation.runner import simulate
from fedge.strategies.rounds import Rounds
from replies import drop_out, tampered_app

TARGET = 1
BASE = {"fleet": "laptop=6", "clients-per-round": 6, "num-rounds": 1, "model": "mlp", "local-epochs": 1,
        "export-onnx": False}
NODES = [{"partition-id": i, "num-partitions": 6, "profile": "laptop"} for i in range(6)]


# --------------------------------------------------------------------------- finding 2: model inconsistency


def _isolate_the_target(fleet: Fleet) -> np.ndarray:
    """The attack, with fedge's own device handlers: every step honest, except that every device
    but the target trains at learning rate 0; the coordinator then unmasks the sum as usual."""
    fleet.setup()
    for node in fleet.nodes:
        fleet.share(node, 3)
    vectors = {node: fleet.masked(node, lr=1.0 if node == TARGET else 0.0) for node in fleet.nodes}
    signatures = {node: fleet.consistency(node, fleet.nodes) for node in reversed(fleet.nodes)}  # the target last
    revealed = [fleet.unmask(node, fleet.nodes, signatures) for node in fleet.nodes]
    total = np.zeros(len(vectors[TARGET]), np.uint32)
    for vector in vectors.values():
        total = ring_add(total, vector, 32)
    seeds = [rebuild_secret([bytes(r[f"b/{u}"]) for r in revealed if f"b/{u}" in r]) for u in fleet.nodes]  # type: ignore[arg-type]
    return fleet.codec.decode_sum(unmask(total, seeds, [], 32)[:-2], len(fleet.nodes))


def test_a_coordinator_sending_the_others_a_zero_update_config_cannot_isolate_one_update() -> None:
    # Prepare: 6 devices, all pairs, t = 3; fedge's real handlers, the coordinator played by the test
    fleet = Fleet(6)
    # Execute / Assert: the target's neighbours refuse to sign the survivor set (before: the sum
    # unmasked to the target's update alone, to the fixed-point step)
    with pytest.raises(ProtocolViolation, match=f"neighbour {TARGET} did not sign the global model and training"):
        recovered = _isolate_the_target(fleet)
        pytest.fail(f"the coordinator recovered device {TARGET}'s update {recovered} (true {fleet.updates[TARGET]}, "
                    f"error {np.abs(recovered - fleet.updates[TARGET]).max():.1e})")


def test_a_device_sent_another_global_model_gets_no_signature_from_its_neighbours() -> None:
    # Prepare: 4 devices (t = 2 of 3); the target is sent another global model than the other three
    fleet = Fleet(4)
    fleet.setup()
    for node in fleet.nodes:
        fleet.share(node, 2)
    for node in fleet.nodes[1:]:  # the model Fleet.masked sends: all zeros
        fleet.masked(node)
    inbox = ConfigRecord({f"from/{p}": fleet.sealed[p][f"to/{TARGET}"] for p in fleet.nodes[1:]})
    params = ConfigRecord({"clip": 10.0, "scale": 2.0**16, "bits": 32, "weight-clip": 10.0, "weight-scale": 2.0**16,
                           "work-clip": 10.0, "work-scale": 2.0**16, "work-cap": 1.0, "work-momentum": -1.0})
    other = ArrayRecord({"w": Array(np.full(6, 0.5))})
    reply = fleet.send(TARGET, "secagg_masked", arrays=other, config=ConfigRecord({"server-round": Fleet.ROUND}),
                       inbox=inbox, secagg=params)
    fleet.received[TARGET] = bytes(reply.config_records[wire.SECAGG_RECEIVED]["signature"])  # type: ignore[arg-type]
    # Execute / Assert: each of the others refuses to sign, naming the target; the target refuses too
    for node in fleet.nodes:
        named = fleet.nodes[1] if node == TARGET else TARGET
        with pytest.raises(ProtocolViolation, match=f"neighbour {named} did not sign the global model"):
            fleet.consistency(node, fleet.nodes)


def test_a_masked_input_carries_no_plaintext_weight() -> None:
    # Prepare: the stub trainer reports samples-processed and steps in its reply meta
    fleet = Fleet(4)
    fleet.setup()
    for node in fleet.nodes:
        fleet.share(node, 2)
    # Execute
    for node in fleet.nodes:
        fleet.masked(node)
    # Assert: the meta that travels in plaintext keeps the round and profile only (the weight is in the
    # masked vector's tail; before, samples-processed gave each device's weight away)
    assert all(dict(meta) == {wire.SERVER_ROUND: Fleet.ROUND, wire.PROFILE: "phone"} for meta in fleet.metas.values())


def _unmasked_sum(fleet: Fleet, nodes: list[int], threshold: int) -> np.ndarray:
    """One honest run of the protocol among ``nodes`` (all pairs): the decoded sum of their updates."""
    fleet.setup()
    for node in nodes:
        fleet.share(node, threshold, [p for p in nodes if p != node])
    vectors = {node: fleet.masked(node, [p for p in nodes if p != node]) for node in nodes}
    signatures = {node: fleet.consistency(node, nodes) for node in nodes}
    revealed = [fleet.unmask(node, nodes, signatures) for node in nodes]
    total = np.zeros(len(vectors[nodes[0]]), np.uint32)
    for vector in vectors.values():
        total = ring_add(total, vector, 32)
    seeds = [rebuild_secret([bytes(r[f"b/{u}"]) for r in revealed if f"b/{u}" in r]) for u in nodes]  # type: ignore[arg-type]
    return fleet.codec.decode_sum(unmask(total, seeds, [], 32)[:-2], len(nodes))


def test_a_coordinator_cannot_run_a_round_twice_and_subtract_the_sums() -> None:
    # Prepare: 5 devices unmask an honest sum (t = 3); the coordinator then starts the same round again
    # without device 5 (the devices would train the same updates again)
    fleet = Fleet(5)
    everyone = _unmasked_sum(fleet, fleet.nodes, 3)
    # Execute / Assert: the devices refuse the second setup (before: the second sum, subtracted from the
    # first, gave device 5's update)
    with pytest.raises(ProtocolViolation, match="this device already unmasked in round 3"):
        recovered = everyone - _unmasked_sum(fleet, fleet.nodes[:-1], 2)
        pytest.fail(f"the coordinator recovered device 5's update {recovered} (true {fleet.updates[5]})")


class MetaRecordingGrid(InlineGrid):
    """fedge's inline grid, keeping the plaintext reply meta of every masked input."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.metas: list[dict[str, Any]] = []

    def pull_messages(self, message_ids: Any) -> Any:
        replies = list(super().pull_messages(message_ids))
        self.metas += [dict(reply.content.config_records[wire.REPLY_META]) for reply in replies
                       if not reply.has_error() and "masked" in reply.content.array_records]
        return replies


def test_a_round_where_the_coordinator_isolates_one_device_yields_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: 6 laptops; the coordinator, changed by an attacker, gives every device but the first a
    # vanishing learning rate in its train instruction (which the masked step carries); every other
    # protocol message is as fedge makes it
    config = resolve_run_config({**BASE, "secure-aggregation": True, "run-dir": str(tmp_path / "r")})
    honest = Rounds.instruction

    def isolate(self: Rounds, node: int, record: RecordDict, config: ConfigRecord, server_round: int,
                grid: Any) -> RecordDict:
        content = honest(self, node, record, config, server_round, grid)
        if node == FIRST_NODE_ID:
            return content
        return RecordDict({wire.ARRAYS: content[wire.ARRAYS],
                           wire.CONFIG: ConfigRecord({**content[wire.CONFIG], "learning-rate": 1e-12})})

    monkeypatch.setattr(Rounds, "instruction", isolate)
    grid = MetaRecordingGrid(make_default_client_app(), NODES, config)
    # Execute
    with caplog.at_level(logging.WARNING), pytest.raises(RunFailed, match="no device update was accepted"):
        run_coordinator(grid, config, progress=False)
    # Assert: the round kept the global model (before: it applied the first device's update alone); the
    # log says why; no masked reply carried samples processed or steps in plaintext; nothing was published
    rows = read_jsonl(Path(config.text("run-dir")) / "metrics.jsonl")
    assert [row["aggregated"] for row in rows[1:]] == [False]
    assert "did not sign the global model and training config this device received" in caplog.text
    assert len(grid.metas) == 6
    assert all(wire.SAMPLES_PROCESSED not in meta and wire.STEPS not in meta for meta in grid.metas)


# --------------------------------------------------------------------------- finding 8: malformed shares


def _flip(sealed: ConfigRecord) -> None:
    for name in list(sealed):
        share = bytearray(sealed[name])  # type: ignore[arg-type]
        share[20] ^= 0x01
        sealed[name] = bytes(share)


def _truncate(sealed: ConfigRecord) -> None:
    for name in list(sealed):
        sealed[name] = bytes(sealed[name])[:-7]  # type: ignore[arg-type]


def _empty(sealed: ConfigRecord) -> None:
    for name in list(sealed):
        sealed[name] = b""


def _swap(sealed: ConfigRecord) -> None:
    first, second = sorted(sealed)[:2]
    sealed[first], sealed[second] = sealed[second], sealed[first]


@pytest.fixture(scope="module")
def honest_five(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """The plaintext FedAvg model of the 6 laptops of which partition 3 fails: the aggregate of the other 5."""
    config = resolve_run_config({**BASE, "run-dir": str(tmp_path_factory.mktemp("plain") / "r")})
    return load_checkpoint(run_coordinator(InlineGrid(tampered_app(3, "train", drop_out), NODES, config), config,
                                           progress=False) / "checkpoint.npz").arrays


@pytest.mark.parametrize("malform", [_flip, _truncate, _empty, _swap], ids=["flipped", "truncated", "empty", "swapped"])
def test_malformed_shares_from_one_device_leave_it_out_and_the_round_completes(
    malform: Any, honest_five: dict[str, np.ndarray], tmp_path: Path
) -> None:
    # Prepare: 6 laptops, all pairs (t = 3 of 5); partition 3 malforms the shares it seals
    config = resolve_run_config({**BASE, "secure-aggregation": True, "run-dir": str(tmp_path / "r")})

    def lie(content: RecordDict) -> None:
        malform(content.config_records["sealed"])

    # Execute
    run_dir = run_coordinator(InlineGrid(tampered_app(3, "secagg_share", lie), NODES, config), config,
                              progress=False)
    # Assert: the round aggregated the 5 honest devices (their plaintext FedAvg model, to the fixed-point
    # step) and named partition 3's shares as the reason it was left out (before: 5 of 6 devices refused
    # the masked step and the round kept the model)
    _assert_only_partition_3_left_out(run_dir, honest_five, "the share it sealed for device")


def test_a_device_naming_every_neighbour_as_a_bad_sender_is_left_out_itself(
    honest_five: dict[str, np.ndarray], tmp_path: Path
) -> None:
    # Prepare: 6 laptops (t = 3 of 5); partition 3 gets good shares but reports all 5 neighbours'
    # as bad, to have the honest devices thrown out of the round
    config = resolve_run_config({**BASE, "secure-aggregation": True, "run-dir": str(tmp_path / "r")})
    honest = [FIRST_NODE_ID + i for i in range(6) if i != 3]

    def frame(content: RecordDict) -> None:
        content.clear()
        content.config_records[wire.SECAGG_BAD_SHARES] = ConfigRecord({"senders": honest})

    # Execute
    run_dir = run_coordinator(InlineGrid(tampered_app(3, "secagg_masked", frame), NODES, config), config,
                              progress=False)
    # Assert: more than k - t = 2 neighbours named: partition 3 is the one left out; the round is the
    # honest devices' plaintext aggregate
    _assert_only_partition_3_left_out(run_dir, honest_five, "more than 2 (an honest majority allows)")


def test_the_virtual_clock_still_charges_training_in_secure_rounds(tmp_path: Path) -> None:
    # Prepare: the same round of 6 phones with and without secure aggregation (masked replies no longer
    # say how many samples a device processed; the simulated device notes it in its own state)
    base = {**BASE, "fleet": "phone=6"}
    # Execute
    plain, _ = simulate({**base, "run-dir": str(tmp_path / "plain")}, progress=False)
    secure, _ = simulate({**base, "secure-aggregation": True, "run-dir": str(tmp_path / "secure")}, progress=False)
    # Assert: training dominates a phone's round either way (the protocol's extra bytes add a little)
    plain_s = read_jsonl(plain / "metrics.jsonl")[-1]["sim_time_s"]
    secure_s = read_jsonl(secure / "metrics.jsonl")[-1]["sim_time_s"]
    assert plain_s <= secure_s < 1.1 * plain_s


def _assert_only_partition_3_left_out(run_dir: Path, honest_five: dict[str, np.ndarray], reason: str) -> None:
    """The round aggregated, left out partition 3 alone for ``reason``, and equals the honest five's
    plaintext FedAvg model (to the fixed-point step)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[1]["aggregated"]
    assert [rejection["node_id"] for rejection in rows[1]["rejections"]] == [FIRST_NODE_ID + 3]
    assert reason in rows[1]["rejections"][0]["reason"]
    secure = load_checkpoint(run_dir / "checkpoint.npz").arrays
    for name, value in honest_five.items():
        np.testing.assert_allclose(secure[name], value, atol=1e-4)
