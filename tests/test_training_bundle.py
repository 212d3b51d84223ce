"""Signed training bundles (issue 15): written, verified, and refused when tampered with, stale or rolled back."""

from __future__ import annotations

import datetime as dt
import io
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from tiny_bundles import tiny_model
from torch import nn

from fedge.edge.bundle import FreshnessStore
from fedge.edge.trainer import OnnxTrainer
from fedge.edge.training_bundle import architecture_of, read_training_bundle, write_training_bundle
from fedge.edge.training_graph import TrainingGraphs, export_training_graphs
from fedge.errors import BundleVerificationError
from fedge.signature import InputSpec

KEY = Ed25519PrivateKey.generate()
NOW = dt.datetime(2026, 12, 3, 12, 0, tzinfo=dt.UTC)
_CACHE: dict[str, TrainingGraphs] = {}


def graphs() -> TrainingGraphs:
    """Training graphs of a small linear classifier (exported once per session)."""
    if "graphs" not in _CACHE:
        rng = np.random.default_rng(0)
        x, y = rng.random((32, 5), dtype=np.float32), rng.integers(0, 3, 32)
        _CACHE["graphs"] = export_training_graphs(nn.Linear(5, 3), nn.functional.cross_entropy, [x], y,
                                                  inputs=[InputSpec("features", ("batch", 5))], parity_steps=2)
    return _CACHE["graphs"]


def fake_graphs() -> dict[str, Any]:
    """The fields of a TrainingGraphs with stand-in graphs (valid ONNX: the manifest lists their ops)."""
    return {"train_onnx": tiny_model(), "eval_onnx": tiny_model(2.0),
            "state": [{"name": "weight", "shape": [3, 5], "dtype": "float32", "trainable": True}],
            "inputs": [InputSpec("features", ("batch", 5))], "target_shape": ("batch",), "target_dtype": "int64",
            "max_abs_diff": 1e-8, "opset": 20}


def write(path: Path, *, version: int = 1, key: Ed25519PrivateKey = KEY, **options: Any) -> dict[str, Any]:
    return write_training_bundle(path, fake_graphs(), task="toy", metrics=["loss", "accuracy"], model_id="run/toy",
                                 version=version, private_key=key, issued_at=NOW, **options)


def rezip(path: Path, change: dict[str, bytes]) -> None:
    """Rewrite the zip at ``path`` with some entries replaced or added."""
    with zipfile.ZipFile(path) as archive:
        files = {name: archive.read(name) for name in archive.namelist()}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in {**files, **change}.items():
            archive.writestr(name, data)
    path.write_bytes(buffer.getvalue())


def test_a_training_bundle_round_trips_and_trains(tmp_path: Path) -> None:
    # Prepare
    exported = graphs()
    path = tmp_path / "train.zip"
    # Execute
    written = write_training_bundle(path, exported, task="toy", metrics=["loss", "accuracy"], model_id="run/toy",
                                    version=3, private_key=KEY)
    bundle = read_training_bundle(path, trusted_keys=[KEY.public_key()])
    from_bytes = read_training_bundle(path.read_bytes(), trusted_keys=[KEY.public_key()])
    trainer = OnnxTrainer(bundle.train_onnx, bundle.eval_onnx, bundle.manifest)
    rng = np.random.default_rng(1)
    weights = {"weight": rng.random((3, 5), dtype=np.float32), "bias": np.zeros(3, np.float32)}
    new, stats = trainer.train(weights, [rng.random((20, 5), dtype=np.float32)], rng.integers(0, 3, 20), epochs=1,
                               batch_size=8, learning_rate=0.1, momentum=0.9, seed=0)
    # Assert
    assert bundle.manifest == written == from_bytes.manifest
    assert (bundle.train_onnx, bundle.eval_onnx) == (exported.train_onnx, exported.eval_onnx)
    assert bundle.architecture == architecture_of(exported.train_onnx, exported.eval_onnx) == written["architecture"]
    manifest = bundle.manifest
    assert (manifest["kind"], manifest["task"], manifest["version"], manifest["optimizer"]) == (
        "training", "toy", 3, "sgd-momentum")
    assert [e["name"] for e in manifest["state"]] == ["weight", "bias"]
    assert manifest["inputs"] == [{"name": "features", "shape": ["batch", 5], "dtype": "float32"}]
    assert manifest["targets"] == {"shape": ["batch"], "dtype": "int64"}
    assert set(manifest["files"]) == {"train.onnx", "eval.onnx"}
    assert stats.steps == 3 and set(new) == {"weight", "bias"}


