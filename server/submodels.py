"""The coordinator's side of width-scaled sub-models: each profile's width, refused at start when it cannot work.

A profile's width is its ``model-width`` when the fleet file declares one, else the largest
width of :data:`fedge.task.submodels.WIDTH_LADDER` whose training memory (estimated from the
sub-model's parameters and its activations at ``batch-size``:
:func:`fedge.task.submodels.training_memory_bytes`) fits the profile's ``memory-mb``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord
from torch import nn

from fedge import knobs
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.profiles import Fleet
from fedge.strategies.submodels import SubModels, extraction
from fedge.submodels import WidthPlan
from fedge.task.api import Task
from fedge.task.models import load_arrays
from fedge.task.submodels import (
    TrainingMemory,
    add_scaler,
    check_widths,
    fold_scaler,
    memory_at,
    sub_model,
    widest_fitting,
    width_plan,
)

log = logging.getLogger("fedge.server")

WHERE = "docs/sub-models.md"


@dataclass(frozen=True)
class ProfileWidth:
    """One profile's width and why: declared, or what fits its memory."""

    profile: str
    width: float | None
    declared: bool
    memory_mb: int
    memory: TrainingMemory | None

    def describe(self) -> str:
        """``phone 0.25 (fits 64 MiB: training takes 14.8 MiB estimated, 40.1 measured)``."""
        shown = "sits out" if self.width is None else f"{self.width:g}"
        why = "declared" if self.declared else f"fits {self.memory_mb} MiB"
        used = "" if self.memory is None else (f": training takes {self.memory.estimate / 2**20:.1f} MiB estimated, "
                                               f"{self.memory.measured / 2**20:.1f} measured")
        return f"{self.profile} {shown} ({why}{used})"


def check_sub_models(config: RunConfig, fleet: Fleet) -> None:
    """Refuse, in one line each, what sub-models do not run with (yet)."""
    if config.text(knobs.SUB_MODELS) == "off":
        return
    refusals = {
        knobs.ASYNCHRONOUS: (config[knobs.ASYNCHRONOUS],
                             "stale updates of another round's window are not rebased per entry"),
        knobs.DP: (config.text(knobs.DP) != "off", "DP clips and noises the whole model's update, not a window's"),
        knobs.GATEWAYS: (config[knobs.GATEWAYS], "a gateway averages its pool into one whole-model update"),
    }
    for knob, (chosen, why) in refusals.items():
        if chosen:
            raise ConfigError(f"sub-models = {config[knobs.SUB_MODELS]} cannot run with {knob} = {config[knob]} "
                              f"({why}); turn one off ({WHERE})")


def profile_widths(config: RunConfig, task: Task, fleet: Fleet, plan: WidthPlan) -> list[ProfileWidth]:
    """Each of the fleet's profiles' width: declared (``model-width``) or the widest whose training fits
    ``memory-mb``. A device of a profile the fleet does not name counts as unknown (see :class:`SubModels`)."""
    batch, seed = config.integer(knobs.BATCH_SIZE), config.integer(knobs.SEED)
    found = []
    for name in dict.fromkeys(name for name, _ in fleet.mix):  # the fleet's profiles; any other is unknown
        profile = fleet.profile(name)
        if profile.model_width is not None:
            plan.check_width(profile.model_width)
            found.append(ProfileWidth(name, profile.model_width, True, profile.memory_mb, None))
            continue
        width = widest_fitting(task, profile.memory_mb, batch, seed=seed)
        found.append(ProfileWidth(name, width, False, profile.memory_mb,
                                  None if width is None else memory_at(task, width, batch, seed)))
    return found


