"""A gateway's devices and rounds, without HTTP: who may check in, their sessions, and the round
in progress with its running aggregate.

The HTTP layer (:mod:`fedge.clients.gateway.service`) turns requests into calls here and the
answers into responses; everything a device sends is checked here before it is used.

Threat model: devices are untrusted. A device proves its key once, at check-in (a signature
over the gateway's name, a timestamp and a fresh nonce: a recorded check-in cannot be
replayed, here or at another gateway), and every later request with an HMAC under the
session key the check-in returned, over the method, path, a strictly increasing counter and
the body's SHA-256 (a recorded request cannot be replayed or altered). Only keys in the
operator's allow-list check in; a name in its ``revoked`` file is refused at once, its live
session included. A device's update is decoded and validated like every Flower reply
(names, shapes, dtypes, finiteness, the example count bounded by ``max-num-examples``)
before it reaches the sum; a rejected update is logged and leaves the round going.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from numpy.typing import NDArray

from fedge import knobs
from fedge.aggregate import (
    DEVICE_RULES,
    ROBUST_DEVICE_RULES,
    WeightedMeanAccumulator,
    clip_update,
    staleness_weight,
    trim_count,
)
from fedge.clients.gateway.protocol import (
    CHECK_IN_DEVICE,
    CLOCK_SKEW_S,
    ENCODINGS,
    INT8_DELTA,
    NONCE_BYTES,
    SECURE_AGGREGATION,
    SESSION_KEY_BYTES,
    TASK_CAPABILITIES,
    TASK_ID,
    EncodedTask,
    Frame,
    b64,
    check_in_message,
    encode_task,
    from_int8_delta,
    macs_equal,
    request_mac,
    unb64,
)
from fedge.codec import FP32, task_capability
from fedge.errors import ConfigError, DeviceProtocolError, UpdateRejected
from fedge.strategies.validation import check_arrays
from fedge.wire import BATCH_SIZE, LOCAL_EPOCHS
from fedge.work import max_local_steps, max_samples

log = logging.getLogger("fedge.gateway")

DEVICE_NAME_MAX = 64
PublicKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey


def refused(status: int, reason: str) -> DeviceProtocolError:
    """A :class:`DeviceProtocolError` answered with HTTP ``status``."""
    error = DeviceProtocolError(reason)
    error.status = status
    return error


class AllowList:
    """The operator's allow-list: ``DIR/NAME.pub`` (PEM, ECDSA P-256 or Ed25519) and ``DIR/revoked``
    (one name a line).

    Each file is watched on its own (inode, size, modification and change times), checked at
    most once a second: a key written over in place, a key removed and a name revoked all take
    effect within a second. Sessions hold their key's :meth:`fingerprint`, so a session whose
    key was replaced or removed ends (:meth:`Sessions.session_of`).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._keys: dict[str, PublicKey] = {}
        self._fingerprints: dict[str, bytes] = {}
        self._revoked: set[str] = set()
        self._stamps: dict[str, tuple[int, ...]] = {}
        self._checked = 0.0
        self._lock = threading.Lock()
        self.refresh(force=True)

    def _current_stamps(self) -> dict[str, tuple[int, ...]]:
        stamps: dict[str, tuple[int, ...]] = {}
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name == "revoked" or entry.name.endswith(".pub"):
                    try:
                        info = entry.stat()
                    except FileNotFoundError:  # removed while we looked
                        continue
                    stamps[entry.name] = (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        return stamps

    def refresh(self, *, force: bool = False) -> None:
        """Re-read the files that changed (looked at most once a second unless ``force``)."""
        now = time.monotonic()
        with self._lock:
            if not force and now - self._checked < 1.0:
                return
            self._checked = now
            stamps = self._current_stamps()
            changed = {name for name in stamps.keys() | self._stamps.keys()
                       if stamps.get(name) != self._stamps.get(name)}
            if not changed:
                return
            for name in sorted(changed):
                if name == "revoked":
                    self._revoked = self._read_revoked()
                else:
                    self._reload_key(name, present=name in stamps)
            self._stamps = stamps

    def _read_revoked(self) -> set[str]:
        try:
            lines = (self.directory / "revoked").read_text().splitlines()
        except FileNotFoundError:
            return set()
        return {line.strip() for line in lines} - {""}

    def _reload_key(self, filename: str, *, present: bool) -> None:
        name = filename.removesuffix(".pub")
        self._keys.pop(name, None)
        self._fingerprints.pop(name, None)
        if not present:
            return
        try:
            key = serialization.load_pem_public_key((self.directory / filename).read_bytes())
        except (ValueError, OSError):
            log.warning("allow-list: %s is not a PEM public key; skipped", filename)
            return
        if isinstance(key, ed25519.Ed25519PublicKey) or \
                (isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1)):
            self._keys[name] = key
            self._fingerprints[name] = key_fingerprint(key)
        else:
            log.warning("allow-list: %s is neither ECDSA P-256 nor Ed25519; skipped", filename)

    def key_of(self, device: str) -> PublicKey:
        """The public key of an admitted device; 403 for an unknown or revoked one."""
        self.refresh()
        if device in self._revoked:
            raise refused(403, f"device '{device}' is revoked by the operator; it cannot check in")
        key = self._keys.get(device)
        if key is None:
            raise refused(403, f"device '{device}' is not in this gateway's allow-list; the operator admits it "
                               "with `fedge gateway add-device NAME`")
        return key

    def fingerprint(self, device: str) -> bytes | None:
        """SHA-256 of ``device``'s admitted public key (DER), or ``None`` when it has none now."""
        self.refresh()
        return self._fingerprints.get(device)

    def revoked(self, device: str) -> bool:
        """Whether the operator revoked ``device`` (checked on every request of its session)."""
        self.refresh()
        return device in self._revoked

    def __len__(self) -> int:
        return len(self._keys)


