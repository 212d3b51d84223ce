"""Width-scaled sub-models end to end: the models' plans, the sub-models, the strategy's rounds, the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord
from torch import nn

from fedge import wire
from fedge.config import resolve_run_config
from fedge.errors import ConfigError
from fedge.profiles import parse_fleet
from fedge.server.submodels import build_sub_models
from fedge.strategies import FedAvg
from fedge.strategies.median import Median
from fedge.strategies.submodels import MODEL_WIDTH, SubModels, extraction
from fedge.submodels import WidthPlan
from fedge.task.api import Task, TaskData, seeded_model
from fedge.task.loading import load_task
from fedge.task.models import load_arrays
from fedge.task.submodels import (
    add_scaler,
    check_widths,
    fold_scaler,
    measured_training_bytes,
    sub_model,
    training_memory_bytes,
    widest_fitting,
    width_plan,
)
from tests.replies import train_reply


def fleet_toml(*, small: int, width: float, big: int, big_profile: str = "big", runtime: str = "torch") -> str:
    """A fleet file: ``small`` devices of a custom profile holding ``width`` of the model, ``big`` whole ones."""
    big_table = "" if big_profile != "big" else (
        "[profiles.big]\ncompute-rate = 2000\nuplink-mbps = 20\ndownlink-mbps = 50\nmemory-mb = 4096\n\n")
    return (f"[profiles.small]\ncompute-rate = 200\nuplink-mbps = 2\ndownlink-mbps = 10\nmemory-mb = 64\n"
            f"model-width = {width}\nruntime = \"{runtime}\"\n\n{big_table}"
            f"[fleet]\nsmall = {small}\n{big_profile} = {big}\n")


FLEET = fleet_toml(small=4, width=0.25, big=2)


def digits(model: str = "mlp", **extra: Any) -> Task:
    return load_task(resolve_run_config({"dataset": "digits", "model": model, **extra}))


# ------------------------------------------------------------------ the models


def test_the_built_in_models_scale_every_axis_but_the_inputs_and_the_classes() -> None:
    # Prepare
    mlp, cnn = digits("mlp"), digits("cnn")
    # Execute
    mlp_plan = width_plan(mlp, seeded_model(mlp, 0))
    cnn_plan = width_plan(cnn, seeded_model(cnn, 0))
    # Assert
    assert mlp_plan.hidden == {"net.0.weight": (0,), "net.0.bias": (0,), "net.2.weight": (1,), "net.2.bias": ()}
    assert cnn_plan.hidden["features.0.weight"] == (0,)  # 1 input channel stays
    assert cnn_plan.hidden["head.1.weight"] == (0, 1)  # the flattened features scale with the channels
    assert cnn_plan.hidden["head.3.weight"] == (1,) and cnn_plan.hidden["head.3.bias"] == ()


def test_a_half_width_mlp_computes_what_its_leading_window_of_the_global_model_computes() -> None:
    # Prepare
    task = digits("mlp")
    model = seeded_model(task, 3)
    plan = width_plan(task, model)
    state = {name: value.numpy() for name, value in model.state_dict().items()}
    cut = plan.window(0.5).take(state)
    small = sub_model(task, plan.sub_shapes(0.5))
    load_arrays(small, ArrayRecord({name: Array(value) for name, value in cut.items()}))
    x = torch.as_tensor(task.train_data().inputs[0][:5])
    # Execute
    out = small(x).detach().numpy()
    # Assert: relu(x W1[:32]^T + b1[:32]) W2[:, :32]^T + b2, by hand
    hidden = np.maximum(x.numpy() @ state["net.0.weight"][:32].T + state["net.0.bias"][:32], 0)
    np.testing.assert_allclose(out, hidden @ state["net.2.weight"][:, :32].T + state["net.2.bias"], rtol=1e-5,
                               atol=1e-6)


def test_the_resnet_at_a_quarter_keeps_its_groups_of_channels() -> None:
    # Prepare
    task = load_task(resolve_run_config({"task": "images"}))
    model = seeded_model(task, 0)
    plan = width_plan(task, model)
    # Execute
    small = sub_model(task, plan.sub_shapes(0.25))
    check_widths(task, model, plan, [0.5, 0.25])
    # Assert: 32 -> 8 channels in 8 groups of 1; 256 -> 64 in 8 groups of 8 (the full model's 32 groups of 8)
    assert (small.stem[1].num_channels, small.stem[1].num_groups) == (8, 8)
    assert (small.blocks[3].norm2.num_channels, small.blocks[3].norm2.num_groups) == (64, 8)
    assert plan.parameters_at(0.25) < plan.parameters_at(1) / 15


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(64, 16, batch_first=True)
        self.out = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(x[:, None])[0][:, -1])  # type: ignore[no-any-return]


class Grouped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 8, 3, padding=1)
        self.depthwise = nn.Conv1d(8, 8, 3, padding=1, groups=8)
        self.out = nn.Linear(8 * 64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.depthwise(self.conv(x[:, None])).flatten(1))  # type: ignore[no-any-return]


class FixedView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(64, 32)
        self.out = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(x).view(-1, 32))  # type: ignore[no-any-return]  # 32: breaks at any width


class UserTask(Task):
    name = "user"

    def __init__(self, model: type[nn.Module]) -> None:
        self.model = model

    def build_model(self) -> nn.Module:
        return self.model()

    def train_data(self) -> TaskData:
        return TaskData.from_xy(np.zeros((4, 64), np.float32), np.zeros(4, np.int64))


@pytest.mark.parametrize(("model", "problem"), [
    (Recurrent, "layer 'rnn' \\(LSTM\\) cannot be width-scaled"),
    (Grouped, "layer 'depthwise' \\(Conv1d\\) cannot be width-scaled"),
    (FixedView, "at width 0.5 does not run"),
])
def test_a_model_that_cannot_be_scaled_is_refused_naming_the_layer_or_width(model: type[nn.Module],
                                                                            problem: str) -> None:
    # Prepare
    task = UserTask(model)
    built = seeded_model(task, 0)
    # Execute / Assert
    with pytest.raises(ConfigError, match=problem):
        check_widths(task, built, width_plan(task, built), [0.5])


@pytest.mark.parametrize("shape", [(128, 64), (32, 64, 1), (0, 64)])
def test_a_device_refuses_arrays_that_are_no_cut_of_its_model(shape: tuple[int, ...]) -> None:
    # Prepare: an instruction whose first layer is wider than the model's (64 hidden), of another rank, or empty
    task = digits("mlp")
    shapes = {"net.0.weight": shape, "net.0.bias": (32,), "net.2.weight": (10, 32), "net.2.bias": (10,)}
    # Execute / Assert: refused before anything of that size is allocated
    with pytest.raises(ConfigError, match="no cut of the model's"):
        sub_model(task, shapes)


def test_a_model_without_a_hidden_layer_is_refused_at_start() -> None:
    # Prepare
    config = resolve_run_config({"dataset": "digits", "model": "logreg", "sub-models": "heterofl"})
    task = load_task(config)
    # Execute / Assert
    with pytest.raises(ConfigError, match="no hidden layer to scale"):
        build_sub_models(config, task, seeded_model(task, 0), parse_fleet("phone=2"))


# ------------------------------------------------------------------ memory


def test_the_memory_estimate_counts_parameter_copies_and_saved_activations_twice() -> None:
    # Prepare: Linear(4, 8) -> ReLU -> Linear(8, 2) on batches of 5
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)  # type: ignore[no-any-return]

    class TinyTask(UserTask):
        def train_data(self) -> TaskData:
            return TaskData.from_xy(np.ones((5, 4), np.float32), np.zeros(5, np.int64))

    task = TinyTask(Tiny)
    # Execute
    estimate = training_memory_bytes(task, Tiny(), 5)
    # Assert: 58 parameters x 4 bytes x 4 copies + 2 x (input 5x4 + ReLU output 5x8) x 4 bytes
    assert estimate == 58 * 4 * 4 + 2 * (5 * 4 + 5 * 8) * 4


def test_the_width_picker_goes_by_the_larger_of_the_estimate_and_the_measured_peak() -> None:
    # Prepare
    task = digits("cnn")
    plan = width_plan(task, seeded_model(task, 0))
    full = sub_model(task, plan.sub_shapes(1))
    for value in full.parameters():
        nn.init.normal_(value, std=0.01)
    estimate, measured = training_memory_bytes(task, full, 32), measured_training_bytes(task, full, 32)
    assert measured > sum(value.numel() * 4 for value in full.parameters())  # a step holds more than the weights
    between = (estimate + measured) / 2 / 2**20
    # Execute
    picked = widest_fitting(task, between, 32)
    fits = widest_fitting(task, max(estimate, measured) / 2**20, 32)
    # Assert: between the two the whole model does not fit (a narrower width is picked); at the larger it does
    assert picked is not None and picked < 1
    assert fits == 1


# ------------------------------------------------------------------ the strategy's rounds


class ProfiledGrid:
    """The part of a Grid a strategy reads to select and to send: nodes and their profiles."""

    def __init__(self, profiles: dict[int, str]) -> None:
        self.profiles = profiles

    def get_node_ids(self) -> list[int]:
        return list(self.profiles)

    def node_profile(self, node: int) -> str:
        return self.profiles[node]


PLAN = WidthPlan({"w": (4, 2), "v": (3, 4)}, {"w": (0,), "v": (1,)})


def global_model() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros((4, 2), np.float32)), "v": Array(np.zeros((3, 4), np.float32))})


def strategy(name: str = "heterofl", *, scaler: bool = False, **kwargs: Any) -> FedAvg:
    submodels = SubModels(PLAN, {"big": 1.0, "small": 0.5}, extraction(name), scaler=scaler)
    return FedAvg(clients_per_round=3, submodels=submodels, flower_lines=False, **kwargs)


def test_each_device_is_sent_the_window_its_profile_holds() -> None:
    # Prepare
    fedavg, grid = strategy(scaler=True), ProfiledGrid({1: "big", 2: "small", 3: "small"})
    # Execute
    messages = {m.metadata.dst_node_id: m for m in fedavg.configure_train(1, global_model(), ConfigRecord(), grid)}
    # Assert: the half model, its width and (asked for) the scaler; the whole model without either
    small = messages[2].content.array_records[wire.ARRAYS]
    assert small["w"].shape == (2, 2) and small["v"].shape == (3, 2)
    assert messages[2].content.config_records[wire.CONFIG][MODEL_WIDTH] == 0.5
    assert messages[2].content.config_records[wire.CONFIG][wire.MODEL_SCALER] is True
    assert wire.MODEL_SCALER not in messages[1].content.config_records[wire.CONFIG]
    assert messages[1].content.array_records[wire.ARRAYS]["w"].shape == (4, 2)


def test_each_entry_is_averaged_over_the_devices_whose_window_held_it() -> None:
    # Prepare: the big device (10 examples) sends ones, a small one (30 examples) fours, another small one
    # the whole model's shapes (refused: its instruction was the half model)
    fedavg, grid = strategy(), ProfiledGrid({1: "big", 2: "small", 3: "small"})
    list(fedavg.configure_train(1, global_model(), ConfigRecord(), grid))
    replies = [train_reply(1, {"w": np.ones((4, 2), np.float32), "v": np.ones((3, 4), np.float32)}, 10),
               train_reply(2, {"w": np.full((2, 2), 4, np.float32), "v": np.full((3, 2), 4, np.float32)}, 30),
               train_reply(3, {"w": np.ones((4, 2), np.float32), "v": np.ones((3, 4), np.float32)}, 30)]
    # Execute
    arrays, _ = fedavg.aggregate_train(1, replies)
    # Assert: held by both: (10 * 1 + 30 * 4) / 40 = 3.25; by the big device only: 1
    assert arrays is not None
    np.testing.assert_allclose(arrays["w"].numpy(), [[3.25, 3.25]] * 2 + [[1, 1]] * 2)
    np.testing.assert_allclose(arrays["v"].numpy(), [[3.25, 3.25, 1, 1]] * 3)
    report = fedavg.reports[-1]
    assert report.accepted == 2 and "shape" in report.rejected[0].reason


def test_a_server_optimiser_leaves_entries_nobody_held_where_they_were() -> None:
    # Prepare: FedAvgM with momentum: round 1 moves every entry (the big device holds them all), round 2 only the
    # small device replies (half of each array)
    from fedge.strategies.fedavgm import FedAvgM

    submodels = SubModels(PLAN, {"big": 1.0, "small": 0.5}, extraction("heterofl"))
    fedavgm = FedAvgM(clients_per_round=2, submodels=submodels, flower_lines=False, server_momentum=0.9)
    grid = ProfiledGrid({1: "big", 2: "small"})
    list(fedavgm.configure_train(1, global_model(), ConfigRecord(), grid))
    after_one, _ = fedavgm.aggregate_train(1, [train_reply(1, {"w": np.ones((4, 2), np.float32),
                                                               "v": np.ones((3, 4), np.float32)})])
    assert after_one is not None
    list(fedavgm.configure_train(2, after_one, ConfigRecord(), grid))
    # Execute
    after_two, _ = fedavgm.aggregate_train(2, [train_reply(2, {"w": np.full((2, 2), 1, np.float32),
                                                               "v": np.full((3, 2), 1, np.float32)},
                                                           server_round=2)])
    # Assert: rows 2-3 of w and columns 2-3 of v, which nobody held in round 2, did not move with the velocity
    assert after_two is not None
    np.testing.assert_array_equal(after_two["w"].numpy()[2:], after_one["w"].numpy()[2:])
    np.testing.assert_array_equal(after_two["v"].numpy()[:, 2:], after_one["v"].numpy()[:, 2:])
    assert not np.array_equal(after_two["w"].numpy()[:2], after_one["w"].numpy()[:2])  # the velocity moved these


def test_fedrolex_sends_the_next_window_each_round() -> None:
    # Prepare
    fedavg, grid = strategy("fedrolex"), ProfiledGrid({1: "big", 2: "small", 3: "small"})
    model = ArrayRecord({"w": Array(np.arange(8, dtype=np.float32).reshape(4, 2)),
                         "v": Array(np.zeros((3, 4), np.float32))})
    # Execute
    sent = [{m.metadata.dst_node_id: m for m in fedavg.configure_train(r, model, ConfigRecord(), grid)}[2]
            for r in (1, 2, 3)]
    # Assert: the paper's rolling, one unit a round: rows 0-1, then 1-2, then 2-3
    rows = [m.content.array_records[wire.ARRAYS]["w"].numpy()[:, 0].tolist() for m in sent]
    assert rows == [[0.0, 2.0], [2.0, 4.0], [4.0, 6.0]]


def test_exclude_leaves_the_small_devices_out_of_selection() -> None:
    # Prepare
    fedavg, grid = strategy("exclude"), ProfiledGrid({1: "big", 2: "small", 3: "small", 4: "big"})
    # Execute
    selected = {m.metadata.dst_node_id for m in fedavg.configure_train(1, global_model(), ConfigRecord(), grid)}
    # Assert
    assert selected == {1, 4}


def test_exclude_sends_an_unknown_device_the_whole_model_until_it_names_a_profile_too_small() -> None:
    # Prepare: a deployment's grid (no profiles); node 7 names "small" in its first reply
    fedavg, grid = strategy("exclude"), ProfiledGrid({7: "", 8: ""})  # "": the grid does not know
    fedavg.clients_per_round, fedavg.min_train_replies = 2, 1
    # Execute
    first = list(fedavg.configure_train(1, global_model(), ConfigRecord(), grid))
    reply = train_reply(7, {"w": np.ones((4, 2), np.float32), "v": np.ones((3, 4), np.float32)})
    reply.content.config_records[wire.REPLY_META][wire.PROFILE] = "small"
    fedavg.rounds.learn(1, [reply], grid)
    second = {m.metadata.dst_node_id for m in fedavg.configure_train(2, global_model(), ConfigRecord(), grid)}
    # Assert: both got the whole model; then node 7 sits out
    assert all(m.content.array_records[wire.ARRAYS]["w"].shape == (4, 2) for m in first)
    assert second == {8}


def test_a_rule_that_needs_whole_updates_is_refused_with_the_reason() -> None:
    # Execute / Assert
    with pytest.raises(ConfigError, match="needs every update whole"):
        Median(submodels=SubModels(PLAN, {"big": 1.0}, extraction("heterofl")))


@pytest.mark.parametrize(("setting", "problem"), [
    ({"asynchronous": True}, "asynchronous"),
    ({"dp": "server-fixed"}, "dp"),
    ({"gateways": True}, "gateways"),
])
def test_what_sub_models_cannot_run_with_is_refused_at_start(setting: dict[str, Any], problem: str) -> None:
    # Prepare
    config = resolve_run_config({"dataset": "digits", "model": "mlp", "sub-models": "heterofl", **setting})
    task = load_task(config)
    # Execute / Assert
    with pytest.raises(ConfigError, match=f"cannot run with {problem}"):
        build_sub_models(config, task, seeded_model(task, 0), parse_fleet("phone=3"))


# ------------------------------------------------------------------ a run


@pytest.fixture(scope="module")
def heterofl_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    from fedge.simulation.runner import simulate

    where = tmp_path_factory.mktemp("heterofl")
    (where / "fleet.toml").write_text(FLEET)
    return simulate({"dataset": "digits", "model": "cnn", "fleet-file": str(where / "fleet.toml"),
                     "sub-models": "heterofl", "num-rounds": 3, "clients-per-round": 6,
                     "run-dir": str(where / "run")}, progress=False)


def test_a_heterogeneous_fleet_trains_one_model_and_each_width_gets_its_signed_bundle(
        heterofl_run: tuple[Path, dict[str, Any]]) -> None:
    # Prepare
    from fedge.edge.runtime import EdgeModel

    run_dir, summary = heterofl_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    bundle = run_dir / summary["width_bundles"]["w0.25"]["path"]
    x = digits("cnn").central_data().inputs[0][:4]
    # Execute: a phone verifies and runs its width's bundle, fp32 and int8, with onnxruntime
    models = [EdgeModel.load(bundle, trusted_keys=[run_dir / "keys" / "signing.pub"], variant=variant)
              for variant in ("fp32", "int8")]
    predictions = [model.predict(x) for model in models]
    # Assert: the whole model learnt; the quarter model is scored and signed in its own lineage
    assert summary["final_accuracy"] > 0.5
    assert set(rows[-1]["headline_by_width"]) == {"0.25", "1"}
    assert summary["final_headline_by_width"] == rows[-1]["headline_by_width"]
    assert models[0].manifest["model_id"].endswith("@w0.25")
    assert all(len(prediction.labels) == 4 for prediction in predictions)
    assert summary["width_bundles"]["w0.25"]["fp32_accuracy"] == pytest.approx(rows[-1]["headline_by_width"]["0.25"])


def test_a_small_device_is_charged_for_its_slice_on_the_virtual_clock(
        heterofl_run: tuple[Path, dict[str, Any]]) -> None:
    # Prepare
    run_dir, summary = heterofl_run
    task = digits("cnn")
    plan = width_plan(task, seeded_model(task, 0))
    # Execute: bytes a round per device of each profile (every device trains each round: 6 of 6)
    per_small = summary["bytes_down_by_profile"]["small"] / (4 * 3)
    per_big = summary["bytes_down_by_profile"]["big"] / (2 * 3)
    # Assert: the quarter model's float32 parameters, not the whole model's; what else a message holds (array
    # headers, the instruction) is the same few hundred bytes for both
    small_rest, big_rest = per_small - 4 * plan.parameters_at(0.25), per_big - 4 * plan.parameters_at(1)
    assert per_small < per_big / 10
    assert 0 < small_rest < 2000 and abs(small_rest - big_rest) < 100


def test_heterofls_scaler_divides_each_scaled_input_once_and_folds_into_the_weights() -> None:
    # Prepare: a half-width mlp (hidden 32 of 64) and a batch
    task = digits("mlp")
    plan = width_plan(task, seeded_model(task, 0))
    small = sub_model(task, plan.sub_shapes(0.5))
    for weight in small.parameters():
        nn.init.normal_(weight, std=0.1)
    x = torch.as_tensor(task.train_data().inputs[0][:3])
    w1, b1, w2, b2 = (value.detach().clone() for value in small.state_dict().values())
    # Execute
    hooks = add_scaler(small, task, 0.5)
    hooked = small(x).detach()
    for hook in hooks:
        hook.remove()
    folded = fold_scaler(small, task, 0.5)(x).detach()
    # Assert: relu(x W1^T + b1) / 0.5 W2^T + b2: the layer reading the 32 hidden units of 64 compensates
    # for the 32 it lacks (inverted dropout's scale); the first layer reads the whole input and is not scaled
    expected = (torch.relu(x @ w1.T + b1) / 0.5) @ w2.T + b2
    torch.testing.assert_close(hooked, expected)
    torch.testing.assert_close(folded, expected)




def secure_base(tmp_path: Path, small: int, mode: str = "fedrolex") -> dict[str, Any]:
    (tmp_path / "fleet.toml").write_text(fleet_toml(small=small, width=0.5, big=3))
    return {"dataset": "digits", "model": "mlp", "fleet-file": str(tmp_path / "fleet.toml"), "sub-models": mode,
            "num-rounds": 2, "clients-per-round": small + 3, "local-epochs": 2, "export-onnx": False}


def test_secure_rounds_over_width_groups_give_the_plaintext_sub_model_average(tmp_path: Path) -> None:
    # Prepare
    from fedge.server.checkpoint import load_checkpoint
    from fedge.server.report import read_jsonl
    from fedge.simulation.runner import simulate

    base = secure_base(tmp_path, small=4)
    # Execute: the same FedRolex run in the clear and under secure aggregation (one instance per width group)
    plain, _ = simulate({**base, "run-dir": str(tmp_path / "plain")}, progress=False)
    secure, _ = simulate({**base, "secure-aggregation": True, "run-dir": str(tmp_path / "secure")}, progress=False)
    # Assert: equal up to fixed-point rounding; every device of both groups counted each round
    clear, masked = (load_checkpoint(run / "checkpoint.npz").arrays for run in (plain, secure))
    for name, value in clear.items():
        np.testing.assert_allclose(masked[name], value, atol=1e-4)
    assert all(row["participants"] == 7 and row["aggregated"] for row in read_jsonl(secure / "metrics.jsonl")[1:])


def test_a_width_group_too_small_to_hide_its_devices_is_left_out_and_the_round_goes_on(tmp_path: Path) -> None:
    # Prepare
    from fedge.server.report import read_jsonl
    from fedge.simulation.runner import simulate

    base = secure_base(tmp_path, small=2, mode="heterofl")
    # Execute
    run, _ = simulate({**base, "secure-aggregation": True, "run-dir": str(tmp_path / "secure")}, progress=False)
    # Assert: the two half-width devices are named and left out; the three whole-model devices aggregate
    rows = read_jsonl(run / "metrics.jsonl")[1:]
    assert all(row["aggregated"] and row["participants"] == 3 for row in rows)
    reasons = {rejection["reason"] for row in rows for rejection in row["rejections"]}
    assert reasons == {"its width group (width 1/2 at offset 0) had 2 devices this round; secure aggregation needs 3"}




def test_onnx_devices_train_their_widths_graph_as_torch_devices_train_the_sub_model(tmp_path: Path) -> None:
    # Prepare: the same FedRolex run with the half-width devices on torch, then on onnxruntime
    from fedge.edge.training_bundle import read_training_bundle
    from fedge.server.checkpoint import load_checkpoint
    from fedge.simulation.runner import simulate

    runs = {}
    for runtime in ("torch", "onnx"):
        (tmp_path / f"{runtime}.toml").write_text(fleet_toml(small=3, width=0.5, big=2, runtime=runtime))
        # Execute
        fleet = str(tmp_path / f"{runtime}.toml")
        runs[runtime], _ = simulate({"dataset": "digits", "model": "mlp", "fleet-file": fleet,
                                     "sub-models": "fedrolex", "num-rounds": 2, "clients-per-round": 5,
                                     "local-epochs": 1, "export-onnx": False,
                                     "run-dir": str(tmp_path / runtime)}, progress=False)
    # Assert: the half-width devices trained with the signed graph of the half model, and the global model is
    # the same either way (to the graphs' parity)
    from fedge.clients.onnx_client import _loaded

    assert any(path.endswith(str(Path("onnx") / "bundles" / "training-w0.5.zip")) for path, *_ in _loaded)
    bundle = read_training_bundle(runs["onnx"] / "bundles" / "training-w0.5.zip",
                                  trusted_keys=[runs["onnx"] / "keys" / "signing.pub"])
    assert bundle.manifest["model_id"].endswith("training-w0.5")
    torch_model, onnx_model = (load_checkpoint(run / "checkpoint.npz").arrays for run in (runs["torch"], runs["onnx"]))
    for name, value in torch_model.items():
        np.testing.assert_allclose(onnx_model[name], value, atol=1e-4)




@pytest.mark.slow
@pytest.mark.deployment
def test_deployed_devices_train_their_widths_over_a_real_superlink(tmp_path: Path) -> None:
    # Prepare: a TLS coordinator whose fleet file gives "small" devices half the model; two small devices and a
    # laptop (the whole model), all unknown to it until they reply
    from fedge.simulation.loopback import LoopbackFederation

    (tmp_path / "fleet.toml").write_text(fleet_toml(small=2, width=0.5, big=1, big_profile="laptop"))
    federation = LoopbackFederation(tmp_path, num_devices=3)
    try:
        federation.start_coordinator("--rounds", "2", "--clients-per-round", "3", "--run-config",
                                     f"model='mlp' local-epochs=2 runtime='torch' round-timeout=900.0 "
                                     f"sub-models='heterofl' fleet-file='{tmp_path / 'fleet.toml'}'")
        for index, profile in enumerate(("small", "small", "laptop")):
            federation.start_device(index, None, "--profile", profile, "--fleet-file", str(tmp_path / "fleet.toml"))
        # Execute
        federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 900, "the summary")
    finally:
        federation.close()
    # Assert: round 1 sends every device the smallest width (none has named its profile yet); round 2 the laptop
    # the whole model; both rounds aggregate; the half model is signed and published for small devices to pull
    rows = federation.rows()
    first, second = (row["bytes_down_by_profile"] for row in rows[1:3])
    assert first["laptop"] == pytest.approx(first["small"] / 2, rel=0.02)
    assert second["laptop"] > 1.5 * second["small"] / 2  # per small device: half the hidden units
    assert all(row["aggregated"] and row["participants"] == 3 for row in rows[1:])
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.2
    assert (tmp_path / "state" / "published" / "inference-w0.5.zip").is_file()


def test_sub_models_compose_with_codecs_both_ways_and_a_deadline(tmp_path: Path) -> None:
    # Prepare: the quarter-width devices send top-k + int8 deltas and receive fp16; the round keeps the first 5
    # replies of the 6 asked (a deadline with over-selection)
    from fedge.server.report import read_jsonl
    from fedge.simulation.runner import simulate

    (tmp_path / "fleet.toml").write_text(fleet_toml(small=4, width=0.25, big=2))
    overrides = {"dataset": "digits", "model": "cnn", "fleet-file": str(tmp_path / "fleet.toml"),
                 "sub-models": "fedrolex", "num-rounds": 3, "clients-per-round": 5, "over-selection": 1.2,
                 "round-policy": "deadline", "deadline-s": 60.0, "codec.small": "topk:0.5+int8",
                 "downlink.small": "fp16", "export-onnx": False}
    # Execute
    run, summary = simulate({**overrides, "run-dir": str(tmp_path / "run")}, progress=False)
    # Assert: every round aggregated 5 devices with nothing rejected, and the model learnt
    rows = read_jsonl(run / "metrics.jsonl")[1:]
    assert all(row["aggregated"] and row["participants"] == 5 and row["rejected"] == 0 for row in rows)
    assert summary["final_accuracy"] > 0.5
    # the codecs work on the quarter model's slices: fp16 down (2 bytes an entry), top-k + int8 up (under 0.6 x fp32)
    task = digits("cnn")
    quarter = width_plan(task, seeded_model(task, 0)).parameters_at(0.25)
    last = rows[-1]
    asked_small = 4  # all 6 devices are asked (5 x 1.2), the first 5 replies kept
    assert last["bytes_down_by_profile"]["small"] / asked_small == pytest.approx(2 * quarter, rel=0.05)
    replied_small = last["participants_by_profile"]["small"]
    assert last["bytes_up_by_profile"]["small"] / replied_small < 0.6 * 4 * quarter
