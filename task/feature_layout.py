"""Which layers' units a hidden axis carries, found by running the model once: flattens and concatenations.

A width's window must take, on a layer's input axis, exactly the units its window takes on the
outputs of the layers that feed it. When a layer reads one layer's output (or a channel-major
flatten of it), the same fraction of the axis does that. When ``forward`` joins features with
``torch.cat`` (two branches before a head, a U-Net's skip features, raw inputs beside hidden
ones), the axis is several :class:`fedge.submodels.Segment` s, each windowed on its own.
:class:`LayoutTracer` follows every tensor a forward pass makes (a
:class:`torch.overrides.TorchFunctionMode`) and notes each weighted layer's input layout.

What it cannot follow is said, not guessed: splitting hidden features (``chunk``, ``split``,
slicing the feature axis, as GRU-style gates do) takes a different set of units in a sub-model
than in the whole model, so it is a *problem*, named with the module and the line of
``forward``; fedge refuses such a model for sub-models. An op whose effect on the feature axis
is unknown (a matmul contracting it, a reshape that moves it) drops what is known: the next
layer reads its input as one segment of its own units, the rule fedge had before, and
:func:`fedge.task.submodels.check_widths` still checks the result.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fedge.submodels import Segment

CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
CHANNEL_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d,
                 nn.InstanceNorm3d)
WEIGHTED = (nn.Linear, *CONV, nn.Embedding)  # layers with an input and an output axis
NORMS = (*CHANNEL_NORMS, nn.LayerNorm)  # one channel axis, scaled as the layer before them
JOINS = {torch.cat, torch.concat, torch.concatenate}
SPLITS = {torch.chunk, torch.split, torch.tensor_split, torch.unbind, torch.narrow, torch.select,
          torch.index_select, torch.Tensor.chunk, torch.Tensor.split, torch.Tensor.tensor_split, torch.Tensor.unbind,
          torch.Tensor.narrow, torch.Tensor.select, torch.Tensor.index_select, torch.Tensor.unsafe_split}
MOVES = {torch.transpose, torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes, torch.permute,
         torch.Tensor.permute, torch.movedim, torch.Tensor.movedim, torch.t, torch.Tensor.t}
HERE = str(Path(__file__).resolve())


@dataclass(frozen=True)
class Layout:
    """A tensor's feature dimension and what its entries are."""

    dim: int
    segments: tuple[Segment, ...]

    @property
    def size(self) -> int:
        """The feature axis' length."""
        return sum(segment.size for segment in self.segments)

    def is_plain(self) -> bool:
        """Whether it is one layer's own units (what a plan assumes when it says nothing)."""
        return len(self.segments) == 1 and not self.segments[0].fixed and self.segments[0].units == self.size


