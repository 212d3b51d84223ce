"""Width-scaled sub-models of a task's torch model (HeteroFL, FedRolex): which axes scale, the
sub-model a device of width ``r`` trains, and the memory that training takes.

The rule a model follows to be scaled (the built-in ``mlp``, ``cnn`` and ``images`` ResNet do):

* its weights live in ``Linear``, ``Conv1d/2d/3d`` (``groups = 1``), ``Embedding``,
  ``BatchNorm``, ``GroupNorm``, ``LayerNorm`` (over one axis) and ``InstanceNorm`` layers;
* the layers that read the model's inputs keep their input size, and the last of the
  ``Linear``/``Conv``/``Embedding`` layers to run is the output layer and keeps its output size;
  every other channel and hidden-unit axis scales by ``r``;
* hidden features are joined only by elementwise operations (residual sums), pooling, a
  channel-major flatten or ``torch.cat`` (followed: :mod:`fedge.task.feature_layout`), never
  split; ``forward`` computes no size from constants that a width changes.

A model that breaks the rule is refused when the run starts, with the layer named. Which axes
are the inputs' and the output's is found by running the model once: a layer whose inputs
need no gradient reads the model's inputs (directly or reshaped). The sub-model is the same
module tree with smaller weights (built on torch's ``meta`` device and then allocated at the
sub-model's size, so a small device never allocates the full model).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import nn

from fedge.errors import ConfigError
from fedge.submodels import Offset, Segment, WidthPlan
from fedge.task.api import Task, seeded_model
from fedge.task.feature_layout import NORMS, WEIGHTED, Layout, LayoutTracer
from fedge.task.submodel_check import first_divergent_layer, mixes_units

SCALABLE = "Linear, Conv1d/2d/3d (groups = 1), Embedding, BatchNorm, GroupNorm, LayerNorm (one axis), InstanceNorm"


@dataclass(frozen=True)
class Probe:
    """What one run of the full model showed: the layers in the order they ran, those that read
    the model's inputs, and the output layer."""

    order: tuple[str, ...]
    reads_inputs: frozenset[str]
    output_layer: str
    output_shape: tuple[int, ...]
    layouts: Mapping[str, Layout]


def probe_inputs(task: Task, batch: int = 2) -> tuple[torch.Tensor, ...]:
    """``batch`` examples of the task's training data as tensors (repeated when it has fewer)."""
    data = task.train_data()
    index = np.arange(batch) % len(data)
    return tuple(torch.as_tensor(np.asarray(array[index])) for array in data.inputs)


def probe(task: Task, model: nn.Module, inputs: Sequence[torch.Tensor]) -> Probe:
    """Run ``model`` once on ``inputs`` and note which weighted layers read them and which is last."""
    order: list[str] = []
    reads: set[str] = set()
    tracer = LayoutTracer()
    handles = tracer.watch(model)
    for name, module in _weighted_modules(model):
        def hook(module: nn.Module, args: tuple[object, ...], output: object, name: str = name) -> None:
            order.append(name)
            tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
            if tensors and not any(tensor.requires_grad for tensor in tensors):
                reads.add(name)
        handles.append(module.register_forward_hook(hook))
    try:
        with torch.enable_grad(), tracer:
            output = task.forward(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    layers = [name for name in order if isinstance(model.get_submodule(name), WEIGHTED)]
    if not layers:
        raise ConfigError(f"task '{task.name}': its model has no {SCALABLE.split(', Embedding')[0]} layer to scale; "
                          "run it without sub-models")
    if tracer.problems:
        raise ConfigError(f"task '{task.name}': its model cannot be width-scaled: {tracer.problems[0]}; a sub-model "
                          "would take other units there than the whole model. Give each part its own layer (two Linear "
                          "layers, not one split in two), or set sub-models = \"off\" (docs/sub-models.md)")
    return Probe(tuple(dict.fromkeys(order)), frozenset(reads), layers[-1], tuple(output.shape), tracer.inputs)


def _weighted_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module holding weights or buffers of its own, refusing those fedge cannot scale (named)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        if not own:
            continue
        if not isinstance(module, WEIGHTED + NORMS) or _grouped(module) or _multi_axis_layer_norm(module):
            kind = type(module).__name__
            raise ConfigError(f"layer '{name or '<model>'}' ({kind}) cannot be width-scaled: fedge scales {SCALABLE} "
                              "layers; set sub-models = \"off\" or build the model from those (docs/sub-models.md)")
        found.append((name, module))
    return found


def _grouped(module: nn.Module) -> bool:
    return isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d) and module.groups != 1


