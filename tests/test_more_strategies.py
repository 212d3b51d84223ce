"""FedProx, FedNova, FedAvgM, FedAdam, FedYogi: hand-computed math and real runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedge.aggregate import (
    FedNovaAccumulator,
    adaptive_step,
    fedavgm_step,
    fednova_norm,
)
from fedge.signature import InputSpec
from fedge.simulation.runner import simulate
from fedge.task.api import Task, TaskData
from fedge.task.models import build_model
from fedge.task.training import train_local


def _x(value: float) -> dict[str, np.ndarray]:
    return {"x": np.array([value], np.float32)}


def test_fedavgm_two_steps_by_hand() -> None:
    # step 1: delta = 1 - 0 = 1, v = 1, x = 0 + 1 * 1 = 1
    new, velocity = fedavgm_step(_x(0), _x(1), {}, server_lr=1.0, momentum=0.9)
    assert float(new["x"][0]) == pytest.approx(1.0)
    # step 2: delta = 2 - 1 = 1, v = 0.9 * 1 + 1 = 1.9, x = 1 + 1.9 = 2.9
    new, velocity = fedavgm_step(new, _x(2), velocity, server_lr=1.0, momentum=0.9)
    assert float(new["x"][0]) == pytest.approx(2.9)
    assert float(velocity["x"][0]) == pytest.approx(1.9)


@pytest.mark.parametrize(("rule", "second"), [("adam", 0.99e-6 + 0.01), ("yogi", 1e-6 + 0.01)])
def test_adaptive_step_by_hand(rule: str, second: float) -> None:
    # delta = 1; m = 0.1 * 1 = 0.1; v0 = tau^2 = 1e-6
    # adam: v = 0.99 * 1e-6 + 0.01 * 1; yogi: v = 1e-6 - 0.01 * 1 * sign(1e-6 - 1) = 1e-6 + 0.01
    new, first, v = adaptive_step(_x(0), _x(1), {}, {}, server_lr=0.5, beta1=0.9, beta2=0.99, tau=1e-3, rule=rule)
    assert float(first["x"][0]) == pytest.approx(0.1)
    assert float(v["x"][0]) == pytest.approx(second)
    assert float(new["x"][0]) == pytest.approx(0.5 * 0.1 / (np.sqrt(second) + 1e-3))


def test_fednova_norm_by_hand() -> None:
    assert fednova_norm(5) == 5.0
    # momentum 0.5, 2 steps: the first gradient counts 1 + 0.5, the second 1 -> 2.5
    assert fednova_norm(2, momentum=0.5) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="local_steps"):
        fednova_norm(0)


def test_fednova_aggregate_by_hand_differs_from_fedavg() -> None:
    # global 0; A: 1 step, moved to -1 (d_A = 1/1); B: 4 steps, moved to -2 (d_B = 2/4)
    # equal weights: d = 0.75, tau_eff = (1 + 4) / 2 = 2.5 -> x = -1.875 (FedAvg: -1.5)
    accumulator = FedNovaAccumulator(_x(0))
    accumulator.add(_x(-1), weight=10, norm=fednova_norm(1))
    accumulator.add(_x(-2), weight=10, norm=fednova_norm(4))
    assert float(accumulator.result()["x"][0]) == pytest.approx(-1.875)


def test_proximal_term_keeps_local_weights_near_the_start() -> None:
    torch.manual_seed(0)
    data = TaskData.from_xy(np.random.default_rng(0).random((64, 8), np.float32), np.arange(64) % 3)
    task = Task()
    task.inputs = (InputSpec("x", ("batch", 8)),)

    def drift(mu: float) -> float:
        model = build_model("mlp", 8, 3, seed=1)
        start = [p.detach().clone() for p in model.parameters()]
        train_local(task, model, data, epochs=20, batch_size=8, learning_rate=0.1, momentum=0.0,
                    device=torch.device("cpu"), seed=0, proximal_mu=mu)
        return float(sum(((p.detach() - s) ** 2).sum() for p, s in zip(model.parameters(), start, strict=True)))

    assert drift(1.0) < 0.5 * drift(0.0)


@pytest.mark.parametrize("strategy", ["fedprox", "fednova", "fedavgm", "fedadam", "fedyogi"])
def test_each_strategy_learns_in_a_real_run(strategy: str, fast_config: dict[str, Any]) -> None:
    config = {**fast_config, "strategy": strategy, "export-onnx": False, "num-rounds": 3,
              "adaptive-learning-rate": 0.05, "server-learning-rate": 0.5}
    run_dir, summary = simulate(config, progress=False)
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert summary["final_accuracy"] > first["accuracy"] + 0.2


@pytest.mark.parametrize("strategy", ["fedavgm", "fedadam"])
def test_server_optimizer_state_survives_resume(strategy: str, fast_config: dict[str, Any], tmp_path: Path) -> None:
    config = {**fast_config, "strategy": strategy, "export-onnx": False, "num-rounds": 4,
              "adaptive-learning-rate": 0.05, "server-learning-rate": 0.5}
    _, straight = simulate({**config, "run-dir": str(tmp_path / "a")}, progress=False)
    simulate({**config, "num-rounds": 2, "run-dir": str(tmp_path / "b")}, progress=False)
    _, resumed = simulate({**config, "run-dir": str(tmp_path / "b"), "resume": True}, progress=False)
    assert resumed["final_accuracy"] == straight["final_accuracy"]
    assert resumed["final_loss"] == pytest.approx(straight["final_loss"], rel=1e-6)


@pytest.mark.parametrize(("strategy", "kept"), [("fedavg", 2), ("fedprox", 4)])
def test_fedavg_drops_stragglers_and_fedprox_keeps_their_partial_work(
    strategy: str, kept: int, fast_config: dict[str, Any]
) -> None:
    # Prepare: half of each round's 4 devices are stragglers doing 1..E-1 of E = 5 epochs
    config = {**fast_config, "strategy": strategy, "straggler-fraction": 0.5, "local-epochs": 5,
              "export-onnx": False, "min-train-replies": 1, "num-rounds": 2}
    # Execute
    run_dir, _ = simulate(config, progress=False)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Assert: FedAvg aggregates only the 2 on-time devices (2 counted late); FedProx all 4
    assert [r["late"] for r in rows[1:]] == [4 - kept] * 2
    assert all(r["aggregated"] and r["train_loss"] is not None for r in rows[1:])


def test_straggler_instructions_carry_fewer_epochs() -> None:
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.clientapp import ClientApp

    from fedge.config import resolve_run_config
    from fedge.errors import ConfigError
    from fedge.knobs import LOCAL_EPOCHS
    from fedge.simulation.grid import InlineGrid
    from fedge.strategies import FedAvg
    from fedge.wire import TrainInstruction

    # Prepare: the coordinator's train instruction of 20 local epochs; half the round straggles
    strategy = FedAvg(clients_per_round=4, straggler_fraction=0.5, wait_for_nodes_s=0)
    grid = InlineGrid(ClientApp(), [{}] * 4, {})
    sent = TrainInstruction.from_run_config(resolve_run_config({LOCAL_EPOCHS: 20})).to_record()
    # Execute
    messages = list(strategy.configure_train(1, ArrayRecord(), sent, grid))
    # Assert: two stragglers train 1..19 epochs, the rest 20; a config that is no train instruction is
    # refused naming what it lacks (a straggler's epochs are not guessed)
    epochs = sorted(int(m.content["config"][LOCAL_EPOCHS]) for m in messages)
    assert len(strategy.stragglers) == 2
    assert epochs[2:] == [20, 20] and all(1 <= e <= 19 for e in epochs[:2])
    with pytest.raises(ConfigError, match="has no 'batch-size'"):
        strategy.configure_train(2, ArrayRecord(), ConfigRecord({LOCAL_EPOCHS: 20}), grid)
