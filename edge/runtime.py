"""Run a verified edge bundle with onnxruntime alone: no torch, just numpy + onnxruntime.

Threat model: see :mod:`fedge.edge.bundle`. :meth:`EdgeModel.load` verifies the
signature, the signer's trust, the manifest, every file hash, the expiry and
(with a :class:`~fedge.edge.bundle.FreshnessStore`) that the bundle is not older
than one this device already ran, and then that the model references no external
data and uses standard ONNX ops only (:mod:`fedge.edge.graph_check`: a signature says
who shipped a model, not that it leaves the device's files alone), all *before*
creating the onnxruntime session; it builds the session from the checked bytes, and
raises the freshness record only once the session exists.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from fedge.edge.bundle import SIGNATURE, FreshnessStore, TrustedKey, read_bundle, verify_bundle
from fedge.edge.graph_check import check_graph, session_of
from fedge.errors import BundleVerificationError, ConfigError
from fedge.preprocessing import AFFINE, NONE, Preprocessing
from fedge.signature import InputSpec, check_inputs

log = logging.getLogger("fedge.edge")

VARIANTS = ("int8", "fp32")
REEXPORT = "re-export the bundle with `fedge export`"
# onnxruntime's input/output type names -> numpy dtype names
ORT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
              "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(bool)": "bool"}

Inputs = tuple[ArrayLike | Mapping[str, ArrayLike], ...]


@dataclass(frozen=True)
class Prediction:
    """Class probabilities (n, classes), predicted class indices (n,) and their names."""

    probabilities: NDArray[np.float32]
    labels: NDArray[np.int64]
    label_names: list[str]


class EdgeModel:
    """A verified bundle's model in an onnxruntime session.

    Attributes
    ----------
    inputs : tuple of InputSpec
        The model's inputs, as the signed manifest declares them (``run`` takes them in this order).
    outputs : list of dict
        The manifest's outputs (``name``, ``shape``, ``dtype``, ``meaning``).
    labels : list of str or None
        Class names of a classifier; None for other models (regression...).
    variant : str
        The model file running: ``int8`` or ``fp32``.
    """

    def __init__(self, session: Any, manifest: dict[str, Any], variant: str) -> None:
        self.session, self.manifest, self.variant = session, manifest, variant
        self.inputs = tuple(InputSpec.from_manifest(entry) for entry in manifest["inputs"])
        self.outputs: list[dict[str, Any]] = list(manifest.get("outputs") or [])
        labels = manifest.get("labels")
        self.labels: list[str] | None = None if labels is None else [str(label) for label in labels]
        self._name = str(manifest.get("model_id") or manifest.get("model_name") or "bundle")

    @property
    def is_classifier(self) -> bool:
        """Whether the bundle's model gives class scores for :attr:`labels` (so :meth:`predict` works)."""
        return self.labels is not None

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        trusted_keys: Iterable[TrustedKey],
        variant: str | None = None,
        allow_unsigned: bool = False,
        threads: int = 1,
        freshness: FreshnessStore | None = None,
        model_id: str | None = None,
        now: dt.datetime | None = None,
    ) -> EdgeModel:
        """Verify the bundle at ``path`` (directory or .zip), then open ``variant``.

        Threat model: the bundle may come from anyone (see :mod:`fedge.edge.bundle`).
        A forged, altered or untrusted bundle is refused by its signature and hashes;
        an expired one by its signed ``expires_at``; a genuine but *older* one (a
        rollback to a model with a known flaw) only by ``freshness``.

        Parameters
        ----------
        path : str or Path
            Bundle directory or ``.zip``.
        trusted_keys : iterable of Ed25519PublicKey or PEM paths
            Signers this device trusts. A bundle signed by anyone else is refused.
        variant : {"int8", "fp32"}, optional
            Which model file to run. Default: int8, or fp32 (logged) when the bundle has
            no int8 model (its manifest says why); an explicit ``"int8"`` is refused then.
        allow_unsigned : bool
            Development only: accept a bundle with no signature (hashes are still
            checked) and log a warning. An unsigned bundle never raises a freshness record.
        threads : int
            onnxruntime intra-op threads.
        freshness : FreshnessStore, optional
            Refuse a bundle whose ``version`` is lower than the highest this device
            accepted for its ``model_id`` (equal is fine); after a successful load,
            record its version. Bundles without ``model_id``/``version`` are refused.
        model_id : str, optional
            The model lineage this device runs: a bundle of another is refused.
        now : datetime, optional
            Timezone-aware clock for ``expires_at`` (default: the system clock).

        Raises
        ------
        BundleVerificationError
            Naming the failed check and what to do; no session is created and no
            freshness record changes.
        """
        return cls.from_files(read_bundle(path), trusted_keys=trusted_keys, variant=variant,
                              allow_unsigned=allow_unsigned, threads=threads, freshness=freshness,
                              model_id=model_id, now=now)

    @classmethod
    def from_files(
        cls,
        files: Mapping[str, bytes],
        *,
        trusted_keys: Iterable[TrustedKey],
        variant: str | None = None,
        allow_unsigned: bool = False,
        threads: int = 1,
        freshness: FreshnessStore | None = None,
        model_id: str | None = None,
        now: dt.datetime | None = None,
    ) -> EdgeModel:
        """:meth:`load` for a bundle already in memory (``{name: bytes}``, as :func:`read_bundle` gives)."""
        if variant is not None and variant not in VARIANTS:
            raise ConfigError(f"variant '{variant}' is not one of {', '.join(VARIANTS)}")
        manifest = verify_bundle(files, trusted_keys=trusted_keys, allow_unsigned=allow_unsigned,
                                 freshness=freshness, model_id=model_id, now=now)
        chosen = _variant(manifest, variant)
        name = manifest["variants"][chosen]["file"]
        model = cls(_open_session(files[name], manifest, threads, name), manifest, chosen)
        if freshness is not None and SIGNATURE in files:
            freshness.record(manifest, now=now)
        return model

    def preprocess(self, raw: ArrayLike) -> NDArray[Any]:
        """Apply the manifest's declared affine preprocessing (``x * scale + offset``, as float32) to raw inputs.

        A bundle whose preprocessing is ``none`` gives ``raw`` back as an array.

        Raises
        ------
        ConfigError
            If the bundle declares preprocessing other than ``affine`` or ``none`` (a
            tokenizer, say): apply it yourself before :meth:`run`.
        """
        preprocessing = Preprocessing.of(self.manifest.get("preprocessing"))
        if preprocessing.kind not in (NONE, AFFINE):
            raise ConfigError(f"bundle '{self._name}' declares preprocessing '{preprocessing.kind}' "
                              f"({preprocessing.description or 'no description'}), which EdgeModel does not apply; "
                              "apply it to the raw inputs yourself, then call run()")
        return preprocessing.apply(raw)  # the same function devices apply to their raw files

    def run(self, *inputs: ArrayLike | Mapping[str, ArrayLike], **named: ArrayLike) -> list[NDArray[Any]]:
        """The model's outputs for a batch of inputs (already preprocessed, see :meth:`preprocess`).

        Parameters
        ----------
        *inputs : array-like, or one mapping of input name to array-like
            One array per input in the order of :attr:`inputs` (or by name), examples on axis 0.
        **named : array-like
            Or the inputs as keywords: ``run(features=x, tokens=ids)``.
            A one-input model also takes a single example without the batch axis (the
            outputs keep a batch axis of 1). Arrays of another precision of the declared
            kind (float64 for float32, int32 for int64) are converted.

        Returns
        -------
        list of np.ndarray
            One array per output, in the manifest's order.

        Raises
        ------
        ConfigError
            For a missing, unknown or extra input, or one of the wrong rank, size or dtype,
            naming the input, what the bundle expects and what was given; or when
            onnxruntime fails on inputs that pass those checks.
        """
        arrays = self._batch(self._given(inputs, named))
        feeds = {spec.name: np.ascontiguousarray(array) for spec, array in zip(self.inputs, arrays, strict=True)}
        try:
            outputs = self.session.run(None, feeds)
        except Exception as exc:  # onnxruntime raises its own types; the inputs passed every declared check
            shapes = ", ".join(f"{name} {array.shape}" for name, array in feeds.items())
            raise ConfigError(f"bundle '{self._name}': onnxruntime cannot run the model on inputs {shapes} "
                              f"({type(exc).__name__}: {str(exc).strip()[:300]}); the model may need other sizes "
                              "on its dynamic axes than the manifest declares") from exc
        return [np.asarray(out) for out in outputs]

    def predict(self, *inputs: ArrayLike | Mapping[str, ArrayLike], **named: ArrayLike) -> Prediction:
        """Class probabilities and labels for one sample or a batch (inputs as :meth:`run` takes them).

        Raises
        ------
        ConfigError
            If the bundle is not a classifier (no labels: a regression model, say) or its
            output is not ``(batch, classes)`` scores: use :meth:`run` for its outputs.
        """
        if not self.is_classifier:
            raise ConfigError(f"bundle '{self._name}' is not a classifier (no labels; its output: "
                              f"{self._meaning()}); predict() gives class probabilities only, use run() "
                              "for the model's outputs")
        if len(self.outputs) > 1:
            raise ConfigError(f"bundle '{self._name}' has {len(self.outputs)} outputs; predict() handles one "
                              "output of class scores, use run() for all of them")
        (scores,) = self.run(*inputs, **named)
        if scores.ndim != 2:
            raise ConfigError(f"bundle '{self._name}' gives class scores of shape {scores.shape}; predict() "
                              "handles (batch, classes) only, use run() for the scores")
        scores = scores.astype(np.float64)
        shifted = np.exp(scores - scores.max(axis=1, keepdims=True))
        probabilities = (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)
        labels = probabilities.argmax(axis=1).astype(np.int64)
        names = self.labels or []
        return Prediction(probabilities, labels, [str(names[i]) if i < len(names) else str(i) for i in labels])

    def _meaning(self) -> str:
        return str(self.outputs[0].get("meaning", "no meaning given")) if self.outputs else "none declared"

    def _given(self, inputs: Inputs, named: Mapping[str, ArrayLike]) -> Inputs:
        """Positional inputs, or keyword inputs as one mapping (not both)."""
        if named and inputs:
            raise ConfigError(f"bundle '{self._name}': give the inputs by position, as one mapping, or by name "
                              f"(run({', '.join(f'{spec.name}=...' for spec in self.inputs)})), not both")
        return (dict(named),) if named else inputs

    def _batch(self, given: Inputs) -> list[np.ndarray]:
        """The inputs as arrays in manifest order, converted within their kind and checked."""
        values = self._ordered(given)
        if len(values) != len(self.inputs):
            raise ConfigError(f"bundle '{self._name}': {len(values)} input arrays for {len(self.inputs)} declared "
                              f"inputs ({', '.join(spec.describe() for spec in self.inputs)})")
        arrays = [_conform(spec, value) for spec, value in zip(self.inputs, values, strict=True)]
        if len(arrays) == 1 and _one_example(self.inputs[0], arrays[0]):
            arrays[0] = arrays[0][None, ...]
        try:
            check_inputs(self.inputs, arrays, source=f"bundle '{self._name}'", declared_by="the model",
                         hint="pass arrays shaped as the bundle's manifest says (EdgeModel.manifest['inputs'])")
        except ConfigError as exc:
            raise ConfigError(f"{exc}{self._example_hint()}") from None
        self._check_shared_axes(arrays)
        return arrays

    def _check_shared_axes(self, arrays: list[np.ndarray]) -> None:
        """Inputs that share an axis name (the batch, say) must agree on its size."""
        seen: dict[str, tuple[str, int]] = {}
        for spec, array in zip(self.inputs, arrays, strict=True):
            for axis, name in spec.dynamic_axes.items():
                first, size = seen.setdefault(name, (spec.name, int(array.shape[axis])))
                if size != array.shape[axis]:
                    raise ConfigError(f"bundle '{self._name}': inputs '{first}' and '{spec.name}' share axis "
                                      f"'{name}' but have sizes {size} and {array.shape[axis]} there; give "
                                      "them the same size")

    def _ordered(self, given: Inputs) -> list[Any]:
        """Positional inputs as given; a mapping's values in manifest order (missing/unknown names refused)."""
        if len(given) != 1 or not isinstance(given[0], Mapping):
            return list(given)
        named = given[0]
        expected = [spec.name for spec in self.inputs]
        missing = [spec.describe() for spec in self.inputs if spec.name not in named]
        unknown = sorted(str(name) for name in named if name not in expected)
        if missing or unknown:
            raise ConfigError(f"bundle '{self._name}': missing input(s) {missing}, unknown input(s) {unknown}; "
                              f"the model takes {', '.join(spec.describe() for spec in self.inputs)}")
        return [named[name] for name in expected]

    def _example_hint(self) -> str:
        if len(self.inputs) != 1:
            return ""
        one = ", ".join(map(str, self.inputs[0].shape[1:]))
        return f" (a single example is ({one},) without the batch axis)"


