"""Publishing bundles to devices: the published directory and the coordinator's bundle service.

``publish_bundle`` puts the newest signed bundle of a kind (``inference``: the edge bundle
of the global model; ``training``: the signed training graph, ``training.zip``) into the
coordinator's published directory, ``STATE_DIR/published/`` (:func:`published_dir`; it is
under the coordinator's state directory, so it survives runs and restarts and a device
keeps getting the last model between runs). An inference bundle directory is zipped
deterministically (sorted entries, fixed timestamps), so the same bundle always has the
same bytes and the same ETag. The file is replaced atomically (temporary file, fsync,
rename): the service never reads half of one. A bundle older than the one published for
the same ``model_id`` is refused (:class:`PublishRefused`).

The ServerApp learns where to publish from the ``FEDGE_PUBLISH_DIR`` environment variable
that ``fedge coordinator start`` sets for the SuperLink (and so for the ServerApp process
it starts); ``fedge simulate`` publishes nothing.

:class:`BundleService` serves ``GET /v1/bundles/{inference,training}`` next to the
SuperLink (default port: the device port + 1): the zip with ``ETag: "<sha256 hex>"``,
``304`` and no body when ``If-None-Match`` names it, ``404`` with a JSON message when
nothing is published, ``401`` with a JSON message saying what to do when the device
authentication fails (logged). The protocol is in :mod:`fedge.edge.delivery`.

Threat model: the bundle bytes need no transport integrity: each bundle is signed
(Ed25519) and a device verifies the signature against keys it trusts, and refuses older
versions, whoever served it. Device authentication keeps parties without a registered
device key (the same ``keys/devices/*.pub`` the coordinator registers with the SuperLink,
followed as the SuperLink follows them: re-read, less the keys whose node the SuperLink
holds revoked, at each device sync of the coordinator, every 10 s) from fetching the
model: each request is signed with the device's ECDSA P-384 key over method, path,
timestamp and nonce; timestamps more than 300 s off, or not a plain number, are refused,
and a nonce seen within the window is refused (replay). The signature is checked before a
nonce is remembered, so strangers cannot fill the replay cache, and each device key has a
replay quota of its own (:data:`MAX_NONCES_PER_DEVICE` requests in the window; more are
answered 429): one device's flood refuses only that device. TLS with the coordinator's
certificate hides the model in transit. The listener's connection limits (header size and
deadline, idle timeout, connections per client address) are :mod:`fedge.listeners`'. ``insecure`` (only when the
coordinator itself was started ``--insecure``) serves plain HTTP to anyone and says so on
start; devices still verify every bundle's signature.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import heapq
import io
import json
import logging
import os
import re
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedge.edge.bundle import MANIFEST, read_bundle, sha256, zip_lineage
from fedge.edge.delivery import (
    API_PREFIX,
    HEADER_DEVICE,
    HEADER_NONCE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    KIND_WORDS,
    KINDS,
    canonical_request,
    is_kind,
    key_fingerprint,
)
from fedge.errors import BundleVerificationError, ConfigError, FedgeError
from fedge.files import exclusive_lock, write_bytes_atomic
from fedge.listeners import ListenerLimits, uvicorn_options
from fedge.server.pki import CoordinatorKeys

log = logging.getLogger("fedge.server.publish")

PUBLISH_ENV = "FEDGE_PUBLISH_DIR"
WINDOW_S = 300.0
MAX_NONCES_PER_DEVICE = 1_000  # requests one device key may make in a window (3 a second, sustained)
_NONCE = re.compile(r"[A-Za-z0-9_-]{16,64}")
_STAMP = re.compile(r"[0-9]{1,12}")  # ASCII digits only: str.isdigit() also takes '\xb2' and int() 5,000 digits
LIMITS = ListenerLimits(max_header_bytes=16 * 1024, header_timeout_s=10.0, idle_timeout_s=5, per_address=16,
                        concurrency=512)
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)
INSECURE_WARNING = (
    "WARNING: INSECURE MODE. The bundle service speaks plain HTTP and asks no device key: anyone on the "
    "network can download the model. Devices still verify every bundle's signature. Test networks only."
)


class PublishRefused(FedgeError):
    """A bundle that may not be published (older than the one published, or not a bundle)."""


def published_dir(state_dir: str | Path) -> Path:
    """Where a coordinator's published bundles live: ``STATE_DIR/published`` (kept across runs)."""
    return Path(state_dir) / "published"


