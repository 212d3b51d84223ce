"""Rollback, expiry and ambiguous archives (security review, issue 12, findings 6 and 6b).

Attacks replayed here, each refused with a :class:`BundleVerificationError` that says
what to do:

* an older bundle, genuinely signed, served to a device that already runs a newer
  one (rollback to a model with a known flaw);
* a bundle past its signed ``expires_at``;
* a zip with two entries of one name (one reader verifies one copy, another loads
  the other), or entries with absolute paths or ``..``;
* a manifest with a key written twice (parsers disagree on which value counts).

Bundles here are tiny (a 4 -> 3 ONNX Gemm, see ``tiny_bundles.py``): no torch.
"""

from __future__ import annotations

import datetime as dt
import json
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from tiny_bundles import ISSUED_AT, MODEL_ID, tiny_bundle, tiny_model, write_dir, write_zip

from fedge.edge import EdgeModel
from fedge.edge.bundle import MANIFEST, SIGNATURE, FreshnessStore, read_bundle, sign_manifest, verify_bundle
from fedge.errors import BundleVerificationError, ConfigError

UTC = dt.UTC


@pytest.fixture(scope="module")
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture
def store(tmp_path: Path) -> FreshnessStore:
    return FreshnessStore(tmp_path / "state")


def _load(files: dict[str, bytes], key: Ed25519PrivateKey, **kwargs: object) -> EdgeModel:
    return EdgeModel.from_files(files, trusted_keys=[key.public_key()], **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- rollback


@pytest.mark.parametrize("as_zip", [False, True])
def test_an_older_signed_bundle_is_refused_after_a_newer_one(
    key: Ed25519PrivateKey, store: FreshnessStore, tmp_path: Path, as_zip: bool
) -> None:
    # Prepare: versions 5 and 3 of one model, both genuinely signed, on disk
    def on_disk(version: int) -> Path:
        files = tiny_bundle(key, version=version)
        path = tmp_path / f"v{version}"
        return write_zip(files.items(), path.with_suffix(".zip")) if as_zip else write_dir(files, path)
    newer, older = on_disk(5), on_disk(3)
    EdgeModel.load(newer, trusted_keys=[key.public_key()], freshness=store)
    # Execute / Assert: the replayed older bundle is refused, and the record is unchanged
    with pytest.raises(BundleVerificationError,
                       match=f"bundle '{MODEL_ID}' version 3 is older than version 5 this device already "
                             r"accepted \(rollback refused\); fetch version 5 or newer"):
        EdgeModel.load(older, trusted_keys=[key.public_key()], freshness=store)
    assert store.accepted_version(MODEL_ID) == 5


def test_same_version_reloads_and_a_newer_one_raises_the_record(
    key: Ed25519PrivateKey, store: FreshnessStore
) -> None:
    # Prepare / Execute: 5, 5 again (a reload), then 6
    for version in (5, 5, 6):
        _load(tiny_bundle(key, version=version), key, freshness=store)
    # Assert: 6 recorded; 5 is now a rollback
    assert store.accepted_version(MODEL_ID) == 6
    with pytest.raises(BundleVerificationError, match="version 5 is older than version 6"):
        _load(tiny_bundle(key, version=5), key, freshness=store)


def test_versions_are_kept_per_model_id(key: Ed25519PrivateKey, store: FreshnessStore) -> None:
    # Prepare
    _load(tiny_bundle(key, version=9), key, freshness=store)
    # Execute: version 1 of another model is not ordered against model MODEL_ID
    _load(tiny_bundle(key, model_id="run-2/mlp-digits", version=1), key, freshness=store)
    # Assert
    assert (store.accepted_version(MODEL_ID), store.accepted_version("run-2/mlp-digits")) == (9, 1)


def test_a_device_can_pin_its_model_lineage(key: Ed25519PrivateKey) -> None:
    with pytest.raises(BundleVerificationError,
                       match="bundle is of model 'run-0/mlp-digits', not 'run-1/mlp-digits' that this device runs"):
        _load(tiny_bundle(key, model_id="run-0/mlp-digits"), key, model_id=MODEL_ID)
    assert _load(tiny_bundle(key), key, model_id=MODEL_ID).manifest["model_id"] == MODEL_ID


def test_record_never_lowers_a_version_recorded_meanwhile(key: Ed25519PrivateKey, store: FreshnessStore) -> None:
    # Prepare: a loader checked version 6, then another loader recorded 7 before it could record
    store.record(_load(tiny_bundle(key, version=7), key).manifest)
    late = _load(tiny_bundle(key, version=6), key).manifest
    # Execute / Assert: the late record is refused under the lock, and 7 stays
    with pytest.raises(BundleVerificationError, match="version 6 is older than version 7"):
        store.record(late)
    assert store.accepted_version(MODEL_ID) == 7



def test_the_record_is_private_atomic_json(
    key: Ed25519PrivateKey, store: FreshnessStore, umask_zero: None
) -> None:
    # Prepare
    now = dt.datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
    # Execute
    _load(tiny_bundle(key, version=5), key, freshness=store, now=now)
    # Assert: one 0600 record (plus its lock file) in a 0700 directory, no temporary left behind
    record = store.record_path(MODEL_ID)
    assert json.loads(record.read_text()) == {"model_id": MODEL_ID, "version": 5, "issued_at": ISSUED_AT,
                                              "accepted_at": "2025-03-01T12:00:00Z"}
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert sorted(p.suffix for p in store.directory.iterdir()) == [".json", ".lock"]


def _tamper_model(files: dict[str, bytes]) -> None:
    files["model.int8.onnx"] = tiny_model(scale=2.0)


def _resign_untrusted(files: dict[str, bytes]) -> None:
    files[SIGNATURE] = sign_manifest(files[MANIFEST], Ed25519PrivateKey.generate())


# (case, bundle overrides, tampering after signing, expected reason): each is refused,
# and none may raise the record of version 5.
REFUSED_NEWER: list[tuple[str, dict[str, object], Callable[[dict[str, bytes]], None] | None, str]] = [
    ("model altered after signing", {}, _tamper_model, "model.int8.onnx: SHA-256 does not match"),
    ("signed by an untrusted key", {}, _resign_untrusted, "untrusted key"),
    ("expired", {"expires_at": "2025-02-01T00:00:00Z"}, None, "bundle expired at 2025-02-01T00:00:00Z"),
    ("signed model that is not ONNX",  # refused by the graph check, before any onnxruntime session
     {"models": {"model.onnx": b"not onnx", "model.int8.onnx": b"not onnx"}}, None,
     "is not a valid ONNX model"),
    ("signed model of another shape",
     {"inputs": [{"name": "input", "shape": ["batch", 9], "dtype": "float32"}]}, None,
     "the model's inputs/outputs differ from what manifest.json declares"),
    ("signed labels that do not match the model", {"labels": ["a", "b"]}, None, "names 2 labels for a model of 3"),
    ("int8 asked of a bundle without one", {"variants": {"fp32": {"file": "model.onnx"}}, "variant": "int8"}, None,
     "bundle has no 'int8' model"),
    ("no fp32 variant", {"variants": {"int8": {"file": "model.int8.onnx"}}}, None,
     "field 'variants' must include the fp32 model"),
]


@pytest.mark.parametrize(("case", "overrides", "tamper", "reason"), REFUSED_NEWER, ids=[r[0] for r in REFUSED_NEWER])
def test_a_newer_bundle_that_fails_any_check_does_not_raise_the_record(
    key: Ed25519PrivateKey, store: FreshnessStore, case: str, overrides: dict[str, object],
    tamper: Callable[[dict[str, bytes]], None] | None, reason: str,
) -> None:
    # Prepare: version 5 accepted, then a version 9 that fails one check
    now = dt.datetime(2025, 3, 1, tzinfo=UTC)
    _load(tiny_bundle(key, version=5), key, freshness=store, now=now)
    overrides = dict(overrides)
    variant = overrides.pop("variant", None)
    files = tiny_bundle(key, version=9, **overrides)  # type: ignore[arg-type]
    if tamper is not None:
        tamper(files)
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match=reason):
        _load(files, key, freshness=store, now=now, variant=variant)
    assert store.accepted_version(MODEL_ID) == 5