def _variant(manifest: dict[str, Any], variant: str | None) -> str:
    """The variant to open: ``variant``, or int8 falling back to fp32 when the bundle has no int8 model."""
    variants = manifest["variants"]
    wanted = variant or "int8"
    entry = variants.get(wanted)
    if entry is not None and "file" in entry:
        return wanted
    reason = f" (skipped at export: {entry['skipped']})" if entry is not None else ""
    if variant is None and "file" in variants.get("fp32", {}):
        log.info("bundle has no int8 model%s; running fp32", reason)
        return "fp32"
    offered = sorted(name for name, item in variants.items() if "file" in item)
    raise BundleVerificationError(f"bundle has no '{wanted}' model{reason}; it offers {offered}: load one of "
                                  "those (or leave variant unset)")


def _one_example(spec: InputSpec, array: np.ndarray) -> bool:
    """Whether ``array`` is one example of ``spec`` without the batch axis (fixed sizes matching)."""
    rest = spec.shape[1:]
    return array.ndim == len(rest) and all(isinstance(size, str) or size == got
                                           for size, got in zip(rest, array.shape, strict=True))


def _conform(spec: InputSpec, value: Any) -> np.ndarray:
    """``value`` as an array of the spec's dtype when it is of the same kind (else as it is, for the check)."""
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"input '{spec.name}' is not an array ({exc}); it takes {spec.describe()}") from None
    if _kind(array.dtype) == _kind(np.dtype(spec.dtype)):
        return array.astype(spec.dtype, copy=False)
    return array


