"""Fuzzing the edge bundle readers: zip, signature envelope, manifest, freshness record (issue 12).

Each fuzz test starts from one valid signed bundle (made once per module), mutates it
(flip, overwrite, insert, delete and truncate bytes; wrong types, missing keys, huge,
negative, NaN and infinite numbers in the manifest; duplicate, extra, renamed, dropped
and truncated zip entries) or draws it at random, and checks the contract of the
verify/load path: either a bundle that verifies (and then loads and predicts), or a
:class:`~fedge.errors.FedgeError` with a message; never another exception, never a hang.

Mutated manifests are *re-signed by the trusted key*, so that the parser and the
runtime see them (an unsigned mutation is stopped by the signature before any parsing).
The verification layer runs the default number of cases (``tests/fuzzing.py``); full
loads build an onnxruntime session per accepted case (a few ms with the tiny model).
Inputs that crashed the previous code are pinned below as regular regression tests.
"""

from __future__ import annotations

import base64
import datetime as dt
import io
import json
import math
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st
from ort_polyglot import polyglot
from tiny_bundles import MODEL_ID, tiny_bundle, tiny_model, write_zip

from fedge.edge import EdgeModel
from fedge.edge.bundle import MANIFEST, SIGNATURE, FreshnessStore, read_bundle, sign_manifest, verify_bundle
from fedge.edge.graph_check import CheckedGraph, check_graph
from fedge.edge.training_bundle import read_training_bundle
from fedge.errors import BundleVerificationError, FedgeError
from fuzzing import FUZZ_EXAMPLES, bounded, fuzz
from fuzzing import mutated as fuzzing_mutated

NOW = dt.datetime(2025, 6, 1, tzinfo=dt.UTC)
# Cases per test, as shares of the shared default (2000; FEDGE_FUZZ_EXAMPLES scales them all):
# the verification layer gets the most, full loads (an onnxruntime session each) fewer.
VERIFY_CASES, LOAD_CASES, SMALL_CASES = FUZZ_EXAMPLES * 3 // 4, FUZZ_EXAMPLES // 2, FUZZ_EXAMPLES // 4


@pytest.fixture(scope="module")
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture(scope="module")
def valid(key: Ed25519PrivateKey) -> dict[str, bytes]:
    """The bundle every case mutates: signed, version 5, expiring after :data:`NOW`."""
    return tiny_bundle(key, version=5, expires_at="2030-01-01T00:00:00Z")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-bundles")


@pytest.fixture(scope="module")
def store(workdir: Path) -> FreshnessStore:
    """A device that has accepted version 3 of the model (so versions 0..2 are rollbacks)."""
    store = FreshnessStore(workdir / "state")
    store.directory.mkdir(mode=0o700)
    store.record_path(MODEL_ID).write_text(json.dumps({"model_id": MODEL_ID, "version": 3}))
    return store


# --------------------------------------------------------------------------- mutation strategies


JSON_TOKENS = [b'"', b"{", b"[", b",", b"\\", b"\xff", b"\x00", b"1e999", b"NaN", b"-", b'"version": 9,']


def mutated(original: bytes, max_ops: int = 4) -> st.SearchStrategy[bytes]:
    """:func:`fuzzing.mutated` with JSON tokens among the insertions."""
    return fuzzing_mutated(original, max_ops, inserts=JSON_TOKENS)


