"""Getting signed bundles onto devices: ``fedge pull`` and :func:`pull` (no torch).

A device fetches the coordinator's latest inference bundle (``inference.zip``) and training
graph (``training.zip``) from the coordinator's bundle service
(:mod:`fedge.server.publish`) over HTTPS, as an authenticated device, and keeps them in a
directory of its own::

    from fedge.edge.delivery import pull
    result = pull(url_or_address="coord.example.org:9096", kind="inference", directory="bundles",
                  device_key="phone-017.key", ca="ca.crt", trusted_keys=["signing.pub"])
    model = EdgeModel.load(result.path, trusted_keys=["signing.pub"])

Protocol (``GET /v1/bundles/{inference,training}``): every request carries

* ``X-Fedge-Device``: the device key's OpenSSH fingerprint (``SHA256:<base64>``, what
  ``ssh-keygen -lf NAME.pub`` prints) or the device's registered name;
* ``X-Fedge-Timestamp``: Unix seconds (the coordinator accepts +-300 s);
* ``X-Fedge-Nonce``: 32 random hex digits, never reused (the coordinator refuses a replay);
* ``X-Fedge-Signature``: base64 of the DER ECDSA-P384/SHA-384 signature, with the device's
  OpenSSH private key, of :func:`canonical_request` (method, path, timestamp, nonce, device);
* ``If-None-Match``: the SHA-256 of the bundle already held, so an unchanged bundle is
  answered ``304`` with no body (no bytes but the headers).

Threat model: trust comes from the bundle's Ed25519 signature, never from the transport.
The download is written to a temporary file in the target directory, verified there
(signature by a trusted key, every file's hash, expiry and freshness: a bundle older
than the one this device accepted is refused as a rollback) and only then renamed over
``DIR/<kind>.zip`` (fsynced, atomic), so readers see the old complete bundle or the new
complete one, never a part, and a bundle that fails any check leaves the old one in place
byte for byte. The version is recorded in the freshness store after the swap, under a lock
that serialises pulls of one kind. TLS (the coordinator's CA) keeps the model private in
transit and the device's signature keeps unregistered parties from fetching it; neither is
needed for integrity. ``insecure=True`` (plain HTTP, only against a coordinator started
``--insecure``) still verifies every signature.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import importlib
import json
import os
import re
import secrets
import ssl
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key

from fedge.edge.bundle import (
    MAX_BUNDLE_BYTES,
    FreshnessStore,
    TrustedKey,
    read_bundle,
    verify_bundle,
    zip_lineage,
)
from fedge.edge.signing import ensure_private_dir
from fedge.errors import BundleVerificationError, FedgeError
from fedge.files import exclusive_lock, write_bytes_atomic

if sys.platform != "win32":
    pass

KINDS = ("inference", "training")
# A width-scaled sub-model's bundles (sub-models: one per width a fleet trains): "inference-w0.25", "training-w0.25"
WIDTH_KIND = re.compile(r"(inference|training)-w0\.[0-9]{1,10}")  # 1/1024 is 0.0009765625
KIND_WORDS = "inference, training, or inference-w<width> / training-w<width> (e.g. inference-w0.25)"


def is_kind(kind: str) -> bool:
    """Whether ``kind`` names a bundle kind: ``inference``, ``training`` or a width's ``inference-w0.25``."""
    return kind in KINDS or WIDTH_KIND.fullmatch(kind) is not None


def inference_kind(width: float, base: str = "inference") -> str:
    """The ``base`` bundle kind (inference, training) of a sub-model of ``width`` (``base`` for the whole model)."""
    return base if width >= 1 else f"{base}-w{width:g}"
API_PREFIX = "/v1/bundles/"
HEADER_DEVICE = "X-Fedge-Device"
HEADER_TIMESTAMP = "X-Fedge-Timestamp"
HEADER_NONCE = "X-Fedge-Nonce"
HEADER_SIGNATURE = "X-Fedge-Signature"
LINEAGE_PIN = "lineage.pin"  # in the freshness directory of each kind: the model_id this device follows
SCHEME = "fedge-bundle-request/1"
DEFAULT_TIMEOUT = 60.0
CHUNK = 1 << 20

Verifier = Callable[[Path, Sequence[TrustedKey], "FreshnessStore | None"], Mapping[str, Any]]