def _kind(dtype: np.dtype[Any]) -> str:
    """``f`` floats, ``i`` integers (signed or not), ``b`` booleans, else numpy's kind."""
    return "i" if dtype.kind == "u" else dtype.kind


def _open_session(model_bytes: bytes, manifest: dict[str, Any], threads: int, what: str) -> Any:
    """An onnxruntime session of verified bytes that must match what the manifest says of them.

    The graph is checked first (:func:`fedge.edge.graph_check.check_graph`: no external
    data, standard ONNX ops only): a signed model that would read the device's files is
    refused before any session exists.
    """
    checked = check_graph(model_bytes, what=what)
    try:
        session = session_of(checked, threads=threads)
    except Exception as exc:  # onnxruntime raises its own types, all from a signed but broken model
        raise BundleVerificationError(f"onnxruntime cannot load the signed model ({type(exc).__name__}); "
                                      "re-export the bundle with `fedge export`") from None
    _check_model_matches(session, manifest)
    return session


def _check_model_matches(session: Any, manifest: dict[str, Any]) -> None:
    """The model's inputs and outputs are those the manifest declares (names, ranks, fixed sizes, dtypes)."""
    problem = (_inputs_problem(session.get_inputs(), manifest["inputs"])
               or _outputs_problem(session.get_outputs(), manifest.get("outputs")))
    if problem is not None:
        raise BundleVerificationError(f"the model's inputs/outputs differ from what manifest.json declares "
                                      f"({problem}); {REEXPORT}")
    labels, scores = manifest.get("labels"), list(session.get_outputs()[0].shape or [])
    if not labels:
        return
    if len(scores) < 2:
        raise BundleVerificationError(f"manifest.json names {len(labels)} labels but the model's first output "
                                      f"has shape {scores}, not (batch, classes, ...) scores; {REEXPORT}")
    if isinstance(scores[1], int) and len(labels) != scores[1]:
        raise BundleVerificationError(f"manifest.json names {len(labels)} labels for a model of {scores[1]} "
                                      f"classes; {REEXPORT}")


