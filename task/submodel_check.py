"""Whether a width's sub-model computes what the whole model computes on its window: the check that a
plan cuts a model consistently.

A sub-model holding a window of the global model must compute exactly what the whole model
computes with every entry outside that window set to zero: each layer's units outside the
window then produce zero (no weight, no bias) and nothing reads them (their columns are zero).
Where the plan took the wrong units somewhere (features joined or split in a way it did not
follow), a layer reads different features in the two models and its outputs differ;
:func:`first_divergent_layer` names the first such layer. Per-channel and per-group norms
(BatchNorm and InstanceNorm in evaluation, GroupNorm over whole groups) keep the identity; a
LayerNorm's statistics span every unit, so a model with one is not checked this way.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from fedge.submodels import Window
from fedge.task.api import Task
from fedge.task.feature_layout import WEIGHTED, feature_dim

UNIT_MIXING_NORMS = (nn.LayerNorm,)  # statistics over all of a layer's units: a window changes them
RTOL, ATOL = 1e-4, 1e-5  # float32 sums in another order


def mixes_units(model: nn.Module) -> bool:
    """Whether ``model`` has a norm whose statistics span a layer's units (the identity does not apply)."""
    return any(isinstance(module, UNIT_MIXING_NORMS) for module in model.modules())


def zeroed_outside(model: nn.Module, window: Window) -> nn.Module:
    """A copy of ``model`` with every entry outside ``window`` set to zero."""
    zeroed = copy.deepcopy(model)
    state = zeroed.state_dict()
    with torch.no_grad():
        for name, value in state.items():
            if value.is_floating_point():
                keep = np.zeros(tuple(value.shape), bool)
                keep[window.outer_index(name, tuple(value.shape))] = True
                value.mul_(torch.as_tensor(keep, dtype=value.dtype))
    return zeroed


def first_divergent_layer(task: Task, model: nn.Module, small: nn.Module, window: Window,
                          inputs: Sequence[torch.Tensor]) -> str | None:
    """The first weighted layer (in the order they run) whose output in ``small`` (the window's
    sub-model, its weights loaded) differs from the window's units of the same layer's output in
    ``model`` zeroed outside the window; None when every layer and the output agree."""
    whole = _outputs(task, zeroed_outside(model, window), inputs)
    part = _outputs(task, small, inputs)
    for name, (module, got) in part.items():
        expected = whole[name][1]
        axes = window.axes.get(f"{name}.weight" if name else "weight", (None, None))
        rows = axes[1] if isinstance(module, nn.Embedding) else axes[0]  # the axis of its output units
        if rows is not None:
            dim = feature_dim(module, expected)
            expected = expected[(slice(None),) * dim + (rows,)] if isinstance(rows, slice) \
                else torch.index_select(expected, dim, torch.as_tensor(rows))
        if expected.shape != got.shape or not torch.allclose(got, expected, rtol=RTOL, atol=ATOL):
            return name
    return None


def _outputs(task: Task, model: nn.Module, inputs: Sequence[torch.Tensor]) -> Mapping[str, tuple[nn.Module,
                                                                                                   torch.Tensor]]:
    """Each weighted layer's output on ``inputs`` (its first call), in the order they ran, and the model's."""
    found: dict[str, tuple[nn.Module, torch.Tensor]] = {}

    def keep(name: str) -> Callable[[nn.Module, object, torch.Tensor], None]:
        def hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
            found.setdefault(name, (module, output.detach()))
        return hook

    handles = [module.register_forward_hook(keep(name)) for name, module in model.named_modules()
               if isinstance(module, WEIGHTED)]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            task.forward(model, inputs)
    finally:
        model.train(was)
        for handle in handles:
            handle.remove()
    return found