def _multi_axis_layer_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) and len(module.normalized_shape) != 1


def width_plan(task: Task, model: nn.Module, inputs: Sequence[torch.Tensor] | None = None) -> WidthPlan:
    """Which axes of each of ``model``'s arrays scale with the width.

    Raises
    ------
    ConfigError
        Naming a layer that cannot be scaled.
    """
    seen = probe(task, model, probe_inputs(task) if inputs is None else inputs)
    state = model.state_dict()
    hidden: dict[str, tuple[int, ...]] = {name: () for name in state}
    layouts: dict[str, dict[int, tuple[Segment, ...]]] = {}
    for layer, module in _weighted_modules(model):
        prefix = f"{layer}." if layer else ""
        axes = _hidden_axes(module, fixed_in=layer in seen.reads_inputs, fixed_out=_after_output(layer, seen))
        for array_name, value in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            hidden[prefix + array_name] = axes.get(array_name, ())
            axis = _input_axis(module)
            layout = seen.layouts.get(layer)
            if layout is not None and axis in hidden[prefix + array_name] and layout.size == value.shape[axis]:
                layouts.setdefault(prefix + array_name, {})[axis] = layout.segments
    return WidthPlan({name: tuple(value.shape) for name, value in state.items()}, hidden, layouts,
                     _group_quanta(model))


def _group_quanta(model: nn.Module) -> dict[int, int]:
    """For each channel count a GroupNorm normalises, its channels per group (the largest, if several)."""
    quanta: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, nn.GroupNorm) and module.num_channels // module.num_groups > 1:
            channels = module.num_channels
            quanta[channels] = math.lcm(quanta.get(channels, 1), channels // module.num_groups)
    return quanta


def _input_axis(module: nn.Module) -> int | None:
    """The axis of ``module``'s arrays that its input features index (None: its inputs are indices)."""
    if isinstance(module, nn.Embedding):
        return None
    return 0 if isinstance(module, NORMS) else 1


def _after_output(layer: str, seen: Probe) -> bool:
    """Whether ``layer`` is the output layer or a norm run after it (their channels are the outputs)."""
    if layer == seen.output_layer:
        return True
    order = seen.order
    return layer in order and order.index(layer) > order.index(seen.output_layer)


def _hidden_axes(module: nn.Module, *, fixed_in: bool, fixed_out: bool) -> dict[str, tuple[int, ...]]:
    """The hidden axes of each of ``module``'s own arrays (weight, bias, running statistics)."""
    if isinstance(module, NORMS):
        channel = () if fixed_in or fixed_out else (0,)
        return {"weight": channel, "bias": channel, "running_mean": channel, "running_var": channel}
    if isinstance(module, nn.Embedding):  # (vocabulary, dim): the vocabulary is the input
        return {"weight": () if fixed_out else (1,)}
    out_axes = () if fixed_out else (0,)
    in_axes = () if fixed_in else (1,)
    return {"weight": out_axes + in_axes, "bias": out_axes}


def sub_model(task: Task, shapes: Mapping[str, tuple[int, ...]]) -> nn.Module:
    """The task's model with each array at ``shapes`` (a sub-model's: what a device of width ``r`` holds).

    Built on the ``meta`` device, resized layer by layer, then allocated at its own size:
    the weights are uninitialised, to be loaded (:func:`fedge.task.models.load_arrays`).

    Raises
    ------
    ConfigError
        When ``shapes`` are not a width-scaling of the task's model (names, ranks, a norm's
        groups), naming the array.
    """
    with torch.device("meta"):
        model = task.build_model()
    full = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    if set(full) != set(shapes):
        raise ConfigError(f"sub-model arrays {sorted(set(shapes) ^ set(full))} are not the task's model's; "
                          "run the task the coordinator runs")
    for layer, module in _weighted_modules(model):
        prefix = f"{layer}." if layer else ""
        _resize(module, prefix, {name: shapes[prefix + name] for name, _ in
                                 [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]},
                full)
    return model.to_empty(device="cpu")


def _resize(module: nn.Module, prefix: str, shapes: dict[str, tuple[int, ...]],
            full: Mapping[str, tuple[int, ...]]) -> None:
    """Give ``module``'s own arrays ``shapes`` and its size attributes the sizes they imply."""
    for name, shape in shapes.items():
        whole = full[prefix + name]
        if len(shape) != len(whole) or any(not 0 < size <= limit for size, limit in zip(shape, whole, strict=False)):
            raise ConfigError(f"'{prefix}{name}' has shape {tuple(shape)}, which is no cut of the model's {whole}: a "
                              "sub-model is never larger than the model; run the task the coordinator runs")
        if name in module._parameters:
            module._parameters[name] = nn.Parameter(torch.empty(shape, device="meta"))
        else:
            module._buffers[name] = torch.empty(shape, device="meta", dtype=module._buffers[name].dtype)  # type: ignore[union-attr]
    weight = shapes.get("weight") or shapes.get("running_mean")
    if isinstance(module, nn.Linear) and weight:
        module.out_features, module.in_features = weight
    elif isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d) and weight:
        module.out_channels, module.in_channels = weight[:2]
    elif isinstance(module, nn.Embedding) and weight:
        module.embedding_dim = weight[1]
    elif isinstance(module, nn.GroupNorm) and weight:
        _regroup(module, prefix, weight[0])
    elif isinstance(module, nn.LayerNorm) and weight:
        module.normalized_shape = (weight[0],)
    elif weight:  # BatchNorm, InstanceNorm
        setattr(module, "num_features", weight[0])  # noqa: B010 - _BatchNorm/_InstanceNorm, not a Module attribute