NASTY_NUMBERS = [0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**400, 1e308, -1e-320, math.nan, math.inf, -math.inf,
                 0.5, True]
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
              st.sampled_from(NASTY_NUMBERS), st.text(max_size=20),
              st.sampled_from(["", "model.onnx", "model.int8.onnx", "../x", "2025-01-01T00:00:00Z",
                               "2000-01-01T00:00:00Z", "batch", "input", "\ud800", "a" * 300, "x\ny"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def _containers(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every dict and list in ``node`` with its path."""
    if isinstance(node, dict | list):
        yield path, node
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            yield from _containers(v, (*path, k))


@st.composite
def mutated_manifest(draw: st.DrawFn, manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with 1..3 structural edits: a value replaced (any type), a key dropped or added."""
    manifest = json.loads(json.dumps(manifest))
    for _ in range(draw(st.integers(1, 3))):
        path, node = draw(st.sampled_from(list(_containers(manifest))))
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        op = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        if op == "add" or not keys:
            new_key = draw(st.one_of(st.text(max_size=8), st.sampled_from(["version", "expires_at", "model_id"])))
            if isinstance(node, dict):
                node[new_key] = draw(json_values)
            else:
                node.append(draw(json_values))
        elif op == "drop":
            del node[draw(st.sampled_from(keys))]
        else:
            node[draw(st.sampled_from(keys))] = draw(json_values)
    return manifest


def accepted_or_refused(action: Callable[[], object]) -> object | None:
    """Run ``action``: its result, or None for a clear refusal; any other exception fails the test."""
    with bounded(memory=False):
        try:
            return action()
        except FedgeError as exc:
            message = str(exc)
            assert message.strip() and len(message) < 2000, repr(message)
            return None


def _full_load(files: dict[str, bytes], key: Ed25519PrivateKey, store: FreshnessStore | None) -> EdgeModel:
    """Load (never recording: the shared store stays at version 3) and predict once."""
    model = EdgeModel.from_files(files, trusted_keys=[key.public_key()], variant="fp32", now=NOW)
    if store is not None:
        store.check(model.manifest)
    with np.errstate(all="ignore"):
        model.run(*(np.ones([2 if isinstance(size, str) else size for size in spec.shape], spec.dtype)
                    for spec in model.inputs))
    return model


def _resigned(valid: dict[str, bytes], manifest_bytes: bytes, key: Ed25519PrivateKey) -> dict[str, bytes]:
    return {**valid, MANIFEST: manifest_bytes, SIGNATURE: sign_manifest(manifest_bytes, key)}


# --------------------------------------------------------------------------- 1. manifests signed by the trusted key


def test_the_unmutated_bundle_loads(valid: dict[str, bytes], key: Ed25519PrivateKey, store: FreshnessStore) -> None:
    assert _full_load(valid, key, store).manifest["version"] == 5


@fuzz(VERIFY_CASES)
@given(data=st.data())
def test_fuzz_signed_manifest_bytes(data: st.DataObject, valid: dict[str, bytes], key: Ed25519PrivateKey,
                                    store: FreshnessStore) -> None:
    files = _resigned(valid, data.draw(mutated(valid[MANIFEST])), key)
    accepted_or_refused(lambda: _full_load(files, key, store))


@fuzz(LOAD_CASES)
@given(data=st.data())
def test_fuzz_signed_manifest_fields(data: st.DataObject, valid: dict[str, bytes], key: Ed25519PrivateKey,
                                     store: FreshnessStore) -> None:
    manifest = data.draw(mutated_manifest(json.loads(valid[MANIFEST])))
    files = _resigned(valid, json.dumps(manifest).encode(), key)  # NaN/Infinity included
    accepted_or_refused(lambda: _full_load(files, key, store))


@fuzz(SMALL_CASES)
@given(manifest=st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode())))
def test_fuzz_random_unsigned_manifests(manifest: bytes, valid: dict[str, bytes]) -> None:
    files = {name: data for name, data in valid.items() if name != SIGNATURE}
    files[MANIFEST] = manifest
    accepted_or_refused(lambda: verify_bundle(files, trusted_keys=[], allow_unsigned=True, now=NOW))


# --------------------------------------------------------------------------- 2. signature envelope


@fuzz(SMALL_CASES)
@given(data=st.data())
def test_fuzz_signature_envelope(data: st.DataObject, valid: dict[str, bytes], key: Ed25519PrivateKey) -> None:
    envelope = data.draw(st.one_of(mutated(valid[SIGNATURE]), json_values.map(lambda v: json.dumps(v).encode()),
                                   st.binary(max_size=64)))
    files = {**valid, SIGNATURE: envelope}
    result = accepted_or_refused(lambda: verify_bundle(files, trusted_keys=[key.public_key()], now=NOW))
    if result is not None:  # accepted: it still carries the genuine signature (extra keys are ignored)
        signature = base64.b64decode(json.loads(envelope)["signature"])
        assert signature == base64.b64decode(json.loads(valid[SIGNATURE])["signature"])


# --------------------------------------------------------------------------- 3. zip archives


def _zip_bytes(entries: list[tuple[str, bytes]], method: int = zipfile.ZIP_DEFLATED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", method) as archive:
        for name, data in entries:
            archive.writestr(name, data)
    return buffer.getvalue()


@st.composite
def mutated_zip(draw: st.DrawFn, files: dict[str, bytes]) -> bytes:
    """A zip of ``files`` with entries duplicated, added, renamed or dropped, and/or bytes mutated."""
    entries = sorted(files.items())
    for _ in range(draw(st.integers(0, 2))):
        op = draw(st.sampled_from(["duplicate", "extra", "rename", "drop"]))
        index = draw(st.integers(0, len(entries) - 1)) if entries else 0
        if op == "duplicate" and entries:
            entries.insert(draw(st.integers(0, len(entries))), (entries[index][0], draw(st.binary(max_size=32))))
        elif op == "extra":
            name = draw(st.one_of(st.text(min_size=1, max_size=12),
                                  st.sampled_from(["../x", "/abs", "a/b", ".hidden", "C:x", "..", "d/"])))
            entries.append((name, draw(st.binary(max_size=32))))
        elif op == "rename" and entries:
            entries[index] = (draw(st.text(min_size=1, max_size=12)), entries[index][1])
        elif op == "drop" and entries:
            del entries[index]
    method = draw(st.sampled_from([zipfile.ZIP_DEFLATED] * 4 + [zipfile.ZIP_STORED] * 2
                                  + [zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA]))
    try:
        archive = _zip_bytes(entries, method)
    except (UnicodeEncodeError, ValueError, IndexError):  # a name zipfile cannot write ("\0", lone surrogate)
        archive = _zip_bytes(sorted(files.items()), method)
    return draw(mutated(archive)) if draw(st.booleans()) else archive


@fuzz(VERIFY_CASES)
@given(data=st.data())
def test_fuzz_zip_archives(data: st.DataObject, valid: dict[str, bytes], key: Ed25519PrivateKey,
                           workdir: Path) -> None:
    path = workdir / "case.zip"
    path.write_bytes(data.draw(mutated_zip(valid)))
    with bounded(memory=True):
        accepted_or_refused(lambda: verify_bundle(read_bundle(path), trusted_keys=[key.public_key()], now=NOW))


@fuzz(FUZZ_EXAMPLES // 8)
@given(data=st.data())
def test_fuzz_zip_archives_full_load(data: st.DataObject, valid: dict[str, bytes], key: Ed25519PrivateKey,
                                     workdir: Path, store: FreshnessStore) -> None:
    path = workdir / "load.zip"
    path.write_bytes(data.draw(mutated_zip(valid)))
    accepted_or_refused(lambda: _full_load(read_bundle(path), key, store))


# --------------------------------------------------------------------------- 4. freshness records


@fuzz(SMALL_CASES)
@given(record=st.one_of(st.binary(max_size=100), json_values.map(lambda v: json.dumps(v).encode()),
                        st.integers().map(lambda v: json.dumps({"model_id": MODEL_ID, "version": v}).encode())))
def test_fuzz_freshness_records(record: bytes, valid: dict[str, bytes], workdir: Path) -> None:
    store = FreshnessStore(workdir / "records")
    store.directory.mkdir(mode=0o700, exist_ok=True)
    store.record_path(MODEL_ID).write_bytes(record)
    accepted_or_refused(lambda: store.check(json.loads(valid[MANIFEST])))


# --------------------------------------------------------------------------- regressions: crashes of the old code


def _signed_with(valid: dict[str, bytes], key: Ed25519PrivateKey, **changes: Any) -> dict[str, bytes]:
    manifest = {**json.loads(valid[MANIFEST]), **changes}
    return _resigned(valid, json.dumps(manifest).encode(), key)


# (case, manifest changes signed by the trusted key, expected reason)
SIGNED_BAD_MANIFESTS: list[tuple[str, dict[str, Any], str]] = [
    ("file entry not an object", {"files": {"model.onnx": "x", "model.int8.onnx": "y"}},
     "field 'files.model.onnx' must be"),
    ("variants a list", {"variants": []}, "field 'variants' must map variant names"),
    ("variant entry a string", {"variants": {"fp32": "model.onnx"}}, "field 'variants.fp32' must name a file"),
    ("no inputs", {"inputs": []}, "field 'inputs' must list the model's inputs"),
    ("input shape of one dimension", {"inputs": [{"name": "input", "shape": [4]}]}, "field 'inputs\\[0\\].shape'"),
    ("features zero", {"inputs": [{"name": "input", "shape": ["batch", 0]}]}, "field 'inputs\\[0\\].shape'"),
    ("features a bool", {"inputs": [{"name": "input", "shape": ["batch", True]}]}, "field 'inputs\\[0\\].shape'"),
    ("features a named axis the model fixes", {"inputs": [{"name": "input", "shape": ["batch", "four"]}]},
     "axis 1 is fixed at 4 in the model but dynamic \\('four'\\)"),
    ("input name not an identifier", {"inputs": [{"name": "in put", "shape": ["batch", 4]}]},
     "field 'inputs\\[0\\].name'"),
    ("input named twice", {"inputs": [{"name": "input", "shape": ["batch", 4]}] * 2}, "repeats input 'input'"),
    ("input dtype unknown", {"inputs": [{"name": "input", "shape": ["batch", 4], "dtype": "complex64"}]},
     "field 'inputs\\[0\\].dtype' must be one of"),
    ("outputs not a list", {"outputs": {"name": "logits"}}, "field 'outputs' must list"),
    ("output without a shape", {"outputs": [{"name": "logits"}]}, "field 'outputs\\[0\\]' must be"),
    ("int8 skipped without a reason", {"variants": {"fp32": {"file": "model.onnx"}, "int8": {"skipped": 1}}},
     "field 'variants.int8' must name a file"),
    ("fp32 skipped", {"variants": {"fp32": {"skipped": "no"}, "int8": {"file": "model.int8.onnx"}}},
     "field 'variants.fp32' must name a file"),
    ("preprocessing kind a number", {"preprocessing": {"kind": 3}}, "field 'preprocessing.kind'"),
    ("headline a number", {"headline": 3}, "field 'headline' must be a metric name"),
    ("preprocessing scale a string", {"preprocessing": {"scale": "x"}}, "field 'preprocessing'"),
    ("preprocessing scale 10**400", {"preprocessing": {"scale": 10**400}}, "field 'preprocessing'"),
    ("labels not strings", {"labels": [1, 2, 3]}, "field 'labels'"),
    ("version a string", {"version": "9"}, "field 'version' must be an integer"),
    ("version a bool", {"version": True}, "field 'version' must be an integer"),
    ("version 2**64", {"version": 2**64}, "field 'version' must be an integer"),
    ("expires_at not a time", {"expires_at": "tomorrow"}, "field 'expires_at' must be a UTC time"),
    ("model_id with a lone surrogate", {"model_id": "\ud800"}, "field 'model_id' must be a printable name"),
]


@pytest.mark.parametrize(("case", "changes", "reason"), SIGNED_BAD_MANIFESTS, ids=[c[0] for c in SIGNED_BAD_MANIFESTS])
def test_signed_manifests_of_the_wrong_shape_are_refused(
    valid: dict[str, bytes], key: Ed25519PrivateKey, case: str, changes: dict[str, Any], reason: str
) -> None:
    # Prepare
    files = _signed_with(valid, key, **changes)
    # Execute / Assert: a BundleVerificationError naming the field, not a TypeError/KeyError/ValueError
    with pytest.raises(FedgeError, match=reason):
        EdgeModel.from_files(files, trusted_keys=[key.public_key()], variant="fp32", now=NOW)


@pytest.mark.parametrize(("case", "manifest", "reason"), [
    ("nested 100000 deep", b"[" * 100_000 + b"]" * 100_000, "is malformed"),
    ("NaN literal", b'{"format": "fedge-bundle/1", "x": NaN}', "contains NaN, which is not JSON"),
    ("not UTF-8", b"\xff\xfe\xfa", "is malformed"),
])
def test_unparseable_manifests_are_refused(valid: dict[str, bytes], case: str, manifest: bytes, reason: str) -> None:
    files = {MANIFEST: manifest, "model.onnx": valid["model.onnx"]}
    with pytest.raises(FedgeError, match=reason):
        verify_bundle(files, trusted_keys=[], allow_unsigned=True)


def _unknown_compression(valid: dict[str, bytes]) -> bytes:
    """A zip whose entries claim compression method 99 (zipfile raised NotImplementedError)."""
    data = bytearray(_zip_bytes(sorted(valid.items()), zipfile.ZIP_STORED))
    for signature, offset in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
        start = 0
        while (start := data.find(signature, start)) >= 0:
            data[start + offset:start + offset + 2] = (99).to_bytes(2, "little")
            start += 4
    return bytes(data)


def _corrupt_deflate(valid: dict[str, bytes]) -> bytes:
    """A deflated zip with bytes inside the first entry's compressed stream overwritten (zlib.error)."""
    data = bytearray(_zip_bytes(sorted(valid.items())))
    name_length = int.from_bytes(data[26:28], "little")
    start = 30 + name_length
    data[start:start + 8] = b"\xff" * 8
    return bytes(data)


def _lzma(valid: dict[str, bytes]) -> bytes:
    """LZMA entries: their header picks the decoder's dictionary size (memory), so they are refused unread."""
    return _zip_bytes(sorted(valid.items()), zipfile.ZIP_LZMA)


def _empty_name(valid: dict[str, bytes]) -> bytes:
    """A zip whose last central-directory entry has an empty name (zipfile's is_dir() raised IndexError)."""
    data = bytearray(_zip_bytes([*sorted(valid.items()), ("Q", b"x")], zipfile.ZIP_STORED))
    entry = data.rfind(b"PK\x01\x02")
    data[entry + 28:entry + 30] = (0).to_bytes(2, "little")  # name length 1 -> 0 ...
    del data[entry + 46]                                      # ... and the name "Q" gone
    end = data.rfind(b"PK\x05\x06")
    size = int.from_bytes(data[end + 12:end + 16], "little")
    data[end + 12:end + 16] = (size - 1).to_bytes(4, "little")  # central directory one byte shorter
    return bytes(data)


def _claims_huge_stored_entry(valid: dict[str, bytes]) -> bytes:
    """A stored zip whose central directory says the first entry holds 2 GiB - 1 bytes (the file is ~1 kB)."""
    data = bytearray(_zip_bytes(sorted(valid.items()), zipfile.ZIP_STORED))
    entry = data.find(b"PK\x01\x02")
    data[entry + 20:entry + 24] = (2**31 - 1).to_bytes(4, "little")  # compressed size
    return bytes(data)


def _claims_deflate_beyond_its_ratio(valid: dict[str, bytes]) -> bytes:
    """A deflated zip whose first entry claims to unpack to 2,000x its compressed bytes (deflate's limit is ~1,032x)."""
    data = bytearray(_zip_bytes(sorted(valid.items())))
    entry = data.find(b"PK\x01\x02")
    compressed = int.from_bytes(data[entry + 20:entry + 24], "little")
    data[entry + 24:entry + 28] = (compressed * 2000).to_bytes(4, "little")  # uncompressed size
    return bytes(data)


@pytest.mark.parametrize("make", [_claims_huge_stored_entry, _claims_deflate_beyond_its_ratio])
def test_a_zip_entry_claiming_sizes_the_archive_cannot_hold_is_refused_unread(
    valid: dict[str, bytes], tmp_path: Path, make: Callable[[dict[str, bytes]], bytes],
) -> None:
    # Prepare: zipfile reads a stored entry by asking the file for its whole declared size, and
    # Python allocates that before finding the file shorter (found fuzzing: 64 MiB for a 2 kB zip)
    path = tmp_path / "claims.zip"
    path.write_bytes(make(valid))
    # Execute / Assert: refused naming the entry, for a bundle file and for a training bundle's bytes
    with pytest.raises(FedgeError, match="declares .* the archive is damaged or forged"), bounded():
        read_bundle(path)
    with pytest.raises(FedgeError, match="declares .* the archive is damaged or forged"), bounded():
        read_training_bundle(path.read_bytes(), trusted_keys=[])


@pytest.mark.parametrize(("make", "reason"), [
    (_unknown_compression, r"uses zip compression method\(s\) \[99\]; only stored \(0\) and deflate \(8\)"),
    (_lzma, r"uses zip compression method\(s\) \[14\]"),
    (_corrupt_deflate, "is not a valid zip"),
    (_empty_name, "has nested or hidden paths"),
])
def test_damaged_or_unusual_zip_streams_are_refused(
    valid: dict[str, bytes], key: Ed25519PrivateKey, tmp_path: Path,
    make: Callable[[dict[str, bytes]], bytes], reason: str,
) -> None:
    path = tmp_path / "bad.zip"
    path.write_bytes(make(valid))
    with pytest.raises(FedgeError, match=reason):
        verify_bundle(read_bundle(path), trusted_keys=[key.public_key()])


def test_a_duplicated_zip_entry_is_refused_even_when_both_copies_match(
    valid: dict[str, bytes], key: Ed25519PrivateKey, tmp_path: Path
) -> None:
    path = write_zip([*valid.items(), ("model.onnx", valid["model.onnx"])], tmp_path / "twice.zip")
    with pytest.raises(FedgeError, match=r"duplicate entries \['model.onnx'\]"):
        read_bundle(path)


# --------------------------------------------------------------------------- 5. the graph checker (issue 23)
# Random ONNX models: nested subgraphs (If/Loop-style ``g`` and ``graphs`` attributes), tensors in
# initializers, sparse initializers and attributes, node domains, model-local functions; each
# flaw (external data by ``data_location`` and/or ``external_data``, a foreign domain, a
# function) is placed at a random depth and recorded, so the test knows the right answer.

DOMAINS = ["", "ai.onnx", "com.microsoft", "evil.domain", "ai.onnx.ml", "ai.onnx.training"]
LOCATIONS = ["phone-017.key", "../../etc/passwd", "/etc/passwd", "", "model.onnx.data"]
# Protobuf fields the mutations aim at: TensorProto.data_location = EXTERNAL (14), an
# external_data entry (13), NodeProto.domain (7), a model-local function (ModelProto 25).
ONNX_TOKENS = [b"\x70\x01", b"\x6a\x11\x0a\x08location\x12\x05a.bin", b"\x3a\x0dcom.microsoft", b"\x3a\x00",
               b"\xca\x01\x04\x0a\x02ff", b"\x70\x02", b"\x70\xff\xff\xff\xff\x0f"]


@dataclass
class _Flaws:
    """What a generated model holds that a device must refuse, and the op types it holds."""

    refused: list[str]
    ops: set[str]


@st.composite
def _tensor(draw: st.DrawFn, flaws: _Flaws, where: str) -> Any:
    from onnx import TensorProto  # noqa: PLC0415

    tensor = TensorProto(name=draw(st.sampled_from(["w", "b", "stolen", ""])), data_type=TensorProto.FLOAT, dims=[2],
                         float_data=[1.0, 2.0])
    how = draw(st.sampled_from(["inline", "inline", "inline", "location", "entries", "both"]))
    if how in ("location", "both"):
        tensor.data_location = TensorProto.EXTERNAL
    if how in ("entries", "both"):
        entry = tensor.external_data.add()
        entry.key, entry.value = draw(st.sampled_from(["location", "offset", "checksum"])), draw(
            st.sampled_from(LOCATIONS))
    if how != "inline":
        flaws.refused.append(f"external data in {where}")
    return tensor


@st.composite
def _graph(draw: st.DrawFn, flaws: _Flaws, depth: int, where: str) -> Any:
    from onnx import SparseTensorProto, helper  # noqa: PLC0415

    graph = helper.make_graph([], f"g{depth}", [], [])
    graph.initializer.extend(draw(_tensor(flaws, f"{where} initializer")) for _ in range(draw(st.integers(0, 2))))
    if draw(st.booleans()):
        graph.sparse_initializer.append(SparseTensorProto(values=draw(_tensor(flaws, f"{where} sparse values")),
                                                          indices=draw(_tensor(flaws, f"{where} sparse indices"))))
    for index in range(draw(st.integers(0, 3))):
        graph.node.append(draw(_node(flaws, depth, f"{where} node {index}")))
    return graph


@st.composite
def _node(draw: st.DrawFn, flaws: _Flaws, depth: int, where: str) -> Any:
    from onnx import AttributeProto, helper  # noqa: PLC0415

    op_type, domain = draw(st.sampled_from(["If", "Loop", "Add", "Constant", "Scan"])), draw(st.sampled_from(DOMAINS))
    node = helper.make_node(op_type, ["x"], ["y"], domain=domain)
    if domain not in ("", "ai.onnx"):
        flaws.refused.append(f"domain {domain} at {where}")
    flaws.ops.add(op_type)
    for kind in draw(st.lists(st.sampled_from(["t", "tensors", "sparse", "g", "graphs"]), max_size=3)):
        attribute = node.attribute.add()
        attribute.name = kind
        if kind == "t":
            attribute.type = AttributeProto.TENSOR
            attribute.t.CopyFrom(draw(_tensor(flaws, f"{where} attribute t")))
        elif kind == "tensors":
            attribute.type = AttributeProto.TENSORS
            attribute.tensors.extend([draw(_tensor(flaws, f"{where} attribute tensors")) for _ in range(2)])
        elif kind == "sparse":
            attribute.type = AttributeProto.SPARSE_TENSOR
            attribute.sparse_tensor.values.CopyFrom(draw(_tensor(flaws, f"{where} attribute sparse")))
        elif depth < 4 and kind == "g":
            attribute.type = AttributeProto.GRAPH
            attribute.g.CopyFrom(draw(_graph(flaws, depth + 1, f"{where} > g")))
        elif depth < 4:
            attribute.type = AttributeProto.GRAPHS
            attribute.graphs.extend([draw(_graph(flaws, depth + 1, f"{where} > graphs"))])
    return node


@st.composite
def flawed_models(draw: st.DrawFn) -> tuple[bytes, _Flaws]:
    """A random model (nested subgraphs, tensors everywhere) and what in it must be refused."""
    from onnx import helper  # noqa: PLC0415

    flaws = _Flaws(refused=[], ops=set())
    model = helper.make_model(draw(_graph(flaws, 0, "graph")), opset_imports=[
        helper.make_opsetid(domain, 1) for domain in draw(st.lists(st.sampled_from(DOMAINS), max_size=3,
                                                                     unique=True))])
    if draw(st.integers(0, 5)) == 0:
        function = helper.make_function("fedge.local", "F", ["x"], ["y"], [helper.make_node("Add", ["x", "x"], ["y"])],
                                        [helper.make_opsetid("", 17)])
        model.functions.append(function)
        flaws.refused.append("a model-local function")
    return bytes(model.SerializeToString()), flaws


def _clean_everywhere(model: Any) -> bool:
    """The fuzz tests' own oracle, recursive and written apart from fedge's walk."""
    def tensor_ok(tensor: Any) -> bool:
        return tensor.data_location == 0 and not tensor.external_data

    def graph_ok(graph: Any) -> bool:
        tensors = [*graph.initializer, *(s.values for s in graph.sparse_initializer),
                   *(s.indices for s in graph.sparse_initializer)]
        for node in graph.node:
            if node.domain not in ("", "ai.onnx"):
                return False
            for attribute in node.attribute:
                tensors += [attribute.t, *attribute.tensors, attribute.sparse_tensor.values,
                            attribute.sparse_tensor.indices, *(s.values for s in attribute.sparse_tensors),
                            *(s.indices for s in attribute.sparse_tensors)]
                if not all(graph_ok(sub) for sub in [attribute.g, *attribute.graphs]):
                    return False
        return all(tensor_ok(tensor) for tensor in tensors)

    return not model.functions and graph_ok(model.graph)


@fuzz(SMALL_CASES)  # each case builds a nested model: ~30 ms
@given(case=flawed_models())
def test_fuzz_graph_checker_external_data_and_domains(case: tuple[bytes, _Flaws]) -> None:
    # Prepare: a model with flaws at random depths (or none)
    data, flaws = case
    # Execute / Assert: accepted exactly when nothing in it may be refused; then its ops are all listed
    with bounded(memory=False):
        try:
            checked = check_graph(data, what="model.onnx")
        except BundleVerificationError as exc:
            assert flaws.refused, f"a clean model was refused: {exc}"
            assert "refused before any onnxruntime session" in str(exc)
            return
    assert not flaws.refused, f"accepted a model with {flaws.refused}"
    assert set(checked.ops) == flaws.ops


@fuzz(VERIFY_CASES)
@given(data=st.data())
def test_fuzz_graph_checker_byte_corruption(data: st.DataObject) -> None:
    # Prepare: a clean model with nested subgraphs, then random byte edits (some aimed at the fields that matter)
    import onnx  # noqa: PLC0415

    case = data.draw(fuzzing_mutated(_CLEAN_NESTED, inserts=ONNX_TOKENS))
    # Execute: accepted, or refused with the project's error; nothing else
    checked = accepted_or_refused(lambda: check_graph(case, what="model.onnx"))
    # Assert: whatever is accepted is clean by the test's own oracle, and so are the bytes a session gets
    if checked is not None:
        assert isinstance(checked, CheckedGraph)
        assert _clean_everywhere(onnx.load_from_string(case))
        assert _clean_everywhere(onnx.load_from_string(checked.model_bytes))


def _clean_nested_model() -> bytes:
    """A model with an If whose branch holds a Loop whose body holds an inline Constant tensor."""
    from onnx import TensorProto, helper  # noqa: PLC0415

    body = helper.make_graph([helper.make_node("Constant", [], ["c"], value=helper.make_tensor(
        "v", TensorProto.FLOAT, [2], [1.0, 2.0]))], "body", [], [helper.make_tensor_value_info("c", TensorProto.FLOAT,
                                                                                             [2])])
    branch = helper.make_graph([helper.make_node("Loop", ["n", "go"], ["c"], body=body)], "then", [],
                               [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2])],
                               initializer=[helper.make_tensor("n", TensorProto.INT64, [], [1])])
    graph = helper.make_graph([helper.make_node("If", ["go"], ["c"], then_branch=branch, else_branch=branch)], "g",
                              [helper.make_tensor_value_info("go", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2])],
                              initializer=[helper.make_tensor("w", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])])
    return bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())


