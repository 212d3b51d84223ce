"""The signed edge bundle format: read, write, sign and verify (no torch).

A bundle is a directory (or a ``.zip`` of one) holding:

* ``model.onnx`` and ``model.int8.onnx``: the models;
* ``manifest.json``: what the models are (inputs, outputs, preprocessing, labels,
  metrics, versions) and the SHA-256 and size of every other file;
* ``manifest.sig``: JSON ``{"algorithm": "ed25519", "key_fingerprint":
  "sha256:<hex of the raw public key>", "signature": "<base64>"}``, the Ed25519
  signature over the exact bytes of ``manifest.json``.

Threat model: the bundle travels over untrusted channels and storage. A device
accepts it only if the manifest is signed by a key it trusts, and every file
the manifest lists is present with the listed hash, and no other file is
there. Verification runs on the bytes read once into memory, and the runtime
builds its session from those same bytes, so a file swapped after the check is
never run.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedge.edge.signing import fingerprint, load_public_key
from fedge.errors import BundleVerificationError

log = logging.getLogger("fedge.edge")

FORMAT = "fedge-bundle/1"
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
MAX_BUNDLE_BYTES = 2**31

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
    manifest = {**manifest, "format": FORMAT,
                "files": {name: {"sha256": sha256(data), "bytes": len(data)}
                          for name, data in sorted(files.items())}}
    manifest_bytes = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    contents = {**files, MANIFEST: manifest_bytes, SIGNATURE: sign_manifest(manifest_bytes, private_key)}
    for name, data in contents.items():
        (out / name).write_bytes(data)
    if make_zip:
        with zipfile.ZipFile(out.with_suffix(".zip"), "w", zipfile.ZIP_DEFLATED) as archive:
            for name, data in sorted(contents.items()):
                archive.writestr(name, data)
    return out


def read_bundle(path: str | Path) -> dict[str, bytes]:
    """Every file of a bundle directory or ``.zip``, read once into memory."""
    path = Path(path)
    if path.is_dir():
        return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}
    if not path.exists():
        raise BundleVerificationError(f"bundle '{path}' does not exist")
    try:
        with zipfile.ZipFile(path) as archive:
            members = [m for m in archive.infolist() if not m.is_dir()]
            if sum(m.file_size for m in members) > MAX_BUNDLE_BYTES:
                raise BundleVerificationError(f"bundle '{path}' unpacks to more than 2 GiB; refused")
            if any("/" in m.filename or m.filename.startswith(".") for m in members):
                raise BundleVerificationError(f"bundle '{path}' has nested or hidden paths; refused")
            return {m.filename: archive.read(m) for m in members}
    except (zipfile.BadZipFile, EOFError, OSError, zipfile.LargeZipFile) as exc:
        raise BundleVerificationError(
            f"bundle '{path}' is not a valid zip (truncated or corrupt: {exc}); fetch it again"
        ) from None


def verify_bundle(
    files: Mapping[str, bytes], *, trusted_keys: Iterable[TrustedKey], allow_unsigned: bool = False
) -> dict[str, Any]:
    """Check signature, trust and every file's hash; return the manifest.

    Raises
    ------
    BundleVerificationError
        Naming the check that failed: signature, trust, missing/extra file, hash, format.
    """
    if MANIFEST not in files:
        raise BundleVerificationError(f"bundle has no {MANIFEST}; it is not a fedge bundle")
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
    return manifest


def _trusted(keys: Iterable[TrustedKey]) -> dict[str, Ed25519PublicKey]:
    trusted = {}
    for key in keys:
        public = key if isinstance(key, Ed25519PublicKey) else load_public_key(key)
        trusted[fingerprint(public)] = public
    return trusted


def _check_signature(manifest: bytes, envelope_bytes: bytes, trusted: dict[str, Ed25519PublicKey]) -> None:
    try:
        envelope = json.loads(envelope_bytes)
        signer = str(envelope["key_fingerprint"])
        signature = base64.b64decode(envelope["signature"], validate=True)
        algorithm = envelope["algorithm"]
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise BundleVerificationError(f"{SIGNATURE} is malformed; the bundle was damaged or forged") from None
    if algorithm != "ed25519":
        raise BundleVerificationError(f"{SIGNATURE} uses '{algorithm}'; only ed25519 is accepted")
    if signer not in trusted:
        raise BundleVerificationError(
            f"bundle is signed by untrusted key {signer}; add that signer's public key to "
            "trusted_keys only if you trust it"
        )
    try:
        trusted[signer].verify(signature, manifest)
    except InvalidSignature:
        raise BundleVerificationError(
            f"signature check failed: {MANIFEST} or {SIGNATURE} was altered after signing"
        ) from None


def _parse_manifest(data: bytes) -> dict[str, Any]:
    try:
        manifest = json.loads(data)
    except ValueError:
        raise BundleVerificationError(f"{MANIFEST} is not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleVerificationError(f"{MANIFEST} is not format {FORMAT}; upgrade fedge or re-export")
    if not isinstance(manifest.get("files"), dict):
        raise BundleVerificationError(f"{MANIFEST} lists no files")
    return manifest


def _check_files(files: Mapping[str, bytes], listed: Mapping[str, Any]) -> None:
    present = set(files) - {MANIFEST, SIGNATURE}
    missing, extra = sorted(set(listed) - present), sorted(present - set(listed))
    if missing:
        raise BundleVerificationError(f"file(s) {missing} listed in {MANIFEST} are missing")
    if extra:
        raise BundleVerificationError(f"unexpected file(s) {extra} not listed in {MANIFEST}; refused")
    for name, entry in sorted(listed.items()):
        if sha256(files[name]) != entry.get("sha256"):
            raise BundleVerificationError(f"{name}: SHA-256 does not match {MANIFEST}; the file was "
                                          "altered or damaged")