class DeliveryError(FedgeError):
    """A bundle could not be fetched (unreachable, TLS, refused device, nothing published)."""


class NotPublished(DeliveryError):
    """The coordinator has not published a bundle of this kind yet (HTTP 404)."""


@dataclass(frozen=True)
class PullResult:
    """What :func:`pull` did.

    Attributes
    ----------
    kind : str
        ``inference`` or ``training``.
    changed : bool
        Whether a new bundle was verified and swapped in (False: the coordinator's is the one held).
    path : Path
        ``DIR/<kind>.zip``: always a complete bundle that verified when it was swapped in.
    version : int | None
        The bundle's signed ``version`` (None when unknown).
    etag : str
        SHA-256 (hex) of the bundle's bytes.
    bytes_downloaded : int
        Body bytes received (0 when unchanged).
    model_id : str | None
        The bundle's signed lineage.
    """

    kind: str
    changed: bool
    path: Path
    version: int | None
    etag: str
    bytes_downloaded: int
    model_id: str | None = None


# --------------------------------------------------------------------------- the request signature


def canonical_request(method: str, path: str, timestamp: str, nonce: str, device: str) -> bytes:
    """The bytes a device signs for one request (one field a line, after the scheme name)."""
    return "\n".join([SCHEME, method.upper(), path, timestamp, nonce, device]).encode()


def key_fingerprint(public_key: ec.EllipticCurvePublicKey) -> str:
    """``SHA256:<base64, unpadded>`` of the OpenSSH public key blob, as ``ssh-keygen -l`` prints it."""
    line = public_key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    blob = base64.b64decode(line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def load_device_key(path: str | Path) -> ec.EllipticCurvePrivateKey:
    """A device's OpenSSH EC P-384 private key (``fedge keys add-device``), with clear errors."""
    try:
        key = load_ssh_private_key(Path(path).read_bytes(), password=None)
    except FileNotFoundError:
        raise DeliveryError(f"device key '{path}' does not exist; the operator makes it with "
                            "`fedge keys add-device NAME`") from None
    except (ValueError, UnsupportedAlgorithm, TypeError):
        raise DeliveryError(f"'{path}' is not an unencrypted OpenSSH private key; use the NAME.key "
                            "of `fedge keys add-device NAME`") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP384R1):
        raise DeliveryError(f"'{path}' is not an EC P-384 key; device keys come from `fedge keys add-device`")
    return key


def signed_headers(key: ec.EllipticCurvePrivateKey, method: str, path: str, *,
                   timestamp: int | None = None, nonce: str | None = None,
                   device: str | None = None) -> dict[str, str]:
    """The four authentication headers of a request for ``path`` (now, with a fresh nonce)."""
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    nonce = nonce or secrets.token_hex(16)
    device = device or key_fingerprint(key.public_key())
    signature = key.sign(canonical_request(method, path, stamp, nonce, device), ec.ECDSA(hashes.SHA384()))
    return {HEADER_DEVICE: device, HEADER_TIMESTAMP: stamp, HEADER_NONCE: nonce,
            HEADER_SIGNATURE: base64.b64encode(signature).decode()}


# --------------------------------------------------------------------------- pull