_CLEAN_NESTED = _clean_nested_model()


def test_the_clean_nested_model_is_accepted() -> None:
    assert check_graph(_CLEAN_NESTED, what="model.onnx").ops == ("Constant", "If", "Loop")


@pytest.mark.parametrize("field", [b"Gemm", b"W", b"C" * 100], ids=["op-type", "tensor-name", "long-attribute-name"])
def test_names_that_are_not_utf8_are_refused_or_harmless(field: bytes) -> None:
    # Found by the byte fuzzer: protobuf hands a proto2 string that is not UTF-8 back as bytes;
    # sorting the op types, then shortening a long name for the message, crashed with a TypeError
    from onnx import helper  # noqa: PLC0415
    from tiny_bundles import tiny_model  # noqa: PLC0415

    model = onnx_model(tiny_model())
    model.graph.node[0].attribute.append(helper.make_attribute("C" * 100, 1.0))
    model.graph.node.append(helper.make_node("Relu", ["logits"], ["out"], domain="evil.domain"))
    case = (model.SerializeToString() if field == b"C" * 100 else tiny_model()).replace(field, field[:-1] + b"\xff")
    if field == b"C" * 100:
        with pytest.raises(BundleVerificationError, match="domain 'evil.domain'"):
            check_graph(case, what="model.onnx")
    elif field == b"Gemm":
        with pytest.raises(BundleVerificationError, match="not UTF-8 text"):
            check_graph(case, what="model.onnx")
    else:
        assert check_graph(case, what="model.onnx").ops == ("Gemm",)


