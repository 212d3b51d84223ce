"""Build a signed edge bundle from a torch model (coordinator side; imports torch).

Any model whose input signature is a sequence of :class:`~fedge.signature.InputSpec`
ships: one or several inputs, of any rank, float or integer (token ids), with named
dynamic axes. The bundle always holds the fp32 model (parity-checked against torch) and
the int8 model when onnxruntime can quantize the graph; when it cannot, the manifest's
``variants.int8`` says why (``{"skipped": "<reason>", "quantization": "<method tried>"}``)
and devices run fp32.
"""

from __future__ import annotations

import datetime as dt
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from torch import nn

import fedge
from fedge.edge.bundle import format_time, write_bundle
from fedge.edge.export import LOGITS_NAME, OUTPUT_NAME, ExportReport, OutputInfo, export_onnx, torch_outputs
from fedge.edge.graph_check import check_graph
from fedge.edge.quantize import Int8Model, quantize_int8
from fedge.errors import BundleVerificationError, ConfigError, ExportError
from fedge.signature import InputSpec, check_inputs

FP32_FILE, INT8_FILE = "model.onnx", "model.int8.onnx"
CLASS_SCORES = "unnormalised class scores; softmax gives probabilities"
PARITY_SAMPLE = 64  # held-out examples the torch/onnxruntime parity check runs on
RUN_CHUNK = 1024  # examples per onnxruntime call when scoring the held-out set

Score = Callable[[np.ndarray], dict[str, float]]


@dataclass(frozen=True)
class BundleSpec:
    """What a bundle says about its model, beyond the model itself.

    ``model_id`` names the model's lineage (default ``<source_run>/<model_name>``)
    and ``server_round`` is its ``version``: devices with a freshness store refuse
    a lower version of the same lineage (rollback). ``valid_for`` makes the bundle
    expire that long after it is signed (default: never).

    Attributes
    ----------
    labels : list of str or None
        Class names of a classification model (its first output is class scores on
        axis 1); None for any other model (regression, embeddings...).
    output_meaning : str
        What the (first) output means, for people reading the manifest.
    headline : str or None
        The metric the task reports first (``accuracy``, ``mse``...), recorded in the manifest.
    """

    model_name: str
    source_run: str
    server_round: int
    preprocessing: dict[str, Any]
    labels: list[str] | None
    output_meaning: str = CLASS_SCORES
    headline: str | None = None
    model_id: str | None = None
    valid_for: dt.timedelta | None = None

    @property
    def lineage(self) -> str:
        """``model_id``, or ``<source_run>/<model_name>`` when none was given."""
        return self.model_id or default_model_id(self.source_run, self.model_name)


def default_model_id(source_run: str, model_name: str) -> str:
    """The lineage of a run's bundles: every round of one run shares it."""
    return f"{source_run}/{model_name}"


@dataclass(frozen=True)
class BuiltBundle:
    """A written bundle and its manifest."""

    path: Path
    manifest: dict[str, Any]


