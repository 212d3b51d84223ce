"""Sub-models of common model shapes: each is scaled correctly or refused by name, never cut wrong silently.

"Correctly" is checked as an identity (for models without norm layers): a width's sub-model,
holding a window of the whole model, computes what the whole model computes with every entry
outside that window zeroed (:func:`fedge.task.submodel_check.first_divergent_layer`), for
HeteroFL's leading window and FedRolex's rolled ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedge.errors import ConfigError
from fedge.submodels import Offset, Segment, WidthPlan
from fedge.task.api import Task, TaskData, seeded_model
from fedge.task.submodel_check import first_divergent_layer
from fedge.task.submodels import check_cut, check_widths, probe_inputs, sub_model, width_plan

WIDTHS = (0.5, 0.25)
OFFSETS = (Offset(), Offset(index=1), Offset(index=3))


class TwoInputs(nn.Module):
    """An image branch (conv) and a tabular branch (MLP), concatenated before the head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3)
        self.mlp = nn.Linear(5, 16)
        self.head = nn.Linear(8 * 4 * 4 + 16, 3)

    def forward(self, image: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        pictures = torch.relu(self.conv(image)).flatten(1)
        return self.head(torch.cat([pictures, torch.relu(self.mlp(table))], dim=1))


class SkipJoin(nn.Module):
    """U-Net's join: an early layer's channels concatenated to a later one's, then a conv reads both."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(1, 8, 3, padding=1)
        self.inner = nn.Conv2d(8, 16, 3, padding=1)
        self.up = nn.Conv2d(8 + 16, 8, 1)
        self.head = nn.Linear(8, 3)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        early = torch.relu(self.down(image))
        joined = torch.cat((early, torch.relu(self.inner(early))), 1)
        return self.head(torch.relu(self.up(joined)).mean(dim=(2, 3)))


class WideAndDeep(nn.Module):
    """Raw inputs beside hidden features (the raw ones are whole at every width)."""

    def __init__(self) -> None:
        super().__init__()
        self.deep = nn.Linear(5, 32)
        self.head = nn.Linear(5 + 32, 3)

    def forward(self, table: torch.Tensor) -> torch.Tensor:
        return self.head(torch.concat([table, torch.tanh(self.deep(table))], dim=-1))


class Sequence(nn.Module):
    """Tokens through an embedding, mixed per position by an MLP whose features are moved last."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.mix = nn.Conv1d(16, 16, 1)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mixed = torch.relu(self.mix(self.embed(tokens).transpose(1, 2))).transpose(1, 2)
        return self.head(mixed.mean(dim=1))


class Gates(nn.Module):
    """GRU-style gates: one layer's units chunked into two halves."""

    def __init__(self) -> None:
        super().__init__()
        self.gates = nn.Linear(5, 32)
        self.head = nn.Linear(16, 3)

    def forward(self, table: torch.Tensor) -> torch.Tensor:
        value, gate = self.gates(table).chunk(2, dim=-1)
        return self.head(value * torch.sigmoid(gate))


class Sliced(nn.Module):
    """The first half of a layer's units taken by slicing."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(5, 32)
        self.head = nn.Linear(16, 3)

    def forward(self, table: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(table))[:, :16])


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 16)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, table: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(table).unsqueeze(1)
        return self.head(self.attention(tokens, tokens, tokens)[0][:, 0])


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 16)
        self.encoder = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, table: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(table).unsqueeze(1))[:, 0])


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(5, 16, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, table: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(table.unsqueeze(1))[0][:, -1])


def zoo_task(model: type[nn.Module], *inputs: np.ndarray) -> Task:
    class Zoo(Task):
        name = f"zoo-{model.__name__.lower()}"

        def build_model(self) -> nn.Module:
            return model()

        def train_data(self) -> TaskData:
            return TaskData(inputs, np.arange(len(inputs[0])) % 3)
    return Zoo()


RNG = np.random.default_rng(0)
IMAGES, TABLE = RNG.normal(size=(4, 1, 6, 6)).astype(np.float32), RNG.normal(size=(4, 5)).astype(np.float32)
TOKENS = RNG.integers(0, 10, size=(4, 7))
SCALED = {
    "two inputs concatenated": zoo_task(TwoInputs, IMAGES, TABLE),
    "U-Net skip join": zoo_task(SkipJoin, IMAGES),
    "wide and deep": zoo_task(WideAndDeep, TABLE),
    "embedding, transposed conv1d": zoo_task(Sequence, TOKENS),
}
REFUSED = {
    "chunked gates": (zoo_task(Gates, TABLE),
                      r"module '<model>' at test_submodel_zoo.py:\d+ in forward: chunk splits the hidden features"),
    "sliced units": (zoo_task(Sliced, TABLE), r"indexing takes 16 of the 32 hidden features"),
    "multi-head attention": (zoo_task(Attention, TABLE), r"layer 'attention' \(MultiheadAttention\) cannot be "
                                                         "width-scaled"),
    "transformer encoder": (zoo_task(Encoder, TABLE), r"layer 'encoder.self_attn' \(MultiheadAttention\)"),
    "GRU": (zoo_task(Recurrent, TABLE), r"layer 'rnn' \(GRU\) cannot be width-scaled"),
}


@pytest.mark.parametrize("shape", list(SCALED))
def test_a_width_computes_what_the_whole_model_computes_on_its_window(shape: str) -> None:
    # Prepare
    task = SCALED[shape]
    model = seeded_model(task, 0)
    plan, inputs = width_plan(task, model), probe_inputs(task)
    state = {name: value.detach().numpy() for name, value in model.state_dict().items()}
    check_widths(task, model, plan, WIDTHS)
    for width in WIDTHS:
        for offset in OFFSETS:
            window = plan.window(width, offset)
            small = sub_model(task, plan.sub_shapes(width))
            small.load_state_dict({name: torch.as_tensor(value) for name, value in window.take(state).items()})
            # Execute
            diverged = first_divergent_layer(task, model, small, window, inputs)
            # Assert
            assert diverged is None, f"{shape}: width {width} at {offset}: layer '{diverged}' differs"


def test_the_two_branch_head_reads_each_branchs_window_at_its_own_columns() -> None:
    # Prepare
    task = SCALED["two inputs concatenated"]
    # Execute
    plan = width_plan(task, seeded_model(task, 0))
    # Assert: 8 channels of 16 pixels, then 16 hidden units; the head holds 4 * 16 + 8 columns at width 0.5
    assert plan.layouts["head.weight"][1] == (Segment(128, 8), Segment(16, 16))
    assert plan.sub_shapes(0.5)["head.weight"] == (3, 72)


def test_the_wide_models_raw_inputs_stay_whole_at_every_width() -> None:
    # Prepare
    task = SCALED["wide and deep"]
    # Execute
    plan = width_plan(task, seeded_model(task, 0))
    # Assert
    assert plan.layouts["head.weight"][1] == (Segment(5, 5, fixed=True), Segment(32, 32))
    assert plan.sub_shapes(0.25)["head.weight"] == (3, 5 + 8)


@pytest.mark.parametrize("shape", ["two inputs concatenated", "U-Net skip join"])
def test_a_plan_that_ignored_the_join_is_refused_naming_the_layer_that_reads_it(shape: str) -> None:
    # Prepare: the plan fedge made before it followed torch.cat (each axis one segment of its own entries)
    task = SCALED[shape]
    model = seeded_model(task, 0)
    plan = width_plan(task, model)
    blind = WidthPlan(plan.shapes, plan.hidden)
    # Execute / Assert
    with pytest.raises(ConfigError, match=r"layer '(head|up)' of the sub-model computes something else"):
        check_cut(task, model, blind, 0.5, probe_inputs(task))


@pytest.mark.parametrize("shape", list(REFUSED))
def test_a_model_whose_features_a_width_cannot_follow_is_refused_by_name(shape: str) -> None:
    # Prepare
    task, message = REFUSED[shape]
    # Execute / Assert
    with pytest.raises(ConfigError, match=message):
        width_plan(task, seeded_model(task, 0))


class Grouped(nn.Module):
    """Convolutions normalised in groups of 4 channels (GroupNorm, as the images ResNet)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3)
        self.norm = nn.GroupNorm(4, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.conv(image))).mean(dim=(2, 3)))


