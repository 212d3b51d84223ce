"""The Task API (issue 14): a user's own task, defined here and not in fedge, runs every feature.

Two tasks written as a user would: a regression on 2-D inputs (4 x 5 grids, MSE headline,
lower is better) and a classifier with two inputs (float features and int64 token ids).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fedge.config import resolve_run_config
from fedge.errors import ConfigError
from fedge.signature import InputSpec
from fedge.simulation.runner import simulate
from fedge.task.api import Task, TaskData
from fedge.task.loading import check_task, load_task

FLEET = {"fleet": "phone=6,laptop=3,gpu-box=1", "clients-per-round": 5, "num-rounds": 3, "local-epochs": 2,
         "export-onnx": False, "partitioner": "iid", "learning-rate": 0.05}


class GridRegression(Task):
    """y = the sum of a 4x5 grid's first row minus its last, plus noise: a linear target on 2-D inputs."""

    name = "grid-regression"
    headline, higher_is_better = "mse", False
    inputs = (InputSpec("grid", ("batch", 4, 5)),)
    labels = None
    target_dtype = "float32"
    output = "predicted value"

    def __init__(self, central: bool = True) -> None:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(600, 4, 5)).astype(np.float32)
        y = (x[:, 0].sum(axis=1) - x[:, 3].sum(axis=1) + 0.1 * rng.normal(size=600)).astype(np.float32)
        self.train, self.test = TaskData.from_xy(x[:500], y[:500]), TaskData.from_xy(x[500:], y[500:])
        self.central = central

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 1))

    def train_data(self) -> TaskData:
        return self.train

    def central_data(self) -> TaskData | None:
        return self.test if self.central else None

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs.squeeze(-1), targets)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        error = outputs.squeeze(-1) - targets
        return {"mse": float((error ** 2).mean()), "mae": float(error.abs().mean())}


class TwoInputs(nn.Module):
    """Float features and an embedded token id, concatenated, to 3 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(8, 4), nn.Linear(6 + 4, 3)

    def forward(self, features: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([features, self.embed(token)], dim=1))  # type: ignore[no-any-return]


class TwoInputTask(Task):
    """The class is the token's id mod 3 when the first feature is positive, else 0."""

    name = "two-inputs"
    inputs = (InputSpec("features", ("batch", 6)), InputSpec("token", ("batch",), "int64"))
    labels = ("a", "b", "c")

    def __init__(self) -> None:
        rng = np.random.default_rng(1)
        features = rng.normal(size=(700, 6)).astype(np.float32)
        token = rng.integers(0, 8, 700)
        y = np.where(features[:, 0] > 0, token % 3, 0)
        self.data = TaskData((features, token), y)

    def build_model(self) -> nn.Module:
        return TwoInputs()

    def train_data(self) -> TaskData:
        return self.data.take(slice(0, 600))

    def central_data(self) -> TaskData:
        return self.data.take(slice(600, 700))


