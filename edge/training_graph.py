"""Export a task model's training step (loss and gradients) and evaluation as plain ONNX graphs.

A device without torch trains with these graphs and numpy (:mod:`fedge.edge.trainer`). The
training graph takes every state entry (weights and buffers), a batch and its targets and
gives the mean loss and the gradient of every trainable weight; the optimiser update stays
outside, in numpy, so momentum and FedProx need nothing from the graph. Weights are inputs,
never constants, so one graph serves every round and devices cache it by its hash.

Why hand-written: onnxruntime-training (ORT's training artifacts) is discontinued and needs
a special ORT build; ExecuTorch's training extension gave wrong CNN gradients; exporting
``torch.func.grad_and_value`` with ``torch.export`` fails in torch 2.13. What works (measured
in the on-device training notes): trace ``functional_call`` + ``grad_and_value`` with
``make_fx(tracing_mode="symbolic")`` and a decomposition table, then export that FX graph
with ``torch.onnx.export(dynamo=True)``. Three traps are handled here:

* onnxscript translates ``aten.nll_loss_forward/backward`` with the total weight faked as 1,
  so mean-reduced gradients come out batch-size times too large: torch's own decompositions
  replace them;
* ``aten.convolution_backward`` has no ONNX translation: :func:`_convolution_backward`
  writes it as two convolutions;
* the exporter stores a stack trace per node, 75-80 % of the file: stripped.

Every export is checked: ``parity_steps`` steps of SGD with momentum under torch eager and
under onnxruntime + numpy from the same weights and batches must end within
:data:`PARITY_TOLERANCE`, or nothing is returned (so nothing gets signed).
"""

from __future__ import annotations

import copy
import functools
import logging
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fedge.edge.export import PARITY_TOLERANCE as INFERENCE_TOLERANCE
from fedge.edge.export import _checked_sample, _first_line, exception_messages
from fedge.edge.graph_cache import cached, forget, graph_cache, store, translation_key
from fedge.edge.trainer import GRAD_PREFIX, LOSS, OUTPUT, STATE_PREFIX, TARGETS, MomentumUpdate
from fedge.errors import ExportError
from fedge.signature import DTYPES, InputSpec

log = logging.getLogger("fedge.edge")

PARITY_TOLERANCE = 1e-5
# Past PARITY_TOLERANCE, the graph passes only if it lies no further than this many times torch's own
# float32 distance from the same training in float64 (see _parity).
DRIFT_FACTOR = 2.0
PARITY_BATCH = 16
aten = torch.ops.aten
# Ops whose results are random: a graph would draw different numbers than torch (or none).
RANDOM_OPS = ("bernoulli", "dropout", "rand", "randn", "randint", "normal", "uniform", "multinomial", "randperm",
              "exponential", "geometric", "cauchy", "log_normal", "poisson")
_SPECIALIZED = re.compile(r"You marked (\w+) as dynamic but your code specialized it to be a constant \((\d+)\)")
_FAILED_TARGET = re.compile(r"target=torch\.ops\.(\w+\.\w+)|OpOverload\(op='(\w+\.\w+)'|(\w+)::(\w+)")


@dataclass(frozen=True)
class StateEntry:
    """One ``state_dict`` entry, in ``state_dict`` order.

    ``trainable``: a parameter that gets a gradient; buffers (and frozen parameters) are
    passed through the graph unchanged.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool

    def manifest(self) -> dict[str, Any]:
        """The training manifest's entry."""
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "trainable": self.trainable}


@dataclass(frozen=True)
class TrainingGraphs:
    """The exported graphs and what they take.

    ``train_onnx`` inputs: ``state:<name>`` for every state entry (in order), then the task
    inputs under their :class:`InputSpec` names, then ``targets``; outputs: ``loss`` (the
    scalar mean loss), then ``grad:<name>`` for each trainable entry in order.
    ``eval_onnx``: the same inputs; outputs ``loss`` and ``output`` (the model's output).
    ``inputs`` is the signature the graphs take: named axes the model cannot vary (an LSTM
    fixes its sequence length) are given as the traced size. ``max_abs_diff`` is the largest
    weight difference between torch and onnxruntime + numpy after the parity steps.
    """

    train_onnx: bytes
    eval_onnx: bytes
    state: tuple[StateEntry, ...]
    inputs: tuple[InputSpec, ...]
    target_shape: tuple[int | str, ...]
    target_dtype: str
    max_abs_diff: float
    opset: int
    float64_drift: tuple[float, float] | None = None  # (onnx, torch) distance from float64 training, when checked