def published_file(published: Path, kind: str) -> Path:
    """``published/<kind>.zip``."""
    if not is_kind(kind):
        raise ConfigError(f"bundle kind '{kind}' is not {KIND_WORDS}")
    return published / f"{kind}.zip"


# --------------------------------------------------------------------------- publishing


def publish_bundle(kind: str, source: Path, published: Path) -> str:
    """Publish ``source`` as the ``kind`` bundle; return its ETag (SHA-256 hex of the published bytes).

    Parameters
    ----------
    kind : str
        ``inference``: ``source`` is a bundle directory, a bundle ``.zip``, or a folder of bundle
        directories (``RUN/bundles``: the highest version is taken). ``training``: ``source`` is
        the signed ``training.zip`` (published as it is).
    source : Path
        The bundle.
    published : Path
        The published directory (:func:`published_dir`); created.

    Raises
    ------
    PublishRefused
        For a source that is not a bundle, or one older than the published bundle of the same
        ``model_id`` (a newer run's lineage replaces an older one's).
    """
    target = published_file(published, kind)
    data = _bundle_bytes(kind, Path(source))
    model_id, version = zip_lineage(data)
    published.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(published / ".publish.lock"):
        current = target.read_bytes() if target.exists() else None
        if current is not None:
            if current == data:
                return sha256(data)
            held_id, held_version = zip_lineage(current)
            if model_id is not None and model_id == held_id and version is not None \
                    and held_version is not None and version < held_version:
                raise PublishRefused(f"{kind} bundle '{model_id}' version {version} is older than the published "
                                     f"version {held_version}; devices would refuse it as a rollback. Publish "
                                     f"version {held_version} or newer (or delete {target} to start over)")
        write_bytes_atomic(target, data)
        os.chmod(target, 0o644)
    etag = sha256(data)
    log.info("published %s bundle %s version %s (%d bytes, ETag %s) at %s", kind, model_id, version, len(data),
             etag[:16], target)
    return etag


def _bundle_bytes(kind: str, source: Path) -> bytes:
    if kind == "training":
        if not source.is_file():
            raise PublishRefused(f"training bundle '{source}' is not a file; publish the signed training.zip")
        return source.read_bytes()
    if source.is_dir() and not (source / MANIFEST).exists():
        source = _newest(source)
    try:
        files = read_bundle(source)  # a damaged or ambiguous zip is refused here, not by every device
    except BundleVerificationError as exc:
        raise PublishRefused(f"cannot publish '{source}': {exc}") from None
    return source.read_bytes() if source.is_file() else deterministic_zip(files)


def _newest(folder: Path) -> Path:
    """The bundle directory under ``folder`` with the highest version (then the latest name)."""
    candidates = []
    for child in sorted(folder.iterdir()):
        if (child / MANIFEST).is_file():
            try:
                version = json.loads((child / MANIFEST).read_bytes()).get("version", -1)
            except (ValueError, AttributeError):
                continue
            candidates.append((version if isinstance(version, int) else -1, child.name, child))
    if not candidates:
        raise PublishRefused(f"'{folder}' holds no bundle ({MANIFEST} missing); export one first")
    return max(candidates)[2]


