"""torch -> ONNX export with an onnxruntime parity check.

Uses torch's dynamo exporter (needs ``onnxscript``): ``torch.export`` traces the model
with every named axis of its :class:`~fedge.signature.InputSpec` s dynamic (one
``torch.export.Dim`` per axis name, so inputs that share an axis name share its size),
then the traced program is translated to ONNX with all weights inside the one ``.onnx``
file. A layer that cannot be traced or translated fails here with an :class:`ExportError`
naming it.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from fedge.errors import ExportError
from fedge.signature import InputSpec

log = logging.getLogger("fedge.edge")

PARITY_TOLERANCE = 1e-4
OUTPUT_NAME = "output"
LOGITS_NAME = "logits"
TRACE_BATCH = 2  # torch.export specialises an axis of size 0 or 1, so the trace sample has at least 2
_FAILED_NODE = re.compile(r"Error when translating node %(\w+)")
_FAILED_TARGET = re.compile(r"target=torch\.ops\.([\w.]+)")
_SPECIALIZED = re.compile(r"You marked (\w+) as dynamic but your code specialized it to be a constant \((\d+)\)")
_USER_CODE = re.compile(r'File "([^"]+)", line (\d+), in \w+\n\s*(.+)')


@dataclass(frozen=True)
class OutputInfo:
    """One output of an exported graph: its name, shape (axis names for dynamic axes) and dtype."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str


@dataclass(frozen=True)
class ExportReport:
    """Where the model went, what it gives, and how closely onnxruntime reproduces torch.

    ``inputs`` is the exported signature: the one asked for, except for ``fixed_axes``,
    named axes the model cannot vary (an ``nn.LSTM`` under ``torch.export`` fixes the
    sequence length, say), which the graph takes at their traced size only.
    """

    path: Path
    max_abs_diff: float
    opset: int
    outputs: tuple[OutputInfo, ...] = ()
    inputs: tuple[InputSpec, ...] = ()
    fixed_axes: dict[str, int] = field(default_factory=dict)

    @property
    def parity_ok(self) -> bool:
        """Whether onnxruntime's outputs are within :data:`PARITY_TOLERANCE` of torch's."""
        return self.max_abs_diff <= PARITY_TOLERANCE