# --------------------------------------------------------------------------- decompositions


def _convolution_backward(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,  # noqa: A002
                          bias_sizes: Any, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                          transposed: bool, output_padding: Sequence[int], groups: int,
                          output_mask: Sequence[bool]) -> tuple[Any, Any, Any]:
    """``aten.convolution_backward`` as forward convolutions (it has no ONNX translation, nor a torch decomposition).

    grad_input is the transposed convolution of grad_output with the weight (output
    padding chosen to give back the input's size); grad_weight is a convolution of the
    input, batch and channels swapped, by grad_output used as the kernel, with stride
    and dilation swapped (groups kept by folding the group into the channel axis).
    """
    if transposed:
        raise NotImplementedError("the backward of a transposed convolution is not decomposed")
    dims = input.dim() - 2
    kernel = weight.shape[2:]
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        extra = [input.shape[2 + i] - ((grad_output.shape[2 + i] - 1) * stride[i] - 2 * padding[i]
                                       + dilation[i] * (kernel[i] - 1) + 1) for i in range(dims)]
        grad_input = aten.convolution(grad_output, weight, None, stride, padding, dilation, True, extra, groups)
    if output_mask[1]:
        batch, per_group = input.shape[0], input.shape[1] // groups
        spatial = input.shape[2:]
        folded = input.reshape(batch, groups, per_group, *spatial).transpose(0, 2)
        folded = folded.reshape(per_group, groups * batch, *spatial)
        result = aten.convolution(folded, grad_output.transpose(0, 1), None, dilation, padding, stride, False,
                                  [0] * dims, groups).transpose(0, 1)
        for axis in range(dims):
            result = result.narrow(2 + axis, 0, kernel[axis])
        grad_weight = result
    if output_mask[2]:
        grad_bias = grad_output.sum([0, *range(2, 2 + dims)])
    return grad_input, grad_weight, grad_bias


def decompositions() -> dict[Any, Callable[..., Any]]:
    """The decomposition table for tracing: torch's own where the ONNX translation is missing or wrong."""
    from torch._decomp import get_decompositions  # noqa: PLC0415

    table = get_decompositions([
        aten.nll_loss_forward, aten.nll_loss_backward,  # onnxscript fakes total_weight: grads batch-size too big
        aten.nll_loss2d_forward, aten.nll_loss2d_backward,  # same, for per-position targets (sequences)
        aten.max_pool2d_with_indices_backward,  # no translation
        aten.native_group_norm, aten.native_group_norm_backward,
        aten.native_layer_norm_backward, aten.embedding_dense_backward,
        aten._log_softmax_backward_data, aten._softmax_backward_data, aten.mse_loss_backward,
        aten.lstm,  # else CPU tracing picks mkldnn_rnn_layer, whose backward has no translation
    ])
    table[aten.convolution_backward.default] = _convolution_backward
    return table


# --------------------------------------------------------------------------- the export