def pull(
    *,
    url_or_address: str,
    kind: str,
    directory: str | Path,
    device_key: str | Path | ec.EllipticCurvePrivateKey | None,
    ca: str | Path | None,
    trusted_keys: Sequence[TrustedKey],
    freshness_dir: str | Path | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    insecure: bool = False,
    verifier: Verifier | None = None,
    model_id: str | None = None,
) -> PullResult:
    """Fetch the coordinator's ``kind`` bundle if it changed, verify it, and swap it in atomically.

    Parameters
    ----------
    url_or_address : str
        The bundle service: ``HOST:PORT`` (what ``fedge coordinator start`` prints for
        bundles) or ``https://HOST:PORT``.
    kind : str
        ``inference`` (``DIR/inference.zip``) or ``training`` (``DIR/training.zip``).
    directory : str or Path
        Where this device keeps its bundles (created).
    device_key : path or EC private key
        This device's OpenSSH key (``fedge keys add-device``); may be None only when ``insecure``.
    ca : path
        The coordinator's ``ca.crt``; may be None only when ``insecure``.
    trusted_keys : sequence of Ed25519 public keys or PEM paths
        Signers whose bundles this device accepts (at least one).
    freshness_dir : path, optional
        The :class:`FreshnessStore` refusing rollbacks (default ``DIR/.freshness``); training
        bundles keep theirs in its ``training/`` subdirectory. Pass the same directory to
        ``EdgeModel.load(..., freshness=FreshnessStore(freshness_dir))``.
    timeout : float
        Seconds a connection or a read may stall.
    insecure : bool
        Plain HTTP to a coordinator started ``--insecure`` (bundles are still verified).
    verifier : callable, optional
        ``verifier(path, trusted_keys, freshness) -> manifest`` for this kind (default: the
        bundle format's own: :func:`fedge.edge.bundle.verify_bundle` for inference,
        ``fedge.edge.training_bundle.read_training_bundle`` for training).
    model_id : str, optional
        The lineage (signed ``model_id``) to accept, by name. Without it, the lineage of
        this kind's first pull is pinned (``LINEAGE_PIN`` in the freshness directory) and a
        bundle of any other lineage is refused; with it, only that lineage is accepted, and
        pinned once installed.

    Threat model (lineage): rollback protection orders the versions of one lineage only. A
    bundle of another lineage (another or an older run's, signed by the same key) would
    otherwise replace the current model at any version; the pin refuses it unless the
    device's owner names it.

    Raises
    ------
    BundleVerificationError
        The download failed a check (signature, trust, hash, expiry, rollback, another
        lineage than the pinned or asked one); the bundle held before is kept.
    DeliveryError
        The coordinator could not be reached, its certificate did not verify, it refused
        this device (401), or nothing is published (:class:`NotPublished`).
    """
    if not is_kind(kind):
        raise DeliveryError(f"bundle kind '{kind}' is not {KIND_WORDS}")
    if not trusted_keys:
        raise BundleVerificationError("give at least one trusted signing key (the coordinator's signing.pub)")
    if not insecure and (device_key is None or ca is None):
        raise DeliveryError("pulling needs the device key (`fedge keys add-device`) and the coordinator's "
                            "ca.crt (or insecure=True against a coordinator started --insecure)")
    key = device_key if isinstance(device_key, ec.EllipticCurvePrivateKey) or device_key is None \
        else load_device_key(device_key)
    scheme, host, port, prefix = _endpoint(url_or_address, insecure)
    folder = ensure_private_dir(directory)  # 0700 whatever the umask: only this device's user swaps bundles
    base_store = Path(freshness_dir) if freshness_dir is not None else folder / ".freshness"
    store = FreshnessStore(base_store if kind == "inference" else base_store / kind)  # a lineage pin per kind
    check = verifier or _default_verifier(kind)
    target = folder / f"{kind}.zip"
    with exclusive_lock(folder / f".{kind}.lock"):
        held = _file_sha256(target)
        path = prefix + API_PREFIX + kind
        headers = signed_headers(key, "GET", path) if key is not None else {}
        if held is not None:
            headers["If-None-Match"] = f'"{held}"'
        connection = _connection(scheme, host, port, ca, timeout)
        try:
            response = _request(connection, path, headers, url_or_address, ca)
            if response.status == 304:
                response.read()
                if held is None:
                    raise DeliveryError("the coordinator answered 304 (not modified) to a device that holds no "
                                        "bundle; try again")
                held_id, version = zip_lineage(target)
                _check_asked(kind, held_id, model_id)
                return PullResult(kind, False, target, version, held, 0, held_id)
            _raise_for_status(response, kind, url_or_address)
            scratch, digest, size = _download(response, folder, target.name)
        finally:
            connection.close()
        try:
            announced = (response.getheader("ETag") or "").strip('"')
            if announced and announced != digest:
                raise DeliveryError(f"the {kind} bundle arrived damaged (its SHA-256 is not the coordinator's "
                                    "ETag); pull again")
            if digest == held:  # the same bytes again (the coordinator ignored If-None-Match)
                held_id, version = zip_lineage(target)
                _check_asked(kind, held_id, model_id)
                return PullResult(kind, False, target, version, digest, size, held_id)
            try:
                manifest = dict(check(scratch, trusted_keys, store))
                _check_lineage(kind, manifest.get("model_id"), model_id, store.directory / LINEAGE_PIN)
            except BundleVerificationError as exc:
                kept = f"kept the bundle already in {target}" if held is not None else "nothing was installed"
                raise BundleVerificationError(f"{kind} bundle from {url_or_address} refused: {exc} ({kept})") \
                    from None
            _install(scratch, target)
        except BaseException:
            scratch.unlink(missing_ok=True)
            raise
        if manifest.get("model_id") is not None or manifest.get("version") is not None:
            store.record(manifest)
        if isinstance(manifest.get("model_id"), str):
            pin_lineage(store.directory / LINEAGE_PIN, manifest["model_id"])
        version = manifest.get("version")
        return PullResult(kind, True, target, version if isinstance(version, int) else None, digest, size,
                          manifest.get("model_id"))


