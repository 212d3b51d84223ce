"""Signed edge bundles: built, verified and run end to end; every kind of tampering refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedge.config import resolve_run_config
from fedge.edge import EdgeModel
from fedge.edge.build import BuiltBundle, BundleSpec, build_bundle
from fedge.edge.bundle import MANIFEST, SIGNATURE, parse_time, read_bundle, sign_manifest, verify_bundle
from fedge.edge.signing import generate_signing_key, load_private_key
from fedge.errors import BundleVerificationError
from fedge.server.bundles import task_score
from fedge.task.api import Task, TaskData, seeded_model
from fedge.task.loading import load_task
from fedge.task.training import train_local


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_signing_key(tmp_path_factory.mktemp("keys"))[0].parent


def _digits(model: str) -> Task:
    return load_task(resolve_run_config({"model": model}))


def _test_set(task: Task) -> TaskData:
    data = task.central_data()
    assert data is not None
    return data


@pytest.fixture(scope="module", params=["cnn", "mlp"])
def bundle(request: pytest.FixtureRequest, keys: Path, tmp_path_factory: pytest.TempPathFactory) -> BuiltBundle:
    """A centrally trained model of each kind (conv -> static int8, linear -> dynamic), bundled."""
    task = _digits(request.param)
    model = seeded_model(task, 0)
    train_local(task, model, task.train_data(), epochs=8, batch_size=32, learning_rate=0.05, momentum=0.9,
                device=torch.device("cpu"), seed=0)
    test = _test_set(task)
    spec = BundleSpec(model_name=f"{request.param}-digits", source_run="test", server_round=7,
                      preprocessing=dict(task.preprocessing), labels=list(task.labels or ()),
                      output_meaning=task.output, headline=task.headline)
    out = tmp_path_factory.mktemp("bundles") / request.param
    return build_bundle(model, out, spec=spec, private_key=load_private_key(keys / "signing.key"),
                        inputs=task.inputs, sample=test.inputs, score=task_score(task, test.targets),
                        calibration=task.calibration_data(256, 0), make_zip=True)


def test_fp32_parity_and_int8_quality(bundle: BuiltBundle) -> None:
    metrics = bundle.manifest["metrics"]
    assert metrics["torch_onnx_max_abs_diff"] <= 1e-4
    assert {"fp32_loss", "int8_loss", "test_samples"} <= set(metrics)
    assert metrics["fp32_accuracy"] > 0.9
    assert metrics["int8_top1_agreement"] >= 0.99
    expected = "static-qdq" if bundle.manifest["model_name"].startswith("cnn") else "dynamic"
    assert bundle.manifest["variants"]["int8"]["quantization"] == expected


def test_manifest_names_the_lineage_and_version_for_freshness(bundle: BuiltBundle) -> None:
    # Prepare: the spec said source_run "test", round 7, no expiry
    manifest = bundle.manifest
    # Execute
    issued = parse_time(manifest["issued_at"], "issued_at")
    # Assert: model_id <source_run>/<model_name>, version = round, signed as written
    assert (manifest["model_id"], manifest["version"], manifest["expires_at"]) == (
        f"test/{manifest['model_name']}", 7, None)
    assert manifest["issued_at"] == manifest["created_at"] and issued.tzinfo is not None
    signed = json.loads(read_bundle(bundle.path)[MANIFEST])
    assert {k: signed[k] for k in ("model_id", "version", "issued_at", "expires_at")} == {
        "model_id": f"test/{manifest['model_name']}", "version": 7, "issued_at": manifest["issued_at"],
        "expires_at": None}


def test_manifest_describes_the_digits_signature(bundle: BuiltBundle) -> None:
    # Prepare
    manifest = json.loads(read_bundle(bundle.path)[MANIFEST])
    # Execute
    outputs = [{k: v for k, v in entry.items() if k != "meaning"} for entry in manifest["outputs"]]
    # Assert: one float input of 64 pixels, 10 class scores named "0".."9", pixels / 16
    assert manifest["inputs"] == [{"name": "input", "shape": ["batch", 64], "dtype": "float32"}]
    assert outputs == [{"name": "logits", "shape": ["batch", 10], "dtype": "float32"}]
    assert manifest["labels"] == [str(i) for i in range(10)] and manifest["headline"] == "accuracy"
    assert (manifest["preprocessing"]["kind"], manifest["preprocessing"]["scale"]) == ("affine", 1 / 16)


@pytest.mark.parametrize("name", ["model.onnx", "model.int8.onnx"])
def test_exported_models_pass_the_full_onnx_checker(bundle: BuiltBundle, name: str) -> None:
    onnx.checker.check_model(onnx.load(bundle.path / name), full_check=True)


@pytest.mark.parametrize("as_zip", [False, True])
@pytest.mark.parametrize("variant", ["int8", "fp32"])
def test_bundle_verifies_and_runs_end_to_end(bundle: BuiltBundle, keys: Path, as_zip: bool, variant: str) -> None:
    # Prepare
    path = bundle.path.with_suffix(".zip") if as_zip else bundle.path
    test = _test_set(_digits("cnn"))
    (x_test,), y_test = test.inputs, test.targets
    # Execute
    model = EdgeModel.load(path, trusted_keys=[keys / "signing.pub"], variant=variant)
    batch = model.predict(x_test)
    single = model.predict(x_test[0])
    raw = model.predict(model.preprocess(x_test[:5] * 16))
    # Assert
    accuracy = float(np.mean(batch.labels == y_test))
    assert accuracy == pytest.approx(bundle.manifest["metrics"][f"{variant}_accuracy"])
    np.testing.assert_allclose(batch.probabilities.sum(axis=1), 1.0, rtol=1e-5)
    assert single.labels.shape == (1,) and single.labels[0] == batch.labels[0]
    assert single.label_names == [str(batch.labels[0])]
    np.testing.assert_array_equal(raw.labels, batch.labels[:5])


def _flip(name: str, offset: int = 40) -> Callable[[dict[str, bytes], Path], None]:
    def tamper(files: dict[str, bytes], keys: Path) -> None:
        data = bytearray(files[name])
        data[offset % len(data)] ^= 0x01
        files[name] = bytes(data)
    return tamper


def _resign_with_untrusted(files: dict[str, bytes], keys: Path) -> None:
    files[SIGNATURE] = sign_manifest(files[MANIFEST], Ed25519PrivateKey.generate())


def _wrong_hash_signed_by_trusted(files: dict[str, bytes], keys: Path) -> None:
    manifest = json.loads(files[MANIFEST])
    manifest["files"]["model.onnx"]["sha256"] = "0" * 64
    files[MANIFEST] = json.dumps(manifest).encode()
    files[SIGNATURE] = sign_manifest(files[MANIFEST], load_private_key(keys / "signing.key"))


def _remove(name: str) -> Callable[[dict[str, bytes], Path], None]:
    def tamper(files: dict[str, bytes], keys: Path) -> None:
        del files[name]
    return tamper


def _add_extra(files: dict[str, bytes], keys: Path) -> None:
    files["payload.py"] = b"print('hi')"


TAMPERING: list[tuple[str, Callable[[dict[str, bytes], Path], None], str]] = [
    ("byte in model.onnx", _flip("model.onnx", 5000), "model.onnx: SHA-256 does not match"),
    ("byte in model.int8.onnx", _flip("model.int8.onnx", 5000), "model.int8.onnx: SHA-256 does not match"),
    ("byte in manifest", _flip(MANIFEST, 60), "signature check failed"),
    ("byte in signature", _flip(SIGNATURE, 150), "signature check failed|malformed"),
    ("re-signed by untrusted key", _resign_with_untrusted, "untrusted key"),
    ("wrong hash in a trusted manifest", _wrong_hash_signed_by_trusted, "model.onnx: SHA-256 does not match"),
    ("missing model file", _remove("model.int8.onnx"), "missing"),
    ("extra file", _add_extra, "unexpected file\\(s\\) \\['payload.py'\\]"),
    ("missing signature", _remove(SIGNATURE), "unsigned"),
    ("missing manifest", _remove(MANIFEST), "no manifest.json"),
]


@pytest.mark.parametrize(("case", "tamper", "reason"), TAMPERING, ids=[t[0] for t in TAMPERING])
def test_tampered_bundles_are_refused_before_any_session(
    bundle: BuiltBundle, keys: Path, tmp_path: Path,
    case: str, tamper: Callable[[dict[str, bytes], Path], None], reason: str,
) -> None:
    # Prepare: a tampered copy, as a directory and as a zip
    files = read_bundle(bundle.path)
    tamper(files, keys)
    (tmp_path / "b").mkdir()
    for name, data in files.items():
        (tmp_path / "b" / name).write_bytes(data)
    with zipfile.ZipFile(tmp_path / "b.zip", "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    # Execute / Assert
    for path in (tmp_path / "b", tmp_path / "b.zip"):
        with pytest.raises(BundleVerificationError, match=reason):
            EdgeModel.load(path, trusted_keys=[keys / "signing.pub"])


def test_truncated_zip_is_refused(bundle: BuiltBundle, keys: Path, tmp_path: Path) -> None:
    data = bundle.path.with_suffix(".zip").read_bytes()
    (tmp_path / "cut.zip").write_bytes(data[: len(data) // 2])
    with pytest.raises(BundleVerificationError, match="not a valid zip"):
        EdgeModel.load(tmp_path / "cut.zip", trusted_keys=[keys / "signing.pub"])


def test_unsigned_bundle_only_with_allow_unsigned(bundle: BuiltBundle, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    shutil.copytree(bundle.path, tmp_path / "u")
    (tmp_path / "u" / SIGNATURE).unlink()
    with pytest.raises(BundleVerificationError, match="unsigned"):
        EdgeModel.load(tmp_path / "u", trusted_keys=[])
    model = EdgeModel.load(tmp_path / "u", trusted_keys=[], allow_unsigned=True)
    assert model.predict(np.zeros(64)).labels.shape == (1,)
    assert "UNSIGNED" in caplog.text


def test_verification_needs_no_trusted_key_file_tricks(bundle: BuiltBundle, tmp_path: Path) -> None:
    (tmp_path / "not-a-key.pub").write_text("hello")
    with pytest.raises(BundleVerificationError, match="not a PEM public key"):
        verify_bundle(read_bundle(bundle.path), trusted_keys=[tmp_path / "not-a-key.pub"])


def test_signing_key_is_private(keys: Path) -> None:
    assert os.stat(keys / "signing.key").st_mode & 0o777 == 0o600


def test_runtime_imports_no_torch(bundle: BuiltBundle, keys: Path) -> None:
    script = textwrap.dedent(f"""
        import sys, numpy as np
        from fedge.edge import EdgeModel
        model = EdgeModel.load({str(bundle.path)!r}, trusted_keys=[{str(keys / 'signing.pub')!r}])
        print(model.predict(np.zeros((3, 64), np.float32)).labels.shape)
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(3,)"