def deterministic_zip(files: Mapping[str, bytes]) -> bytes:
    """``files`` as a zip whose bytes depend only on the files (sorted, fixed times, deflate)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, files[name])
    return buffer.getvalue()




def publish_from_environment(kind: str, source: Path) -> str | None:
    """Publish ``source`` when running under ``fedge coordinator start`` (``FEDGE_PUBLISH_DIR`` set).

    A refusal or an I/O error is logged, never raised: publishing must not stop a run.
    """
    where = os.environ.get(PUBLISH_ENV)
    if not where:
        return None
    try:
        return publish_bundle(kind, source, Path(where))
    except (FedgeError, OSError) as exc:
        log.warning("the %s bundle %s was not published to devices: %s", kind, source, exc)
        return None


# --------------------------------------------------------------------------- device authentication


def registered_device_keys(keys: CoordinatorKeys, *,
                           revoked: Collection[str] = ()) -> dict[str, ec.EllipticCurvePublicKey]:
    """Every registered device key (``keys/devices/*.pub``) by its name and by its fingerprint.

    ``revoked``: names of keys whose node the SuperLink holds unregistered (the coordinator's
    device sync reports them); they are left out although their file is still there.
    """
    found: dict[str, ec.EllipticCurvePublicKey] = {}
    for path in keys.device_public_keys():
        if path.stem in revoked:
            continue
        try:
            key = serialization.load_ssh_public_key(path.read_bytes())
        except (ValueError, OSError) as exc:
            log.warning("device key %s is unreadable (%s); that device cannot pull bundles", path, exc)
            continue
        if isinstance(key, ec.EllipticCurvePublicKey):
            found[path.stem] = key
            found[key_fingerprint(key)] = key
    return found


class Refused(FedgeError):
    """A request that fails authentication (the message says what to do)."""

    status = 401


class OverQuota(Refused):
    """A device key that made more requests in the window than its replay quota allows."""

    status = 429


@dataclass
class DeviceAuthenticator:
    """Checks a request's device signature, timestamp window and nonce.

    Parameters
    ----------
    keys : mapping of device name or fingerprint to its P-384 public key
    window_s : float
        Largest accepted difference between the request's timestamp and this clock.
    clock : callable
        Seconds since the epoch (tests move it).
    quota : int, optional
        Requests one device key may make within a window (its replay cache holds that many
        nonces); more are refused with :class:`OverQuota` for that key only. Default
        :data:`MAX_NONCES_PER_DEVICE`.

    Threat model: the keys' holders are authenticated, not trusted: a registered device
    flooding signed requests fills only its own replay cache. Memory is bounded by
    registered keys x quota. Strangers reach no cache (the signature is checked first).
    """

    keys: Mapping[str, ec.EllipticCurvePublicKey]
    window_s: float = WINDOW_S
    clock: Callable[[], float] = time.time
    quota: int | None = None  # requests per device key in a window; None: MAX_NONCES_PER_DEVICE

    def __post_init__(self) -> None:
        self._seen: dict[str, tuple[list[tuple[float, str]], set[str]]] = {}  # fingerprint -> (heap, nonces)
        self._lock = threading.Lock()

    def use_keys(self, keys: Mapping[str, ec.EllipticCurvePublicKey]) -> None:
        """Admit exactly ``keys`` from now on (the allow-list changed); remembered nonces are kept."""
        self.keys = dict(keys)

    def check(self, method: str, path: str, headers: Mapping[str, str]) -> str:
        """The authenticated device's id, or :class:`Refused`."""
        device, stamp = headers.get(HEADER_DEVICE), headers.get(HEADER_TIMESTAMP)
        nonce, signature = headers.get(HEADER_NONCE), headers.get(HEADER_SIGNATURE)
        if not (device and stamp and nonce and signature):
            raise Refused(f"the request is not signed by a device (headers {HEADER_DEVICE}, {HEADER_TIMESTAMP}, "
                          f"{HEADER_NONCE}, {HEADER_SIGNATURE} required); use `fedge pull --key DEVICE.key` or "
                          "fedge.edge.delivery.pull")
        key = self.keys.get(device)
        if key is None:
            raise Refused(f"device key {device[:80]} is not registered with this coordinator (or was revoked); "
                          "the operator adds it with `fedge keys add-device NAME` (taken within 10 s, no restart)")
        if not _STAMP.fullmatch(stamp) or not _NONCE.fullmatch(nonce):
            raise Refused("malformed timestamp or nonce (the timestamp is whole seconds since the epoch, ASCII "
                          "digits); use fedge's pull client")
        now = self.clock()
        if abs(now - int(stamp)) > self.window_s:
            raise Refused(f"the request's timestamp is {int(stamp) - now:+.0f} s off the coordinator's clock "
                          f"(at most +-{self.window_s:.0f} s); set this device's clock (NTP)")
        try:
            key.verify(base64.b64decode(signature, validate=True),
                       canonical_request(method, path, stamp, nonce, device), ec.ECDSA(hashes.SHA384()))
        except (InvalidSignature, binascii.Error, ValueError):
            raise Refused("the request's signature does not verify with the registered key of "
                          f"{device[:80]}; sign with that device's own key (NAME.key of `fedge keys add-device`)") \
                from None
        self._remember(key_fingerprint(key), nonce, float(stamp), now)
        return device

    def _remember(self, identity: str, nonce: str, stamp: float, now: float) -> None:
        """Record ``nonce`` in the key's own replay cache; refuse a replay or a key over its quota."""
        with self._lock:
            heap, nonces = self._seen.setdefault(identity, ([], set()))
            while heap and heap[0][0] < now - self.window_s:  # outside the window: refused by timestamp anyway
                nonces.discard(heapq.heappop(heap)[1])
            if nonce in nonces:
                raise Refused("this request was already used (replayed nonce); send a new request")
            quota = MAX_NONCES_PER_DEVICE if self.quota is None else self.quota
            if len(nonces) >= quota:
                raise OverQuota(f"this device made {quota} requests within {self.window_s:.0f} s, the most one "
                                "device may; wait a few minutes (pull less often)")
            heapq.heappush(heap, (stamp, nonce))
            nonces.add(nonce)


# --------------------------------------------------------------------------- the service


class _Cache:
    """The bytes and ETag of each published file, re-read when the file is replaced."""

    def __init__(self, published: Path) -> None:
        self.published = published
        self._entries: dict[str, tuple[tuple[int, int, int, int], bytes, str]] = {}
        self._lock = threading.Lock()

    def get(self, kind: str) -> tuple[bytes, str] | None:
        path = published_file(self.published, kind)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as handle:  # bytes and ETag from one open file: a rename cannot mix them
            info = os.fstat(handle.fileno())
            identity = (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size)
            with self._lock:
                entry = self._entries.get(kind)
                if entry is not None and entry[0] == identity:
                    return entry[1], entry[2]
            data = handle.read()
        etag = sha256(data)
        with self._lock:
            self._entries[kind] = (identity, data, etag)
        return data, etag


def create_app(published: Path, *, authenticator: DeviceAuthenticator | None) -> Any:
    """The bundle service's Starlette app; ``authenticator=None`` serves anyone (insecure mode only)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    cache = _Cache(published)

    async def bundle(request: Request) -> Response:
        client = request.client.host if request.client else "?"
        device = "anyone (insecure)"
        if authenticator is not None:
            try:
                device = authenticator.check(request.method, request.url.path, request.headers)
            except Refused as exc:
                log.warning("bundle request %s %s from %s refused: %s", request.method, request.url.path, client,
                            exc)
                return JSONResponse({"error": str(exc)}, status_code=exc.status,
                                    headers={"Retry-After": "60"} if exc.status == 429 else None)
        kind = request.path_params["kind"]
        if not is_kind(kind):
            return JSONResponse({"error": f"no bundle kind '{kind}'; ask for {KIND_WORDS}"}, status_code=404)
        found = await run_in_threadpool(cache.get, kind)
        if found is None:
            return JSONResponse({"error": f"no {kind} bundle is published yet; the coordinator publishes one "
                                          "when its run exports a bundle (every export-every rounds and at "
                                          "the end)"}, status_code=404)
        data, etag = found
        headers = {"ETag": f'"{etag}"', "Cache-Control": "no-cache"}
        if _matches(request.headers.get("if-none-match", ""), etag):
            log.debug("%s bundle unchanged for %s", kind, device)
            return Response(status_code=304, headers=headers)
        log.info("%s bundle (%d bytes) sent to %s at %s", kind, len(data), device, client)
        return Response(data, media_type="application/zip", headers=headers)

    return Starlette(routes=[Route(API_PREFIX + "{kind}", bundle, methods=["GET"])])


def _matches(header: str, etag: str) -> bool:
    """Whether an ``If-None-Match`` value names ``etag`` (or is ``*``)."""
    for tag in header.split(","):
        tag = tag.strip()
        if tag == "*" or tag.removeprefix("W/").strip('"') == etag:
            return True
    return False


class BundleService:
    """The bundle service in a background thread of the coordinator process.

    Parameters
    ----------
    published : Path
        The published directory.
    keys : CoordinatorKeys | None
        TLS certificate and registered device keys; ``None`` is insecure mode (plain HTTP,
        no device authentication, announced on stderr).
    host, port : str, int
        Where to listen (port 0: a free one, see :attr:`port` after :meth:`start`).
    """

    def __init__(self, published: Path, keys: CoordinatorKeys | None, *, host: str = "127.0.0.1",
                 port: int = 0, window_s: float = WINDOW_S, clock: Callable[[], float] = time.time,
                 revoked: Collection[str] = (), limits: ListenerLimits = LIMITS) -> None:
        self.published, self.keys, self.host, self.port, self.limits = published, keys, host, port, limits
        self.authenticator = None if keys is None else \
            DeviceAuthenticator(registered_device_keys(keys, revoked=revoked), window_s=window_s, clock=clock)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def follow(self, *, revoked: Collection[str]) -> None:
        """Admit the allow-list as it is now: ``KEYS/devices/*.pub`` re-read, less the ``revoked`` key names.

        The coordinator calls this after each device sync (:meth:`Coordinator.sync_devices`, every
        10 s), so the bundle service admits exactly the devices the SuperLink admits: a key added is
        served, a key removed (or whose node was revoked) is refused, without a restart.
        """
        if self.authenticator is not None and self.keys is not None:
            self.authenticator.use_keys(registered_device_keys(self.keys, revoked=revoked))

    @property
    def url(self) -> str:
        """``https://HOST:PORT`` (``http://`` in insecure mode)."""
        scheme = "http" if self.keys is None else "https"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    def start(self, timeout: float = 15.0) -> None:
        """Bind, start serving, and wait until it accepts connections.

        Raises
        ------
        ConfigError
            If the port cannot be bound (name another with ``--bundle-port``).
        """
        import uvicorn

        from fedge.listeners import bind

        self.published.mkdir(parents=True, exist_ok=True)
        if self.keys is None:
            print(INSECURE_WARNING, file=sys.stderr, flush=True)
        try:
            sock = bind(self.host, self.port)
        except OSError as exc:
            raise ConfigError(f"the bundle service cannot listen on {self.host}:{self.port} "
                              f"({exc.strerror or exc}); pass another --bundle-port") from None
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(create_app(self.published, authenticator=self.authenticator), log_level="warning",
                                access_log=False, **uvicorn_options(self.limits),
                                ssl_certfile=None if self.keys is None else str(self.keys.cert),
                                ssl_keyfile=None if self.keys is None else str(self.keys.key))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="fedge-bundles", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise FedgeError(f"the bundle service did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        devices = 0 if self.authenticator is None else len({id(k) for k in self.authenticator.keys.values()})
        log.info("bundle service on %s for %d registered devices, serving %s", self.url, devices, self.published)

    def stop(self) -> None:
        """Stop serving (waits a few seconds for requests in flight)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = self._thread = None


def describe(published: Path) -> list[str]:
    """One line per published bundle: kind, lineage, version, size, when (for status output)."""
    lines = []
    widths = sorted(path.stem for path in published.glob("*-w*.zip") if is_kind(path.stem))
    for kind in (*KINDS, *widths):
        path = published_file(published, kind)
        if not path.exists():
            continue
        data = path.read_bytes()
        model_id, version = zip_lineage(data)
        when = dt.datetime.fromtimestamp(path.stat().st_mtime, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        lines.append(f"{kind}: {model_id or '?'} version {version if version is not None else '?'}, "
                     f"{len(data)} bytes, published {when}")
    return lines