def pinned_lineage(pin: Path) -> str | None:
    """The ``model_id`` pinned in ``pin``, or None before the first pull; fails closed on a damaged pin."""
    try:
        record = json.loads(pin.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError):
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("model_id"), str):
        raise BundleVerificationError(f"lineage pin '{pin}' is damaged; every bundle is refused until it is "
                                      "deleted and the lineage named again (`fedge pull --model-id NAME`)")
    return str(record["model_id"])


def _check_lineage(kind: str, offered: Any, asked: str | None, pin: Path) -> None:
    """Refuse a bundle whose lineage is not the one asked for by name, else not the pinned one."""
    if asked is not None:
        _check_asked(kind, offered, asked)
        return
    pinned = pinned_lineage(pin)
    if pinned is not None and offered != pinned:
        raise BundleVerificationError(
            f"the {kind} bundle is of model '{offered}', but this device follows model '{pinned}' (pinned on its "
            f"first pull); a bundle of another lineage is not installed unless asked for by name: "
            f"`fedge pull --kind {kind} --model-id '{offered}'` switches to it")


def _check_asked(kind: str, offered: str | None, asked: str | None) -> None:
    if asked is not None and offered != asked:
        raise BundleVerificationError(f"the coordinator's {kind} bundle is of model '{offered}', not '{asked}' "
                                      "that --model-id asks for")


def pin_lineage(pin: Path, model_id: str) -> None:
    """Record ``model_id`` as the lineage this device follows (0600, in a 0700 folder)."""
    if pinned_lineage(pin) != model_id:
        ensure_private_dir(pin.parent)
        write_bytes_atomic(pin, (json.dumps({"model_id": model_id}) + "\n").encode())


def _default_verifier(kind: str) -> Verifier:
    return _verify_inference if kind.startswith("inference") else _verify_training


def _verify_inference(path: Path, trusted_keys: Sequence[TrustedKey],
                      freshness: FreshnessStore | None) -> Mapping[str, Any]:
    return verify_bundle(read_bundle(path), trusted_keys=trusted_keys, freshness=freshness)


def _verify_training(path: Path, trusted_keys: Sequence[TrustedKey],
                     freshness: FreshnessStore | None) -> Mapping[str, Any]:
    """The training bundle's own reader (``fedge.edge.training_bundle``), when this fedge has it."""
    try:
        reader = importlib.import_module("fedge.edge.training_bundle").read_training_bundle
    except (ImportError, AttributeError):
        raise BundleVerificationError("this fedge cannot verify training bundles (no "
                                      "fedge.edge.training_bundle.read_training_bundle); upgrade fedge "
                                      "on the device, or pull only --kind inference") from None
    bundle = reader(path, trusted_keys=trusted_keys, freshness=freshness)
    manifest = getattr(bundle, "manifest", bundle)
    if not isinstance(manifest, Mapping):
        raise BundleVerificationError("the training bundle reader returned no manifest; upgrade fedge")
    return manifest


def _endpoint(url_or_address: str, insecure: bool) -> tuple[str, str, int, str]:
    """(scheme, host, port, path prefix) of ``HOST:PORT`` or ``http(s)://HOST:PORT[/prefix]``."""
    text = url_or_address.strip()
    if "://" not in text:
        text = ("http://" if insecure else "https://") + text
    parsed = urllib.parse.urlsplit(text)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port is None:
        raise DeliveryError(f"bundle service address '{url_or_address}' is not HOST:PORT or https://HOST:PORT "
                            "(the address `fedge coordinator start` prints for bundles)")
    if parsed.scheme == "http" and not insecure:
        raise DeliveryError(f"'{url_or_address}' is plain HTTP; bundles are fetched over HTTPS (pass --insecure "
                            "only against a coordinator started --insecure)")
    if parsed.scheme == "https" and insecure:
        raise DeliveryError("--insecure speaks plain HTTP; drop it for an https:// address")
    return parsed.scheme, parsed.hostname, port, parsed.path.rstrip("/")