def export_training_graphs(module: nn.Module, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                           sample_inputs: Sequence[np.ndarray], sample_targets: np.ndarray, *,
                           inputs: Sequence[InputSpec], parity_steps: int = 20, learning_rate: float = 0.05,
                           momentum: float = 0.9) -> TrainingGraphs:
    """Export ``module``'s training step and evaluation, and check them against torch.

    Parameters
    ----------
    module : nn.Module
        ``module(*inputs)`` gives the output (a :class:`fedge.server.bundles.TaskForward`
        works). State names are ``module.state_dict()``'s; for a wrapper whose whole state
        lies under its ``model`` attribute the ``model.`` prefix is dropped, so the names are
        those of ``model_arrays(model)``.
    loss : callable
        ``loss(output, targets)``: the mean loss of a batch (``Task.loss``).
    sample_inputs, sample_targets : np.ndarray
        Real examples (axis 0), one array per input: traced and used for the parity check.
    inputs : sequence of InputSpec
        The input signature; the batch axis (and other named axes the model can vary) stay dynamic.
    parity_steps, learning_rate, momentum : int, float, float
        The parity check: that many SGD steps with momentum on batches of 16 from the sample.

    Raises
    ------
    ExportError
        For a layer the graph cannot reproduce (BatchNorm in training mode, dropout or other
        random ops), a backward that cannot be traced or translated (naming the layer), or
        parity worse than :data:`PARITY_TOLERANCE`.
    """
    # torch's exporter warns four times per export that torchvision (not a dependency) is absent
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    module = module.cpu()
    was_training = module.training
    arrays = _checked_sample(inputs, sample_inputs)
    targets = np.ascontiguousarray(sample_targets)
    if len(targets) != len(arrays[0]):
        raise ExportError(f"{len(targets)} sample targets for {len(arrays[0])} sample examples; give one per example")
    try:
        _refuse_layers(module)
        names, state = _state(module)
        ops = _recorded_ops(module, names, state, arrays)
        _refuse_random(module, ops)
        traced = _Traced(module, loss, names, state, tuple(inputs), ops)
        train_onnx, specs, opset = traced.export(train=True, arrays=arrays, targets=targets)
        eval_onnx, _, _ = traced.export(train=False, arrays=arrays, targets=targets, specs=specs)
    finally:
        module.train(was_training)
    graphs = TrainingGraphs(train_onnx=train_onnx, eval_onnx=eval_onnx, state=state, inputs=specs,
                            target_shape=_target_shape(targets, specs, arrays), target_dtype=str(targets.dtype),
                            max_abs_diff=0.0, opset=opset)
    try:
        diff, drift = _parity(module, loss, names, graphs, arrays, targets, parity_steps, learning_rate, momentum)
        failed = drift is not None and not drift[0] <= DRIFT_FACTOR * drift[1]
    except Exception:
        if not traced.hits:
            raise
        failed = True
    finally:
        module.train(was_training)
    if failed and traced.hits:  # a cached translation that fails parity: dropped, and the step translated again
        log.warning("graph cache: a translation taken from %s failed the parity check against torch; removed, "
                    "translating again", graph_cache())
        forget(graph_cache(), traced.hits)
        return export_training_graphs(module, loss, sample_inputs, sample_targets, inputs=inputs,
                                      parity_steps=parity_steps, learning_rate=learning_rate, momentum=momentum)
    if failed and drift is not None:
        raise ExportError(f"{type(module).__name__}: after {parity_steps} SGD steps onnxruntime's weights differ from "
                          f"torch's by {diff:.3g} (tolerance {PARITY_TOLERANCE:g}) and lie {drift[0]:.3g} from exact "
                          f"(float64) training, where torch's float32 lies {drift[1]:.3g}; nothing is signed. Report "
                          "it with the model's layers and the torch/onnxscript versions")
    if drift is not None:
        log.info("%s: onnxruntime and torch drift %.2g apart in %d float32 steps, as float32 rounding does: both lie "
                 "within %.2g (onnx) / %.2g (torch) of exact float64 training", type(module).__name__, diff,
                 parity_steps, drift[0], drift[1])
    return replace(graphs, max_abs_diff=diff, float64_drift=drift)


def _target_shape(targets: np.ndarray, specs: Sequence[InputSpec],
                  arrays: Sequence[np.ndarray]) -> tuple[int | str, ...]:
    """The targets' shape: the batch axis by name, then sizes, or the name of an input's named axis of that size.

    Per-position targets of a sequence model share the inputs' ``sequence`` axis, say.
    """
    named = {int(array.shape[axis]): name for spec, array in zip(specs, arrays, strict=True)
             for axis, name in spec.dynamic_axes.items() if axis}
    return (str(specs[0].shape[0]), *(named.get(int(size), int(size)) for size in targets.shape[1:]))


# --------------------------------------------------------------------------- refusals


def _refuse_layers(module: nn.Module) -> None:
    """Refuse layers whose training the graph cannot reproduce, naming them."""
    for path, layer in module.named_modules():
        where = f"layer '{_strip(path) or type(module).__name__}' ({type(layer).__name__})"
        if isinstance(layer, nn.modules.batchnorm._BatchNorm) and layer.track_running_stats:
            raise ExportError(f"{where}: BatchNorm in training mode updates its running statistics, which the "
                              "training graph cannot return (they would freeze on the device); use GroupNorm or "
                              "LayerNorm, or BatchNorm(track_running_stats=False)")
        if isinstance(layer, nn.modules.dropout._DropoutNd) and layer.p > 0:
            raise ExportError(f"{where}: dropout draws random masks that an ONNX graph would not reproduce; "
                              "remove it (p=0) for on-device training")