def onnx_model(data: bytes) -> Any:
    import onnx  # noqa: PLC0415

    return onnx.load_from_string(data)


# --------------------------------------------------------------------------- 6. ORT-format bytes (issue 38, item 5)
# onnxruntime runs bytes whose 4..8 are "ORTM" as an ORT-format flatbuffer, whatever the ONNX parser
# reads in them (tests/ort_polyglot.py builds a file that is both). Protobuf framings that put "ORTM" at
# byte 4 of a valid ONNX message: a varint then an unknown fixed64 (the polyglot's own), ir_version then
# producer_name, an overlong length of an unknown field, doc_string after two bytes of its own.
ORT_FRAMINGS = [b"\x08\x00\x09\x00ORTM\x00\x00\x00", b"\x08\x08\x12\x06ORTMxx", b"\x4a\x86\x00\x00ORTM\x00",
                b"\x32\x06xxORTM"]


@st.composite
def ort_format_models(draw: st.DrawFn) -> bytes:
    """A clean ONNX model behind a framing that puts "ORTM" at byte 4, then maybe random edits."""
    case = draw(st.sampled_from(ORT_FRAMINGS)) + _CLEAN_NESTED
    return draw(fuzzing_mutated(case, inserts=[b"ORTM", *ONNX_TOKENS])) if draw(st.booleans()) else case


def test_every_ort_framing_is_a_valid_onnx_model() -> None:
    for framing in ORT_FRAMINGS:
        data = framing + _CLEAN_NESTED
        assert data[4:8] == b"ORTM" and onnx_model(data).graph.node[0].op_type == "If", framing


@fuzz(SMALL_CASES)
@given(case=ort_format_models())
def test_fuzz_graph_checker_ort_format_bytes(case: bytes) -> None:
    # Execute: accepted, or refused with the project's error; nothing else
    checked = accepted_or_refused(lambda: check_graph(case, what="model.onnx"))
    # Assert: nothing accepted is ORT-format bytes, as sent or as the session gets them
    if checked is not None:
        assert isinstance(checked, CheckedGraph)
        assert case[4:8] != b"ORTM" and checked.model_bytes[4:8] != b"ORTM"
        assert _clean_everywhere(onnx_model(checked.model_bytes))


def test_the_ort_format_polyglot_is_refused() -> None:
    with pytest.raises(BundleVerificationError, match="is an ORT-format model"):
        check_graph(polyglot(tiny_model()), what="model.onnx")