class LayoutTracer(TorchFunctionMode):
    """Follows feature layouts through one forward pass; see the module's docstring.

    Attributes
    ----------
    inputs : dict[str, Layout]
        Each weighted or norm layer's input layout, where it is more than one layer's own units.
    problems : list[str]
        What a width cannot cut consistently, each naming the module and the line.
    """

    def __init__(self) -> None:
        super().__init__()
        self.inputs: dict[str, Layout] = {}
        self.problems: list[str] = []
        self._layouts: dict[int, tuple[torch.Tensor, Layout]] = {}
        self._modules: list[str] = []

    def layout(self, tensor: object) -> Layout | None:
        """The layout noted for ``tensor`` (None: unknown, or not a hidden tensor)."""
        found = self._layouts.get(id(tensor))
        return found[1] if found is not None and found[0] is tensor else None

    def tag(self, tensor: object, layout: Layout | None) -> None:
        """Note ``tensor``'s layout (it is kept alive, so its id stays its own while tracing)."""
        if isinstance(tensor, torch.Tensor) and layout is not None and 0 <= layout.dim < tensor.ndim \
                and tensor.shape[layout.dim] == layout.size:
            self._layouts[id(tensor)] = (tensor, layout)

    def __torch_function__(self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tagged = [(tensor, layout) for tensor in _tensors(args, kwargs) if (layout := self.layout(tensor))]
        if func in JOINS:
            self._join(args, kwargs, out)
        elif tagged and func in SPLITS:
            self._split(func, tagged[0], args, kwargs, out)
        elif tagged and func is torch.Tensor.__getitem__:
            self._index(tagged[0], out)
        elif tagged:
            for tensor in _tensors((out,), {}):
                self.tag(tensor, _follow(func, args, kwargs, *tagged[0], tensor))
        return out

    def _join(self, args: Sequence[Any], kwargs: dict[str, Any], out: torch.Tensor) -> None:
        parts = list(args[0] if args else kwargs["tensors"])
        dim = _dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), parts[0].ndim)
        layouts = [self.layout(part) for part in parts]
        known = [layout for layout in layouts if layout is not None]
        if not known and not any(part.requires_grad for part in parts):
            return  # the model's inputs joined: not hidden
        if any(layout.dim != dim for layout in known):
            self.tag(out, known[0] if len({layout.dim for layout in known}) == 1 else None)  # e.g. a batch-axis join
            return
        segments: list[Segment] = []
        for part, layout in zip(parts, layouts, strict=True):
            size = int(part.shape[dim])
            segments.extend(layout.segments if layout else (Segment(size, size, fixed=not part.requires_grad),))
        self.tag(out, Layout(dim, tuple(segments)))

    def _split(self, func: Callable[..., Any], tagged: tuple[torch.Tensor, Layout], args: Sequence[Any],
               kwargs: dict[str, Any], out: Any) -> None:
        tensor, layout = tagged
        dim = _split_dim(func, args, kwargs, tensor.ndim)
        if dim == layout.dim and any(not segment.fixed for segment in layout.segments):
            self.problem(f"{_name(func)} splits the hidden features (axis {dim} of a {tuple(tensor.shape)} tensor)")
            return
        for piece in _tensors((out,), {}):
            shift = -1 if piece.ndim < tensor.ndim and dim < layout.dim else 0
            self.tag(piece, Layout(layout.dim + shift, layout.segments))

    def _index(self, tagged: tuple[torch.Tensor, Layout], out: Any) -> None:
        tensor, layout = tagged
        if not isinstance(out, torch.Tensor):
            return
        trailing = tensor.ndim - layout.dim
        if out.ndim >= trailing and tuple(out.shape[out.ndim - trailing:]) == tuple(tensor.shape[layout.dim:]):
            self.tag(out, Layout(out.ndim - trailing, layout.segments))
        elif out.ndim == tensor.ndim and out.shape[layout.dim] != tensor.shape[layout.dim]:
            self.problem(f"indexing takes {out.shape[layout.dim]} of the {tensor.shape[layout.dim]} hidden features")

    def problem(self, what: str) -> None:
        """Note what a width cannot cut, with the module and the line of ``forward`` that did it."""
        module = self._modules[-1] if self._modules else "<model>"
        self.problems.append(f"module '{module or '<model>'}' at {_caller()}: {what}")

    def watch(self, model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        """Hooks on every module of ``model``: the module stack, and each layer's input and output layouts."""
        handles = []
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(self._enter(name, module)))
            handles.append(module.register_forward_hook(self._leave(name, module)))
        return handles

    def _enter(self, name: str, module: nn.Module) -> Callable[..., None]:
        def hook(module_: nn.Module, args: tuple[Any, ...]) -> None:
            self._modules.append(name)
            layout = self.layout(args[0]) if args else None
            if layout is None or layout.dim != feature_dim(module, args[0]) or layout.is_plain():
                return
            if name in self.inputs and self.inputs[name] != layout:
                self.problem(f"layer '{name}' reads differently joined features on two calls")
            self.inputs[name] = layout
        return hook

    def _leave(self, name: str, module: nn.Module) -> Callable[..., None]:
        def hook(module_: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            self._modules.pop()
            if not isinstance(output, torch.Tensor):
                return
            dim = feature_dim(module, output)
            if isinstance(module, WEIGHTED):
                units = int(output.shape[dim])
                self.tag(output, Layout(dim, (Segment(units, units),)))
            elif isinstance(module, (nn.LayerNorm, *CHANNEL_NORMS)) and args:
                self.tag(output, self.layout(args[0]))
        return hook


def _tensors(args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, list | tuple):
            yield from (item for item in value if isinstance(item, torch.Tensor))


def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def feature_dim(module: nn.Module, tensor: torch.Tensor) -> int:
    """Where ``module`` reads (and writes) its features: the last axis, or the channels before a conv's spatial axes."""
    if isinstance(module, CONV):
        return tensor.ndim - 1 - len(module.kernel_size)
    if isinstance(module, CHANNEL_NORMS):
        return 1 if tensor.ndim > 1 else 0
    return tensor.ndim - 1


def _split_dim(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], ndim: int) -> int:
    """The axis a split op splits along (its ``dim`` argument; where the op takes it positionally)."""
    if "dim" in kwargs:
        return _dim(int(kwargs["dim"]), ndim)
    position = 1 if func in {torch.unbind, torch.Tensor.unbind, torch.select, torch.Tensor.select, torch.narrow,
                             torch.Tensor.narrow, torch.index_select, torch.Tensor.index_select} else 2
    return _dim(int(args[position]), ndim) if len(args) > position else 0


def _follow(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], source: torch.Tensor,
            layout: Layout, out: torch.Tensor) -> Layout | None:
    """``out``'s layout, made by ``func`` from ``source`` (None: unknown)."""
    dim, shape, new = layout.dim, tuple(source.shape), tuple(out.shape)
    if func in MOVES:
        return _moved(func, args, kwargs, source.ndim, layout)
    if len(new) == len(shape) and new[:dim + 1] == shape[:dim + 1]:
        return layout  # elementwise, pooling, a reshape of the axes after it
    if len(new) == dim + 1 and new[:dim] == shape[:dim] and new[dim] == math.prod(shape[dim:]):
        per = math.prod(shape[dim + 1:])  # a channel-major flatten: each unit's entries stay together
        return Layout(dim, tuple(Segment(s.size * per, s.units, s.fixed) for s in layout.segments))
    trailing = len(shape) - dim
    if len(new) >= trailing and new[len(new) - trailing:] == shape[dim:]:
        return Layout(len(new) - trailing, layout.segments)  # the batch axes reshaped, the features kept
    return None


def _moved(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], ndim: int,
           layout: Layout) -> Layout | None:
    order = list(range(ndim))
    values = [*args[1:], *kwargs.values()]
    if func in {torch.t, torch.Tensor.t}:
        order.reverse()
    elif func in {torch.permute, torch.Tensor.permute}:
        order = [_dim(int(d), ndim) for d in (values[0] if len(values) == 1 else values)]
    elif func in {torch.movedim, torch.Tensor.movedim}:
        order.insert(_dim(int(values[1]), ndim), order.pop(_dim(int(values[0]), ndim)))
    else:
        first, second = (_dim(int(d), ndim) for d in values[:2])
        order[first], order[second] = order[second], order[first]
    return Layout(order.index(layout.dim), layout.segments)


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", repr(func))


def _caller() -> str:
    """``model.py:42 in forward``: the innermost frame outside torch and fedge's own code."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and str(Path(frame.filename).resolve()) != HERE:
            return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"
    return "forward"