def _run(task: Task, tmp_path: Path, **overrides: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    run_dir, summary = simulate({**FLEET, "run-dir": str(tmp_path / "run"), **overrides}, progress=False, task=task)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, summary


# ---------------------------------------------------------------------------- runs on custom tasks

FEATURES = [
    pytest.param({}, id="fedavg"),
    pytest.param({"round-policy": "deadline", "deadline-s": 30.0, "over-selection": 1.4}, id="deadline"),
    pytest.param({"strategy": "fedprox"}, id="fedprox"),
    pytest.param({"strategy": "fednova"}, id="fednova"),
    pytest.param({"strategy": "fedadam", "server-learning-rate": 0.05}, id="fedadam"),
    pytest.param({"strategy": "median"}, id="median"),
    pytest.param({"strategy": "trimmed-mean", "trim-fraction": 0.2}, id="trimmed-mean"),
    pytest.param({"strategy": "krum", "num-byzantine": 1}, id="krum"),
    pytest.param({"strategy": "fedbuff", "buffer-size": 3}, id="fedbuff"),
    pytest.param({"secure-aggregation": True}, id="secure-aggregation"),
    pytest.param({"dp": "server-fixed", "dp-noise-multiplier": 0.01, "dp-clipping-norm": 5.0}, id="dp"),
    pytest.param({"codec.default": "int8", "downlink.default": "fp16"}, id="codecs"),
]


@pytest.mark.parametrize("overrides", FEATURES)
def test_a_regression_task_on_2d_inputs_learns_under_every_feature(overrides: dict[str, Any],
                                                                   tmp_path: Path) -> None:
    # Execute
    rows, summary = _run(GridRegression(), tmp_path, **overrides)
    # Assert: the headline is the task's MSE, lower is better, and it went down
    assert summary["headline"] == "mse" and summary["higher_is_better"] is False
    assert rows[-1]["metric"] == "mse" and rows[-1]["mse"] == rows[-1]["headline"]
    assert summary["final_mse"] < rows[0]["mse"] and summary["best_mse"] <= summary["final_mse"]
    assert (tmp_path / "run" / "headline.png").stat().st_size > 0


@pytest.mark.parametrize("overrides", [pytest.param({}, id="fedavg"), pytest.param({"secure-aggregation": True},
                                                                                  id="secure-aggregation"),
                                       pytest.param({"strategy": "median"}, id="median")])
def test_a_two_input_task_with_token_ids_learns(overrides: dict[str, Any], tmp_path: Path) -> None:
    # Execute
    rows, summary = _run(TwoInputTask(), tmp_path, **{"num-rounds": 4, "learning-rate": 0.2, **overrides})
    # Assert
    assert summary["headline"] == "accuracy" and summary["final_accuracy"] > rows[0]["accuracy"] + 0.1


def test_a_task_without_central_data_is_scored_by_federated_evaluation(tmp_path: Path) -> None:
    # Execute
    rows, summary = _run(GridRegression(central=False), tmp_path)
    # Assert: no score before any device saw the model; then the devices' weighted mean
    assert rows[0]["headline"] is None and rows[0]["evaluation"] == "federated"
    assert all(row["mse"] == row["headline"] > 0 for row in rows[1:])
    assert rows[-1]["mse"] < rows[1]["mse"] * 1.5 and summary["final_mse"] == rows[-1]["mse"]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["fraction-evaluate"] == pytest.approx(0.5)  # about clients-per-round of the 10 devices


def test_fedbuff_on_a_task_without_central_data_is_scored_by_its_idle_devices(tmp_path: Path) -> None:
    # Execute: asynchronous rounds (buffer flushes); after each, devices not training evaluate (it was refused)
    rows, summary = _run(GridRegression(central=False), tmp_path, strategy="fedbuff", concurrency=3,
                         **{"buffer-size": 2})
    # Assert: every flushed version scored by the devices' weighted mean
    assert rows[0]["headline"] is None
    assert all(row["evaluation"] == "federated" and row["mse"] == row["headline"] > 0 for row in rows[1:])
    assert summary["final_mse"] == rows[-1]["mse"]


def test_a_custom_task_resumes_where_an_uninterrupted_run_ends(tmp_path: Path) -> None:
    # Prepare
    straight = simulate({**FLEET, "num-rounds": 4, "run-dir": str(tmp_path / "a")}, progress=False,
                        task=GridRegression())[1]
    simulate({**FLEET, "num-rounds": 2, "run-dir": str(tmp_path / "b")}, progress=False, task=GridRegression())
    # Execute
    resumed = simulate({**FLEET, "num-rounds": 4, "run-dir": str(tmp_path / "b"), "resume": True}, progress=False,
                       task=GridRegression())[1]
    # Assert
    assert resumed["final_mse"] == straight["final_mse"] and resumed["rounds"] == 4


# ---------------------------------------------------------------------------- naming a task

TASK_MODULE = '''
import numpy as np
from torch import nn
from fedge.signature import InputSpec
from fedge.task.api import Task, TaskData


class Tiny(Task):
    name = "tiny"
    inputs = (InputSpec("x", ("batch", 3)),)

    def __init__(self, config=None):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(200, 3)).astype(np.float32)
        self.data = TaskData.from_xy(x, (x[:, 0] > 0).astype(np.int64))

    def build_model(self):
        return nn.Linear(3, 2)

    def train_data(self):
        return self.data

    def central_data(self):
        return self.data.take(slice(0, 50))


instance = Tiny()
number = 7


def factory(config):
    return Tiny(config)


def not_a_task(config):
    return "hello"
'''


@pytest.fixture
def user_module(tmp_path: Path) -> Any:
    (tmp_path / "my_fl_task.py").write_text(textwrap.dedent(TASK_MODULE))
    sys.path.insert(0, str(tmp_path))
    yield "my_fl_task"
    sys.path.remove(str(tmp_path))
    sys.modules.pop("my_fl_task", None)


@pytest.mark.parametrize("attribute", ["instance", "Tiny", "factory"])
def test_a_task_outside_fedge_is_named_as_module_and_object(attribute: str, user_module: str,
                                                             tmp_path: Path) -> None:
    # Execute: only the run config names it
    _, summary = simulate({**FLEET, "task": f"{user_module}:{attribute}", "run-dir": str(tmp_path / "run")},
                          progress=False)
    # Assert
    assert summary["task"] == "tiny" and summary["final_accuracy"] > 0.6


@pytest.mark.parametrize(("reference", "message"), [
    ("no-such-task", "is not a registered task or 'package.module:object'; registered tasks: "),
    ("no_such_module_xyz:Task", "cannot import module 'no_such_module_xyz'"),
    ("my_fl_task:missing", "module 'my_fl_task' has no 'missing'"),
    ("my_fl_task:number", "is a int, not a fedge Task"),
    ("my_fl_task:not_a_task", "returned a str, not a fedge Task"),
])
def test_a_bad_task_reference_is_refused_naming_the_problem(reference: str, message: str,
                                                            user_module: str) -> None:
    # Execute / Assert
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("'", "'")):
        load_task(resolve_run_config({"task": reference}))


