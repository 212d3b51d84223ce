"""The signed edge bundle format: read, write, sign and verify (no torch).

A bundle is a directory (or a ``.zip`` of one) holding:

* ``model.onnx`` and ``model.int8.onnx``: the models (the int8 one only when the graph
  quantizes; otherwise ``variants.int8`` in the manifest says why it was skipped);
* ``manifest.json``: what the models are (inputs with named dynamic axes, outputs,
  preprocessing, labels or null, headline, metrics, versions), which model lineage and
  version they are (``model_id``, ``version``, ``issued_at``, optional ``expires_at``)
  and the SHA-256 and size of every other file;
* ``manifest.sig``: JSON ``{"algorithm": "ed25519", "key_fingerprint":
  "sha256:<hex of the raw public key>", "signature": "<base64>"}``, the Ed25519
  signature over the exact bytes of ``manifest.json``.

Threat model: the bundle travels over untrusted channels and storage. A device
accepts it only if the manifest is signed by a key it trusts, and every file
the manifest lists is present with the listed hash, and no other file is
there. Verification runs on the bytes read once into memory, and the runtime
builds its session from those same bytes, so a file swapped after the check is
never run. A zip whose entries could mean different files to different readers
(two entries of one name, absolute paths, ``..``) is refused, and so is a
manifest with a key written twice. A signature alone does not stop *rollback*:
an attacker who replays an older signed bundle (a model with a known flaw)
passes every check above. A device that keeps a :class:`FreshnessStore` refuses
a bundle whose ``version`` is lower than the highest it accepted for that
``model_id``; a bundle past its signed ``expires_at`` is refused by everyone.
"""

from __future__ import annotations

import base64
import binascii
import collections
import datetime as dt
import hashlib
import json
import logging
import math
import re
import sys
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedge.archive import ZIP_READ_ERRORS, impossible_sizes
from fedge.edge.signing import ensure_private_dir, fingerprint, load_public_key
from fedge.errors import BundleVerificationError, ConfigError
from fedge.files import exclusive_lock, write_bytes_atomic
from fedge.signature import DTYPES

log = logging.getLogger("fedge.edge")

FORMAT = "fedge-bundle/1"
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
MAX_BUNDLE_BYTES = 2**31
MAX_MANIFEST_BYTES = 2**20
MAX_SIGNATURE_BYTES = 2**12
MAX_VERSION = 2**63 - 1
MAX_FEATURES = 2**24  # largest fixed axis size a manifest may declare
MAX_INPUTS = 64  # most inputs (or outputs) a manifest may declare
MAX_RANK = 16
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
REEXPORT = "re-export the bundle with `fedge export` (or upgrade fedge on the device)"
# Everything zipfile and its decompressors raise on a damaged archive.
# Zip compression methods a bundle may use: stored and deflate (what ``write_bundle`` writes).
# Others (bzip2, LZMA with its attacker-chosen dictionary size, unknown ids) are refused unread.
COMPRESSION = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_DRIVE = re.compile(r"^[A-Za-z]:")

TrustedKey = Ed25519PublicKey | str | Path