def build_sub_models(config: RunConfig, task: Task, model: nn.Module, fleet: Fleet) -> SubModels | None:
    """The run's :class:`SubModels` (None when ``sub-models = "off"``), its widths logged.

    Raises
    ------
    ConfigError
        A model that cannot be scaled (its layer named), a declared width that does not cut its
        axes, or a fleet in which no profile can train.
    """
    name = config.text(knobs.SUB_MODELS)
    if name == "off":
        return None
    check_sub_models(config, fleet)
    plan = width_plan(task, model)
    if not any(plan.hidden.values()):
        raise ConfigError(f"task '{task.name}': its model has no hidden layer to scale (its input layer is its "
                          "output layer); set sub-models = \"off\"")
    widths = profile_widths(config, task, fleet, plan)
    in_fleet = {profile for profile, _ in fleet.mix}
    check_widths(task, model, plan, [w.width for w in widths if w.width is not None and w.profile in in_fleet])
    for found in widths:
        if found.width is None and found.profile in in_fleet:
            log.warning("sub-models: profile '%s' (memory-mb = %d) fits no width of the model at batch-size %d: its "
                        "devices sit out; give it more memory-mb or a model-width", found.profile, found.memory_mb,
                        config.integer(knobs.BATCH_SIZE))
    submodels = SubModels(plan, {w.profile: w.width for w in widths}, extraction(name),
                          scaler=config.flag(knobs.SUB_MODEL_SCALER), stride=config.integer(knobs.FEDROLEX_STRIDE))
    log.info("sub-models %s (the fleet's profiles: %s)", submodels.describe(),
             "; ".join(w.describe() for w in widths if w.profile in in_fleet))
    return submodels


def trained_widths(submodels: SubModels | None, fleet: Fleet) -> Mapping[str, float]:
    """The widths the fleet's profiles train, by profile (what bundles and the run report are made for)."""
    if submodels is None:
        return {}
    in_fleet = {profile for profile, _ in fleet.mix}
    return {name: float(width) for name, width in submodels.widths.items() if width is not None and name in in_fleet}


def leading_window_model(task: Task, model: nn.Module, plan: WidthPlan, width: float) -> nn.Module:
    """The task's sub-model at ``width`` holding the global ``model``'s leading window (HeteroFL's; under
    FedRolex every window is trained in turn and the leading one is what is shipped and exported)."""
    state = {name: value.detach().cpu().numpy() for name, value in model.state_dict().items()}
    small = sub_model(task, plan.sub_shapes(width))
    load_arrays(small, ArrayRecord({name: Array(np.ascontiguousarray(value))
                                    for name, value in plan.window(width).take(state).items()}),
                source=f"the global model at width {width:g}")
    return small


def width_model(task: Task, model: nn.Module, plan: WidthPlan, width: float, *, scaler: bool) -> nn.Module:
    """A width's deliverable model: :func:`leading_window_model`, with HeteroFL's scaler folded into its
    weights when the run uses it (what devices of that width run)."""
    small = leading_window_model(task, model, plan, width)
    return fold_scaler(small, task, width) if scaler else small


def training_sub_model(task: Task, model: nn.Module, plan: WidthPlan, width: float, *, scaler: bool) -> nn.Module:
    """The sub-model a device of ``width`` trains: :func:`leading_window_model` with the scaler's hooks if
    the run uses it (what a width's training graph is exported from: weights are its inputs)."""
    small = leading_window_model(task, model, plan, width)
    if scaler:
        add_scaler(small, task, width)
    return small


def width_training_graphs(task: Task, model: nn.Module, config: RunConfig, submodels: SubModels | None,
                          fleet: Fleet) -> dict[float, tuple[Any, list[str]]]:
    """Each trained width's training and evaluation graphs for onnx devices (exported and checked against
    torch like the whole model's; an export that fails is refused as the whole model's is)."""
    from fedge.server.training_bundle import export_training_graph  # noqa: PLC0415 - onnx loads only when exporting

    if submodels is None:
        return {}
    widths = sorted({width for width in trained_widths(submodels, fleet).values() if width < 1})
    return {width: export_training_graph(task, training_sub_model(task, model, submodels.plan, width,
                                                                  scaler=submodels.scaler), config)
            for width in widths}


def width_label(width: float) -> str:
    """``w0.25``: how bundles and reports name a width."""
    return f"w{width:g}"
