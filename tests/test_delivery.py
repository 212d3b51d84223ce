"""Bundle delivery (issue 15 item 4): publishing, the coordinator's bundle service, ``fedge pull``.

The service runs for real on 127.0.0.1 with TLS from ``fedge keys init`` and device keys from
``fedge keys add-device``. Attacks replayed: a request without, or with a wrong, device
signature; an unknown key; a stale timestamp; a replayed nonce; a tampered bundle and an
older (rollback) bundle served to a device; an untrusted signer. Bundles are tiny (see
``tiny_bundles.py``): no torch, except in the end-to-end test (``slow``).
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import ssl
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from tiny_bundles import MODEL_ID, tiny_bundle, tiny_model, write_dir

from fedge.cli.main import main
from fedge.edge import EdgeModel
from fedge.edge.bundle import FreshnessStore, pack_bundle, verify_bundle
from fedge.edge.delivery import (
    API_PREFIX,
    DeliveryError,
    NotPublished,
    PullResult,
    key_fingerprint,
    load_device_key,
    pull,
    signed_headers,
)
from fedge.errors import BundleVerificationError
from fedge.server.pki import CoordinatorKeys, add_device, init_keys
from fedge.server.publish import (
    BundleService,
    PublishRefused,
    deterministic_zip,
    publish_bundle,
    published_file,
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> CoordinatorKeys:
    """Coordinator keys with two registered devices."""
    keys = init_keys(tmp_path_factory.mktemp("pki") / "keys")
    add_device(keys.directory, "dev0")
    add_device(keys.directory, "dev1")
    return keys


@pytest.fixture(scope="module")
def signer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Ed25519PrivateKey, Path]:
    """The coordinator's bundle signing key and its public PEM (what devices trust)."""
    key = Ed25519PrivateKey.generate()
    path = tmp_path_factory.mktemp("signer") / "signing.pub"
    path.write_bytes(key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    return key, path


@pytest.fixture
def service(pki: CoordinatorKeys, tmp_path: Path) -> Iterator[BundleService]:
    served = BundleService(tmp_path / "published", pki, host="127.0.0.1", port=0)
    served.start()
    yield served
    served.stop()


def _publish(service: BundleService, signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path, version: int,
             **manifest: Any) -> str:
    folder = write_dir(tiny_bundle(signer[0], version=version, **manifest), tmp_path / f"round-{version:04d}")
    return publish_bundle("inference", folder, service.published)


def _pull(service: BundleService, pki: CoordinatorKeys, signer: tuple[Ed25519PrivateKey, Path], device: Path,
          kind: str = "inference", key: str = "dev0", **kwargs: Any) -> PullResult:
    return pull(url_or_address=f"127.0.0.1:{service.port}", kind=kind, directory=device,
                device_key=pki.devices / f"{key}.key", ca=pki.ca_cert, trusted_keys=[signer[1]], **kwargs)


def _raw(service: BundleService, pki: CoordinatorKeys, headers: Mapping[str, str],
         path: str = API_PREFIX + "inference") -> tuple[int, dict[str, str], bytes]:
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    connection = http.client.HTTPSConnection("127.0.0.1", service.port, context=context, timeout=10)
    try:
        connection.request("GET", path, headers=dict(headers))
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


# --------------------------------------------------------------------------- pull, ETag, swap


def test_pull_verifies_and_installs_then_costs_no_bytes_when_unchanged(
        service: BundleService, pki: CoordinatorKeys, signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path) -> None:
    # Prepare: version 3 published
    etag = _publish(service, signer, tmp_path, 3)
    device = tmp_path / "device"
    # Execute: first pull, then a second one
    first = _pull(service, pki, signer, device)
    started = time.perf_counter()
    second = _pull(service, pki, signer, device)
    unchanged_s = time.perf_counter() - started
    # Assert: installed, verified, then 304 with nothing downloaded
    assert first.changed and first.version == 3 and first.model_id == MODEL_ID and first.etag == etag
    assert first.bytes_downloaded == published_file(service.published, "inference").stat().st_size > 0
    assert first.path == device / "inference.zip"
    assert hashlib.sha256(first.path.read_bytes()).hexdigest() == etag
    assert not second.changed and second.bytes_downloaded == 0 and second.version == 3 and second.etag == etag
    assert unchanged_s < 2.0
    model = EdgeModel.load(first.path, trusted_keys=[signer[1]], freshness=FreshnessStore(device / ".freshness"))
    assert model.manifest["version"] == 3
    assert FreshnessStore(device / ".freshness").accepted_version(MODEL_ID) == 3
    assert sorted(p.name for p in device.iterdir() if p.name.startswith(".inference.zip")) == []


def test_304_carries_no_body(service: BundleService, pki: CoordinatorKeys,
                             signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path) -> None:
    # Prepare
    etag = _publish(service, signer, tmp_path, 1)
    key = load_device_key(pki.devices / "dev0.key")
    # Execute: the same bundle asked for with and without its ETag
    full = _raw(service, pki, signed_headers(key, "GET", API_PREFIX + "inference"))
    cached = _raw(service, pki, {**signed_headers(key, "GET", API_PREFIX + "inference"),
                                 "If-None-Match": f'"{etag}"'})
    # Assert
    assert full[0] == 200 and full[1]["etag"] == f'"{etag}"' and hashlib.sha256(full[2]).hexdigest() == etag
    assert cached[0] == 304 and cached[2] == b"" and cached[1]["etag"] == f'"{etag}"'


def test_a_newer_bundle_replaces_the_held_one(service: BundleService, pki: CoordinatorKeys,
                                              signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path) -> None:
    # Prepare
    _publish(service, signer, tmp_path, 4)
    device = tmp_path / "device"
    _pull(service, pki, signer, device)
    _publish(service, signer, tmp_path, 7)
    # Execute
    result = _pull(service, pki, signer, device, key="dev1")
    # Assert
    assert result.changed and result.version == 7 and result.bytes_downloaded > 0
    assert verify_bundle(_files(result.path), trusted_keys=[signer[1]])["version"] == 7


def _files(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def _serve_raw(service: BundleService, data: bytes) -> None:
    """What a compromised host or storage serves: bytes written past publish_bundle's checks."""
    published_file(service.published, "inference").write_bytes(data)


def test_a_tampered_bundle_is_refused_and_the_old_one_kept_byte_for_byte(
        service: BundleService, pki: CoordinatorKeys, signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path) -> None:
    # Prepare: version 5 held; then a "version 6" whose model was swapped after signing
    _publish(service, signer, tmp_path, 5)
    device = tmp_path / "device"
    held = _pull(service, pki, signer, device).path.read_bytes()
    files = tiny_bundle(signer[0], version=6)
    files["model.onnx"] = tiny_model(scale=-1.0)
    _serve_raw(service, deterministic_zip(files))
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match=r"model.onnx: SHA-256 does not match.*kept the bundle"):
        _pull(service, pki, signer, device)
    assert (device / "inference.zip").read_bytes() == held
    assert FreshnessStore(device / ".freshness").accepted_version(MODEL_ID) == 5
    assert not [p for p in device.iterdir() if p.suffix == ".part"]


def test_an_older_bundle_is_refused_as_a_rollback(service: BundleService, pki: CoordinatorKeys,
                                                  signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path) -> None:
    # Prepare: version 9 held; the coordinator refuses to publish 8, a compromised host serves it anyway
    _publish(service, signer, tmp_path, 9)
    device = tmp_path / "device"
    held = _pull(service, pki, signer, device).path.read_bytes()
    with pytest.raises(PublishRefused, match="older than the published version 9"):
        _publish(service, signer, tmp_path, 8)
    _serve_raw(service, deterministic_zip(tiny_bundle(signer[0], version=8)))
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match="rollback refused"):
        _pull(service, pki, signer, device)
    assert (device / "inference.zip").read_bytes() == held