def key_fingerprint(key: PublicKey) -> bytes:
    """SHA-256 of a public key's DER SubjectPublicKeyInfo."""
    return hashlib.sha256(key.public_bytes(serialization.Encoding.DER,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)).digest()


def verify_signature(key: PublicKey, signature: bytes, message: bytes) -> None:
    """Verify a device signature: Ed25519, or ECDSA P-256/SHA-256 as raw r||s (WebCrypto) or DER."""
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, message)
            return
        if len(signature) == 64:  # WebCrypto's raw r || s
            signature = encode_dss_signature(int.from_bytes(signature[:32], "big"),
                                             int.from_bytes(signature[32:], "big"))
        key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        raise refused(401, "the check-in signature does not verify with this device's registered key") from None


@dataclass
class Session:
    """One checked-in device."""

    device: str
    key: bytes
    expires: float
    counter: int = 0
    last_seen: float = 0.0
    secure: bool = True  # the device implements secure aggregation's steps (its check-in's "capabilities")
    tasks: frozenset[str] = frozenset(TASK_CAPABILITIES)  # the lossy task encodings it reads ("task:fp16", ...)
    fingerprint: bytes | None = None  # the allow-list key it checked in with (the session ends if it changes)


class Sessions:
    """Check-ins and the sessions they open (one per device; a new check-in replaces the old)."""

    def __init__(self, allow: AllowList, gateway: str, ttl_s: float = 3600.0) -> None:
        self.allow, self.gateway, self.ttl_s = allow, gateway, ttl_s
        self._by_token: dict[str, Session] = {}
        self._token_of: dict[str, str] = {}
        self._nonces: dict[str, float] = {}
        self._lock = threading.Lock()
        self.secure_run = False  # set once the coordinator's rounds ask for secure aggregation

    def check_in(self, body: Mapping[str, Any], now: float | None = None) -> tuple[str, bytes, Session]:
        """Verify a check-in and open a session; (token, session key, session)."""
        now = time.time() if now is None else now
        device = body.get(CHECK_IN_DEVICE)
        if not isinstance(device, str) or not 0 < len(device) <= DEVICE_NAME_MAX:
            raise refused(400, f"'device' must be the device's name (1-{DEVICE_NAME_MAX} characters)")
        issued = body.get("time")
        if isinstance(issued, bool) or not isinstance(issued, int) or not 0 <= issued < 2**53:
            raise refused(400, "'time' must be the device's clock in whole Unix seconds (an integer)")
        if abs(now - issued) > CLOCK_SKEW_S:
            raise refused(401, f"this device's clock is {abs(now - issued):.0f} s "
                               f"{'behind' if issued < now else 'ahead of'} the gateway's (the limit is "
                               f"{CLOCK_SKEW_S} s); set the device's clock (NTP, or the platform's network time), "
                               "then check in again")
        nonce = body.get("nonce")
        unb64(nonce, "nonce", size=NONCE_BYTES)
        signature = unb64(body.get("signature"), "signature", max_size=128)
        secure, tasks = self._capabilities(body)
        key = self.allow.key_of(device)
        verify_signature(key, signature, check_in_message(device=device, gateway=self.gateway,
                                                          issued_at=issued, nonce=str(nonce)))
        with self._lock:
            self._forget_nonces(now)
            if nonce in self._nonces:
                raise refused(401, "this check-in was seen before (a replay); sign a fresh nonce")
            self._nonces[str(nonce)] = now + 2 * CLOCK_SKEW_S
            old = self._token_of.pop(device, None)
            if old is not None:
                self._by_token.pop(old, None)
            token, session_key = secrets.token_urlsafe(24), secrets.token_bytes(SESSION_KEY_BYTES)
            session = Session(device=device, key=session_key, expires=now + self.ttl_s, last_seen=now, secure=secure,
                              tasks=tasks, fingerprint=key_fingerprint(key))
            self._by_token[token], self._token_of[device] = session, token
        return token, session_key, session

    def _capabilities(self, body: Mapping[str, Any]) -> tuple[bool, frozenset[str]]:
        """Whether the device implements secure aggregation, and the lossy task encodings it reads
        (``capabilities`` lists what it does; absent: all).

        A gateway whose run asks for secure aggregation refuses a device that cannot, at
        check-in, with the reason (403): it could only ever drop out of that run's rounds.
        """
        capabilities = body.get("capabilities")
        if capabilities is None:
            return True, frozenset(TASK_CAPABILITIES)
        if not isinstance(capabilities, list) or not all(isinstance(c, str) for c in capabilities):
            raise refused(400, "'capabilities' must be a list of names "
                               f"(e.g. [\"{INT8_DELTA}\", \"{SECURE_AGGREGATION}\"])")
        if SECURE_AGGREGATION not in capabilities and self.secure_run:
            raise refused(403, "this run uses secure aggregation, which this device does not implement "
                               f"('{SECURE_AGGREGATION}' is not in its capabilities): it cannot take part in this run; "
                               "use a device that does, or a run without secure-aggregation")
        return SECURE_AGGREGATION in capabilities, frozenset(capabilities) & frozenset(TASK_CAPABILITIES)

    def _forget_nonces(self, now: float) -> None:
        """Drop expired nonces, oldest first (they were added in time order: O(1) a check-in on average)."""
        while self._nonces:
            oldest = next(iter(self._nonces))
            if self._nonces[oldest] > now:
                break
            del self._nonces[oldest]

    def session_of(self, *, authorization: str | None, counter: str | None, mac: str | None,
                   now: float | None = None) -> tuple[Session, int]:
        """The live session a request's headers name, and its counter, checked before any body is read.

        401/403 naming what is wrong: no or an unknown session, an expired one, a revoked device,
        a device whose key the operator replaced or removed, a counter already used. Nothing is
        spent: the counter moves only once :meth:`authenticate` verified the MAC.
        """
        now = time.time() if now is None else now
        if not authorization or not authorization.startswith("Fedge-Session "):
            raise refused(401, "no session: check in first (POST /v1/check-in) and send "
                               "'Authorization: Fedge-Session <token>'")
        with self._lock:
            session = self._by_token.get(authorization.removeprefix("Fedge-Session ").strip())
        if session is None or session.expires < now:
            raise refused(401, "the session is unknown or expired: check in again")
        if self.allow.revoked(session.device):
            raise refused(403, f"device '{session.device}' is revoked by the operator")
        if self.allow.fingerprint(session.device) != session.fingerprint:
            self.end(session)
            raise refused(401, f"device '{session.device}''s key was replaced or removed from the allow-list since it "
                               "checked in; this session is over: check in again (with the key the operator admitted)")
        if counter is None or not (counter.isascii() and counter.isdigit()) or len(counter) > 18 or mac is None:
            raise refused(401, "an authenticated request needs X-Fedge-Counter (a whole number) and X-Fedge-Mac")
        number = int(counter)
        if number <= session.counter:
            raise refused(401, f"counter {number} was used before (a replay); send more than {session.counter}")
        return session, number

    def end(self, session: Session) -> None:
        """Forget ``session`` (its device must check in again)."""
        with self._lock:
            token = self._token_of.get(session.device)
            if token is not None and self._by_token.get(token) is session:
                del self._by_token[token], self._token_of[session.device]

    def authenticate(self, *, authorization: str | None, counter: str | None, mac: str | None, method: str,
                     path: str, body: bytes, now: float | None = None) -> Session:
        """The session of an authenticated request, or 401/403 naming what is wrong."""
        now = time.time() if now is None else now
        session, number = self.session_of(authorization=authorization, counter=counter, mac=mac, now=now)
        assert mac is not None  # session_of refused a request without one
        expected = request_mac(session.key, method=method, path=path, counter=number, body=body)
        if not macs_equal(expected, mac):
            raise refused(401, "the request MAC does not verify (wrong session key, or the body was altered)")
        with self._lock:
            if number <= session.counter:
                raise refused(401, f"counter {number} was used before (a replay); send more than {session.counter}")
            session.counter, session.last_seen = number, now
        return session

    def live(self, within_s: float, now: float | None = None) -> int:
        """Sessions that made a request in the last ``within_s`` seconds."""
        now = time.time() if now is None else now
        with self._lock:
            return sum(1 for s in self._by_token.values() if now - s.last_seen <= within_s and s.expires >= now)

    def live_devices(self, within_s: float, now: float | None = None, *, secure: bool = False) -> list[str]:
        """The names of devices that made a request in the last ``within_s`` seconds (with ``secure``: those
        that implement secure aggregation), sorted."""
        now = time.time() if now is None else now
        with self._lock:
            return sorted(s.device for s in self._by_token.values() if now - s.last_seen <= within_s
                          and s.expires >= now and (s.secure or not secure))

    def __len__(self) -> int:
        return len(self._by_token)