def build_bundle(
    model: nn.Module,
    out_dir: str | Path,
    *,
    spec: BundleSpec,
    private_key: Ed25519PrivateKey,
    inputs: Sequence[InputSpec],
    sample: Sequence[np.ndarray],
    score: Score | None,
    calibration: Sequence[np.ndarray],
    make_zip: bool = False,
) -> BuiltBundle:
    """Export fp32 (+ int8 where possible) ONNX, measure them on ``sample``, write and sign the bundle.

    Parameters
    ----------
    model : nn.Module
        The global model, called as ``model(*inputs)``.
    out_dir : str or Path
        Bundle directory to create.
    spec : BundleSpec
        Name, provenance, lineage and version, expiry, preprocessing, labels, output
        meaning and headline for the manifest.
    private_key : Ed25519PrivateKey
        Signs the manifest (keyword-only: a security-sensitive argument).
    inputs : sequence of InputSpec
        The model's input signature (names, shapes with named dynamic axes, dtypes).
    sample : sequence of np.ndarray
        Held-out inputs, one array per input: traced, parity-checked (first
        :data:`PARITY_SAMPLE` examples) and scored.
    score : callable or None
        Metrics of the first model output on ``sample`` (e.g. ``{"accuracy": ...}``); the
        manifest records ``fp32_<name>`` and ``int8_<name>`` for each.
    calibration : sequence of np.ndarray
        A sample of the training inputs, one array per input, for static quantization.

    Raises
    ------
    ConfigError
        If ``sample`` or ``calibration`` does not match ``inputs``.
    ExportError
        If the model cannot be exported (naming the layer) or the graph is invalid.
    """
    specs = tuple(inputs)
    check_inputs(specs, list(sample), source="bundle sample (held-out inputs)")
    check_inputs(specs, list(calibration), source="bundle calibration sample")
    if not len(calibration[0]):
        raise ConfigError("bundle calibration sample holds no examples; give a sample of the training inputs")
    model = model.cpu().eval()
    _check_labels(spec.labels, _first_output(model, sample))
    output_name = LOGITS_NAME if spec.labels is not None else OUTPUT_NAME
    with tempfile.TemporaryDirectory() as scratch:
        report = export_onnx(model, [a[:PARITY_SAMPLE] for a in sample], Path(scratch) / FP32_FILE,
                             inputs=specs, output_name=output_name)
        fp32 = report.path.read_bytes()
    specs = report.inputs or specs
    _check_graph(fp32)
    int8 = quantize_int8(fp32, calibration, inputs=specs)
    fp32_out = run_model(fp32, specs, sample)
    _check_outputs(fp32_out, len(sample[0]))
    int8_out = run_model(int8.model, specs, sample) if int8.model is not None else None
    manifest = _manifest(spec, specs, report, int8, sample, fp32_out)
    manifest["metrics"] = _metrics(spec, report, score, fp32_out, int8_out)
    files = {FP32_FILE: fp32, **({INT8_FILE: int8.model} if int8.model is not None else {})}
    for name, data in files.items():
        _check_devices_accept(data, name)
    path = write_bundle(out_dir, files, manifest, private_key=private_key, make_zip=make_zip)
    return BuiltBundle(path=path, manifest=manifest)


def _check_graph(fp32: bytes) -> None:
    try:
        onnx.checker.check_model(onnx.load_from_string(fp32), full_check=True)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"exported model fails onnx.checker: {exc}; the exporter produced an invalid graph, "
                          "report it with the model's class and the torch and onnx versions") from exc


def _check_devices_accept(model_bytes: bytes, name: str) -> None:
    """The graph passes the check every device runs before loading it (no external data, standard ops)."""
    try:
        check_graph(model_bytes, what=name)
    except BundleVerificationError as exc:
        raise ExportError(f"every device would refuse this bundle: {exc}") from None


def _check_outputs(outputs: list[np.ndarray], examples: int) -> None:
    """Every output holds one entry per example on axis 0 (what devices slice results by)."""
    for index, array in enumerate(outputs):
        if array.ndim == 0 or len(array) != examples:
            raise ExportError(f"model output {index} has shape {array.shape} for {examples} examples; bundle "
                              "outputs must keep the examples on axis 0 (batch first)")


def _first_output(model: nn.Module, sample: Sequence[np.ndarray]) -> np.ndarray:
    """The model's first output on two sample examples (to check labels before the slow export)."""
    try:
        return torch_outputs(model, [np.ascontiguousarray(array[:2]) for array in sample])[0]
    except ExportError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the user's forward raises
        raise ExportError(f"{type(model).__name__} fails on the held-out inputs ({type(exc).__name__}: {exc}); "
                          "check the task's input signature against the model") from exc


def _check_labels(labels: list[str] | None, scores: np.ndarray) -> None:
    """A classifier's first output must hold one score per label on axis 1."""
    if labels is not None and (scores.ndim < 2 or scores.shape[1] != len(labels)):
        raise ConfigError(f"the bundle names {len(labels)} labels but the model's first output has shape "
                          f"{scores.shape}; a classifier gives (batch, {len(labels)}, ...) class scores "
                          "(give labels=None for other models)")


def _manifest(spec: BundleSpec, specs: tuple[InputSpec, ...], report: ExportReport, int8: Int8Model,
              sample: Sequence[np.ndarray], fp32_out: list[np.ndarray]) -> dict[str, Any]:
    """Every manifest field but the metrics (and the file list, which :func:`write_bundle` adds)."""
    issued = dt.datetime.now(dt.UTC)
    int8_entry = ({"file": INT8_FILE, "quantization": int8.method} if int8.model is not None
                  else {"skipped": int8.skipped, "quantization": int8.method})
    return {
        "model_name": spec.model_name,
        "source_run": spec.source_run,
        "round": spec.server_round,
        "model_id": spec.lineage,
        "version": spec.server_round,
        "issued_at": format_time(issued),
        "expires_at": format_time(issued + spec.valid_for) if spec.valid_for is not None else None,
        "created_at": format_time(issued),
        "versions": {"fedge": fedge.__version__, "onnx": onnx.__version__,
                     "onnxruntime": ort.__version__, "torch": torch.__version__, "opset": report.opset},
        "inputs": [s.manifest() for s in specs],
        "fixed_axes": report.fixed_axes,
        "outputs": _outputs(specs, report.outputs, sample, fp32_out, spec.output_meaning),
        "preprocessing": spec.preprocessing,
        "labels": spec.labels,
        "headline": spec.headline,
        "variants": {"fp32": {"file": FP32_FILE}, "int8": int8_entry},
    }


