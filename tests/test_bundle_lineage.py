"""``fedge pull`` follows one model lineage (issue 23, item 11).

Rollback protection orders the versions of one ``model_id``; a bundle of another lineage
(an older run's, signed by the same key) used to replace the current one at any version.
The first pull pins the lineage; another is refused unless asked for by name
(``--model-id``). Real parts: the bundle service on 127.0.0.1 with TLS and device keys,
signed tiny bundles (``tiny_bundles.py``), fedge's CLI.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from test_delivery import _publish, _pull, _serve_raw, pki, service, signer  # noqa: F401 - pytest fixtures
from tiny_bundles import MODEL_ID, tiny_bundle

from fedge.cli.main import main
from fedge.edge.bundle import FreshnessStore
from fedge.edge.delivery import LINEAGE_PIN, pinned_lineage
from fedge.errors import BundleVerificationError
from fedge.server.pki import CoordinatorKeys
from fedge.server.publish import BundleService, deterministic_zip

OLD_RUN = "run-0/mlp-digits"  # an older run of the same task: another lineage, the same signing key


def test_a_bundle_of_another_lineage_is_refused_unless_asked_for_by_name(
        service: BundleService, pki: CoordinatorKeys, signer: tuple[Ed25519PrivateKey, Path],  # noqa: F811
        tmp_path: Path) -> None:
    # Prepare: the device pulled the current run's version 5; the host then serves an older run's bundle,
    # at a higher version (versions of different lineages are not ordered against each other)
    _publish(service, signer, tmp_path, 5)
    device = tmp_path / "device"
    held = _pull(service, pki, signer, device).path.read_bytes()
    _serve_raw(service, deterministic_zip(tiny_bundle(signer[0], model_id=OLD_RUN, version=50)))
    # Execute / Assert: refused, naming both lineages and the flag; the held bundle kept byte for byte
    with pytest.raises(BundleVerificationError, match=rf"model '{OLD_RUN}'.*follows model '{MODEL_ID}'.*"
                                                      rf"--model-id '{OLD_RUN}'.*kept the bundle"):
        _pull(service, pki, signer, device)
    assert (device / "inference.zip").read_bytes() == held
    assert pinned_lineage(device / ".freshness" / LINEAGE_PIN) == MODEL_ID
    # Execute / Assert: asked for by name, it is installed and followed from then on
    switched = _pull(service, pki, signer, device, model_id=OLD_RUN)
    assert switched.changed and switched.model_id == OLD_RUN and switched.version == 50
    assert pinned_lineage(device / ".freshness" / LINEAGE_PIN) == OLD_RUN
    assert FreshnessStore(device / ".freshness").accepted_version(OLD_RUN) == 50


def test_model_id_refuses_a_bundle_of_another_lineage_even_on_the_first_pull(
        service: BundleService, pki: CoordinatorKeys, signer: tuple[Ed25519PrivateKey, Path],  # noqa: F811
        tmp_path: Path) -> None:
    # Prepare
    _publish(service, signer, tmp_path, 3)
    device = tmp_path / "device"
    # Execute / Assert: nothing installed, nothing pinned
    with pytest.raises(BundleVerificationError, match=rf"of model '{MODEL_ID}', not '{OLD_RUN}'.*nothing was"):
        _pull(service, pki, signer, device, model_id=OLD_RUN)
    assert not (device / "inference.zip").exists() and pinned_lineage(device / ".freshness" / LINEAGE_PIN) is None


def test_fedge_pull_model_id(service: BundleService, pki: CoordinatorKeys,  # noqa: F811
                             signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path,  # noqa: F811
                             capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: the current run pulled; an older run's bundle served
    _publish(service, signer, tmp_path, 7)
    argv = ["pull", "--coordinator", f"127.0.0.1:{service.port}", "--key", str(pki.devices / "dev0.key"),
            "--ca", str(pki.ca_cert), "--trust", str(signer[1]), "--dir", str(tmp_path / "device"),
            "--kind", "inference"]
    assert main(argv) == 0
    _serve_raw(service, deterministic_zip(tiny_bundle(signer[0], model_id=OLD_RUN, version=70)))
    capsys.readouterr()
    # Execute / Assert: refused in one line naming both ids and the flag; accepted by name
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and OLD_RUN in err and MODEL_ID in err and "--model-id" in err
    assert main([*argv, "--model-id", OLD_RUN]) == 0
    assert capsys.readouterr().out.startswith("inference v70 updated")
    # One lineage names one kind's bundles
    assert main([*argv[:-2], "--model-id", OLD_RUN]) == 2
    assert "use it with --kind inference or --kind training" in capsys.readouterr().err


def test_a_damaged_pin_refuses_every_bundle(service: BundleService, pki: CoordinatorKeys,  # noqa: F811
                                            signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path) -> None:  # noqa: F811
    # Prepare
    _publish(service, signer, tmp_path, 2)
    device = tmp_path / "device"
    _pull(service, pki, signer, device)
    (device / ".freshness" / LINEAGE_PIN).write_text("{not json")
    _publish(service, signer, tmp_path, 3)
    # Execute / Assert: fails closed
    with pytest.raises(BundleVerificationError, match="lineage pin .* is damaged"):
        _pull(service, pki, signer, device)