@dataclass(frozen=True)
class RoundResult:
    """What a gateway round sends up: the weighted mean of its devices' results and their totals."""

    kind: str
    arrays: dict[str, NDArray[np.generic]]
    num_examples: int
    metrics: dict[str, float]
    samples_processed: int
    steps: int
    devices: int
    rejected: int
    secure: bool = False  # the arrays are the unmasked sum of a secure-aggregation round over the pool
    clipped: int = 0  # device updates clipped to the run's max-update-norm
    capped: int = 0  # device weights capped at the run's max-device-examples
    pool_clipping: Mapping[str, int] = field(default_factory=dict)  # a secure round: what the devices' encodings
    # clipped, totals over the pool (fedge.strategies.validation.POOL_CLIPPING)
    device_norm_median: float | None = None  # a plain train round: its devices' median update norm before clipping
    late: int = 0  # an asynchronous round: results folded in that answered one of this gateway's earlier rounds


@dataclass(frozen=True)
class DeviceBounds:
    """What bounds each device's result at its gateway: the run's, sent with every round.

    ``max_device_examples`` caps a device's weight (a larger claim is capped and counted, not
    refused: a device may really hold more); ``max_update_norm`` clips its update's L2 norm
    (0: off); ``epochs`` and ``batch_size`` are the instruction's, which bound the steps and
    samples a device may claim (as the coordinator bounds a reply's, :func:`fedge.work.max_local_steps`).
    """

    max_device_examples: int = 10_000
    max_update_norm: float = 10.0
    epochs: int | None = None
    batch_size: int | None = None

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> DeviceBounds:
        """The bounds in a round's config (what the coordinator's gateway bridge sends), defaults for the rest."""
        def number(key: str, default: float) -> float:
            value = config.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise refused(400, f"control: '{key}' must be a finite number >= 0, got {value!r:.20}")
            return float(value)

        epochs, batch = config.get(LOCAL_EPOCHS), config.get(BATCH_SIZE)  # the instruction's (a train round's)
        return cls(max_device_examples=max(1, int(number(knobs.MAX_DEVICE_EXAMPLES, cls.max_device_examples))),
                   max_update_norm=number(knobs.MAX_UPDATE_NORM, cls.max_update_norm),
                   epochs=int(number(LOCAL_EPOCHS, 1)) if epochs is not None else None,
                   batch_size=max(1, int(number(BATCH_SIZE, 1))) if batch is not None else None)

    def steps_for(self, examples: int) -> int:
        """The most local steps the instruction allows a device holding ``examples``."""
        if self.epochs is None or self.batch_size is None:
            return MAX_CLAIM
        return max_local_steps(epochs=self.epochs, batch_size=self.batch_size, num_examples=examples)

    def samples_for(self, examples: int) -> int:
        """The most samples the instruction has a device holding ``examples`` process."""
        return MAX_CLAIM if self.epochs is None else max_samples(epochs=self.epochs, num_examples=examples)