def test_a_bundle_signed_by_an_untrusted_key_is_refused(
        service: BundleService, pki: CoordinatorKeys, signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path) -> None:
    # Prepare: a bundle signed by someone else (the transport is fine: TLS and device auth pass)
    _serve_raw(service, deterministic_zip(tiny_bundle(Ed25519PrivateKey.generate(), version=1)))
    # Execute / Assert: nothing installed
    with pytest.raises(BundleVerificationError, match="nothing was installed"):
        _pull(service, pki, signer, tmp_path / "device")
    assert not (tmp_path / "device" / "inference.zip").exists()


def test_nothing_published_is_a_404_with_a_message(service: BundleService, pki: CoordinatorKeys,
                                                   signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path) -> None:
    with pytest.raises(NotPublished, match="no training bundle is published yet"):
        _pull(service, pki, signer, tmp_path / "device", kind="training")


# --------------------------------------------------------------------------- device authentication


def test_unknown_device_key_is_refused(service: BundleService, pki: CoordinatorKeys,
                                       signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path) -> None:
    # Prepare: a well-formed key the coordinator never registered
    _publish(service, signer, tmp_path, 1)
    stranger, _ = add_device(tmp_path / "elsewhere", "stranger")
    # Execute / Assert
    with pytest.raises(DeliveryError, match="is not registered with this coordinator.*fedge keys add-device"):
        pull(url_or_address=f"127.0.0.1:{service.port}", kind="inference", directory=tmp_path / "device",
             device_key=stranger, ca=pki.ca_cert, trusted_keys=[signer[1]])


