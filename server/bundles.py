"""Signed edge bundles of the global model, for the coordinator and ``fedge export``."""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from torch import nn

from fedge.config import RunConfig
from fedge.edge.build import BuiltBundle, BundleSpec, build_bundle, default_model_id
from fedge.edge.signing import PRIVATE_NAME, fingerprint, generate_signing_key, load_private_key
from fedge.task.data import FederatedData, calibration_sample, label_names, preprocessing_for

log = logging.getLogger("fedge.server")

CALIBRATION_SIZE = 256


def run_signing_key(config: RunConfig, run_dir: Path) -> Ed25519PrivateKey:
    """The key named by ``signing-key``, else one made for this run under ``run_dir/keys``.

    A per-run key keeps simulation bundles signed (devices still verify them) without
    asking a researcher for key management; its public half is ``keys/signing.pub``.
    """
    if config["signing-key"]:
        return load_private_key(config.text("signing-key"))
    keys = run_dir / "keys"
    if not (keys / PRIVATE_NAME).exists():
        generate_signing_key(keys)
        log.info("bundles are signed with a key made for this run; its public key is %s",
                 keys / "signing.pub")
    return load_private_key(keys / PRIVATE_NAME)


def export_global_model(
    model: nn.Module,
    out_dir: Path,
    *,
    config: RunConfig,
    data: FederatedData,
    server_round: int,
    source_run: str,
    private_key: Ed25519PrivateKey,
    make_zip: bool = False,
    valid_for: dt.timedelta | None = None,
) -> BuiltBundle:
    """Build and sign the bundle of ``model`` (the global model after ``server_round``).

    The manifest's ``model_id`` is ``<source_run>/<model>-<dataset>``, shared by every
    bundle of the run (the coordinator's and ``fedge export``'s alike), and its
    ``version`` is ``server_round``, so a device with a freshness store refuses an
    earlier round of the run once it has run a later one. ``valid_for`` sets
    ``expires_at`` (default: no expiry).
    """
    model_name = f"{config['model']}-{config['dataset']}"
    spec = BundleSpec(
        model_name=model_name,
        source_run=source_run,
        server_round=server_round,
        preprocessing=preprocessing_for(config.text("dataset")),
        labels=label_names(data.num_classes),
        model_id=default_model_id(source_run, model_name),
        valid_for=valid_for,
    )
    built = build_bundle(model, out_dir, spec=spec, private_key=private_key, test_set=data.test,
                         calibration=calibration_sample(data, CALIBRATION_SIZE, config.integer("seed")),
                         make_zip=make_zip)
    log.info("round %d: signed bundle %s (model %s version %d, signer %s)", server_round, built.path,
             spec.lineage, server_round, fingerprint(private_key.public_key()))
    return built