def _regroup(module: nn.GroupNorm, prefix: str, channels: int) -> None:
    """Keep the channels a group holds (so a window of whole groups normalises as the full model does)."""
    per_group = module.num_channels // module.num_groups
    if channels % per_group:
        raise ConfigError(f"GroupNorm '{prefix.rstrip('.')}' has {module.num_groups} groups of {per_group} channels; "
                          f"{channels} channels are not whole groups: use a width that keeps whole groups")
    module.num_channels, module.num_groups = channels, channels // per_group


def check_widths(task: Task, model: nn.Module, plan: WidthPlan, widths: Sequence[float]) -> None:
    """Build each width's sub-model and run it once; refuse (naming the width) one that does not run
    or whose output is not the full model's shape."""
    inputs = probe_inputs(task)
    expected = tuple(task.forward(model, inputs).shape)
    for width in sorted(set(widths)):
        shapes = plan.sub_shapes(width)
        try:
            small = sub_model(task, shapes)
            with torch.no_grad():
                got = tuple(task.forward(small, inputs).shape)
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"task '{task.name}': its model at width {width:g} does not run ({exc}); its "
                              "forward must follow the scaling rule in docs/sub-models.md, or set sub-models = "
                              "\"off\"") from None
        if got != expected:
            raise ConfigError(f"task '{task.name}': at width {width:g} the model's output has shape {got}, not "
                              f"{expected}; its output layer must be the last Linear/Conv (docs/sub-models.md)")
        check_cut(task, model, plan, width, inputs)


CHECKED_OFFSETS = (Offset(), Offset(index=1), Offset(index=3))  # HeteroFL's leading window; FedRolex's rolled ones


def check_whole_groups(model: nn.Module, plan: WidthPlan, width: float) -> None:
    """Refuse a plan whose windows split a GroupNorm's group (its sub-model would normalise other channels
    together than the whole model does), for the leading window and rolled ones."""
    for name, module in model.named_modules():
        if not isinstance(module, nn.GroupNorm) or f"{name}.weight" not in plan.shapes:
            continue
        per_group = module.num_channels // module.num_groups
        for offset in CHECKED_OFFSETS:
            rows = plan.window(width, offset).axes[f"{name}.weight"][0]
            held = np.zeros(module.num_channels, bool)
            held[slice(None) if rows is None else rows] = True
            if any(len(set(group)) > 1 for group in held.reshape(module.num_groups, per_group)):
                raise ConfigError(f"at width {width:g} ({plan.window(width, offset).describe()}) the window splits "
                                  f"groups of GroupNorm '{name}' ({module.num_groups} groups of {per_group} channels): "
                                  "use a width that keeps whole groups, or sub-models = \"heterofl\"")


