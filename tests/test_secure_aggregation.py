"""Secure aggregation end to end in simulation: same model as plaintext FedAvg, dropouts survived."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedge.cli.main import main
from fedge.clients.app import make_default_client_app
from fedge.config import resolve_run_config
from fedge.server.app import run_coordinator
from fedge.server.checkpoint import load_checkpoint
from fedge.server.report import read_jsonl
from fedge.simulation.grid import InlineGrid
from fedge.simulation.runner import simulate
from replies import drop_out, tampered_app

BASE = {"fleet": "phone=6,laptop=3,gpu-box=1", "clients-per-round": 6, "num-rounds": 3, "model": "mlp",
        "local-epochs": 2, "export-onnx": False}


def _final(run_dir: Path) -> dict[str, np.ndarray]:
    return load_checkpoint(run_dir / "checkpoint.npz").arrays


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox", "fednova"])
def test_secure_rounds_give_the_plaintext_model(strategy: str, tmp_path: Path) -> None:
    # Prepare: FedProx keeps stragglers' partial work; FedNova normalises unequal local steps (data sizes differ)
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


@pytest.mark.parametrize("step", ["secagg_setup", "secagg_share", "secagg_masked", "secagg_unmask"])
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
    # one that dropped only at the unmask step is already in the sum (its shares are not needed)
    expected = _final(plain) if step != "secagg_unmask" else _final(simulate(
        {**config, "run-dir": str(tmp_path / "all")}, progress=False)[0])
    for name, value in expected.items():
        np.testing.assert_allclose(_final(secure)[name], value, atol=1e-4)
    assert all(r["aggregated"] for r in read_jsonl(secure / "metrics.jsonl")[1:])


def test_device_refuses_to_reveal_both_shares_of_a_peer() -> None:
    from fedge.clients.secure import STATE

    app = make_default_client_app()
    context = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    context.state[STATE] = ConfigRecord({"round": 1, "stage": "secagg_masked", "neighbours": [6],
                                         "c-sk": b"\x01" * 32})
    ask = ConfigRecord({"survivors": [6], "dropped": [6], "server-round": 1})
    message = Message(RecordDict({"ask": ask}), dst_node_id=5, message_type="train.secagg_unmask")
    with pytest.raises(ValueError, match="safety rule"):
        app(message, context)


@pytest.mark.parametrize("strategy", ["median", "krum", "trimmed-mean", "fedbuff"])
def test_secure_aggregation_refuses_strategies_that_need_individual_updates(
    strategy: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["simulate", "--quiet", "--fleet", "laptop=4", "--clients-per-round", "4", "--strategy", strategy,
                 "--run-config", "secure-aggregation=true", "--run-dir", str(tmp_path / "r")])
    assert code == 2 and "secure-aggregation works with strategy fedavg, fedprox, fednova" in capsys.readouterr().err