def test_an_unsigned_bundle_never_raises_the_record(key: Ed25519PrivateKey, store: FreshnessStore) -> None:
    # Prepare: an unsigned "version 99" (anyone can write that number)
    _load(tiny_bundle(key, version=5), key, freshness=store)
    files = tiny_bundle(key, version=99)
    del files[SIGNATURE]
    # Execute: accepted only in development mode...
    model = _load(files, key, freshness=store, allow_unsigned=True)
    # Assert: ...and the genuine version 6 is still accepted afterwards
    assert model.manifest["version"] == 99 and store.accepted_version(MODEL_ID) == 5
    _load(tiny_bundle(key, version=6), key, freshness=store)


def test_a_bundle_without_a_version_needs_re_export_for_a_freshness_store(
    key: Ed25519PrivateKey, store: FreshnessStore
) -> None:
    # Prepare: as made by a fedge before this fix
    files = tiny_bundle(key, model_id=None, version=None)
    # Execute / Assert: refused with a store, still accepted without one
    with pytest.raises(BundleVerificationError, match="has no model_id/version.*re-export it with `fedge export`"):
        _load(files, key, freshness=store)
    assert "version" not in _load(files, key).manifest


@pytest.mark.parametrize(("content", "problem"), [
    (b"", "is not JSON"),
    (b"{", "is not JSON"),
    (b"[]", "is not a record of model"),
    (json.dumps({"model_id": "someone-else", "version": 1}).encode(), "is not a record of model"),
    (json.dumps({"model_id": MODEL_ID, "version": "9"}).encode(), "is not a record of model"),
    (json.dumps({"model_id": MODEL_ID, "version": -1}).encode(), "is not a record of model"),
])
def test_an_unreadable_record_fails_closed(
    key: Ed25519PrivateKey, store: FreshnessStore, content: bytes, problem: str
) -> None:
    # Prepare
    store.directory.mkdir(mode=0o700)
    store.record_path(MODEL_ID).write_bytes(content)
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match=f"freshness record .* {problem}.*restored from a backup"):
        _load(tiny_bundle(key, version=5), key, freshness=store)


