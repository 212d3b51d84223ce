"""End-to-end inline simulations: the real ServerApp and ClientApp over a simulated fleet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from torch.utils.data import Subset, TensorDataset

from fedge import wire
from fedge.clients.app import make_client_app, make_default_client_app
from fedge.config import resolve_run_config
from fedge.server.app import run_coordinator
from fedge.server.checkpoint import load_checkpoint
from fedge.signature import InputSpec
from fedge.simulation.grid import InlineGrid
from fedge.simulation.runner import simulate
from fedge.task.api import Task, TaskData
from fedge.task.data import load_digits_arrays
from fedge.task.loaders import from_dataset
from fedge.task.models import build_model

METRIC_KEYS = {"round", "accuracy", "loss", "sim_time_s", "wall_time_s", "bytes_up", "bytes_down",
               "participants", "rejected"}


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_three_round_simulation_learns_and_writes_the_run_report(fast_config: dict[str, Any]) -> None:
    # Execute
    run_dir, summary = simulate(fast_config, progress=False)
    # Assert: accuracy rises from the initial model, every artefact is there
    rows = _rows(run_dir)
    assert [row["round"] for row in rows] == [0, 1, 2, 3]
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.2
    assert all(row.keys() >= METRIC_KEYS for row in rows)
    assert all(row["participants"] == 4 and row["bytes_up"] > 0 for row in rows[1:])
    assert rows[1]["sim_time_s"] > 0 and rows[3]["sim_time_s"] > rows[1]["sim_time_s"]
    for name in ("config.json", "summary.json", "headline.png", "checkpoint.npz", "model.onnx"):
        assert (run_dir / name).stat().st_size > 0, name
    assert summary["final_accuracy"] == rows[-1]["accuracy"] and summary["rounds"] == 3
    assert summary["onnx"]["max_abs_diff"] <= 1e-4 and summary["onnx"]["parity_ok"]
    assert json.loads((run_dir / "config.json").read_text())["num-rounds"] == 3
    assert load_checkpoint(run_dir / "checkpoint.npz").server_round == 3


def test_simulation_is_reproducible_from_its_seed(fast_config: dict[str, Any], tmp_path: Path) -> None:
    fast_config.update({"num-rounds": 2, "export-onnx": False})
    _, first = simulate(fast_config, progress=False)
    _, second = simulate({**fast_config, "run-dir": str(tmp_path / "again")}, progress=False)
    assert first["final_accuracy"] == second["final_accuracy"]
    assert first["sim_time_s"] == pytest.approx(second["sim_time_s"])


def _hostile_app(bad_partitions: set[int]) -> ClientApp:
    """Honest fedge clients, except some partitions reply with NaN-poisoned arrays."""
    honest = make_default_client_app()
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = honest(msg, context)
        if context.node_config["partition-id"] in bad_partitions:
            arrays = reply.content[wire.ARRAYS]
            poisoned = {k: np.full(a.shape, np.nan, dtype=a.numpy().dtype) for k, a in arrays.items()}
            reply.content[wire.ARRAYS] = ArrayRecord({k: Array(v) for k, v in poisoned.items()})
        return reply

    return app


def test_poisoned_updates_are_rejected_and_rounds_go_on(fast_config: dict[str, Any]) -> None:
    # Prepare: all 10 devices every round, two of them hostile
    config = resolve_run_config({**fast_config, "clients-per-round": 10, "export-onnx": False})
    nodes = [{"partition-id": i, "num-partitions": 10, "profile": "laptop"} for i in range(10)]
    grid = InlineGrid(_hostile_app({2, 7}), nodes, config)
    # Execute
    run_dir = run_coordinator(grid, config, progress=False)
    # Assert
    rows = _rows(run_dir)
    assert [row["rejected"] for row in rows[1:]] == [2, 2, 2]
    assert all(row["participants"] == 10 and row["aggregated"] for row in rows[1:])
    assert {r["node_id"] for r in rows[1]["rejections"]} == {10_002, 10_007}
    assert all("NaN" in r["reason"] for r in rows[1]["rejections"])
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.2
    final = load_checkpoint(run_dir / "checkpoint.npz").arrays
    assert all(np.all(np.isfinite(a)) for a in final.values())


class UserDigits(Task):
    """An app developer's own task: their MLP and their torch Dataset (digits in a TensorDataset)."""

    name = "user-digits"
    inputs = (InputSpec("pixels", ("batch", 64)),)

    def __init__(self) -> None:
        x, y = load_digits_arrays()
        self.dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))

    def build_model(self) -> Any:
        return build_model("mlp", 64, 10)

    def train_data(self) -> TaskData:
        return from_dataset(Subset(self.dataset, range(1400)), self)

    def central_data(self) -> TaskData:
        return from_dataset(Subset(self.dataset, range(1400, 1797)), self)


def test_sdk_takes_a_torch_dataset_and_a_user_model(fast_config: dict[str, Any]) -> None:
    # Prepare: a task given in Python to both app factories, its data a torch Dataset
    config = resolve_run_config({**fast_config, "export-onnx": False, "partitioner": "iid"})
    task = UserDigits()
    nodes = [{"partition-id": i, "num-partitions": 10, "profile": "phone"} for i in range(10)]
    grid = InlineGrid(make_client_app(task), nodes, config)
    # Execute
    rows = _rows(run_coordinator(grid, config, progress=False, task=task))
    # Assert
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.2
    assert rows[1]["participants_by_profile"] == {"phone": 4}