def _refuse_random(module: nn.Module, ops: list[tuple[str, str]]) -> None:
    for op, path in ops:
        base = op.split(".")[-2] if "." in op else op
        if any(base.strip("_").startswith(name) for name in RANDOM_OPS):
            where = f"layer '{path}'" if path else f"{type(module).__name__}'s own forward()"
            raise ExportError(f"{where} calls the random op {op}: a training graph would not reproduce torch's "
                              "draws; remove the randomness from forward() for on-device training")


def _strip(path: str) -> str:
    return path.removeprefix("model.") if path.startswith("model.") else path


def _state(module: nn.Module) -> tuple[list[str], tuple[StateEntry, ...]]:
    """(state_dict names in the module, the entries under the names devices use)."""
    state = module.state_dict(keep_vars=True)
    if not state:
        raise ExportError(f"{type(module).__name__} has no weights: nothing to train")
    parameters = {id(p) for p in module.parameters() if p.requires_grad}
    if len({id(t) for t in state.values()}) != len(state):
        raise ExportError(f"{type(module).__name__} shares one tensor between state entries (tied weights); the "
                          "training graph needs each weight once: untie them for on-device training")
    prefix = "model." if isinstance(getattr(module, "model", None), nn.Module) and all(
        name.startswith("model.") for name in state) else ""
    entries = []
    for name, tensor in state.items():
        if str(tensor.dtype).removeprefix("torch.") not in DTYPES:
            raise ExportError(f"state entry '{name}' is {tensor.dtype}; on-device training takes float32 weights")
        entries.append(StateEntry(name.removeprefix(prefix), tuple(tensor.shape), str(tensor.dtype).removeprefix(
            "torch."), id(tensor) in parameters))
    if not any(entry.trainable for entry in entries):
        raise ExportError(f"{type(module).__name__} has no parameter that requires a gradient: nothing to train")
    return list(state), tuple(entries)


# --------------------------------------------------------------------------- who calls which op


class _Recorder(TorchDispatchMode):
    """Records every aten op with the innermost module path running it (forward hooks set the path)."""

    def __init__(self) -> None:
        super().__init__()
        self.path: list[str] = []
        self.ops: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append((str(func), self.path[-1] if self.path else ""))
        return func(*args, **(kwargs or {}))