def export_onnx(
    model: nn.Module,
    sample_inputs: Sequence[np.ndarray],
    path: str | Path,
    *,
    inputs: Sequence[InputSpec],
    output_name: str = OUTPUT_NAME,
) -> ExportReport:
    """Export ``model`` (eval mode, CPU) to ``path`` and compare it with torch on the sample.

    Parameters
    ----------
    model : nn.Module
        Called as ``model(*inputs)``; returns a tensor (or a tuple of tensors).
    sample_inputs : sequence of np.ndarray
        A batch of real inputs, one array per input (examples on axis 0), used to trace and
        to check parity. Named axes other than the batch need a size of at least 2 here.
    path : str or Path
        Output ``.onnx`` file (single file, no external data).
    inputs : sequence of InputSpec
        The model's input signature: graph input names, dtypes, and which axes are dynamic.
    output_name : str
        The graph's output name (``logits`` for class scores); further outputs get
        ``<output_name>_1``, ``<output_name>_2``...

    Raises
    ------
    ExportError
        If the sample does not match ``inputs``, or the model cannot be traced or translated
        to ONNX (naming the layer and op where torch says which).
    """
    path = Path(path)
    model = model.cpu().eval()
    arrays = _checked_sample(inputs, sample_inputs)
    trace = tuple(torch.from_numpy(_trace_batch(array)) for array in arrays)
    output_names = _output_names(model, trace, output_name)
    program, specs = _traced(model, trace, tuple(inputs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            onnx_program = torch.onnx.export(program, dynamo=True, input_names=[s.name for s in inputs],
                                             output_names=output_names, verbose=False)
        except Exception as exc:  # noqa: BLE001 - the exporter raises many types
            raise _translation_error(model, program, exc) from exc
    if onnx_program is None:
        raise ExportError(f"torch.onnx.export returned no program for {type(model).__name__}; "
                          "upgrade torch and onnxscript")
    onnx_program.save(str(path), external_data=False)
    opset = int(onnx_program.model.opset_imports.get("", 0))
    graph = _name_axes(path, specs)
    return ExportReport(path=path, max_abs_diff=parity_diff(model, path, arrays, specs), opset=opset,
                        outputs=tuple(_output_info(value) for value in graph.output), inputs=specs,
                        fixed_axes=_fixed_axes(inputs, specs))


def _checked_sample(specs: Sequence[InputSpec], sample: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """The sample as contiguous arrays; refused when it does not fit the specs or cannot be traced."""
    if not specs:
        raise ExportError("the model declares no inputs; give the task's input signature (Task.inputs)")
    if len(sample) != len(specs):
        raise ExportError(f"{len(sample)} sample arrays for {len(specs)} declared inputs "
                          f"({', '.join(s.describe() for s in specs)})")
    arrays = tuple(np.ascontiguousarray(array) for array in sample)
    for spec, array in zip(specs, arrays, strict=True):
        if not spec.matches(array):
            raise ExportError(f"sample input '{spec.name}' has shape {array.shape} {array.dtype}; the "
                              f"signature declares {spec.describe()}: make the task's inputs match its data")
        if len(array) == 0:
            raise ExportError(f"sample input '{spec.name}' holds no examples; export needs at least one")
        small = [name for axis, name in spec.dynamic_axes.items() if axis and array.shape[axis] < 2]
        if small:
            raise ExportError(f"sample input '{spec.name}' has size < 2 on dynamic axis {small}: torch.export "
                              "would fix that size; export with a sample of at least 2 there")
    return arrays


def _trace_batch(array: np.ndarray) -> np.ndarray:
    """The first :data:`TRACE_BATCH` examples (repeated when the sample has fewer)."""
    if len(array) >= TRACE_BATCH:
        return array[:TRACE_BATCH]
    return np.ascontiguousarray(np.concatenate([array] * TRACE_BATCH)[:TRACE_BATCH])


def _flat_outputs(result: Any) -> list[torch.Tensor]:
    """A model's result as a list of tensors (one tensor, or a tuple/list of them)."""
    items = list(result) if isinstance(result, tuple | list) else [result]
    if not items or not all(isinstance(item, torch.Tensor) for item in items):
        raise ExportError(f"the model returns {type(result).__name__}; bundles need a tensor or a tuple of tensors")
    return items


def _output_names(model: nn.Module, trace: tuple[torch.Tensor, ...], output_name: str) -> list[str]:
    """``output_name`` for the first output, ``<output_name>_<i>`` for the others."""
    try:
        with torch.no_grad():
            count = len(_flat_outputs(model(*trace)))
    except ExportError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the user's forward raises
        raise ExportError(f"{type(model).__name__} fails on the sample inputs ({type(exc).__name__}: "
                          f"{_first_line(exc)}); check the task's input signature against the model") from exc
    return [output_name] + [f"{output_name}_{index}" for index in range(1, count)]


def _traced(model: nn.Module, trace: tuple[torch.Tensor, ...],
            specs: tuple[InputSpec, ...]) -> tuple[Any, tuple[InputSpec, ...]]:
    """``torch.export`` of ``model`` with every named axis dynamic, and the signature it was traced with.

    A named axis other than the batch that the model fixes (torch says which) is traced
    again at its sample size, with a warning: the bundle then takes that size only.
    """
    try:
        return _export_program(model, trace, specs), specs
    except ExportError as error:
        fixed = {name: int(size) for name, size in _SPECIALIZED.findall(str(error.__cause__))}
        batch = {spec.shape[0] for spec in specs}
        if not fixed or batch & set(fixed):
            raise
    log.warning("%s cannot vary axis %s: the bundle takes %s only (torch.export fixes it; an nn.LSTM does)",
                type(model).__name__, ", ".join(sorted(fixed)),
                ", ".join(f"{name} = {size}" for name, size in sorted(fixed.items())))
    fixed_specs = tuple(replace(spec, shape=tuple(fixed.get(size, size) if isinstance(size, str) else size
                                                  for size in spec.shape)) for spec in specs)
    return _export_program(model, trace, fixed_specs), fixed_specs


def _export_program(model: nn.Module, trace: tuple[torch.Tensor, ...], specs: Sequence[InputSpec]) -> Any:
    dims: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            shapes = tuple({axis: dims.setdefault(name, torch.export.Dim(name))
                            for axis, name in spec.dynamic_axes.items()} for spec in specs)
            return torch.export.export(model, trace, dynamic_shapes=_by_parameter(model, shapes), strict=False)
        except Exception as exc:  # noqa: BLE001 - torch.export raises many types
            raise _trace_error(model, specs, sorted(dims), exc) from exc


def _fixed_axes(asked: Sequence[InputSpec], got: Sequence[InputSpec]) -> dict[str, int]:
    """Axis name -> size, for named axes of ``asked`` that ``got`` fixes."""
    return {name: int(b.shape[axis]) for a, b in zip(asked, got, strict=True)
            for axis, name in a.dynamic_axes.items() if not isinstance(b.shape[axis], str)}


def _by_parameter(model: nn.Module, shapes: tuple[dict[int, Any], ...]) -> tuple[Any, ...]:
    """``shapes`` grouped as ``forward``'s parameters take them: a ``*args`` parameter takes a tuple."""
    parameters = list(inspect.signature(model.forward).parameters.values())
    star = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    return shapes if star is None or star >= len(shapes) else (*shapes[:star], shapes[star:])


def _trace_error(model: nn.Module, specs: Sequence[InputSpec], axes: list[str], exc: BaseException) -> ExportError:
    """An ExportError saying why torch.export could not trace ``model``, and where when torch says."""
    fixed = _SPECIALIZED.findall(str(exc))
    if fixed:
        found = ", ".join(f"'{name}' to {size}" for name, size in fixed)
        batch = {spec.shape[0] for spec in specs} & {name for name, _ in fixed}
        fix = ("a bundle runs any batch size, so the model must take any number of examples (no batch size "
               "written into a reshape)" if batch else "declare that size instead of the axis name in the task's "
               "input signature, or make the model take any size there")
        return ExportError(f"{type(model).__name__} fixes dynamic axis {found}: {fix}")
    return ExportError(
        f"torch.export cannot trace {type(model).__name__} with dynamic axes {axes}{_user_code(exc)} "
        f"({type(exc).__name__}: {_first_line(exc, 600)}); make forward() free of data-dependent Python "
        "control flow, and make every axis the signature names dynamic really take any size"
    )


def _user_code(exc: BaseException) -> str:
    """`` at file.py:12 (`code`)``: the line of the model's code torch names, if it names one."""
    found = _USER_CODE.findall(str(exc))
    if not found:
        return ""
    path, line, code = found[-1]
    return f" at {Path(path).name}:{line} (`{code.strip()[:120]}`)"


def _translation_error(model: nn.Module, program: Any, exc: BaseException) -> ExportError:
    """An ExportError naming the layer and op the ONNX translation failed on."""
    messages = exception_messages(exc)
    node = _failed_node(program, messages)
    detail = _first_line(exc.__cause__ or exc, 300) if node is None else _root_line(exc)
    where = "an op" if node is None else _describe_node(node)
    return ExportError(
        f"{type(model).__name__}: {where} cannot be translated to ONNX ({detail}); replace that layer with "
        "standard torch layers, or register an ONNX translation for the op "
        "(torch.onnx.export(custom_translation_table=...))"
    )


def exception_messages(exc: BaseException) -> list[str]:
    """The texts of ``exc`` and its causes."""
    texts: list[str] = []
    current: BaseException | None = exc
    while current is not None and len(texts) < 10:
        texts.append(str(current))
        current = current.__cause__ or current.__context__
    return texts


def _failed_node(program: Any, messages: list[str]) -> Any:
    """The traced graph's node the exporter names in ``messages``, if any."""
    text = "\n".join(messages)
    names = set(_FAILED_NODE.findall(text))
    targets = set(_FAILED_TARGET.findall(text))
    for node in program.graph.nodes:
        if node.op == "call_function" and (node.name in names or str(node.target) in targets):
            return node
    return None


def _describe_node(node: Any) -> str:
    """``layer 'block.odd' (Weird), op mylib.weird.default``."""
    stack = list(node.meta.get("nn_module_stack", {}).values())
    op = f"op {node.target}"
    if not stack or not stack[-1][0]:
        return f"{op} in the model's own forward()"
    path, cls = stack[-1]
    return f"layer '{_module_path(path)}' ({str(getattr(cls, '__name__', cls)).rsplit('.', 1)[-1]}), {op}"


def _module_path(path: str) -> str:
    """``L['self'].block.odd`` -> ``block.odd`` (torch.export's module-stack keys vary by version)."""
    return re.sub(r"^L\['self'\]\.?", "", str(path)).replace("._modules['", ".").replace("']", "")


def _root_line(exc: BaseException) -> str:
    """The innermost cause's first line (what the exporter could not do)."""
    current = exc
    while current.__cause__ is not None:
        current = current.__cause__
    return _first_line(current, 300)


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return text if len(text) <= limit else text[:limit] + "..."


def _name_axes(path: Path, specs: Sequence[InputSpec]) -> onnx.GraphProto:
    """Rename the exporter's dynamic-axis symbols (``s77``) to the signature's axis names, in place."""
    model = onnx.load(str(path), load_external_data=False)
    graph_inputs = {value.name: value for value in model.graph.input}
    names: dict[str, str] = {}
    for spec in specs:
        dims = graph_inputs[spec.name].type.tensor_type.shape.dim
        names.update({dims[axis].dim_param: name for axis, name in spec.dynamic_axes.items()
                      if axis < len(dims) and dims[axis].dim_param})
    for value in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in names:
                dim.dim_param = names[dim.dim_param]
    onnx.save(model, str(path))
    return model.graph


def _output_info(value: onnx.ValueInfoProto) -> OutputInfo:
    tensor = value.type.tensor_type
    shape = tuple(dim.dim_param or int(dim.dim_value) for dim in tensor.shape.dim)
    return OutputInfo(value.name, shape, str(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)))


def torch_outputs(model: nn.Module, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``model(*arrays)`` in eval mode without gradients, as numpy arrays."""
    with torch.no_grad():
        result = model.eval()(*(torch.from_numpy(np.ascontiguousarray(array)) for array in arrays))
    return [tensor.detach().cpu().numpy() for tensor in _flat_outputs(result)]


def parity_diff(model: nn.Module, path: Path, sample: Sequence[np.ndarray], inputs: Sequence[InputSpec]) -> float:
    """Largest absolute difference between torch's and onnxruntime's outputs on ``sample``, over all outputs."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {spec.name: np.ascontiguousarray(array) for spec, array in zip(inputs, sample, strict=True)}
    onnx_out = session.run(None, feeds)
    torch_out = torch_outputs(model, sample)
    if len(onnx_out) != len(torch_out):
        raise ExportError(f"the ONNX graph gives {len(onnx_out)} outputs where torch gives {len(torch_out)}; "
                          "report it with the model's class and the torch and onnx versions")
    for index, (o, t) in enumerate(zip(onnx_out, torch_out, strict=True)):
        if np.shape(o) != np.shape(t):
            raise ExportError(f"output {index}: onnxruntime gives shape {np.shape(o)} where torch gives "
                              f"{np.shape(t)}; report it with the model's class and the torch and onnx versions")
    return max((_max_abs_diff(o, t) for o, t in zip(onnx_out, torch_out, strict=True)), default=0.0)


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    """Largest absolute difference; NaN on both sides agrees, anywhere else counts as the largest float
    (so the result always fits in JSON)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    diff = np.where(both_nan, 0.0, np.abs(a - b))
    if not np.isfinite(diff).all():
        return sys.float_info.max
    return float(np.max(diff, initial=0.0))
