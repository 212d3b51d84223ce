"""Run a verified edge bundle with onnxruntime alone: no torch, just numpy + onnxruntime.

Threat model: see :mod:`fedge.edge.bundle`. :meth:`EdgeModel.load` verifies the
signature, the signer's trust, the manifest, every file hash, the expiry and
(with a :class:`~fedge.edge.bundle.FreshnessStore`) that the bundle is not older
than one this device already ran, all *before* creating the onnxruntime session;
it builds the session from the verified bytes, and raises the freshness record
only once the session exists.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedge.edge.bundle import SIGNATURE, FreshnessStore, TrustedKey, read_bundle, verify_bundle
from fedge.errors import BundleVerificationError, ConfigError

log = logging.getLogger("fedge.edge")

VARIANTS = ("int8", "fp32")


@dataclass(frozen=True)
class Prediction:
    """Class probabilities (n, classes), predicted class indices (n,) and their names."""

    probabilities: NDArray[np.float32]
    labels: NDArray[np.int64]
    label_names: list[str]


class EdgeModel:
    """A verified bundle's model in an onnxruntime session."""

    def __init__(self, session: Any, manifest: dict[str, Any], variant: str) -> None:
        self.session, self.manifest, self.variant = session, manifest, variant
        (self._input,) = manifest["inputs"]
        self.num_features = int(self._input["shape"][1])

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        trusted_keys: Iterable[TrustedKey],
        variant: str = "int8",
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
        variant : {"int8", "fp32"}
            Which model file to run.
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
        variant: str = "int8",
        allow_unsigned: bool = False,
        threads: int = 1,
        freshness: FreshnessStore | None = None,
        model_id: str | None = None,
        now: dt.datetime | None = None,
    ) -> EdgeModel:
        """:meth:`load` for a bundle already in memory (``{name: bytes}``, as :func:`read_bundle` gives)."""
        if variant not in VARIANTS:
            raise ConfigError(f"variant '{variant}' is not one of {', '.join(VARIANTS)}")
        manifest = verify_bundle(files, trusted_keys=trusted_keys, allow_unsigned=allow_unsigned,
                                 freshness=freshness, model_id=model_id, now=now)
        entry = manifest["variants"].get(variant)
        if entry is None:
            raise BundleVerificationError(f"bundle has no '{variant}' model; it offers "
                                          f"{sorted(manifest['variants'])}")
        model = cls(_open_session(files[entry["file"]], manifest, threads), manifest, variant)
        if freshness is not None and SIGNATURE in files:
            freshness.record(manifest, now=now)
        return model

    def preprocess(self, raw: NDArray[Any]) -> NDArray[np.float32]:
        """Apply the manifest's declared preprocessing (``x * scale + offset``) to raw inputs."""
        spec = self.manifest.get("preprocessing", {})
        return (np.asarray(raw, np.float32) * float(spec.get("scale", 1.0))
                + float(spec.get("offset", 0.0))).astype(np.float32)

    def predict(self, x: NDArray[Any]) -> Prediction:
        """Class probabilities and labels for one sample ``(features,)`` or a batch ``(n, features)``.

        ``x`` must already be preprocessed (see :meth:`preprocess`).
        """
        batch = np.asarray(x, dtype=np.float32)
        if batch.ndim == 1:
            batch = batch[None, :]
        if batch.ndim != 2 or batch.shape[1] != self.num_features:
            raise ConfigError(f"input has shape {np.shape(x)}; the model takes ({self.num_features},) "
                              f"or (n, {self.num_features})")
        (logits,) = self.session.run(None, {self._input["name"]: np.ascontiguousarray(batch)})
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        probabilities = (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)
        labels = probabilities.argmax(axis=1).astype(np.int64)
        names = self.manifest.get("labels") or [str(i) for i in range(probabilities.shape[1])]
        return Prediction(probabilities, labels, [str(names[i]) for i in labels])


def _open_session(model_bytes: bytes, manifest: dict[str, Any], threads: int) -> Any:
    """An onnxruntime session of verified bytes that must match what the manifest says of them."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    try:
        session = ort.InferenceSession(model_bytes, sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own types, all from a signed but broken model
        raise BundleVerificationError(f"onnxruntime cannot load the signed model ({type(exc).__name__}); "
                                      "re-export the bundle with `fedge export`") from None
    _check_model_matches(session, manifest)
    return session


def _check_model_matches(session: Any, manifest: dict[str, Any]) -> None:
    """The model takes (batch, features) and gives (batch, classes), as the manifest declares."""
    (declared,) = manifest["inputs"]
    inputs, outputs = session.get_inputs(), session.get_outputs()
    shape = inputs[0].shape if len(inputs) == 1 else []
    features = shape[1] if len(shape) == 2 else None
    if len(shape) != 2 or inputs[0].name != declared["name"] or len(outputs) != 1 \
            or len(outputs[0].shape) != 2 or (isinstance(features, int) and features != declared["shape"][1]):
        raise BundleVerificationError("the model's inputs/outputs differ from what manifest.json declares; "
                                      "re-export the bundle with `fedge export`")
    labels, classes = manifest.get("labels"), outputs[0].shape[-1]
    if labels and isinstance(classes, int) and len(labels) != classes:
        raise BundleVerificationError(f"manifest.json names {len(labels)} labels for a model of {classes} "
                                      "classes; re-export the bundle with `fedge export`")