# --------------------------------------------------------------------------- expiry


@pytest.mark.parametrize(("now", "accepted"), [
    (dt.datetime(2025, 1, 31, 23, 59, 59, tzinfo=UTC), True),
    (dt.datetime(2025, 2, 1, 0, 0, 0, tzinfo=UTC), False),   # expires_at itself is already too late
    (dt.datetime(2026, 1, 1, tzinfo=UTC), False),
    (dt.datetime(2025, 2, 1, 1, 0, 0, tzinfo=dt.timezone(dt.timedelta(hours=2))), True),  # 23:00 UTC
])
def test_expired_bundles_are_refused_even_without_a_store(
    key: Ed25519PrivateKey, now: dt.datetime, accepted: bool
) -> None:
    # Prepare
    files = tiny_bundle(key, expires_at="2025-02-01T00:00:00Z")
    # Execute / Assert
    if accepted:
        assert _load(files, key, now=now).manifest["expires_at"] == "2025-02-01T00:00:00Z"
    else:
        with pytest.raises(BundleVerificationError, match="bundle expired at 2025-02-01T00:00:00Z .*fetch a current"):
            _load(files, key, now=now)


def test_the_clock_must_be_timezone_aware(key: Ed25519PrivateKey) -> None:
    with pytest.raises(ConfigError, match="timezone-aware"):
        _load(tiny_bundle(key, expires_at="2025-02-01T00:00:00Z"), key, now=dt.datetime(2025, 1, 1))


# --------------------------------------------------------------------------- ambiguous archives


def test_a_zip_with_two_entries_of_one_name_is_refused(key: Ed25519PrivateKey, tmp_path: Path) -> None:
    # Prepare: an attacker's model first, then the signed one under the same name; Python's
    # zipfile reads the last copy, other unzip tools the first (or ask), so what one reader
    # verified is not what another runs.
    files = tiny_bundle(key)
    entries = [("model.int8.onnx", tiny_model(scale=-1.0)), *files.items()]
    path = write_zip(entries, tmp_path / "dup.zip")
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match=r"has duplicate entries \['model.int8.onnx'\]"):
        EdgeModel.load(path, trusted_keys=[key.public_key()])


def test_a_zip_with_two_manifests_is_refused(key: Ed25519PrivateKey, tmp_path: Path) -> None:
    # Prepare: the manifest of an older version first, then the current one
    older, files = tiny_bundle(key, version=1), tiny_bundle(key, version=5)
    path = write_zip([(MANIFEST, older[MANIFEST]), *files.items()], tmp_path / "dup.zip")
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match=r"duplicate entries \['manifest.json'\].*refused"):
        verify_bundle(read_bundle(path), trusted_keys=[key.public_key()])


@pytest.mark.parametrize("name", [
    "/model.int8.onnx", "../model.int8.onnx", "x/../../model.int8.onnx", "..\\model.int8.onnx",
    "\\model.int8.onnx", "C:model.int8.onnx", "..",
])
def test_zip_entries_with_absolute_paths_or_dotdot_are_refused(
    key: Ed25519PrivateKey, tmp_path: Path, name: str
) -> None:
    # Prepare: a valid bundle plus one entry that would land outside an extraction directory
    path = write_zip([*tiny_bundle(key).items(), (name, b"payload")], tmp_path / "escape.zip")
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match=r"has entries with an absolute path or '\.\.'"):
        read_bundle(path)


def test_a_manifest_with_a_key_written_twice_is_refused(key: Ed25519PrivateKey) -> None:
    # Prepare: signed by the trusted key, yet "version" reads 1 to a first-wins parser, 9 to Python's
    files = tiny_bundle(key, version=1)
    text = files[MANIFEST].decode().replace('"version": 1', '"version": 1, "version": 9')
    files[MANIFEST] = text.encode()
    files[SIGNATURE] = sign_manifest(files[MANIFEST], key)
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match=r"manifest.json has key\(s\) \['version'\] written twice"):
        verify_bundle(files, trusted_keys=[key.public_key()])