@pytest.mark.parametrize("server_round", [1, 2, 3, 5])
def test_a_rolling_window_keeps_groupnorms_groups_whole(server_round: int) -> None:
    # Prepare
    from fedge.submodels import rolling_offset

    task = zoo_task(Grouped, IMAGES)
    model = seeded_model(task, 0)
    plan = width_plan(task, model)
    # Execute: FedRolex's window at width 1/4 (4 channels), one step a round
    window = plan.window(0.25, rolling_offset(0.25, server_round, stride=1))
    rows = np.arange(16)[window.axes["norm.weight"][0]]
    # Assert: one whole group, the (round - 1)-th (mod 4): a step is a group, not a channel
    group = (server_round - 1) % 4
    assert sorted(rows.tolist()) == list(range(4 * group, 4 * group + 4))
    check_widths(task, model, plan, [0.25, 0.5])


def test_a_plan_that_rolls_by_channels_through_a_groupnorm_is_refused() -> None:
    # Prepare: the plan without its GroupNorm step (a window moved one channel would split a group)
    task = zoo_task(Grouped, IMAGES)
    model = seeded_model(task, 0)
    plan = width_plan(task, model)
    by_channel = WidthPlan(plan.shapes, plan.hidden, plan.layouts)
    # Execute / Assert
    with pytest.raises(ConfigError, match=r"splits groups of GroupNorm 'norm' \(4 groups of 4 channels\)"):
        check_widths(task, model, by_channel, [0.25])
