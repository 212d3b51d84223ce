"""Signed TRAINING bundles: the graphs a device without torch trains with (no torch here).

A training bundle is a zip of four files:

* ``train.onnx``: one training step, weights in, mean loss and gradients out
  (:mod:`fedge.edge.training_graph`);
* ``eval.onnx``: the same inputs, mean loss and model output out;
* ``manifest.json``: ``kind: "training"``, the format, the task, the model lineage
  (``model_id``, ``version``, ``issued_at``, optional ``expires_at``), the state entries
  (name, shape, dtype, trainable), the inputs (as inference manifests write them), the
  targets (shape, dtype), the metrics a device can compute, the optimiser
  (``sgd-momentum``), the parity of the export, the opset, the library versions, every
  file's SHA-256 and size, ``architecture``: the SHA-256 of ``train.onnx`` followed by
  ``eval.onnx``, by which devices cache the graphs (they do not change with the weights),
  and ``graph_ops``: each graph's op types (all in the standard ONNX domain), which a
  device owner can read and pin, and which the device enforces (a graph whose ops differ
  is refused before any session, :class:`fedge.edge.trainer.OnnxTrainer`);
* ``manifest.sig``: the Ed25519 signature envelope of :mod:`fedge.edge.bundle`.

Threat model: the same as inference bundles (see :mod:`fedge.edge.bundle`): a device
accepts a training bundle only when a key it trusts signed the manifest, every listed file
has its listed hash, no other file is there, it has not expired and (with a
:class:`~fedge.edge.bundle.FreshnessStore`) it is not older than one it accepted. The
signing, zip-safety, hash and freshness checks are :mod:`fedge.edge.bundle`'s own; only
the manifest's fields differ. A signature says who shipped a graph, not what it does:
the trainer refuses graphs that reference external data (device files) or non-standard
ops (:mod:`fedge.edge.graph_check`), yet a graph can still compute anything from the
examples it trains on and return it in the update, as any federated client code could;
only secure aggregation and differential privacy bound what one update reveals. The
weights are not in the bundle: they come with each round's instructions.
"""

from __future__ import annotations

import datetime as dt
import io
import platform
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedge.archive import ZIP_READ_ERRORS
from fedge.edge.bundle import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_VERSION,
    SIGNATURE,
    FreshnessStore,
    TrustedKey,
    _bad,
    _check_file_entry,
    _check_files,
    _check_inputs,
    _check_members,
    _check_signature,
    _is_int,
    _is_number,
    _is_shape,
    _load_json,
    _short,
    _trusted,
    check_expiry,
    format_time,
    parse_time,
    read_bundle,
    sha256,
    sign_manifest,
)
from fedge.edge.graph_check import check_graph
from fedge.errors import BundleVerificationError, ConfigError
from fedge.files import write_bytes_atomic
from fedge.preprocessing import Preprocessing
from fedge.signature import DTYPES, InputSpec

TRAINING_FORMAT = "fedge-training-bundle/1"
KIND = "training"
TRAIN_FILE = "train.onnx"
EVAL_FILE = "eval.onnx"
GRAPH_OPS = "graph_ops"  # each graph's op list: {file: {"domains": ["ai.onnx"], "ops": [op types]}}
MAX_OPS_LISTED = 1024
OPTIMIZER = "sgd-momentum"
MAX_STATE = 4096  # most state entries a manifest may declare
_VERSIONED = ("fedge", "torch", "onnx", "onnxruntime", "onnxscript")


@dataclass(frozen=True)
class TrainingBundle:
    """A verified training bundle: its manifest and graphs, and the graphs' cache key."""

    manifest: dict[str, Any]
    train_onnx: bytes
    eval_onnx: bytes
    architecture: str


def architecture_of(train_onnx: bytes, eval_onnx: bytes) -> str:
    """SHA-256 of ``train.onnx`` followed by ``eval.onnx``: equal graphs, equal key, whatever the weights."""
    return sha256(train_onnx + eval_onnx)


