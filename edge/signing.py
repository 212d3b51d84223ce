"""Ed25519 signing keys for edge bundles (``cryptography``; no torch).

Threat model: whoever holds the private key can publish models that devices
will run. The private key is written with mode 0600 and never leaves the
coordinator; devices hold only public keys (or their fingerprints) of signers
they trust. A key is identified by the SHA-256 of its raw 32-byte public key.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedge.errors import BundleVerificationError, ConfigError

log = logging.getLogger("fedge.edge")

PRIVATE_NAME = "signing.key"
PUBLIC_NAME = "signing.pub"
PRIVATE_DIR_MODE = 0o700
PUBLIC_FILE_MODE = 0o644


def fingerprint(public_key: Ed25519PublicKey) -> str:
    """``sha256:<hex>`` of the raw public key bytes."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def generate_signing_key(directory: str | Path, *, force: bool = False) -> tuple[Path, Path]:
    """Create ``signing.key`` (PKCS#8 PEM, mode 0600) and ``signing.pub`` in ``directory``.

    Raises
    ------
    ConfigError
        If either file exists and ``force`` is not set.
    """
    directory = ensure_private_dir(directory)
    private_path, public_path = directory / PRIVATE_NAME, directory / PUBLIC_NAME
    existing = [p for p in (private_path, public_path) if p.exists()]
    if existing and not force:
        raise ConfigError(f"{existing[0]} already exists; pass --force to replace it "
                          "(bundles signed with the old key will no longer verify against the new one)")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    _write_private(private_path, private_pem)
    write_public(public_path, key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private_path, public_path


def ensure_private_dir(directory: str | Path) -> Path:
    """Make ``directory`` a directory only its owner can write: mode 0700 whatever the umask.

    Threat model: a key directory (or a device's freshness state) that others can
    write lets them swap a public key in an allow-list, plant a key, or delete a
    record. ``mkdir`` alone follows the umask (0777 under umask 0), so a new
    directory is created 0700 and then ``chmod``-ed to exactly 0700. Missing parents
    are created with the usual umask. An existing directory that group or others
    can write is tightened to 0700 and a warning is logged; one that is only
    readable by them is left as it is.

    Raises
    ------
    ConfigError
        If ``directory`` exists but is not a directory, belongs to another user, or is
        writable by others and cannot be tightened: choose a private directory instead.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(directory, PRIVATE_DIR_MODE)
    except FileExistsError:
        if not directory.is_dir():
            raise ConfigError(f"'{directory}' exists and is not a directory") from None
        _tighten(directory)
        return directory
    os.chmod(directory, PRIVATE_DIR_MODE)
    return directory


def _tighten(directory: Path) -> None:
    info = directory.stat()
    if hasattr(os, "getuid") and info.st_uid != os.getuid():  # its owner could swap keys in it later
        raise ConfigError(f"'{directory}' belongs to another user (uid {info.st_uid}), who could replace the keys "
                          "in it; use a directory of your own")
    mode = stat.S_IMODE(info.st_mode)
    if not mode & (stat.S_IWGRP | stat.S_IWOTH):
        return
    try:
        os.chmod(directory, PRIVATE_DIR_MODE)
    except PermissionError:
        raise ConfigError(f"'{directory}' is writable by group or others (mode {mode:04o}) and is not "
                          "yours to tighten; keep keys in a private directory (mode 0700)") from None
    log.warning("'%s' was writable by group or others (mode %04o); tightened it to 0700",
                directory, mode)


def write_public(path: Path, data: bytes) -> None:
    """Write a public file (key, certificate) with mode 0644, whatever the umask."""
    path.write_bytes(data)
    os.chmod(path, PUBLIC_FILE_MODE)


def _write_private(path: Path, data: bytes) -> None:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    """Read an Ed25519 private key (PEM); clear errors for a missing or wrong key."""
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except FileNotFoundError:
        raise ConfigError(f"signing key '{path}' does not exist; create one with "
                          "`fedge keys signing init DIR`") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"'{path}' is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"'{path}' is a {type(key).__name__}, not an Ed25519 key")
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    """Read an Ed25519 public key (PEM) that a device trusts."""
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except FileNotFoundError:
        raise BundleVerificationError(f"trusted key '{path}' does not exist") from None
    except ValueError as exc:
        raise BundleVerificationError(f"'{path}' is not a PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise BundleVerificationError(f"'{path}' is a {type(key).__name__}, not an Ed25519 key")
    return key