@pytest.mark.parametrize("attack", ["unsigned", "bad signature", "someone else's key", "stale", "future",
                                    "other path"])
def test_forged_requests_get_401(service: BundleService, pki: CoordinatorKeys, attack: str) -> None:
    # Prepare: dev1 pretends to be dev0, or dev0's request is altered
    dev0, dev1 = load_device_key(pki.devices / "dev0.key"), load_device_key(pki.devices / "dev1.key")
    path = API_PREFIX + "inference"
    headers = {
        "unsigned": {},
        "bad signature": {**signed_headers(dev0, "GET", path),
                          "X-Fedge-Signature": base64.b64encode(b"\x30\x06\x02\x01\x01\x02\x01\x01").decode()},
        "someone else's key": signed_headers(dev1, "GET", path, device=key_fingerprint(dev0.public_key())),
        "stale": signed_headers(dev0, "GET", path, timestamp=int(time.time()) - 301),
        "future": signed_headers(dev0, "GET", path, timestamp=int(time.time()) + 400),
        "other path": signed_headers(dev0, "GET", API_PREFIX + "training"),
    }[attack]
    # Execute
    status, _, body = _raw(service, pki, headers)
    # Assert: refused with a message saying what to do, no bundle bytes
    assert status == 401, body
    assert json.loads(body)["error"]


def test_a_replayed_request_is_refused(service: BundleService, pki: CoordinatorKeys,
                                       signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path) -> None:
    # Prepare: one genuinely signed request, captured
    _publish(service, signer, tmp_path, 1)
    headers = signed_headers(load_device_key(pki.devices / "dev0.key"), "GET", API_PREFIX + "inference")
    # Execute: sent twice
    first, second = _raw(service, pki, headers), _raw(service, pki, headers)
    # Assert
    assert first[0] == 200
    assert second[0] == 401 and "replayed nonce" in json.loads(second[2])["error"]


def test_the_device_may_name_itself(service: BundleService, pki: CoordinatorKeys,
                                    signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path) -> None:
    _publish(service, signer, tmp_path, 1)
    headers = signed_headers(load_device_key(pki.devices / "dev1.key"), "GET", API_PREFIX + "inference",
                             device="dev1")
    assert _raw(service, pki, headers)[0] == 200


def test_a_wrong_ca_is_a_one_line_error(service: BundleService, pki: CoordinatorKeys,
                                        signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path) -> None:
    other = init_keys(tmp_path / "other")
    with pytest.raises(DeliveryError, match="does not verify with"):
        pull(url_or_address=f"127.0.0.1:{service.port}", kind="inference", directory=tmp_path / "device",
             device_key=pki.devices / "dev0.key", ca=other.ca_cert, trusted_keys=[signer[1]])


# --------------------------------------------------------------------------- training bundles