def check_cut(task: Task, model: nn.Module, plan: WidthPlan, width: float, inputs: Sequence[torch.Tensor]) -> None:
    """Refuse a plan that does not cut ``model`` consistently at ``width``: its sub-model must compute what
    the whole model computes with the entries outside its window zeroed
    (:func:`fedge.task.submodel_check.first_divergent_layer`), for the leading window and rolled ones; a
    model with a LayerNorm (statistics over all units) is checked for whole GroupNorm groups only."""
    check_whole_groups(model, plan, width)
    if mixes_units(model):
        return
    state = {name: value.detach().cpu().numpy() for name, value in model.state_dict().items()}
    for offset in CHECKED_OFFSETS:
        window = plan.window(width, offset)
        small = sub_model(task, plan.sub_shapes(width))
        small.load_state_dict({name: torch.as_tensor(value) for name, value in window.take(state).items()})
        layer = first_divergent_layer(task, model, small, window, inputs)
        if layer is not None:
            raise ConfigError(f"task '{task.name}': at width {width:g} ({window.describe()}) layer '{layer}' of the "
                              "sub-model computes something else than the whole model on the same units: the "
                              "model joins or splits hidden features in a way fedge does not follow (e.g. "
                              "slicing them, or a size computed in forward); follow the scaling rule in "
                              "docs/sub-models.md, or set sub-models = \"off\"")


def training_memory_bytes(task: Task, model: nn.Module, batch_size: int, *, optimizer_copies: int = 3) -> int:
    """An estimate of the memory that training ``model`` on batches of ``batch_size`` takes, in bytes.

    ``(1 + optimizer_copies)`` float copies of the parameters (weights, gradients, the
    optimiser's momentum and the starting copy FedProx and the reply keep) plus twice the
    activations autograd keeps for the backward pass (counted from one forward pass: each
    saved tensor's storage once, parameters not again), once for themselves and once for their
    gradients. What torch's kernels take on top (workspaces, reordered copies) is not in it:
    :func:`measured_training_bytes` measures that, and fedge takes the larger of the two.
    """
    parameters = {value.untyped_storage().data_ptr() for value in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    inputs = probe_inputs(task, batch_size)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        task.forward(model, inputs)
    weights = sum(value.numel() * value.element_size() for value in model.parameters())
    return weights * (1 + optimizer_copies) + 2 * sum(saved.values())


KINETO_LOG_LEVEL = "KINETO_LOG_LEVEL"
KINETO_QUIET = "6"  # above kineto's USDT level (5), its highest: profiler_start / profiler_stop lines included


def quiet_profiler() -> None:
    """Keep torch's profiler (kineto) from writing ``USDT: ... profiler_start`` lines to stderr.

    Kineto reads ``KINETO_LOG_LEVEL`` when the profiler first starts in a process; it is set
    (unless the user set it) before then. Only kineto's own lines go: stderr stays open to
    everything else (fedge's lines, warnings, errors).
    """
    os.environ.setdefault(KINETO_LOG_LEVEL, KINETO_QUIET)


def measured_training_bytes(task: Task, model: nn.Module, batch_size: int, *, optimizer_copies: int = 3) -> int:
    """The memory one training step of ``model`` at ``batch_size`` takes on this machine's CPU kernels, in bytes.

    The peak of torch's CPU allocator during a forward pass, the loss, a backward pass and a
    momentum step (torch's profiler counts each allocation and free), plus the parameters'
    copies that exist before the step. The model's gradients are cleared afterwards.
    """
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415 - loads the profiler only when asked

    quiet_profiler()
    data = task.train_data()
    index = np.arange(batch_size) % len(data)
    inputs = tuple(torch.as_tensor(np.asarray(array[index])) for array in data.inputs)
    targets = torch.as_tensor(np.asarray(data.targets[index]))
    optimizer = task.optimizer(list(model.parameters()), lr=0.0, momentum=0.9)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        task.loss(task.forward(model, inputs), targets).backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)
    # each allocation once: an op's cpu_memory_usage includes its children's (conv2d -> convolution -> ... ->
    # empty would count one output five times), its self_cpu_memory_usage does not
    events = sorted((event for event in recorded.events() if event.self_cpu_memory_usage),
                    key=lambda event: event.time_range.start)
    current = peak = 0
    for event in events:
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    weights = sum(value.numel() * value.element_size() for value in model.parameters())
    return peak + weights * (optimizer_copies - 1)  # the weights and the starting copy exist before the step


@dataclass(frozen=True)
class TrainingMemory:
    """A sub-model's training memory: the estimate, the measured peak, and what fedge goes by (the larger)."""

    estimate: int
    measured: int

    @property
    def needed(self) -> int:
        """The larger of the two, in bytes."""
        return max(self.estimate, self.measured)