# ---------------------------------------------------------------------------- bad tasks fail at start

class Broken(GridRegression):
    """GridRegression with one thing wrong, chosen by ``flaw``."""

    def __init__(self, flaw: str) -> None:
        super().__init__()
        self.flaw = flaw
        if flaw == "shape":
            self.inputs = (InputSpec("grid", ("batch", 5, 4)),)
        if flaw == "no-inputs":
            self.inputs = ()
        if flaw == "headline":
            self.headline = "r2"

    def build_model(self) -> nn.Module:
        if self.flaw == "random-init":
            model = nn.Linear(20, 1)
            with torch.no_grad():
                model.weight.copy_(torch.from_numpy(np.random.default_rng().normal(size=(1, 20))))
            return nn.Sequential(nn.Flatten(), model)
        if self.flaw == "output":
            return nn.Sequential(nn.Flatten(), nn.Linear(20, 3))
        return super().build_model()

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.flaw == "vector-loss":
            return (outputs.squeeze(-1) - targets) ** 2
        if self.flaw == "output":
            return nn.functional.mse_loss(outputs, targets)
        return super().loss(outputs, targets)


@pytest.mark.parametrize(("flaw", "message"), [
    ("random-init", "build_model\\(\\) is not deterministic under torch.manual_seed"),
    ("output", "the model's output does not fit the loss or the data"),
    ("shape", "input 'grid' has shape \\(2, 4, 5\\) float32; the task declares grid\\[batch, 5, 4\\]"),
    ("vector-loss", "loss\\(\\) must return a finite scalar"),
    ("headline", "headline metric 'r2' is not among its metrics \\['mae', 'mse'\\]"),
    ("no-inputs", "declares no inputs"),
])
def test_a_broken_task_fails_at_start_naming_the_fix(flaw: str, message: str, tmp_path: Path) -> None:
    # Execute / Assert: refused before the run directory exists
    with pytest.raises(ConfigError, match=message):
        _run(Broken(flaw), tmp_path)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["digits", "synthetic"])
def test_check_task_accepts_the_built_in_tasks(name: str) -> None:
    # Prepare
    config = resolve_run_config({"task": name, "model": "mlp"})
    task = load_task(config)
    # Execute: raises on a broken task
    check_task(task, config)
    # Assert: what it checked holds: 10 classes of scores for a batch of the central data
    from fedge.task.api import seeded_model

    central = task.central_data()
    assert central is not None
    inputs, _ = central.take(slice(0, 3)).tensors()
    assert tuple(seeded_model(task, 0)(*inputs).shape) == (3, 10)


# ---------------------------------------------------------------------------- who may name a task

@pytest.mark.parametrize(("node_config", "run_task", "message"), [
    ({"data-path": "/d.npz"}, "my_fl_task:Tiny", "which this device did not choose; start the device with --task"),
    ({"data-path": "/d.npz", "task": "digits"}, "my_fl_task:Tiny", "this device runs task 'digits', but the run"),
    ({"data-path": "/d.npz", "task": "my_fl_task:Tiny"}, "", "this device runs task 'my_fl_task:Tiny', but"),
])
def test_a_coordinator_cannot_make_a_device_load_a_task_it_did_not_choose(
        node_config: dict[str, Any], run_task: str, message: str, user_module: str) -> None:
    # Prepare: a deployed device's context (its own data-path) and the run config the coordinator sent
    from flwr.app import Context, RecordDict

    from fedge.clients.app import device_task

    context = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})
    # Execute / Assert: refused before the module is imported
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        device_task(context, resolve_run_config({"task": run_task}))
    assert "my_fl_task" not in sys.modules


def test_a_device_that_chose_the_runs_task_loads_it(user_module: str) -> None:
    # Prepare
    from flwr.app import Context, RecordDict

    from fedge.clients.app import device_task

    context = Context(run_id=1, node_id=7, node_config={"data-path": "/d.npz", "task": "my_fl_task:instance"},
                      state=RecordDict(), run_config={})
    # Execute
    task = device_task(context, resolve_run_config({"task": "my_fl_task:instance"}))
    # Assert
    assert task.name == "tiny"


class RootMean(GridRegression):
    """GridRegression with a derived metric: rmse = sqrt(mse), computed by summarize()."""

    def summarize(self, metrics: dict[str, float]) -> dict[str, float]:
        return {**metrics, "rmse": metrics["mse"] ** 0.5}


def test_derived_metrics_stay_exact_under_federated_evaluation(tmp_path: Path) -> None:
    # Execute: no central data, so devices evaluate and the coordinator averages their means
    rows, _ = _run(RootMean(central=False), tmp_path)
    # Assert: rmse is the root of the example-weighted mean mse (not a mean of device roots,
    # which would be smaller by Jensen's inequality)
    for row in rows[1:]:
        assert row["rmse"] == pytest.approx(row["mse"] ** 0.5, rel=1e-12)