def test_training_bundles_are_verified_by_their_verifier(
        service: BundleService, pki: CoordinatorKeys, signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path) -> None:
    # Prepare: an opaque signed training.zip (here: a zip with a signed manifest) and a verifier
    def training_zip(version: int, name: str) -> Path:
        files = pack_bundle({"train.onnx": b"t" * 100}, {"model_id": "run/train", "version": version},
                            private_key=signer[0])
        path = tmp_path / name
        path.write_bytes(deterministic_zip(files))
        return path

    seen: list[int] = []

    def verifier(path: Path, trusted: Any, freshness: FreshnessStore | None) -> dict[str, Any]:
        manifest = json.loads(_files(path)["manifest.json"])
        if manifest["version"] == 13:
            raise BundleVerificationError("bad training graph")
        assert freshness is not None
        freshness.check(manifest)
        seen.append(manifest["version"])
        return dict(manifest)

    publish_bundle("training", training_zip(2, "a.zip"), service.published)
    device = tmp_path / "device"
    first = _pull(service, pki, signer, device, kind="training", verifier=verifier)
    held = (device / "training.zip").read_bytes()
    publish_bundle("training", training_zip(13, "b.zip"), service.published)
    # Execute / Assert: a failing verifier keeps the old bundle
    with pytest.raises(BundleVerificationError, match="bad training graph"):
        _pull(service, pki, signer, device, kind="training", verifier=verifier)
    assert first.changed and first.version == 2 and seen == [2]
    assert (device / "training.zip").read_bytes() == held
    assert FreshnessStore(device / ".freshness" / "training").accepted_version("run/train") == 2


def test_training_bundles_default_to_the_training_bundle_reader(
        service: BundleService, pki: CoordinatorKeys, signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path) -> None:
    # Prepare: where fedge has the training bundle format, an inference bundle passed off as training.zip
    pytest.importorskip("fedge.edge.training_bundle")
    fake = tmp_path / "training.zip"
    fake.write_bytes(deterministic_zip(tiny_bundle(signer[0], version=3)))
    publish_bundle("training", fake, service.published)
    # Execute / Assert: the reader refuses it, nothing is installed
    with pytest.raises(BundleVerificationError, match="training bundle from .* refused: .*nothing was installed"):
        _pull(service, pki, signer, tmp_path / "device", kind="training")
    assert not (tmp_path / "device" / "training.zip").exists()


# --------------------------------------------------------------------------- publishing


def test_publishing_is_deterministic_and_refuses_older(signer: tuple[Ed25519PrivateKey, Path],
                                                       tmp_path: Path) -> None:
    # Prepare
    files = tiny_bundle(signer[0], version=2)
    folder = write_dir(files, tmp_path / "bundles" / "round-0002")
    write_dir(tiny_bundle(signer[0], version=1), tmp_path / "bundles" / "round-0001")
    published = tmp_path / "published"
    # Execute: the folder of bundles publishes its newest; publishing again changes nothing
    etag = publish_bundle("inference", tmp_path / "bundles", published)
    again = publish_bundle("inference", folder, published)
    # Assert
    assert etag == again == hashlib.sha256(deterministic_zip(files)).hexdigest()
    assert sorted(p.name for p in published.iterdir()) == [".publish.lock", "inference.zip"]
    with pytest.raises(PublishRefused, match="older"):
        publish_bundle("inference", tmp_path / "bundles" / "round-0001", published)
    other_run = write_dir(tiny_bundle(signer[0], version=1, model_id="run-2/mlp"), tmp_path / "run-2")
    assert publish_bundle("inference", other_run, published) != etag  # a new lineage replaces the old one