def write_training_bundle(
    path: str | Path,
    graphs: Any = None,
    *,
    task: str,
    metrics: Sequence[str],
    model_id: str,
    version: int,
    private_key: Ed25519PrivateKey,
    expires_at: dt.datetime | None = None,
    issued_at: dt.datetime | None = None,
    preprocessing: Mapping[str, Any] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """Write a signed training bundle (a zip) to ``path`` atomically; return its manifest.

    The graphs' fields come either as ``graphs``, any object with the attributes of
    :class:`fedge.edge.training_graph.TrainingGraphs` (or a mapping with those keys), or as
    keyword arguments: ``train_onnx``, ``eval_onnx`` (bytes), ``state`` (entries with
    ``name``, ``shape``, ``dtype``, ``trainable``, as objects or dicts), ``inputs``
    (:class:`InputSpec` s or manifest dicts), ``target_shape``, ``target_dtype``,
    ``max_abs_diff`` and ``opset``. Taking plain fields keeps this module free of torch.

    Parameters
    ----------
    task : str
        The task's name.
    metrics : sequence of str
        Metrics the device computes (``loss`` and names of :data:`fedge.edge.trainer.NUMPY_METRICS`).
    model_id, version : str, int
        The lineage and its version: a device with a freshness store refuses older versions.
    private_key : Ed25519PrivateKey
        The coordinator's signing key.
    expires_at : datetime, optional
        After this (timezone-aware) moment every device refuses the bundle.
    preprocessing : Mapping, optional
        The task's declared preprocessing (:mod:`fedge.preprocessing`), which a device applies
        to raw inputs of its own before training, as torch devices and ``EdgeModel`` do.

    Raises
    ------
    ConfigError
        For a missing field or a lineage that cannot be ordered.
    """
    values = graph_fields(graphs, fields)
    manifest = training_manifest(values, task=task, metrics=metrics, model_id=model_id, version=version,
                                 expires_at=expires_at, issued_at=issued_at, preprocessing=preprocessing)
    data = pack_training_bundle(values["train_onnx"], values["eval_onnx"], manifest, private_key=private_key)
    write_bytes_atomic(Path(path), data)
    return _load_json(zipfile.ZipFile(io.BytesIO(data)).read(MANIFEST), MANIFEST)  # type: ignore[no-any-return]


TRAINING_BUNDLE = Path("bundles") / "training.zip"  # where a run directory holds its training bundle


def training_bundle_for(width: float) -> Path:
    """Where a run directory holds the training bundle of a sub-model of ``width`` (1: :data:`TRAINING_BUNDLE`)."""
    return TRAINING_BUNDLE if width >= 1 else TRAINING_BUNDLE.with_name(f"training-w{width:g}.zip")


SIGNING_PUBLIC_KEY = Path("keys") / "signing.pub"  # and the public key that signs it

_OPTIONAL = ("float64_drift",)
_FIELDS = ("train_onnx", "eval_onnx", "state", "inputs", "target_shape", "target_dtype", "max_abs_diff", "opset")


def graph_fields(graphs: Any, fields: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The graphs' fields from an object, a mapping or keyword arguments."""
    fields = fields or {}
    if graphs is None:
        source: Mapping[str, Any] = fields
    elif isinstance(graphs, Mapping):
        source = {**graphs, **fields}
    else:
        known = (*_FIELDS, *_OPTIONAL)
        source = {name: getattr(graphs, name) for name in known if hasattr(graphs, name)} | dict(fields)
    missing = [name for name in _FIELDS if name not in source]
    unknown = sorted(set(source) - set(_FIELDS) - set(_OPTIONAL))
    if missing or unknown:
        raise ConfigError(f"write_training_bundle: missing fields {missing}, unknown fields {unknown}; pass the "
                          "TrainingGraphs of export_training_graphs (or its fields)")
    return dict(source)


def training_manifest(values: Mapping[str, Any], *, task: str, metrics: Sequence[str], model_id: str, version: int,
                      expires_at: dt.datetime | None = None, issued_at: dt.datetime | None = None,
                      preprocessing: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of a training bundle (without ``format`` and ``files``, which packing adds)."""
    Preprocessing.of(preprocessing)  # refused here, named, rather than by every device
    if not isinstance(model_id, str) or not 0 < len(model_id) <= 256 or not model_id.isprintable():
        raise ConfigError(f"model_id {model_id!r} must be a printable name of at most 256 characters")
    if not _is_int(version, 0, MAX_VERSION):
        raise ConfigError(f"version {version!r} must be an integer from 0 to {MAX_VERSION}")
    issued = issued_at or dt.datetime.now(dt.UTC)
    if expires_at is not None and expires_at.tzinfo is None:
        raise ConfigError("expires_at must be timezone-aware (e.g. datetime.now(datetime.UTC) + timedelta(days=30))")
    return {
        "kind": KIND,
        "task": str(task),
        "model_id": model_id,
        "version": int(version),
        "issued_at": format_time(issued),
        "expires_at": None if expires_at is None else format_time(expires_at),
        "state": [_state_entry(entry) for entry in values["state"]],
        "inputs": [spec.manifest() if isinstance(spec, InputSpec) else dict(spec) for spec in values["inputs"]],
        "targets": {"shape": list(values["target_shape"]), "dtype": str(values["target_dtype"])},
        "preprocessing": dict(preprocessing or {"kind": "none"}),
        "metrics": [str(name) for name in metrics],
        "optimizer": OPTIMIZER,
        "outputs": {"train": ["loss", "grad:<name> per trainable state entry"], "eval": ["loss", "output"]},
        "parity": _parity(values),
        "opset": int(values["opset"]),
        "architecture": architecture_of(values["train_onnx"], values["eval_onnx"]),
        GRAPH_OPS: {TRAIN_FILE: _op_list(values["train_onnx"], TRAIN_FILE),
                    EVAL_FILE: _op_list(values["eval_onnx"], EVAL_FILE)},
        "versions": _versions(),
    }


def _op_list(graph: bytes, name: str) -> dict[str, list[str]]:
    """The graph's op list for the manifest; a graph devices would refuse is refused here already."""
    try:
        return check_graph(graph, what=name).op_list()
    except BundleVerificationError as exc:
        raise ConfigError(f"every device would refuse this training graph: {exc}") from None


def _parity(values: Mapping[str, Any]) -> dict[str, Any]:
    """The export's parity: torch vs onnxruntime, and (when they drifted apart) both vs float64 training."""
    parity: dict[str, Any] = {"max_abs_diff": float(values["max_abs_diff"])}
    drift = values.get("float64_drift")
    if drift is not None:
        parity["float64_drift"] = {"onnx": float(drift[0]), "torch": float(drift[1])}
    return parity


def _state_entry(entry: Any) -> dict[str, Any]:
    values = dict(entry) if isinstance(entry, Mapping) else {key: getattr(entry, key) for key in
                                                             ("name", "shape", "dtype", "trainable")}
    return {"name": str(values["name"]), "shape": [int(size) for size in values["shape"]],
            "dtype": str(values["dtype"]), "trainable": bool(values["trainable"])}


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def pack_training_bundle(train_onnx: bytes, eval_onnx: bytes, manifest: Mapping[str, Any], *,
                         private_key: Ed25519PrivateKey) -> bytes:
    """The bundle's zip bytes: the graphs, the manifest with their hashes, and its signature."""
    import json  # noqa: PLC0415

    files = {TRAIN_FILE: train_onnx, EVAL_FILE: eval_onnx}
    full = {**manifest, "format": TRAINING_FORMAT,
            "files": {name: {"sha256": sha256(data), "bytes": len(data)} for name, data in sorted(files.items())}}
    manifest_bytes = (json.dumps(full, indent=2, sort_keys=True) + "\n").encode()
    contents = {**files, MANIFEST: manifest_bytes, SIGNATURE: sign_manifest(manifest_bytes, private_key)}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in sorted(contents.items()):
            archive.writestr(name, data)
    return buffer.getvalue()


# --------------------------------------------------------------------------- reading


def read_training_bundle(path: str | Path | bytes, *, trusted_keys: Iterable[TrustedKey],
                         freshness: FreshnessStore | None = None, model_id: str | None = None,
                         now: dt.datetime | None = None) -> TrainingBundle:
    """Read and verify a training bundle (zip file, zip bytes or directory).

    Checks, in order: zip safety, the signature by a trusted key, the manifest's fields,
    every file's hash (no file missing, none extra), expiry, the lineage (``model_id``
    when given) and freshness (rollback refused). Checking does not record: call
    ``freshness.record(bundle.manifest)`` once the bundle is in use.

    Raises
    ------
    BundleVerificationError
        Naming the check that failed and what to do.
    """
    files = _read_files(path)
    if MANIFEST not in files:
        raise BundleVerificationError(f"training bundle has no {MANIFEST}; it is not a fedge bundle")
    if len(files[MANIFEST]) > MAX_MANIFEST_BYTES:
        raise BundleVerificationError(f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes; refused")
    if SIGNATURE not in files:
        raise BundleVerificationError(f"training bundle is unsigned (no {SIGNATURE}); devices train only with "
                                      "bundles the coordinator signed: fetch it again from the coordinator")
    _check_signature(files[MANIFEST], files[SIGNATURE], _trusted(trusted_keys))
    manifest = _parse_training_manifest(files[MANIFEST])
    _check_files(files, manifest["files"])
    check_expiry(manifest, now=now)
    if model_id is not None and manifest["model_id"] != model_id:
        raise BundleVerificationError(f"training bundle is of model '{manifest['model_id']}', not '{model_id}' that "
                                      "this device trains; refused: fetch a bundle of that model")
    if freshness is not None:
        freshness.check(manifest)
    train, evaluation = files[TRAIN_FILE], files[EVAL_FILE]
    architecture = architecture_of(train, evaluation)
    if manifest["architecture"] != architecture:
        raise _bad("architecture", "is not the SHA-256 of train.onnx and eval.onnx")
    return TrainingBundle(manifest=manifest, train_onnx=train, eval_onnx=evaluation, architecture=architecture)


def _read_files(path: str | Path | bytes) -> dict[str, bytes]:
    if not isinstance(path, bytes):
        return read_bundle(path)
    where = Path("<bytes>")
    try:
        with zipfile.ZipFile(io.BytesIO(path)) as archive:
            members = archive.infolist()
            _check_members(where, members, len(path))
            return {m.filename: archive.read(m) for m in members}
    except ZIP_READ_ERRORS as exc:
        raise BundleVerificationError(f"training bundle is not a valid zip (truncated or corrupt: {_short(exc)}); "
                                      "fetch it again") from None


def _parse_training_manifest(data: bytes) -> dict[str, Any]:
    manifest = _load_json(data, MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("format") != TRAINING_FORMAT or manifest.get("kind") != KIND:
        raise BundleVerificationError(f"{MANIFEST} is not a training bundle of format {TRAINING_FORMAT}; upgrade "
                                      "fedge on the device or fetch the training bundle again")
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != {TRAIN_FILE, EVAL_FILE}:
        raise _bad("files", f"must list exactly {TRAIN_FILE} and {EVAL_FILE}")
    for name, entry in files.items():
        _check_file_entry(name, entry)
    _check_inputs(manifest.get("inputs"))
    _check_state(manifest.get("state"))
    targets = manifest.get("targets")
    if not isinstance(targets, dict) or not _is_shape(targets.get("shape")) or targets.get("dtype") not in DTYPES:
        raise _bad("targets", "must be {\"shape\": [batch, ...], \"dtype\": <dtype>}")
    if not isinstance(manifest.get("metrics"), list) or not all(isinstance(m, str) for m in manifest["metrics"]):
        raise _bad("metrics", "must list metric names")
    if manifest.get("optimizer") != OPTIMIZER:
        raise _bad("optimizer", f"must be '{OPTIMIZER}' (the update this fedge implements)")
    if not isinstance(manifest.get("model_id"), str) or not _is_int(manifest.get("version"), 0, MAX_VERSION):
        raise _bad("model_id/version", "must name the model lineage and its version")
    parse_time(manifest.get("issued_at"), "issued_at")
    if manifest.get("expires_at") is not None:
        parse_time(manifest["expires_at"], "expires_at")
    parity = manifest.get("parity")
    if not isinstance(parity, dict) or not _is_number(parity.get("max_abs_diff")):
        raise _bad("parity", "must be {\"max_abs_diff\": <number>}")
    if not isinstance(manifest.get("architecture"), str):
        raise _bad("architecture", "must be the graphs' SHA-256")
    _check_graph_ops(manifest.get(GRAPH_OPS))
    try:  # absent in bundles of older fedge: none
        Preprocessing.of(manifest.get("preprocessing"))
    except ConfigError as exc:
        raise _bad("preprocessing", str(exc)) from None
    return manifest


def _check_graph_ops(listed: object) -> None:
    """Each graph's op list: what a device owner can read in the signed manifest, and what the device enforces."""
    shape = "must list each graph's ops ({\"train.onnx\": {\"domains\": [...], \"ops\": [...]}, ...}; bundles " \
            "made before fedge recorded them: re-export on the coordinator)"
    if not isinstance(listed, dict) or set(listed) != {TRAIN_FILE, EVAL_FILE}:
        raise _bad(GRAPH_OPS, shape)
    for entry in listed.values():
        if not isinstance(entry, dict) or set(entry) != {"domains", "ops"} or not all(
                isinstance(names, list) and len(names) <= MAX_OPS_LISTED
                and all(isinstance(name, str) and 0 < len(name) <= 128 for name in names)
                for names in entry.values()):
            raise _bad(GRAPH_OPS, shape)


def _check_state(state: object) -> None:
    if not isinstance(state, list) or not 1 <= len(state) <= MAX_STATE:
        raise _bad("state", f"must list the model's state entries (1 to {MAX_STATE})")
    names = set()
    for index, entry in enumerate(state):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"] \
                or entry["name"] in names or not isinstance(entry.get("trainable"), bool) \
                or entry.get("dtype") not in DTYPES or not isinstance(entry.get("shape"), list) \
                or not all(_is_int(size, 0, 2**31) for size in entry["shape"]):
            raise _bad(f"state[{index}]", "must be {\"name\": <unique>, \"shape\": [sizes], \"dtype\": <dtype>, "
                                          "\"trainable\": <bool>}")
        names.add(entry["name"])