def _inputs_problem(graph: list[Any], declared: list[dict[str, Any]]) -> str | None:
    names = {entry["name"]: entry for entry in declared}
    if sorted(value.name for value in graph) != sorted(names):
        return f"model inputs {sorted(v.name for v in graph)}, manifest {sorted(names)}"
    for value in graph:
        entry = names[value.name]
        dtype = ORT_DTYPES.get(value.type, value.type)
        if dtype != entry.get("dtype", "float32"):
            return f"input '{value.name}' is {dtype} in the model, {entry.get('dtype')} in the manifest"
        problem = _shape_problem(f"input '{value.name}'", list(value.shape or []), entry["shape"])
        if problem is not None:
            return problem
    return None


def _outputs_problem(graph: list[Any], declared: object) -> str | None:
    if not graph:
        return "the model has no outputs"
    if not isinstance(declared, list) or not declared:
        return None  # bundles before outputs were declared: nothing to compare
    if [value.name for value in graph] != [entry.get("name") for entry in declared]:
        return f"model outputs {[v.name for v in graph]}, manifest {[e.get('name') for e in declared]}"
    for value, entry in zip(graph, declared, strict=True):
        problem = _shape_problem(f"output '{value.name}'", list(value.shape or []), entry.get("shape"),
                                 fixed_may_vary=True)
        if problem is not None:
            return problem
    return None


def _shape_problem(what: str, graph_shape: list[Any], declared: Any, *, fixed_may_vary: bool = False) -> str | None:
    """Ranks must agree; fixed sizes known on both sides must be equal; an axis the manifest calls
    dynamic must be dynamic in an input of the model (an output's may be fixed by the graph)."""
    if not isinstance(declared, list) or len(graph_shape) != len(declared):
        return f"{what} has shape {graph_shape} in the model, {declared} in the manifest"
    for axis, (got, want) in enumerate(zip(graph_shape, declared, strict=True)):
        if isinstance(got, int) and isinstance(want, int) and got != want:
            return f"{what} axis {axis} is {got} in the model, {want} in the manifest"
        if isinstance(got, int) and isinstance(want, str) and not fixed_may_vary:
            return f"{what} axis {axis} is fixed at {got} in the model but dynamic ('{want}') in the manifest"
    return None