def _connection(scheme: str, host: str, port: int, ca: str | Path | None,
                timeout: float) -> http.client.HTTPConnection:
    if scheme == "http":
        return http.client.HTTPConnection(host, port, timeout=timeout)
    assert ca is not None
    if not Path(ca).exists():
        raise DeliveryError(f"CA certificate '{ca}' does not exist; copy the coordinator's keys/ca.crt here")
    try:
        context = ssl.create_default_context(cafile=str(ca))
    except ssl.SSLError as exc:
        raise DeliveryError(f"'{ca}' is not a PEM CA certificate ({exc.reason}); use the coordinator's "
                            "keys/ca.crt") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return http.client.HTTPSConnection(host, port, timeout=timeout, context=context)


def _request(connection: http.client.HTTPConnection, path: str, headers: dict[str, str], where: str,
             ca: str | Path | None) -> http.client.HTTPResponse:
    try:
        connection.request("GET", path, headers={**headers, "Accept": "application/zip"})
        return connection.getresponse()
    except ssl.SSLCertVerificationError as exc:
        raise DeliveryError(f"the bundle service's certificate does not verify with {ca}: {exc.verify_message}; "
                            "use the ca.crt of this coordinator's `fedge keys init`") from None
    except ssl.SSLError as exc:
        raise DeliveryError(f"TLS with {where} failed ({exc.reason}); is that the coordinator's bundle port, "
                            "started with TLS?") from None
    except (OSError, http.client.HTTPException) as exc:
        raise DeliveryError(f"cannot reach the bundle service at {where} ({_reason(exc)}); check the address "
                            "(`fedge coordinator start` prints it) and that the coordinator runs") from None


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def _raise_for_status(response: http.client.HTTPResponse, kind: str, where: str) -> None:
    if response.status == 200:
        return
    body = response.read(64 * 1024)
    try:
        message = str(json.loads(body).get("error", ""))
    except (ValueError, AttributeError):
        message = body.decode("utf-8", "replace")[:300]
    if response.status == 404:
        raise NotPublished(message or f"no {kind} bundle is published at {where} yet")
    if response.status == 401:
        raise DeliveryError(f"the coordinator refused this device: {message}")
    raise DeliveryError(f"the bundle service at {where} answered {response.status} {response.reason}: {message}")


def _download(response: http.client.HTTPResponse, folder: Path, name: str) -> tuple[Path, str, int]:
    """The body into a fsynced temporary file beside the target: (path, SHA-256 hex, size)."""
    length = response.getheader("Content-Length")
    if length is not None and length.isdigit() and int(length) > MAX_BUNDLE_BYTES:
        raise DeliveryError(f"the coordinator offers a bundle of {int(length)} bytes, more than the "
                            f"{MAX_BUNDLE_BYTES} a bundle may have; refused")
    fd, scratch = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".part")
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as handle:
            while chunk := response.read(CHUNK):
                size += len(chunk)
                if size > MAX_BUNDLE_BYTES:
                    raise DeliveryError(f"the bundle is larger than {MAX_BUNDLE_BYTES} bytes; refused")
                digest.update(chunk)
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException as exc:
        Path(scratch).unlink(missing_ok=True)
        if isinstance(exc, (OSError, http.client.HTTPException)) and not isinstance(exc, DeliveryError):
            raise DeliveryError(f"the download broke off after {size} bytes ({_reason(exc)}); pull again") \
                from None
        raise
    return Path(scratch), digest.hexdigest(), size


def _install(scratch: Path, target: Path) -> None:
    """Rename the verified download over ``target`` (0600: the device's own state) and make the rename durable."""
    os.chmod(scratch, 0o600)
    os.replace(scratch, target)
    if sys.platform != "win32":
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def _file_sha256(path: Path) -> str | None:
    try:
        with path.open("rb") as handle:
            digest = hashlib.sha256()
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
            return digest.hexdigest()
    except FileNotFoundError:
        return None