def _outputs(specs: Sequence[InputSpec], infos: Sequence[OutputInfo], sample: Sequence[np.ndarray],
             arrays: list[np.ndarray], meaning: str) -> list[dict[str, Any]]:
    """The manifest's outputs: batch first, then the graph's sizes, with input axis names where they vary.

    The exporter names some dynamic output axes after internal symbols (``s27``); such an
    axis gets the name of the one input axis whose size it had on the sample (if only one
    had that size). An axis the exporter could not size gets the torch output's size.
    """
    by_size = _axis_names_by_size(specs, sample)
    entries = []
    for index, (info, array) in enumerate(zip(infos, arrays, strict=True)):
        graph = info.shape if len(info.shape) == array.ndim else array.shape
        shape: list[int | str] = [specs[0].shape[0]]
        for axis, size in enumerate(graph[1:], start=1):
            if isinstance(size, str):
                known = size in {n for spec in specs for n in spec.dynamic_axes.values()}
                shape.append(size if known else by_size.get(int(array.shape[axis]), size))
            else:
                shape.append(size if size > 0 else int(array.shape[axis]))
        entries.append({"name": info.name, "shape": shape, "dtype": str(array.dtype),
                        "meaning": meaning if index == 0 else f"output {index} of the model"})
    return entries


def _axis_names_by_size(specs: Sequence[InputSpec], sample: Sequence[np.ndarray]) -> dict[int, str]:
    """Sample size -> the named input axis of that size, for sizes only one named axis has."""
    sizes: dict[str, int] = {}
    for spec, array in zip(specs, sample, strict=True):
        for axis, name in spec.dynamic_axes.items():
            sizes.setdefault(name, int(array.shape[axis]))
    counts: dict[int, list[str]] = {}
    for name, size in sizes.items():
        counts.setdefault(size, []).append(name)
    return {size: found[0] for size, found in counts.items() if len(found) == 1}


def _metrics(spec: BundleSpec, report: ExportReport, score: Score | None, fp32_out: list[np.ndarray],
             int8_out: list[np.ndarray] | None) -> dict[str, float | int | None]:
    """``test_samples``, parity, ``fp32_<m>``/``int8_<m>`` of ``score`` and, for classifiers, top-1 agreement."""
    metrics: dict[str, float | int | None] = {"test_samples": len(fp32_out[0]),
                                       "torch_onnx_max_abs_diff": report.max_abs_diff}
    for variant, outputs in (("fp32", fp32_out), ("int8", int8_out)):
        if outputs is not None and score is not None:
            metrics.update({f"{variant}_{name}": _finite(value) for name, value in score(outputs[0]).items()})
    if spec.labels is not None and int8_out is not None:
        agree = np.argmax(int8_out[0], axis=1) == np.argmax(fp32_out[0], axis=1)
        metrics["int8_top1_agreement"] = float(np.mean(agree))
    return metrics


def _finite(value: float) -> float | None:
    """``value``, or None (JSON null) when it is NaN or infinite, which JSON cannot hold."""
    return float(value) if np.isfinite(value) else None


def run_model(model_bytes: bytes, specs: Sequence[InputSpec], arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """An ONNX model's outputs on ``arrays`` (one per input), run :data:`RUN_CHUNK` examples at a time."""
    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    chunks: list[list[np.ndarray]] = []
    for start in range(0, len(arrays[0]), RUN_CHUNK):
        feeds = {s.name: np.ascontiguousarray(a[start:start + RUN_CHUNK], s.dtype)
                 for s, a in zip(specs, arrays, strict=True)}
        chunks.append([np.asarray(out) for out in session.run(None, feeds)])
    return [np.concatenate(parts) for parts in zip(*chunks, strict=True)]