def test_insecure_service_serves_plain_http_and_warns(pki: CoordinatorKeys, signer: tuple[Ed25519PrivateKey, Path],
                                                      tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare
    served = BundleService(tmp_path / "published", None, port=0)
    served.start()
    try:
        _publish(served, signer, tmp_path, 1)
        # Execute
        result = pull(url_or_address=f"127.0.0.1:{served.port}", kind="inference", directory=tmp_path / "device",
                      device_key=None, ca=None, trusted_keys=[signer[1]], insecure=True)
    finally:
        served.stop()
    # Assert: served, verified, announced
    assert result.changed and result.version == 1
    assert "INSECURE MODE" in capsys.readouterr().err
    with pytest.raises(DeliveryError, match="plain HTTP"):
        pull(url_or_address=f"http://127.0.0.1:{served.port}", kind="inference", directory=tmp_path / "d",
             device_key=pki.devices / "dev0.key", ca=pki.ca_cert, trusted_keys=[signer[1]])


# --------------------------------------------------------------------------- the CLI


def test_fedge_pull_prints_one_line_per_bundle_and_exits_2_on_refusal(
        service: BundleService, pki: CoordinatorKeys, signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare
    _publish(service, signer, tmp_path, 12)
    argv = ["pull", "--coordinator", f"127.0.0.1:{service.port}", "--key", str(pki.devices / "dev0.key"),
            "--ca", str(pki.ca_cert), "--trust", str(signer[1]), "--dir", str(tmp_path / "device")]
    # Execute / Assert: updated, then unchanged; training not published yet is said, not failed
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("inference v12 updated (") and out[1] == "training none published yet"
    assert main([*argv, "--kind", "inference"]) == 0
    assert capsys.readouterr().out.strip() == "inference v12 unchanged (0 bytes)"
    _serve_raw(service, deterministic_zip(tiny_bundle(signer[0], version=11)))
    assert main([*argv, "--kind", "inference"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rollback refused" in err


def test_fedge_pull_imports_no_torch(pki: CoordinatorKeys, signer: tuple[Ed25519PrivateKey, Path],
                                     tmp_path: Path) -> None:
    # Execute: a pull that fails to connect, in a fresh interpreter
    code = ("import sys; from fedge.cli.main import main; "
            f"rc = main(['pull', '--coordinator', '127.0.0.1:1', '--key', {str(pki.devices / 'dev0.key')!r}, "
            f"'--ca', {str(pki.ca_cert)!r}, '--trust', {str(signer[1])!r}, '--dir', {str(tmp_path)!r}]); "
            "print(rc, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    # Assert
    assert done.stdout.split()[-2:] == ["2", "False"], done.stdout + done.stderr
    assert "cannot reach the bundle service" in done.stderr


def test_key_fingerprint_is_ssh_keygens(pki: CoordinatorKeys) -> None:
    key = load_device_key(pki.devices / "dev0.key")
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    line = (pki.devices / "dev0.pub").read_text().split()
    expected = "SHA256:" + base64.b64encode(hashlib.sha256(base64.b64decode(line[1])).digest()).decode().rstrip("=")
    assert key_fingerprint(key.public_key()) == expected


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.deployment
def test_a_coordinator_publishes_and_a_device_pulls(tmp_path: Path) -> None:
    from fedge.simulation.loopback import FEDGE, LoopbackFederation, free_port

    federation = LoopbackFederation(tmp_path, num_devices=2)
    bundle_port = free_port()
    published = federation.root / "state" / "published" / "inference.zip"
    trust = federation.bundle_signing_key  # the coordinator's own bundle key (KEYS/bundle-signing), kept across runs
    try:
        # Prepare: a two-round run signing a bundle after round 1 (published while round 2 trains)
        federation.start_coordinator("--rounds", "2", "--clients-per-round", "2", "--bundle-port", str(bundle_port),
                                     "--run-config", "model='mlp' local-epochs=10 export-every=1 round-timeout=900.0 "
                                     "runtime='torch'")
        for index in range(2):
            federation.start_device(index)
        federation.wait_for(published.exists, 900, "the published bundle")
        assert "bundles: https://127.0.0.1:" in federation.log("coordinator")
        # Execute: `fedge pull` as a device, then the Python API with the ETag it left
        argv = [FEDGE, "pull", "--coordinator", f"127.0.0.1:{bundle_port}", "--key",
                str(federation.keys.devices / "dev0.key"), "--ca", str(federation.keys.ca_cert),
                "--trust", str(trust), "--dir", str(tmp_path / "phone"), "--kind", "inference"]
        first = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        second = pull(url_or_address=f"127.0.0.1:{bundle_port}", kind="inference", directory=tmp_path / "phone",
                      device_key=federation.keys.devices / "dev0.key", ca=federation.keys.ca_cert,
                      trusted_keys=[trust])
    finally:  # round 2 is still training (local-epochs=10): what was pulled is round 1's bundle
        federation.close()
    # Assert
    assert first.returncode == 0, first.stdout + first.stderr + federation.log("coordinator")
    assert first.stdout.startswith("inference v1 updated ("), first.stdout
    assert not second.changed and second.bytes_downloaded == 0 and second.version == 1
    model = EdgeModel.load(tmp_path / "phone" / "inference.zip", trusted_keys=[trust])
    assert model.manifest["version"] == 1


# --------------------------------------------------------------------------- issue 23: timestamps, quota, allow-list


@pytest.mark.parametrize("stamp", [b"\xb2", b"9" * 5000, b"1" * 13])
def test_odd_timestamps_get_401_not_500(service: BundleService, pki: CoordinatorKeys, stamp: bytes) -> None:
    # Prepare: dev0's genuine headers with the timestamp swapped for one str.isdigit() takes but int() chokes on
    headers: dict[str, Any] = signed_headers(load_device_key(pki.devices / "dev0.key"), "GET",
                                             API_PREFIX + "inference")
    headers["X-Fedge-Timestamp"] = stamp
    # Execute
    status, _, body = _raw(service, pki, headers)
    # Assert: refused like any bad signature (before: 500 with a traceback)
    assert status == 401, body
    assert "malformed timestamp" in json.loads(body)["error"]


def _flood(service: BundleService, pki: CoordinatorKeys, key: str, count: int) -> list[int]:
    """``count`` genuinely signed requests of device ``key`` on one TLS connection; their statuses."""
    device = load_device_key(pki.devices / f"{key}.key")
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    connection = http.client.HTTPSConnection("127.0.0.1", service.port, context=context, timeout=30)
    statuses = []
    try:
        for _ in range(count):
            connection.request("GET", API_PREFIX + "inference", headers=signed_headers(device, "GET",
                                                                                       API_PREFIX + "inference"))
            response = connection.getresponse()
            response.read()
            statuses.append(response.status)
    finally:
        connection.close()
    return statuses


def test_one_devices_flood_never_refuses_another_device(service: BundleService, pki: CoordinatorKeys,
                                                        signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a bundle; the replay quota made small so the flood fits in a test (the rule is the same)
    import fedge.server.publish as publish

    monkeypatch.setattr(publish, "MAX_NONCES_PER_DEVICE", 150)
    _publish(service, signer, tmp_path, 1)
    # Execute: dev0 floods with valid signed requests past its quota, then dev1 pulls
    flood = _flood(service, pki, "dev0", 160)
    other = _pull(service, pki, signer, tmp_path / "dev1", key="dev1")
    # Assert: dev0 alone is held back (429 once over quota); dev1 is served
    assert flood[:150] == [200] * 150 and set(flood[150:]) == {429}
    assert other.changed and other.version == 1


def test_the_bundle_service_follows_the_allow_list_without_a_restart(
        signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path) -> None:
    # Prepare: a coordinator's keys with one device, its bundle service running
    keys = init_keys(tmp_path / "keys")
    add_device(keys.directory, "old")
    served = BundleService(tmp_path / "published", keys)
    served.start()
    try:
        _publish(served, signer, tmp_path, 1)
        assert _pull(served, keys, signer, tmp_path / "old-device", key="old").version == 1
        # Execute: the operator adds a device and removes the old key; the coordinator's device sync runs
        add_device(keys.directory, "new")
        (keys.devices / "old.pub").unlink()
        served.follow(revoked=())
        # Assert: the new device pulls, the removed one is refused, without a restart
        assert _pull(served, keys, signer, tmp_path / "new-device", key="new").version == 1
        with pytest.raises(DeliveryError, match="not registered with this coordinator"):
            _pull(served, keys, signer, tmp_path / "old-device-2", key="old")
        # Execute / Assert: a key whose node the SuperLink revoked is refused although its file is there
        served.follow(revoked={"new"})
        with pytest.raises(DeliveryError, match="not registered with this coordinator"):
            _pull(served, keys, signer, tmp_path / "new-device-2", key="new")
    finally:
        served.stop()
