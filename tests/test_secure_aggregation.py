"""Secure aggregation end to end in simulation: same model as plaintext FedAvg, dropouts survived."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from flwr.app import RecordDict

from fedge.cli.main import main
from fedge.config import resolve_run_config
from fedge.secagg import public_bytes
from fedge.server.app import run_coordinator
from fedge.server.checkpoint import load_checkpoint
from fedge.server.report import read_jsonl
from fedge.simulation.grid import FIRST_NODE_ID, InlineGrid
from fedge.simulation.runner import simulate
from fedge.strategies.validation import Rejection
from replies import capture_strategies, drop_out, tampered_app, tampered_apps

BASE = {"fleet": "phone=6,laptop=3,gpu-box=1", "clients-per-round": 6, "num-rounds": 3, "model": "mlp",
        "local-epochs": 2, "export-onnx": False}


def _final(run_dir: Path) -> dict[str, np.ndarray]:
    return load_checkpoint(run_dir / "checkpoint.npz").arrays


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox", "fednova", "fedavgm", "fedadam"])
def test_secure_rounds_give_the_plaintext_model(strategy: str, tmp_path: Path) -> None:
    # Prepare: FedProx keeps stragglers' partial work; FedNova normalises unequal local steps (data sizes differ);
    # FedAvgM and FedAdam step from the unmasked mean (the secure driver composed with their rules).
    # FedNova multiplies the mean by tau_eff (~30 here), and the quantisation error with it: finer precision
    tight = {"secagg-clip": 10.0, "secagg-precision": 1e-6, "max-num-examples": 1000} if strategy == "fednova" else {}
    base = {**BASE, "strategy": strategy, "straggler-fraction": 0.5 if strategy == "fedprox" else 0.0, **tight}
    # Execute: the same run with and without secure aggregation
    plain, _ = simulate({**base, "run-dir": str(tmp_path / "plain")}, progress=False)
    secure, summary = simulate({**base, "secure-aggregation": True, "run-dir": str(tmp_path / "secure")},
                               progress=False)
    # Assert: equal up to fixed-point rounding; every round aggregated 6 devices
    for name, value in _final(plain).items():
        np.testing.assert_allclose(_final(secure)[name], value, atol=1e-4)
    rows = read_jsonl(secure / "metrics.jsonl")
    assert all(r["participants"] == 6 and r["aggregated"] for r in rows[1:])
    assert summary["final_accuracy"] == pytest.approx(read_jsonl(plain / "metrics.jsonl")[-1]["accuracy"], abs=0.01)


@pytest.mark.parametrize("step", ["secagg_setup", "secagg_share", "secagg_masked", "secagg_consistency",
                                  "secagg_unmask"])
def test_a_dropout_at_any_step_leaves_the_plaintext_mean_of_the_rest(step: str, tmp_path: Path) -> None:
    # Prepare: all 10 devices every round; partition 3 fails at `step` (secure) or at training (plain)
    config = {**BASE, "fleet": "laptop=10", "clients-per-round": 10, "num-rounds": 2}
    nodes = [{"partition-id": i, "num-partitions": 10, "profile": "laptop"} for i in range(10)]
    secure_config = resolve_run_config({**config, "secure-aggregation": True, "run-dir": str(tmp_path / "s")})
    plain_config = resolve_run_config({**config, "run-dir": str(tmp_path / "p")})
    # Execute
    secure = run_coordinator(InlineGrid(tampered_app(3, step, drop_out), nodes, secure_config), secure_config,
                             progress=False)
    plain = run_coordinator(InlineGrid(tampered_app(3, "train", drop_out), nodes, plain_config), plain_config,
                            progress=False)
    # Assert: a device that dropped before its masked input is left out, like a failed plaintext device;
    # one that dropped after it (consistency check or unmask) is in the sum (its self mask is rebuilt)
    in_sum = step in ("secagg_consistency", "secagg_unmask")
    expected = _final(plain) if not in_sum else _final(simulate(
        {**config, "run-dir": str(tmp_path / "all")}, progress=False)[0])
    for name, value in expected.items():
        np.testing.assert_allclose(_final(secure)[name], value, atol=1e-4)
    assert all(r["aggregated"] for r in read_jsonl(secure / "metrics.jsonl")[1:])


ORDER_8 = bytes.fromhex("26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05")  # an Ed25519 torsion point


@pytest.fixture(scope="module")
def plain_without_partition_3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """The plaintext FedAvg model of 5 laptops of which partition 3 fails: the aggregate of the other 4."""
    config = resolve_run_config({**BASE, "fleet": "laptop=5", "clients-per-round": 5, "num-rounds": 1,
                                 "run-dir": str(tmp_path_factory.mktemp("plain") / "r")})
    nodes = [{"partition-id": i, "num-partitions": 5, "profile": "laptop"} for i in range(5)]
    return _final(run_coordinator(InlineGrid(tampered_app(3, "train", drop_out), nodes, config), config,
                                  progress=False))


@pytest.mark.parametrize(("key", "value", "reason"), [
    ("c-pk", bytes(32), "c-pk is of small order"),
    ("s-pk", bytes(32), "s-pk is of small order"),
    ("s-pk", (1).to_bytes(32, "little"), "s-pk is of small order"),
    ("g-pk", bytes(32), "g-pk is of small order"),
    ("g-pk", ORDER_8, "g-pk is of small order"),
    ("g-pk", (2**255 - 19 + 1).to_bytes(32, "little"), "g-pk does not encode a curve point"),
    ("s-pk", b"short", "s-pk is not 32 bytes"),
], ids=["c-pk-zero", "s-pk-zero", "s-pk-one", "g-pk-zero", "g-pk-order-8", "g-pk-off-curve", "s-pk-short"])
def test_a_device_sending_a_small_order_key_is_named_and_the_round_goes_on_without_it(
    key: str, value: bytes, reason: str, plain_without_partition_3: dict[str, np.ndarray], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: 5 devices; partition 3 sends `value` as its public key `key` in the setup step
    # (an all-zero X25519 key passed the old 32-byte check, and every honest device then failed)
    strategies = capture_strategies(monkeypatch)
    config = resolve_run_config({**BASE, "fleet": "laptop=5", "clients-per-round": 5, "num-rounds": 1,
                                 "secure-aggregation": True, "run-dir": str(tmp_path / "r")})
    nodes = [{"partition-id": i, "num-partitions": 5, "profile": "laptop"} for i in range(5)]

    def lie(content: RecordDict) -> None:
        content.config_records["keys"][key] = value

    # Execute
    run_dir = run_coordinator(InlineGrid(tampered_app(3, "secagg_setup", lie), nodes, config), config, progress=False)
    # Assert: the round aggregated the other 4 (the plaintext model without partition 3); the
    # device that sent the key, and only it, is named in the round's failures and in the log
    row = read_jsonl(run_dir / "metrics.jsonl")[-1]
    assert row["aggregated"] and row["failed"] == 1
    for name, expected in plain_without_partition_3.items():
        np.testing.assert_allclose(_final(run_dir)[name], expected, atol=1e-4)
    bad = FIRST_NODE_ID + 3
    [failure] = strategies[0].reports[0].failed
    assert isinstance(failure, Rejection) and failure.node_id == bad
    assert failure.reason.startswith(f"secagg_setup: invalid public key: {reason}")
    assert any(f"device {bad} sent an invalid public key" in r.getMessage() for r in caplog.records)


def test_devices_that_send_the_same_public_key_are_named_and_left_out(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: 5 devices; partitions 2 and 3 send one and the same (valid) mask key, as a device that
    # copied another's would: honest devices refuse neighbours with equal keys
    strategies = capture_strategies(monkeypatch)
    copied = public_bytes(X25519PrivateKey.generate())

    def copy_key(content: RecordDict) -> None:
        content.config_records["keys"]["s-pk"] = copied

    config = resolve_run_config({**BASE, "fleet": "laptop=5", "clients-per-round": 5, "num-rounds": 1,
                                 "secure-aggregation": True, "run-dir": str(tmp_path / "r")})
    nodes = [{"partition-id": i, "num-partitions": 5, "profile": "laptop"} for i in range(5)]
    app = tampered_apps({(2, "secagg_setup"): copy_key, (3, "secagg_setup"): copy_key})
    # Execute
    run_dir = run_coordinator(InlineGrid(app, nodes, config), config, progress=False)
    # Assert: the round aggregated the other 3; both senders are named, each with the other
    assert read_jsonl(run_dir / "metrics.jsonl")[-1]["aggregated"]
    failures = {(f.node_id, f.reason) for f in strategies[0].reports[0].failed}
    assert failures == {(FIRST_NODE_ID + 2, f"secagg_setup: a public key also sent by device {FIRST_NODE_ID + 3}"),
                        (FIRST_NODE_ID + 3, f"secagg_setup: a public key also sent by device {FIRST_NODE_ID + 2}")}


@pytest.mark.parametrize(("strategy", "reason"), [
    ("median", "not strategy 'median': it needs each update, which secure aggregation hides; run it over the "
               "means of secure groups: secure-groups = K"),
    ("krum", "not strategy 'krum': it needs each update, which secure aggregation hides; run it over the "
             "means of secure groups: secure-groups = K"),
    ("trimmed-mean", "not strategy 'trimmed-mean': it needs each update, which secure aggregation hides; run it "
                     "over the means of secure groups: secure-groups = K"),
    ("qfedavg", "FairStep: its step is not one on the updates' weighted mean"),
    ("fedbuff", "FedBuff is asynchronous"),
])
def test_secure_aggregation_refuses_rules_that_are_not_linear(
    strategy: str, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["simulate", "--quiet", "--fleet", "laptop=4", "--clients-per-round", "4", "--strategy", strategy,
                 "--run-config", "secure-aggregation=true", "--run-dir", str(tmp_path / "r")])
    assert code == 2 and reason in capsys.readouterr().err
