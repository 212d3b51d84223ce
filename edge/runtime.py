"""Run a verified edge bundle with onnxruntime alone: no torch, just numpy + onnxruntime.

Threat model: see :mod:`fedge.edge.bundle`. :meth:`EdgeModel.load` verifies the
signature, the signer's trust and every file hash *before* creating the
onnxruntime session, and builds the session from the verified bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedge.edge.bundle import TrustedKey, read_bundle, verify_bundle
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
    ) -> EdgeModel:
        """Verify the bundle at ``path`` (directory or .zip), then open ``variant``.

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
            checked) and log a warning.
        threads : int
            onnxruntime intra-op threads.

        Raises
        ------
        BundleVerificationError
            Naming the failed check; no session is created.
        """
        if variant not in VARIANTS:
            raise ConfigError(f"variant '{variant}' is not one of {', '.join(VARIANTS)}")
        files = read_bundle(path)
        manifest = verify_bundle(files, trusted_keys=trusted_keys, allow_unsigned=allow_unsigned)
        entry = manifest.get("variants", {}).get(variant)
        if not entry or entry.get("file") not in files:
            raise BundleVerificationError(f"bundle has no '{variant}' model; it offers "
                                          f"{sorted(manifest.get('variants', {}))}")
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(files[entry["file"]], sess_options=options,
                                       providers=["CPUExecutionProvider"])
        return cls(session, manifest, variant)

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