@contextmanager
def _hooked(module: nn.Module, recorder: _Recorder) -> Iterator[None]:
    def enter(path: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            recorder.path.append(path)
        return hook

    def leave(*_: Any) -> None:  # returns None: a forward hook's result would replace the layer's output
        recorder.path.pop()

    handles = []
    for path, layer in module.named_modules():
        if path:
            handles.append(layer.register_forward_pre_hook(enter(_strip(path))))
            handles.append(layer.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _recorded_ops(module: nn.Module, names: list[str], state: tuple[StateEntry, ...],
                  arrays: Sequence[np.ndarray]) -> list[tuple[str, str]]:
    """Every op one training-mode forward pass runs, with the layer running it (on copies of the weights)."""
    weights = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    recorder = _Recorder()
    module.train()
    with torch.no_grad(), _hooked(module, recorder), recorder:
        try:
            torch.func.functional_call(module, weights, tuple(torch.from_numpy(a[:2]) for a in arrays))
        except Exception as exc:  # noqa: BLE001 - whatever the model's forward raises
            raise ExportError(f"{type(module).__name__} fails on the sample inputs ({type(exc).__name__}: "
                              f"{_first_line(exc)}); check the task's input signature against the model") from exc
    return recorder.ops


def _op_name(op: str) -> str:
    """``aten.convolution.default`` -> ``convolution`` (``native_``/underscore prefixes dropped)."""
    parts = op.split(".")
    return (parts[1] if len(parts) > 1 else parts[0]).strip("_").removeprefix("native_")


def _layer_of(op: str, ops: list[tuple[str, str]]) -> str | None:
    """The layer whose forward ran ``op``, or the forward op of a backward op ``X_backward``."""
    base = _op_name(op)
    forward = base.removesuffix("_data").removesuffix("_backward")
    for name, path in ops:
        called = _op_name(name)
        if path and (called == base or called.startswith(forward)):
            return path
    return None


# --------------------------------------------------------------------------- tracing and translation


class _Traced:
    """Traces and exports the training and the evaluation function of one module."""

    def __init__(self, module: nn.Module, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 names: list[str], state: tuple[StateEntry, ...], specs: tuple[InputSpec, ...],
                 ops: list[tuple[str, str]]) -> None:
        self.module, self.loss, self.names, self.state, self.specs, self.ops = module, loss, names, state, specs, ops
        self.trainable = [name for name, entry in zip(names, state, strict=True) if entry.trainable]
        self.hits: list[str] = []  # keys of the translations taken from the graph cache

    def _train_step(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        count = len(self.names)
        weights = dict(zip(self.names, args[:count], strict=True))
        batch, targets = args[count:-1], args[-1]
        frozen = {name: value for name, value in weights.items() if name not in self.trainable}

        def objective(params: dict[str, torch.Tensor]) -> torch.Tensor:
            output = torch.func.functional_call(self.module, {**frozen, **params}, tuple(batch))
            return self.loss(output, targets)

        grads, value = torch.func.grad_and_value(objective)({name: weights[name] for name in self.trainable})
        return (value, *(grads[name] for name in self.trainable))

    def _eval_step(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = len(self.names)
        weights = dict(zip(self.names, args[:count], strict=True))
        batch, targets = args[count:-1], args[-1]
        output = torch.func.functional_call(self.module, weights, tuple(batch))
        if not isinstance(output, torch.Tensor):
            raise ExportError(f"{type(self.module).__name__} returns {type(output).__name__}; a training bundle "
                              "needs one output tensor")
        return self.loss(output, targets).detach(), output.detach()

    def export(self, *, train: bool, arrays: Sequence[np.ndarray], targets: np.ndarray,
               specs: tuple[InputSpec, ...] | None = None) -> tuple[bytes, tuple[InputSpec, ...], int]:
        """The stripped ONNX graph, the signature it takes and its opset."""
        from torch.fx.experimental.proxy_tensor import make_fx  # noqa: PLC0415

        self.module.train(train)
        self.arrays = arrays
        size = _trace_batch(arrays, targets, self.state)
        weights = tuple(t.detach().clone() for t in self.module.state_dict().values())
        sample = tuple(torch.from_numpy(_repeat(a, size)) for a in arrays)
        example = (*weights, *sample, torch.from_numpy(_repeat(targets, size)))
        function = self._train_step if train else self._eval_step
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                fakes = _symbolic_inputs(example, len(self.names), specs or self.specs,
                                         _target_shape(targets, specs or self.specs, arrays))
                tracker = _Recorder()  # its hooks say which layer's forward was running when tracing failed
                # mkldnn off: on CPU an LSTM would trace to mkldnn_rnn_layer, which has no ONNX translation
                with _hooked(self.module, tracker), torch.backends.mkldnn.flags(enabled=False):
                    graph = make_fx(function, tracing_mode="symbolic", decomposition_table=decompositions())(*fakes)
            except ExportError:
                raise
            except Exception as exc:  # noqa: BLE001 - tracing raises many types
                raise self._error("cannot be traced for training", exc, tracker.path[-1:]) from exc
            program, specs = self._program(graph, example, specs or self.specs, targets)
            outputs = [LOSS, *(GRAD_PREFIX + _strip_name(n, self) for n in self.trainable)] if train else [LOSS, OUTPUT]
            input_names = [*(STATE_PREFIX + e.name for e in self.state), *(s.name for s in specs), TARGETS]
            target_shape = _target_shape(targets, specs, arrays)
            cache = graph_cache()
            key = translation_key(graph, signature=(input_names, outputs, specs, target_shape),
                                  source=_own_source()) if cache is not None else ""
            if (hit := cached(cache, key)) is not None:
                _check_no_weights(onnx.load_from_string(hit[0]), self.state)
                self.hits.append(key)
                log.info("%s graph: torch's ONNX translation reused from %s (%s...)", "training" if train else
                         "evaluation", cache, key[:12])
                return hit[0], specs, hit[1]
            try:
                onnx_program = torch.onnx.export(program, dynamo=True, input_names=input_names,
                                                 output_names=outputs, verbose=False)
            except Exception as exc:  # noqa: BLE001 - the exporter raises many types
                raise self._error("cannot be translated to ONNX", exc) from exc
        if onnx_program is None:
            raise ExportError("torch.onnx.export returned no program; upgrade torch and onnxscript")
        proto = onnx_program.model_proto
        _name_axes(proto, specs, target_shape)
        _strip_metadata(proto)
        _check_no_weights(proto, self.state)
        data = proto.SerializeToString()
        store(cache, key, data)
        return data, specs, int(onnx_program.model.opset_imports.get("", 0))

    def _program(self, graph: Any, example: tuple[torch.Tensor, ...], specs: tuple[InputSpec, ...],
                 targets: np.ndarray) -> tuple[Any, tuple[InputSpec, ...]]:
        """``torch.export`` of the traced graph with the named axes dynamic; axes the model fixes are fixed."""
        for _ in range(3):
            try:
                return self._exported(graph, example, specs, targets), specs
            except ExportError as error:
                fixed = {name: int(size) for name, size in _SPECIALIZED.findall(str(error.__cause__))}
                batch = {str(spec.shape[0]) for spec in specs}
                if not fixed or batch & set(fixed):
                    raise
                log.warning("%s cannot vary axis %s in training: the training bundle takes %s only",
                            type(self.module).__name__, ", ".join(sorted(fixed)),
                            ", ".join(f"{name} = {size}" for name, size in sorted(fixed.items())))
                specs = tuple(replace(spec, shape=tuple(fixed.get(s, s) if isinstance(s, str) else s
                                                        for s in spec.shape)) for spec in specs)
        raise ExportError(f"{type(self.module).__name__}: the training graph's axes could not be settled")

    def _exported(self, graph: Any, example: tuple[torch.Tensor, ...], specs: tuple[InputSpec, ...],
                  targets: np.ndarray) -> Any:
        dims: dict[str, Any] = {}
        shapes: list[Any] = [None] * len(self.names)
        shapes += [{axis: dims.setdefault(name, torch.export.Dim(name)) for axis, name in spec.dynamic_axes.items()}
                   for spec in specs]
        target_shape = _target_shape(targets, specs, self.arrays)
        shapes.append({axis: dims[name] for axis, name in enumerate(target_shape) if isinstance(name, str)})
        try:
            return torch.export.export(graph, example, dynamic_shapes=tuple(shapes), strict=False)
        except Exception as exc:  # noqa: BLE001 - torch.export raises many types
            fixed = _SPECIALIZED.findall(str(exc))
            batch = str(specs[0].shape[0])
            if any(name == batch for name, _ in fixed):
                raise ExportError(f"{type(self.module).__name__}'s training step fixes the batch axis to "
                                  f"{dict(fixed)[batch]}: a device trains on any batch size, so the model must "
                                  "take any number of examples (no batch size written into a reshape)") from exc
            raise ExportError(f"torch.export cannot take {type(self.module).__name__}'s traced training step "
                              f"({type(exc).__name__}: {_first_line(exc, 400)})") from exc

    def _error(self, what: str, exc: BaseException, running: Sequence[str] = ()) -> ExportError:
        text = "\n".join(exception_messages(exc))
        found = _FAILED_TARGET.search(text)
        op = None
        if found:
            op = found.group(1) or found.group(2) or f"{found.group(3)}.{found.group(4)}"
        layer = _layer_of(op, self.ops) if op else None
        layer = layer or (running[-1] if running else None)
        if layer and not op:  # name the layer's own ops (a custom op, say), else its type
            op = next((name for name, path in self.ops if path == layer), None)
            op = op.removesuffix(".default") if op else None
        where = f"layer '{layer}' ({type(self.module.get_submodule(_unstrip(layer, self.module))).__name__})" \
            if layer else f"{type(self.module).__name__}"
        detail = f"op {op}" if op else "an op"
        return ExportError(f"{where}: the backward of {detail} {what} ({type(exc).__name__}: "
                           f"{_first_line(exc, 300)}); replace that layer with standard torch layers (Linear, "
                           "Conv, GroupNorm, LSTM...) for on-device training, or export without training")


@functools.cache
def _own_source() -> bytes:
    """This module's source (part of a translation's cache key: its decompositions and clean-up), read once."""
    return Path(__file__).read_bytes()


def _unstrip(path: str, module: nn.Module) -> str:
    """The module path ``_strip`` shortened, as ``module.get_submodule`` takes it."""
    names = dict(module.named_modules())
    return path if path in names else f"model.{path}"


def _strip_name(name: str, traced: _Traced) -> str:
    return traced.state[traced.names.index(name)].name




def _symbolic_inputs(example: tuple[torch.Tensor, ...], count: int, specs: Sequence[InputSpec],
                     target_shape: tuple[int | str, ...]) -> tuple[torch.Tensor, ...]:
    """``example`` as fake tensors whose named axes only are symbolic.

    ``make_fx(tracing_mode="symbolic")`` would make every size symbolic, weights' included,
    and spend most of a minute reasoning about them; weights have fixed shapes.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext  # noqa: PLC0415

    mode = FakeTensorMode(shape_env=ShapeEnv())
    axes: list[set[int]] = [set() for _ in range(count)] + [set(spec.dynamic_axes) for spec in specs]
    axes.append({axis for axis, size in enumerate(target_shape) if isinstance(size, str)})

    def fake(tensor: torch.Tensor, dynamic: set[int]) -> torch.Tensor:
        sizes = [DimDynamic.DYNAMIC if axis in dynamic else DimDynamic.STATIC for axis in range(tensor.dim())]
        context: Any = StatelessSymbolicContext(dynamic_sizes=sizes, constraint_sizes=[None] * tensor.dim())
        return mode.from_tensor(tensor, symbolic_context=context)

    return tuple(fake(tensor, dynamic) for tensor, dynamic in zip(example, axes, strict=True))


def _trace_batch(arrays: Sequence[np.ndarray], targets: np.ndarray, state: tuple[StateEntry, ...]) -> int:
    """A batch size for tracing that no other size shares: symbolic tracing gives equal sizes one symbol."""
    taken = {size for a in (*arrays, targets) for size in a.shape[1:]}
    taken |= {size for entry in state for size in entry.shape}
    return next(size for size in range(3, 10_000) if size not in taken)


def _repeat(array: np.ndarray, size: int) -> np.ndarray:
    """``size`` examples of ``array`` (repeated as needed)."""
    reps = -(-size // len(array))
    return np.ascontiguousarray(np.concatenate([array] * reps)[:size])


def _name_axes(proto: onnx.ModelProto, specs: Sequence[InputSpec], target_shape: tuple[int | str, ...]) -> None:
    """Rename the exporter's axis symbols (``s40``) to the signature's axis names (``batch``), in place."""
    declared = {spec.name: spec.shape for spec in specs} | {TARGETS: target_shape}
    names: dict[str, str] = {}
    for value in proto.graph.input:
        shape = declared.get(value.name, ())
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.dim_param and axis < len(shape) and isinstance(shape[axis], str):
                names[dim.dim_param] = str(shape[axis])
    for value in (*proto.graph.input, *proto.graph.output, *proto.graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in names:
                dim.dim_param = names[dim.dim_param]


def _strip_metadata(proto: onnx.ModelProto) -> None:
    """Drop per-node stack traces and doc strings: 75-80 % of the file, and of no use on a device."""
    del proto.metadata_props[:]
    proto.doc_string = ""
    graphs = [proto.graph, *(f for f in proto.functions)]
    for graph in graphs:
        for node in graph.node:
            del node.metadata_props[:]
            node.doc_string = ""
        if isinstance(graph, onnx.GraphProto):
            del graph.metadata_props[:]
            graph.doc_string = ""
            for value in (*graph.input, *graph.output, *graph.value_info):
                del value.metadata_props[:]
                value.doc_string = ""


def _check_no_weights(proto: onnx.ModelProto, state: tuple[StateEntry, ...]) -> None:
    """Weights are inputs: a constant as large as a weight would tie the graph to one round's weights."""
    shapes = {entry.shape for entry in state if entry.trainable and int(np.prod(entry.shape)) > 16}
    for tensor in proto.graph.initializer:
        if tuple(tensor.dims) in shapes and np.unique(onnx.numpy_helper.to_array(tensor)).size > 1:
            raise ExportError(f"the training graph holds a constant '{tensor.name}' as large as a weight; it must "
                              "take every weight as an input. Report it with the model's layers")


# --------------------------------------------------------------------------- parity


def _parity(module: nn.Module, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], names: list[str],
            graphs: TrainingGraphs, arrays: Sequence[np.ndarray], targets: np.ndarray, steps: int,
            learning_rate: float, momentum: float) -> tuple[float, tuple[float, float] | None]:
    """Largest weight difference between torch eager and onnxruntime + numpy after ``steps`` SGD steps.

    When that exceeds :data:`PARITY_TOLERANCE`, also how far each of the two lies from the
    same training done in float64 (onnx, torch): a deep model amplifies float32 rounding
    step after step (the images ResNet: ~3x a step), so two correct float32 runs drift apart;
    the graph is still right when it stays as close to the exact trajectory as torch does.
    """
    from fedge.edge.trainer import OnnxTrainer  # noqa: PLC0415

    manifest = {"state": [e.manifest() for e in graphs.state], "inputs": [s.manifest() for s in graphs.inputs],
                "targets": {"shape": list(graphs.target_shape), "dtype": graphs.target_dtype}, "metrics": []}
    trainer = OnnxTrainer(graphs.train_onnx, graphs.eval_onnx, manifest, threads=1)
    start = {entry.name: tensor.detach().numpy().copy()
             for entry, tensor in zip(graphs.state, module.state_dict().values(), strict=True)}
    rng = np.random.default_rng(0)
    batches = [rng.permutation(len(targets))[:PARITY_BATCH] for _ in range(steps)]
    onnx_weights, _ = trainer.train(start, arrays, targets, epochs=1, batch_size=PARITY_BATCH,
                                    learning_rate=learning_rate, momentum=momentum, seed=0, batches=batches)
    reference = torch_sgd(module, loss, batches, arrays, targets, learning_rate=learning_rate, momentum=momentum)
    onnx_state = [onnx_weights[entry.name] for entry in graphs.state]
    diff = _max_diff(onnx_state, list(reference.values()))
    _check_eval(module, loss, trainer, start, arrays, targets)
    if diff <= PARITY_TOLERANCE:
        return diff, None
    exact = torch_sgd(copy.deepcopy(module).double(), loss, batches, [_widened(a) for a in arrays], _widened(targets),
                      learning_rate=learning_rate, momentum=momentum)
    exact_state = list(exact.values())
    return diff, (_max_diff(onnx_state, exact_state), _max_diff(list(reference.values()), exact_state))


def _widened(array: np.ndarray) -> np.ndarray:
    """Float data in float64 (for the exact-arithmetic reference); integers (labels, tokens) as they are."""
    return array.astype(np.float64) if np.issubdtype(array.dtype, np.floating) else array


def _max_diff(first: Sequence[np.ndarray], second: Sequence[np.ndarray]) -> float:
    """Largest difference between two states given in the same (state_dict) order."""
    return max(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))
               for a, b in zip(first, second, strict=True))


def torch_sgd(module: nn.Module, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              batches: Sequence[np.ndarray], arrays: Sequence[np.ndarray], targets: np.ndarray, *,
              learning_rate: float, momentum: float) -> dict[str, np.ndarray]:
    """``module``'s state after torch eager SGD with momentum on ``batches`` (a copy: ``module`` is untouched)."""
    model = copy.deepcopy(module).train()
    params = [p for p in model.parameters() if p.requires_grad]
    update = MomentumUpdate(learning_rate=learning_rate, momentum=momentum)
    for index in batches:
        model.zero_grad(set_to_none=True)
        value = loss(model(*(torch.from_numpy(np.ascontiguousarray(a[index])) for a in arrays)),
                     torch.from_numpy(np.ascontiguousarray(targets[index])))
        value.backward()
        with torch.no_grad():
            current = {str(i): p.detach().numpy() for i, p in enumerate(params)}
            grads = {str(i): p.grad.numpy() for i, p in enumerate(params) if p.grad is not None}
            update.step(current, grads)
            for i, p in enumerate(params):
                p.copy_(torch.from_numpy(current[str(i)]))
    return {name: tensor.detach().numpy().copy() for name, tensor in model.state_dict().items()}


def _check_eval(module: nn.Module, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], trainer: Any,
                weights: dict[str, np.ndarray], arrays: Sequence[np.ndarray], targets: np.ndarray) -> None:
    """The evaluation graph's loss and output against torch's in eval mode (the inference tolerance)."""
    batch = tuple(np.ascontiguousarray(a[:PARITY_BATCH]) for a in arrays)
    batch_targets = np.ascontiguousarray(targets[:PARITY_BATCH])
    got_loss, got_output = trainer._eval.run(None, trainer._feeds(weights, batch, batch_targets))
    model = module.eval()
    with torch.no_grad():
        output = model(*(torch.from_numpy(a) for a in batch))
        expected = float(loss(output, torch.from_numpy(batch_targets)))
    diff = max(abs(float(got_loss) - expected), float(np.max(np.abs(got_output - output.numpy()), initial=0.0)))
    if not diff <= INFERENCE_TOLERANCE:
        raise ExportError(f"{type(module).__name__}: the evaluation graph differs from torch by {diff:.3g} "
                          f"(tolerance {INFERENCE_TOLERANCE:g}); nothing is signed. Report it with the model's layers")