WIDTH_LADDER = (1.0, 0.5, 0.25, 0.125, 0.0625)  # what fedge picks from when a profile declares memory only


@lru_cache(maxsize=32)
def memory_at(task: Task, width: float, batch_size: int, seed: int = 0) -> TrainingMemory:
    """The training memory of the task's sub-model at ``width`` (cached per task, width and batch size)."""
    plan = full_plan(task, seed)
    small = sub_model(task, plan.sub_shapes(width))
    for weight in small.parameters():  # allocated, not initialised: give the step finite numbers
        nn.init.normal_(weight, std=0.01)
    for name, buffer in small.named_buffers():
        buffer.copy_(torch.ones_like(buffer) if name.endswith("running_var") else torch.zeros_like(buffer))
    return TrainingMemory(training_memory_bytes(task, small, batch_size),
                          measured_training_bytes(task, small, batch_size))


@lru_cache(maxsize=8)
def full_plan(task: Task, seed: int) -> WidthPlan:
    """The width plan of ``task``'s model (cached per task object)."""
    return width_plan(task, seeded_model(task, seed))


def widest_fitting(task: Task, memory_mb: float, batch_size: int, *, seed: int = 0,
                   ladder: Sequence[float] = WIDTH_LADDER) -> float | None:
    """The largest width of ``ladder`` whose training fits in ``memory_mb`` MiB; None when none does."""
    plan = full_plan(task, seed)
    for width in ladder:
        try:
            plan.check_width(width)
        except ConfigError:
            continue
        if memory_at(task, width, batch_size, seed).needed <= memory_mb * 2**20:
            return width
    return None


def model_for(task: Task, shapes: Mapping[str, tuple[int, ...]], *, seed: int) -> nn.Module:
    """The task's model for arrays of ``shapes``: the whole model (seeded), or the sub-model they are a cut of.

    What a device builds for the arrays an instruction carries: a device of width ``r`` never
    allocates the whole model.
    """
    if dict(shapes) == full_shapes(task):
        return seeded_model(task, seed)
    return sub_model(task, shapes)


def full_shapes(task: Task) -> dict[str, tuple[int, ...]]:
    """The task's model's array shapes, from a model built on the ``meta`` device (no memory)."""
    with torch.device("meta"):
        model = task.build_model()
    return {name: tuple(value.shape) for name, value in model.state_dict().items()}


def scaled_layers(model: nn.Module, task: Task) -> list[nn.Module]:
    """The layers of a sub-model that read scaled (hidden) inputs: fewer than the whole model's."""
    full = full_shapes(task)
    return [module for name, module in model.named_modules()
            if isinstance(module, WEIGHTED) and not isinstance(module, nn.Embedding)
            and module.weight.shape[1] < full[f"{name}.weight" if name else "weight"][1]]


def add_scaler(model: nn.Module, task: Task, width: float) -> list[torch.utils.hooks.RemovableHandle]:
    """HeteroFL's scaler on a sub-model of ``width`` (Diao et al., ICLR 2021, sec. 3.2): each layer that
    reads a scaled hidden input divides that input by ``width``, so its output estimates the whole
    model's (as inverted dropout does), and weights a sub-model trained fit back into the whole model.
    Returns the hooks (remove them to take it off).

    The paper divides each scaled layer's *output* (before its static BatchNorm, which undoes the
    scale) and turns the scaler off in evaluation. fedge's models have layers with no norm after
    them, where dividing every output would compound (``1 / r`` per layer: a quarter-width CNN's
    logits 64 times too large, and its training diverged); dividing each layer's input once is the
    same where a norm follows and the intended compensation where none does. It stays on in
    evaluation, and :func:`fold_scaler` puts it into the weights of a width's deliverable model.
    """
    if width >= 1:
        return []

    def scale(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (args[0] / width, *args[1:])

    return [module.register_forward_pre_hook(scale) for module in scaled_layers(model, task)]


def fold_scaler(model: nn.Module, task: Task, width: float) -> nn.Module:
    """``model`` (a sub-model of ``width``) with the scaler in its weights: each layer reading a scaled
    input has its weight (not its bias) divided by ``width``, which is what :func:`add_scaler` computes."""
    if width < 1:
        with torch.no_grad():
            for module in scaled_layers(model, task):
                module.weight.div_(width)  # type: ignore[operator]
    return model