MAX_CLAIM = 10**12


def device_seed(run_seed: int, server_round: int, device: str) -> int:
    """A device's training seed for a round (stable across gateways and restarts)."""
    number = int.from_bytes(hashlib.sha256(device.encode()).digest()[:6], "big")
    return (run_seed * 1_000_003 + server_round * 10_007 + number) % 2**53  # exact as a JSON number in JavaScript


@dataclass(frozen=True)
class LateResult:
    """A device's checked result for a closed round of an asynchronous run, until a later round folds it in."""

    device: str
    change: dict[str, NDArray[np.float32]]  # its change from the model it was sent, bounded as its round bounds it
    server_round: int  # the round (model version) it trained from
    examples: int
    weight: int  # its examples, capped at the run's max-device-examples
    samples: int
    steps: int
    metrics: dict[str, float]
    clipped: bool
    norm: float  # its update's norm before clipping


class GatewayRound:
    """One round of the coordinator's, run over this gateway's devices.

    Train results fold into a streaming weighted mean (:class:`fedge.aggregate.WeightedMeanAccumulator`,
    weights = example counts), so the gateway holds one model-sized float64 buffer however
    many devices answer; the coordinator then weights the gateway's mean by the examples
    behind it, which is FedAvg over every device (hierarchical FedAvg equals flat FedAvg).

    In an asynchronous run (``late_exponent`` set: the coordinator's FedBuff driver) the round
    is one partial flush: its first ``target`` results, and a device still training one of the
    gateway's earlier rounds is not lost when it answers after that round closed. Its result is
    tagged with the round (model version) it trained from (:meth:`late_result`), taken as its
    change from that model applied to the round open then or next, and weighted
    ``1 / (1 + s)^late_exponent`` for ``s`` versions of staleness (:meth:`fold_late`), as FedBuff
    weighs stale updates (Nguyen et al., AISTATS 2022). fedge differs from the paper in where:
    the gateway weighs its devices' staleness within its partial, the coordinator the partial's
    own (so a late result's weight is the product of the two).
    """

    def __init__(self, *, kind: str, server_round: int, config: Mapping[str, Any], graph: str,
                 weights: Mapping[str, NDArray[np.generic]], target: int, max_num_examples: int,
                 bounds: DeviceBounds | None = None, device_rule: str = "mean", trim_fraction: float = 0.2,
                 downlink: str = "fp32", late_exponent: float | None = None) -> None:
        self.task_id = secrets.token_hex(8)
        self.late_exponent = late_exponent  # an asynchronous run's: late results are folded in (None: refused)
        self.kind, self.server_round, self.graph = kind, server_round, graph
        self.config, self.weights, self.target = dict(config), dict(weights), max(1, target)
        self.spec = {name: (tuple(value.shape), str(value.dtype)) for name, value in weights.items()}
        self.downlink = downlink  # the task encoding devices that read it are sent (the others: fp32)
        self._encoded: dict[str, EncodedTask] = {}  # each encoding made once, sent under each device's header
        self._received: dict[str, str] = {}  # device name -> the task encoding it was handed
        self.max_num_examples = max_num_examples
        self.bounds = bounds or DeviceBounds()
        self._sum = WeightedMeanAccumulator()
        if device_rule not in DEVICE_RULES:
            raise ConfigError(f"gateway device rule {device_rule!r}: use one of {', '.join(DEVICE_RULES)}")
        self.device_rule, self.trim_fraction = device_rule, trim_fraction
        self._kept: list[dict[str, NDArray[np.generic]]] = []  # a robust device rule: every update (O(devices x P))
        self._metric_means: dict[str, float] = {}  # running float64 means, weighted by the devices' (capped) weights
        self._examples = self._samples = self._steps = self._devices = self._rejected = 0
        self._clipped = self._capped = self._late = 0
        self._norms: list[float] = []  # the accepted train results' update norms before clipping
        self._answered: set[str] = set()  # device names whose result is in the sum
        self._taken: set[str] = set()  # device names handed this round's task
        self._lock = threading.Lock()
        self.complete = threading.Event()
        self.closed = False
        self.opened = time.monotonic()

    def accept(self, session: Session, frame: Frame, scales: Mapping[str, float]) -> None:
        """Fold one device's result in; :class:`UpdateRejected` (logged, counted) if it is not valid.

        Checked as the coordinator checks a reply (:class:`fedge.strategies.validation.ReplyValidator`):
        names, shapes, dtypes and finiteness of the arrays, and the counts against the instruction's
        budget: ``num-examples`` in [1, gateway's max-num-examples], ``steps`` and
        ``samples-processed`` within what the instruction allows for that many examples. Then the
        run's device bounds: the weight capped at ``max-device-examples`` and the update clipped to
        ``max-update-norm`` (each counted); metric means must stay finite.
        """
        header = frame.header
        if header.get(TASK_ID) != self.task_id or header.get("kind") != self.kind:
            raise refused(409, "this result answers another task (the round it belonged to is over); "
                               "ask for the current one (GET /v1/task)")
        try:
            examples, weight, samples, steps = self._claims(header)
            metrics = self._metrics(header)
            arrays, clipped, norm = self._arrays(session, frame, scales) if self.kind == "train" else ({}, False, None)
        except (UpdateRejected, DeviceProtocolError) as exc:
            self._reject(session, exc)
        with self._lock:
            if self.closed:
                raise refused(409, "the round closed before this result arrived; it was not counted")
            if session.device in self._answered:  # by name: a device that checked in again (an app or page
                # reloaded after sending) must not be counted twice
                raise refused(409, "this device already answered this task")
            means = self._folded_means(metrics, weight)
            if means is None:
                self._rejected += 1
            else:
                self._fold(session.device, arrays, weight, means, samples, steps, clipped=clipped, norm=norm,
                           capped=weight < examples)
        if means is None:
            self._reject(session, UpdateRejected("its metrics make this round's metric means overflow"))

    def late_result(self, session: Session, frame: Frame, scales: Mapping[str, float]) -> LateResult:
        """A device's result for this round after it closed (an asynchronous run): checked and bounded as
        :meth:`accept` checks one, taken once per device, and kept as its change from this round's model
        for a later round to fold in (:meth:`fold_late`). 409 when this round takes no late result."""
        if self.late_exponent is None or self.kind != "train":
            raise refused(409, "the round this result answers has closed, and this gateway's runs are not "
                               "asynchronous; it was not counted")
        try:
            examples, weight, samples, steps = self._claims(frame.header)
            metrics = self._metrics(frame.header)
            arrays, clipped, norm = self._arrays(session, frame, scales)
        except (UpdateRejected, DeviceProtocolError) as exc:
            self._reject(session, exc)
        with self._lock:
            if session.device in self._answered:
                raise refused(409, "this device already answered this task")
            self._answered.add(session.device)
        change = {name: (np.asarray(value, np.float64) - np.asarray(self.weights[name], np.float64)).astype(np.float32)
                  for name, value in arrays.items()}
        return LateResult(session.device, change, self.server_round, examples, weight, samples, steps, metrics,
                          clipped, norm)

    def fold_late(self, late: LateResult) -> bool:
        """Fold ``late`` in (an asynchronous train round that is open): its change applied to this round's
        model, weighted by its examples times ``1 / (1 + s)^late_exponent`` for ``s`` rounds of staleness.
        False, folding nothing, when this round is closed or takes no late result."""
        if self.late_exponent is None or self.kind != "train":
            return False
        rebased = {name: (np.asarray(self.weights[name], np.float64) + change).astype(self.weights[name].dtype)
                   for name, change in late.change.items()}
        mass = late.weight * staleness_weight(max(0, self.server_round - late.server_round), self.late_exponent)
        with self._lock:
            if self.closed:
                return False
            means = self._folded_means(late.metrics, late.weight)
            if means is None:
                self._rejected += 1
                log.warning("round %d: rejected %s's late result: its metrics make this round's metric means "
                            "overflow", self.server_round, late.device)
                return True
            self._fold(late.device, rebased, late.weight, means, late.samples, late.steps, mass=mass,
                       clipped=late.clipped, norm=late.norm, capped=late.weight < late.examples)
            self._late += 1
        return True

    def _reject(self, session: Session, exc: Exception) -> NoReturn:
        with self._lock:
            self._rejected += 1
        log.warning("round %d: rejected %s's %s result: %s", self.server_round, session.device, self.kind, exc)
        raise refused(422, f"result rejected: {exc}") from None

    def _claims(self, header: Mapping[str, Any]) -> tuple[int, int, int, int]:
        """The device's example count, its (capped) weight, its samples and steps (within the instruction's budget)."""
        examples = self._count(header, "num-examples", low=1, high=self.max_num_examples)
        weight = min(examples, self.bounds.max_device_examples)
        if self.kind != "train":
            return examples, weight, 0, 0
        samples = self._count(header, "samples-processed", low=0, high=self.bounds.samples_for(examples),
                              default=examples)
        steps = self._count(header, "steps", low=0, high=self.bounds.steps_for(examples), default=0)
        return examples, weight, samples, steps

    def _folded_means(self, metrics: Mapping[str, float], weight: int) -> dict[str, float] | None:
        """The running metric means with this result folded in (float64), or None if one is not finite."""
        total = self._examples + weight
        means = dict(self._metric_means)
        for name, value in metrics.items():
            old = means.get(name, 0.0) if self._examples else 0.0
            means[name] = old + (value - old) * (weight / total)
        return means if all(math.isfinite(v) for v in means.values()) else None

    def _fold(self, device: str, arrays: Mapping[str, NDArray[np.generic]], weight: int,
              means: dict[str, float], samples: int, steps: int, *, mass: float | None = None, clipped: bool = False,
              norm: float | None = None, capped: bool = False) -> None:
        """Add a result: its arrays weighted ``mass`` (its examples; a late result's, times its staleness
        weight), its counts and what the bounds did to it (``clipped``, its ``norm`` before, its weight
        ``capped``); a late result (``mass`` given) leaves ``device`` free to answer this round too."""
        if arrays and self.device_rule != "mean":
            self._kept.append(dict(arrays))
        elif arrays:
            self._sum.add(arrays, float(weight) if mass is None else mass)
        self._metric_means = means
        self._examples += weight
        self._samples += samples
        self._steps = max(self._steps, steps)
        self._devices += 1
        self._clipped += clipped
        self._capped += capped
        if norm is not None:
            self._norms.append(norm)
        if mass is None:
            self._answered.add(device)
        if self._devices >= self.target:
            self.complete.set()

    @staticmethod
    def _count(header: Mapping[str, Any], key: str, *, low: int, high: int, default: int | None = None) -> int:
        value = header.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise UpdateRejected(f"'{key}' must be a whole number in [{low}, {high}], got {value!r:.40}")
        return value

    def _metrics(self, header: Mapping[str, Any]) -> dict[str, float]:
        raw = header.get("metrics", {})
        if not isinstance(raw, dict) or len(raw) > 64:
            raise UpdateRejected("'metrics' must be an object of at most 64 names")
        values = {}
        for name, value in raw.items():
            if not isinstance(name, str) or len(name) > 64 or isinstance(value, bool) or \
                    not isinstance(value, int | float) or not math.isfinite(value):
                raise UpdateRejected(f"metric {name!r:.40} must be a finite number")
            values[name] = float(value)
        return values

    def _arrays(self, session: Session, frame: Frame, scales: Mapping[str, float]
                ) -> tuple[dict[str, NDArray[np.generic]], bool, float]:
        """The device's trained weights, checked, with the update clipped to the round's norm bound; whether it
        was clipped and its norm before.

        A device handed a lossy task (fp16, int8) trained from the weights as it read them; its
        update is taken against those and applied to the round's exact weights, so the task's
        rounding never reaches the model."""
        encoding = frame.header.get("encoding")
        if encoding not in ENCODINGS:
            raise UpdateRejected(f"'encoding' must be one of {', '.join(ENCODINGS)}, got {encoding!r:.20}")
        received = self.received_by(session.device)
        arrays = from_int8_delta(frame.tensors, scales, received) if encoding == INT8_DELTA else frame.tensors
        check_arrays(arrays, self.spec)
        if received is not self.weights:  # a lossy task: the device's update, taken against what it trained from
            arrays = {name: (np.asarray(self.weights[name], np.float64) + (np.asarray(value, np.float64) -
                             np.asarray(received[name], np.float64))).astype(self.weights[name].dtype)
                      for name, value in arrays.items()}
        bounded, norm, clipped = clip_update(arrays, self.weights, self.bounds.max_update_norm)
        return bounded, clipped, norm

    def close(self) -> RoundResult | None:
        """End the round: its result, or ``None`` when no device answered."""
        with self._lock:
            self.closed = True
            if self._devices == 0:
                return None
            arrays = self._robust() if self._kept else self._sum.result() if self.kind == "train" else {}
            return RoundResult(kind=self.kind, arrays=arrays, num_examples=self._examples,
                               metrics=dict(self._metric_means), samples_processed=self._samples, steps=self._steps,
                               devices=self._devices, rejected=self._rejected, clipped=self._clipped,
                               capped=self._capped, late=self._late,
                               device_norm_median=float(np.median(self._norms)) if self._norms else None)

    def _robust(self) -> dict[str, NDArray[np.generic]]:
        """The device rule over the kept updates: coordinate-wise median or trimmed mean (unweighted: a device's
        example count is its own claim), so one device moves the reply at most within the others' spread."""
        if self.device_rule == "trimmed-mean" and trim_count(len(self._kept), self.trim_fraction) == 0:
            log.warning("round %d: the trimmed mean cuts no device at either end of %d (trim fraction %g): this "
                        "round's reply is their plain mean; a hostile device is not bounded by it",
                        self.server_round, len(self._kept), self.trim_fraction)
        return ROBUST_DEVICE_RULES[self.device_rule](self._kept, self.trim_fraction)

    def task(self, session: Session) -> EncodedTask:
        """The round's model in the task encoding ``session``'s device is sent (the gateway's ``downlink``
        if the device reads it, else fp32), made once per encoding; noted as handed to the device (what
        the gateway's waiting line counts, and what its update is taken against)."""
        encoding = self.downlink if task_capability(self.downlink) in session.tasks else FP32.spec
        with self._lock:
            if encoding not in self._encoded:
                self._encoded[encoding] = encode_task(self.weights, encoding)
            self._taken.add(session.device)
            self._received[session.device] = encoding
            return self._encoded[encoding]

    def received_by(self, device: str) -> Mapping[str, NDArray[np.generic]]:
        """The weights ``device`` was handed, as it read them (the round's own for fp32)."""
        with self._lock:
            encoding = self._received.get(device, FP32.spec)
            return self.weights if encoding == FP32.spec else self._encoded[encoding].received

    @property
    def taken(self) -> int:
        """Devices handed this round's task so far."""
        with self._lock:
            return len(self._taken)

    def has_answered(self, device: str) -> bool:
        """Whether ``device``'s result is already in this round (under any session of it)."""
        with self._lock:
            return device in self._answered

    @property
    def answered(self) -> int:
        """Devices whose result was folded in."""
        return self._devices


def new_session_answer(token: str, key: bytes, ttl_s: float, next_in_s: float) -> dict[str, Any]:
    """The check-in answer's JSON."""
    return {"session": token, "key": b64(key), "expires-in-s": ttl_s, "next-in-s": next_in_s}