def sha256(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sign_manifest(manifest_bytes: bytes, private_key: Ed25519PrivateKey) -> bytes:
    """The ``manifest.sig`` envelope for ``manifest_bytes``."""
    envelope = {
        "algorithm": "ed25519",
        "key_fingerprint": fingerprint(private_key.public_key()),
        "signature": base64.b64encode(private_key.sign(manifest_bytes)).decode(),
    }
    return (json.dumps(envelope, indent=2) + "\n").encode()


def pack_bundle(
    files: Mapping[str, bytes], manifest: Mapping[str, Any], *, private_key: Ed25519PrivateKey
) -> dict[str, bytes]:
    """``files`` plus ``manifest.json`` (``manifest`` with the format and every file's hash) and its signature."""
    manifest = {**manifest, "format": FORMAT,
                "files": {name: {"sha256": sha256(data), "bytes": len(data)}
                          for name, data in sorted(files.items())}}
    manifest_bytes = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    return {**files, MANIFEST: manifest_bytes, SIGNATURE: sign_manifest(manifest_bytes, private_key)}


def write_bundle(
    out_dir: str | Path,
    files: Mapping[str, bytes],
    manifest: dict[str, Any],
    *,
    private_key: Ed25519PrivateKey,
    make_zip: bool = False,
) -> Path:
    """Write ``files`` plus a manifest listing their hashes, signed with ``private_key``.

    Returns the bundle directory (and writes ``<dir>.zip`` beside it when ``make_zip``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    contents = pack_bundle(files, manifest, private_key=private_key)
    for name, data in contents.items():
        (out / name).write_bytes(data)
    if make_zip:
        with zipfile.ZipFile(out.with_suffix(".zip"), "w", zipfile.ZIP_DEFLATED) as archive:
            for name, data in sorted(contents.items()):
                archive.writestr(name, data)
    return out


def read_bundle(path: str | Path) -> dict[str, bytes]:
    """Every file of a bundle directory or ``.zip``, read once into memory.

    Raises
    ------
    BundleVerificationError
        For a missing path, a damaged zip, or a zip whose entries are duplicated,
        absolute, climb out with ``..``, are nested or hidden, or unpack to more
        than 2 GiB.
    """
    path = Path(path)
    if path.is_dir():
        return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}
    if not path.exists():
        raise BundleVerificationError(f"bundle '{path}' does not exist")
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            _check_members(path, members, path.stat().st_size)
            return {m.filename: archive.read(m) for m in members}
    except ZIP_READ_ERRORS as exc:
        raise BundleVerificationError(
            f"bundle '{path}' is not a valid zip (truncated or corrupt: {_short(exc)}); fetch it again"
        ) from None


def _short(exc: BaseException, limit: int = 160) -> str:
    """An exception's text cut to ``limit`` characters (zipfile quotes whole headers)."""
    text = str(exc) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def _check_members(path: Path, members: list[zipfile.ZipInfo], archive_size: int) -> None:
    """Refuse entries that different unzip tools could read as different files, or whose declared
    sizes would make reading them allocate what the archive cannot hold."""
    names = [m.filename for m in members]
    unsafe = sorted({n for n in names if _escapes(n)})
    if unsafe:
        raise BundleVerificationError(f"bundle '{path}' has entries with an absolute path or '..' "
                                      f"({unsafe}); refused: fetch the bundle again from the coordinator")
    duplicated = sorted(n for n, count in collections.Counter(names).items() if count > 1)
    if duplicated:
        raise BundleVerificationError(
            f"bundle '{path}' has duplicate entries {duplicated}: one reader could verify one copy and "
            "another load the other; refused: fetch the bundle again (`fedge export --zip` writes each once)"
        )
    odd = sorted({m.compress_type for m in members} - set(COMPRESSION))
    if odd:
        raise BundleVerificationError(f"bundle '{path}' uses zip compression method(s) {odd}; only "
                                      "stored (0) and deflate (8) are accepted: re-zip it with `fedge export --zip`")
    if any(not _plain_name(m.filename) or m.is_dir() for m in members):  # is_dir() fails on ""
        raise BundleVerificationError(f"bundle '{path}' has nested or hidden paths; refused: zip the "
                                      "bundle's files at the top level (`fedge export --zip` does)")
    for member in members:
        problem = impossible_sizes(member, archive_size)
        if problem:
            raise BundleVerificationError(f"bundle '{path}': entry {member.filename!r} {problem}; refused: fetch "
                                          "the bundle again from the coordinator")
    if sum(m.file_size for m in members) > MAX_BUNDLE_BYTES:
        raise BundleVerificationError(f"bundle '{path}' unpacks to more than 2 GiB; refused")


def _escapes(name: str) -> bool:
    """Whether an entry name is absolute or climbs out of the extraction directory."""
    parts = re.split(r"[/\\]", name)
    return name.startswith(("/", "\\")) or bool(_DRIVE.match(name)) or ".." in parts or "\0" in name


def _plain_name(name: object) -> bool:
    """A file name at the top level of a bundle: not empty, not hidden, no separators."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and not name.startswith(".")
            and not any(c in name for c in "/\\\0"))


def verify_bundle(
    files: Mapping[str, bytes],
    *,
    trusted_keys: Iterable[TrustedKey],
    allow_unsigned: bool = False,
    freshness: FreshnessStore | None = None,
    model_id: str | None = None,
    now: dt.datetime | None = None,
) -> dict[str, Any]:
    """Check signature, trust, manifest, every file's hash, expiry and freshness; return the manifest.

    Threat model: see the module docstring. The checks run in this order, and the
    manifest is parsed only after its signature is verified.

    Parameters
    ----------
    files : mapping of name to bytes
        The bundle as :func:`read_bundle` returns it.
    trusted_keys : iterable of Ed25519PublicKey or PEM paths
        Signers this device trusts.
    allow_unsigned : bool
        Development only: accept a bundle with no signature (and log a warning).
    freshness : FreshnessStore, optional
        Refuse a bundle older than the highest version of its ``model_id`` this
        device accepted (rollback). Checking does not record: call
        :meth:`FreshnessStore.record` once the bundle is in use.
    model_id : str, optional
        The model lineage this device runs; a bundle of any other is refused.
    now : datetime, optional
        Timezone-aware clock for ``expires_at`` (default: the system clock).

    Raises
    ------
    BundleVerificationError
        Naming the check that failed: signature, trust, missing/extra file, hash,
        format, expiry, lineage or rollback, and what to do about it.
    """
    if MANIFEST not in files:
        raise BundleVerificationError(f"bundle has no {MANIFEST}; it is not a fedge bundle")
    if len(files[MANIFEST]) > MAX_MANIFEST_BYTES:
        raise BundleVerificationError(f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes; refused")
    if SIGNATURE in files:
        _check_signature(files[MANIFEST], files[SIGNATURE], _trusted(trusted_keys))
    elif allow_unsigned:
        log.warning("bundle is UNSIGNED and was accepted only because allow_unsigned=True; "
                    "never do this outside development")
    else:
        raise BundleVerificationError(f"bundle is unsigned (no {SIGNATURE}); sign it with "
                                      "`fedge export --key` or pass allow_unsigned=True in development")
    manifest = _parse_manifest(files[MANIFEST])
    _check_files(files, manifest["files"])
    check_expiry(manifest, now=now)
    if model_id is not None and manifest.get("model_id") != model_id:
        raise BundleVerificationError(
            f"bundle is of model '{manifest.get('model_id')}', not '{model_id}' that this device runs; "
            "refused (versions of different models are not ordered): fetch a bundle of that model"
        )
    if freshness is not None:
        freshness.check(manifest)
    return manifest


def _trusted(keys: Iterable[TrustedKey]) -> dict[str, Ed25519PublicKey]:
    trusted = {}
    for key in keys:
        public = key if isinstance(key, Ed25519PublicKey) else load_public_key(key)
        trusted[fingerprint(public)] = public
    return trusted


def _check_signature(manifest: bytes, envelope_bytes: bytes, trusted: dict[str, Ed25519PublicKey]) -> None:
    malformed = BundleVerificationError(f"{SIGNATURE} is malformed; the bundle was damaged or forged")
    if len(envelope_bytes) > MAX_SIGNATURE_BYTES:
        raise malformed
    envelope = _load_json(envelope_bytes, SIGNATURE)
    try:
        signer = envelope["key_fingerprint"]
        signature = base64.b64decode(envelope["signature"], validate=True)
        algorithm = envelope["algorithm"]
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise malformed from None
    if not isinstance(signer, str) or not isinstance(algorithm, str):
        raise malformed
    if algorithm != "ed25519":
        raise BundleVerificationError(f"{SIGNATURE} uses '{algorithm[:40]}'; only ed25519 is accepted")
    if signer not in trusted:
        raise BundleVerificationError(
            f"bundle is signed by untrusted key {signer[:80]}; add that signer's public key to "
            "trusted_keys only if you trust it"
        )
    try:
        trusted[signer].verify(signature, manifest)
    except InvalidSignature:
        raise BundleVerificationError(
            f"signature check failed: {MANIFEST} or {SIGNATURE} was altered after signing"
        ) from None


def _load_json(data: bytes, what: str) -> Any:
    """Strict JSON: no key written twice, no NaN/Infinity, bounded nesting."""
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            twice = sorted({k for k in keys if keys.count(k) > 1})
            raise BundleVerificationError(f"{what} has key(s) {twice[:5]} written twice: readers could "
                                          "disagree on the value; refused")
        return dict(pairs)

    def constant(name: str) -> Any:
        raise BundleVerificationError(f"{what} contains {name}, which is not JSON; refused")

    try:
        return json.loads(data, object_pairs_hook=unique, parse_constant=constant)
    except (ValueError, RecursionError):
        raise BundleVerificationError(f"{what} is malformed (not valid JSON); the bundle was damaged "
                                      "or forged") from None


def _parse_manifest(data: bytes) -> dict[str, Any]:
    manifest = _load_json(data, MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleVerificationError(f"{MANIFEST} is not format {FORMAT}; upgrade fedge or re-export")
    if not isinstance(manifest.get("files"), dict) or not manifest["files"]:
        raise BundleVerificationError(f"{MANIFEST} lists no files")
    for name, entry in manifest["files"].items():
        _check_file_entry(name, entry)
    _check_inputs(manifest.get("inputs"))
    _check_outputs(manifest.get("outputs"))
    _check_variants(manifest.get("variants"), manifest["files"])
    _check_optional(manifest)
    return manifest


def _bad(field: str, expected: str) -> BundleVerificationError:
    return BundleVerificationError(f"{MANIFEST} field '{field}' {expected}; {REEXPORT}")


def _is_int(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return abs(value) <= sys.float_info.max if isinstance(value, int) else math.isfinite(value)


def _check_file_entry(name: str, entry: object) -> None:
    if not _plain_name(name) or name in (MANIFEST, SIGNATURE):
        raise _bad("files", f"names '{name[:80]}', which is not a plain file name")
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) \
            or not _SHA256_HEX.match(entry["sha256"]) or not _is_int(entry.get("bytes"), 0, MAX_BUNDLE_BYTES):
        raise _bad(f"files.{name}", "must be {\"sha256\": <64 hex digits>, \"bytes\": <size>}")


def _check_inputs(inputs: object) -> None:
    if not isinstance(inputs, list) or not 1 <= len(inputs) <= MAX_INPUTS:
        raise _bad("inputs", f"must list the model's inputs (1 to {MAX_INPUTS})")
    names = set()
    for index, entry in enumerate(inputs):
        field = f"inputs[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"].isidentifier():
            raise _bad(f"{field}.name", "must be the model's input name (an identifier)")
        if entry["name"] in names:
            raise _bad(f"{field}.name", f"repeats input '{entry['name']}'")
        names.add(entry["name"])
        if not _is_shape(entry.get("shape")) or not isinstance(entry["shape"][0], str):
            raise _bad(f"{field}.shape", f"must be [batch, ...]: a named batch axis, then sizes (1 to "
                                         f"{MAX_FEATURES}) or axis names, at most {MAX_RANK} axes")
        if entry.get("dtype", "float32") not in DTYPES:
            raise _bad(f"{field}.dtype", f"must be one of {', '.join(DTYPES)}")


def _is_shape(shape: object) -> bool:
    """A list of 1 to MAX_RANK sizes (ints 1..MAX_FEATURES) or axis names (short printable strings)."""
    return isinstance(shape, list) and 1 <= len(shape) <= MAX_RANK and all(
        _is_int(size, 1, MAX_FEATURES) or (isinstance(size, str) and 0 < len(size) <= 64 and size.isprintable())
        for size in shape)


def _check_outputs(outputs: object) -> None:
    if outputs is None:
        return
    if not isinstance(outputs, list) or not 1 <= len(outputs) <= MAX_INPUTS:
        raise _bad("outputs", f"must list the model's outputs (1 to {MAX_INPUTS})")
    for index, entry in enumerate(outputs):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"] \
                or not _is_shape(entry.get("shape")):
            raise _bad(f"outputs[{index}]", "must be {\"name\": <output name>, \"shape\": [sizes or axis names]}")
        for key in ("dtype", "meaning"):
            if key in entry and not isinstance(entry[key], str):
                raise _bad(f"outputs[{index}].{key}", "must be a string")


def _check_variants(variants: object, files: Mapping[str, Any]) -> None:
    if not isinstance(variants, dict) or not variants:
        raise _bad("variants", "must map variant names to their model files")
    for name, entry in variants.items():
        skipped = isinstance(entry, dict) and "file" not in entry and name != "fp32" \
            and isinstance(entry.get("skipped"), str)
        if not skipped and (not isinstance(entry, dict) or not isinstance(entry.get("file"), str)
                            or entry["file"] not in files):
            raise _bad(f"variants.{name[:40]}", "must name a file listed in 'files' (or, except fp32, say why "
                                                "it was \"skipped\")")
    if "fp32" not in variants:
        raise _bad("variants", "must include the fp32 model")


def _check_optional(manifest: Mapping[str, Any]) -> None:
    """Fields a bundle may omit (older bundles) but must get right when present."""
    preprocessing = manifest.get("preprocessing", {})
    if not isinstance(preprocessing, dict) or not all(
            _is_number(preprocessing[k]) for k in ("scale", "offset") if k in preprocessing):
        raise _bad("preprocessing", "must be {\"scale\": <number>, \"offset\": <number>}")
    if not isinstance(preprocessing.get("kind", ""), str):
        raise _bad("preprocessing.kind", "must be a string (affine, none...)")
    labels = manifest.get("labels")
    if labels is not None and not (isinstance(labels, list) and all(isinstance(x, str) for x in labels)):
        raise _bad("labels", "must be a list of class names (or null for a model that is not a classifier)")
    if manifest.get("headline") is not None and not isinstance(manifest["headline"], str):
        raise _bad("headline", "must be a metric name")
    fixed = manifest.get("fixed_axes", {})
    if not isinstance(fixed, dict) or not all(_is_int(size, 1, MAX_FEATURES) for size in fixed.values()):
        raise _bad("fixed_axes", "must map axis names to the sizes the model fixes")
    if "round" in manifest and not _is_int(manifest["round"], 0, MAX_VERSION):
        raise _bad("round", "must be a round number")
    model_id = manifest.get("model_id")
    if model_id is not None and not (isinstance(model_id, str) and 0 < len(model_id) <= 256
                                     and model_id.isprintable()):
        raise _bad("model_id", "must be a printable name of at most 256 characters")
    if "version" in manifest and not _is_int(manifest["version"], 0, MAX_VERSION):
        raise _bad("version", f"must be an integer from 0 to {MAX_VERSION}")
    if "issued_at" in manifest:
        parse_time(manifest["issued_at"], "issued_at")
    if manifest.get("expires_at") is not None:
        parse_time(manifest["expires_at"], "expires_at")


def _check_files(files: Mapping[str, bytes], listed: Mapping[str, Any]) -> None:
    present = set(files) - {MANIFEST, SIGNATURE}
    missing, extra = sorted(set(listed) - present), sorted(present - set(listed))
    if missing:
        raise BundleVerificationError(f"file(s) {missing} listed in {MANIFEST} are missing")
    if extra:
        raise BundleVerificationError(f"unexpected file(s) {extra[:10]} not listed in {MANIFEST}; refused")
    for name, entry in sorted(listed.items()):
        if sha256(files[name]) != entry["sha256"] or len(files[name]) != entry["bytes"]:
            raise BundleVerificationError(f"{name}: SHA-256 does not match {MANIFEST}; the file was "
                                          "altered or damaged")


# --------------------------------------------------------------------------- time and freshness


def format_time(moment: dt.datetime) -> str:
    """``moment`` as manifests write times: UTC, ``YYYY-MM-DDTHH:MM:SSZ``."""
    return moment.astimezone(dt.UTC).strftime(TIME_FORMAT)


def parse_time(value: object, field: str) -> dt.datetime:
    """A manifest time (``YYYY-MM-DDTHH:MM:SSZ``, UTC) as an aware datetime."""
    try:
        if isinstance(value, str):
            return dt.datetime.strptime(value, TIME_FORMAT).replace(tzinfo=dt.UTC)
    except ValueError:
        pass
    raise _bad(field, "must be a UTC time like 2025-01-31T12:00:00Z")


def _clock(now: dt.datetime | None) -> dt.datetime:
    if now is None:
        return dt.datetime.now(dt.UTC)
    if now.tzinfo is None:
        raise ConfigError("now must be timezone-aware (e.g. datetime.now(datetime.UTC))")
    return now


def check_expiry(manifest: Mapping[str, Any], *, now: dt.datetime | None = None) -> None:
    """Refuse a bundle whose signed ``expires_at`` is at or before ``now`` (default: the system clock)."""
    if manifest.get("expires_at") is None:
        return
    expires, moment = parse_time(manifest["expires_at"], "expires_at"), _clock(now)
    if moment >= expires:
        raise BundleVerificationError(
            f"bundle expired at {manifest['expires_at']} (now {format_time(moment)}); fetch a current "
            "bundle from the coordinator (or re-export with `fedge export --valid-days N`)"
        )


def lineage(manifest: Mapping[str, Any]) -> tuple[str, int]:
    """``(model_id, version)`` of a bundle, for freshness; refused if the bundle has none."""
    model_id, version = manifest.get("model_id"), manifest.get("version")
    if not isinstance(model_id, str) or not model_id or not isinstance(version, int) \
            or not _is_int(version, 0, MAX_VERSION):
        raise BundleVerificationError(
            "bundle has no model_id/version (it was made by a fedge without rollback protection), so a "
            "freshness store cannot order it; re-export it with `fedge export` (or let the coordinator "
            "sign a new round)"
        )
    return model_id, version


class FreshnessStore:
    """The highest bundle ``version`` a device accepted, per ``model_id``, kept in ``directory``.

    Threat model: a signature proves who made a bundle, not that it is current; an
    attacker who controls the channel or the storage can replay an older signed
    bundle (rollback to a model with a known flaw). The store records, per model
    lineage, the highest version accepted and refuses anything lower; the same
    version is accepted again (reloading). It fails closed: a record that cannot be
    read or parsed refuses every bundle of that model. Records are small JSON files
    written atomically with mode 0600 in a directory kept at 0700, under an advisory
    lock so that two loaders cannot lower a record. Whoever can write ``directory``
    can reset the protection, so keep it on storage only the device's user can write.
    Versions of different model ids are not ordered against each other: pin the
    lineage with ``model_id=`` where that matters.

    Parameters
    ----------
    directory : str or Path
        Where the records live; created (mode 0700) on the first record.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def record_path(self, model_id: str) -> Path:
        """The record file of ``model_id`` (named by its hash: any id is a safe file name)."""
        digest = hashlib.sha256(model_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return self.directory / f"{digest}.json"

    def accepted_version(self, model_id: str) -> int | None:
        """The highest version of ``model_id`` accepted so far, or None."""
        path = self.record_path(model_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._corrupt(path, f"cannot be read ({exc.strerror})") from None
        try:
            record = json.loads(data)
        except (ValueError, RecursionError):
            raise self._corrupt(path, "is not JSON") from None
        if not isinstance(record, dict) or record.get("model_id") != model_id \
                or not _is_int(record.get("version"), 0, MAX_VERSION):
            raise self._corrupt(path, f"is not a record of model '{model_id}'")
        return int(record["version"])

    def check(self, manifest: Mapping[str, Any]) -> None:
        """Refuse ``manifest`` if it is older than the version accepted for its ``model_id``.

        Raises
        ------
        BundleVerificationError
            For a rollback, a bundle without ``model_id``/``version``, or an unreadable record.
        """
        model_id, version = lineage(manifest)
        accepted = self.accepted_version(model_id)
        if accepted is not None and version < accepted:
            raise BundleVerificationError(
                f"bundle '{model_id}' version {version} is older than version {accepted} this device "
                f"already accepted (rollback refused); fetch version {accepted} or newer. If going back "
                f"is intended, delete {self.record_path(model_id)}"
            )

    def record(self, manifest: Mapping[str, Any], *, now: dt.datetime | None = None) -> None:
        """Raise the record of the manifest's ``model_id`` to its ``version`` (never lower it).

        Call only once the bundle is fully verified and in use. Rechecks under the
        lock, so a bundle that became older meanwhile is refused.
        """
        model_id, version = lineage(manifest)
        ensure_private_dir(self.directory)
        with self._locked(model_id):
            self.check(manifest)
            if self.accepted_version(model_id) == version:
                return
            record = {"model_id": model_id, "version": version, "issued_at": manifest.get("issued_at"),
                      "accepted_at": format_time(_clock(now))}
            write_bytes_atomic(self.record_path(model_id), (json.dumps(record, indent=2) + "\n").encode())

    @contextmanager
    def _locked(self, model_id: str) -> Iterator[None]:
        with exclusive_lock(self.record_path(model_id).with_suffix(".lock")):
            yield

    @staticmethod
    def _corrupt(path: Path, problem: str) -> BundleVerificationError:
        return BundleVerificationError(
            f"freshness record '{path}' {problem}; every bundle of this model is refused until it is "
            "restored from a backup (or deleted, which accepts the next bundle at any version)"
        )


def zip_lineage(data: bytes | Path) -> tuple[str | None, int | None]:
    """``(model_id, version)`` a zipped bundle's manifest names, or Nones (unreadable, or none named).

    Unverified: for reporting and for refusing to publish an older version, never for trust.
    """
    import io  # noqa: PLC0415

    try:
        with zipfile.ZipFile(io.BytesIO(data) if isinstance(data, bytes) else data) as archive:
            manifest = json.loads(archive.read(MANIFEST))
    except (*ZIP_READ_ERRORS, KeyError):
        return None, None
    if not isinstance(manifest, dict):
        return None, None
    model_id, version = manifest.get("model_id"), manifest.get("version")
    return (model_id if isinstance(model_id, str) else None,
            version if isinstance(version, int) and not isinstance(version, bool) else None)