def test_the_architecture_key_does_not_depend_on_the_weights() -> None:
    # Prepare: two exports of differently initialised models of one architecture
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 5), dtype=np.float32), rng.integers(0, 3, 32)
    spec = [InputSpec("features", ("batch", 5))]
    # Execute
    other = export_training_graphs(nn.Linear(5, 3), nn.functional.cross_entropy, [x], y, inputs=spec, parity_steps=2)
    # Assert: devices cache one graph for every round
    assert architecture_of(other.train_onnx, other.eval_onnx) == architecture_of(graphs().train_onnx,
                                                                                 graphs().eval_onnx)


def test_a_tampered_graph_is_refused(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "b.zip"
    write(path)
    rezip(path, {"train.onnx": b"train graph, altered"})
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match=r"train\.onnx: SHA-256 does not match"):
        read_training_bundle(path, trusted_keys=[KEY.public_key()], now=NOW)


def test_a_tampered_manifest_is_refused(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "b.zip"
    manifest = write(path)
    rezip(path, {"manifest.json": json.dumps({**manifest, "version": 99}).encode()})
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match="altered after signing"):
        read_training_bundle(path, trusted_keys=[KEY.public_key()], now=NOW)


def test_a_bundle_signed_by_another_key_is_refused(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "b.zip"
    write(path, key=Ed25519PrivateKey.generate())
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match="untrusted key"):
        read_training_bundle(path, trusted_keys=[KEY.public_key()], now=NOW)


def test_an_extra_file_is_refused(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "b.zip"
    write(path)
    rezip(path, {"payload.so": b"\x7fELF"})
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match=r"unexpected file\(s\) \['payload\.so'\]"):
        read_training_bundle(path, trusted_keys=[KEY.public_key()], now=NOW)


def test_an_inference_bundle_is_not_taken_for_a_training_bundle(tmp_path: Path) -> None:
    # Prepare: a signed manifest of another format
    path = tmp_path / "b.zip"
    manifest = write(path)
    from fedge.edge.bundle import sign_manifest  # noqa: PLC0415

    forged = json.dumps({**manifest, "format": "fedge-bundle/1"}).encode()
    rezip(path, {"manifest.json": forged, "manifest.sig": sign_manifest(forged, KEY)})
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match="not a training bundle"):
        read_training_bundle(path, trusted_keys=[KEY.public_key()], now=NOW)


def test_rollback_is_refused_by_the_freshness_store(tmp_path: Path) -> None:
    # Prepare: the device accepted version 5
    store = FreshnessStore(tmp_path / "fresh")
    newer, older = tmp_path / "v5.zip", tmp_path / "v4.zip"
    write(newer, version=5)
    write(older, version=4)
    accepted = read_training_bundle(newer, trusted_keys=[KEY.public_key()], freshness=store, now=NOW)
    store.record(accepted.manifest)
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match="rollback refused"):
        read_training_bundle(older, trusted_keys=[KEY.public_key()], freshness=store, now=NOW)
    assert read_training_bundle(newer, trusted_keys=[KEY.public_key()], freshness=store, now=NOW).manifest[
        "version"] == 5


def test_an_expired_bundle_is_refused(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "b.zip"
    write(path, expires_at=NOW + dt.timedelta(days=1))
    # Execute / Assert: accepted before, refused after
    read_training_bundle(path, trusted_keys=[KEY.public_key()], now=NOW)
    with pytest.raises(BundleVerificationError, match="expired"):
        read_training_bundle(path, trusted_keys=[KEY.public_key()], now=NOW + dt.timedelta(days=2))


def test_a_truncated_zip_is_refused(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "b.zip"
    write(path)
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match="not a valid zip"):
        read_training_bundle(path.read_bytes()[:100], trusted_keys=[KEY.public_key()], now=NOW)
