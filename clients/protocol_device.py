"""The reference client of fedge's device protocol: a device with no Flower and no torch.

It is the executable specification of ``docs/device-protocol.md`` (a Kotlin, Swift or JS
app does what this class does, step for step) and the load generator of
``bench/gateway_load.py``. It needs numpy, onnxruntime, cryptography and the standard
library's HTTPS client; a test imports it where ``import flwr`` and ``import torch`` fail.

One cycle: ``hello`` (the gateway's name), ``check-in`` (a signature over that name, the
time and a nonce; returns a session token and key), then ``task`` polls. A task frame holds
the global weights and the training settings; the device trains them with the run's signed
training graph on onnxruntime (:class:`fedge.edge.trainer.OnnxTrainer`, the same trainer an
onnx device under a SuperNode runs, so both send the same update) and posts the result.
Every answer says when to come back (``next-in-s``): the gateway's pace steering. Each round
it took part in is one log line (``round 3: trained on 240 examples, loss 0.41, sent``); a
result that came after its round closed (409) is a normal outcome, logged as such. When the
gateway answers a poll with ``done`` (the run is over) the device logs one line and
:meth:`ProtocolDevice.run` returns.

Threat model (device side): the gateway is authenticated by TLS against the CA the device
was given, and the gateway name the device signs at check-in is the one in that verified
certificate (``fedge gateway NAME``, from ``fedge keys add-gateway NAME``): a gateway that
announces another gateway's name in ``hello`` is refused, so it cannot pass the device's
signed check-in on to that gateway and act as the device there. The training graph a
gateway hands out is verified against the coordinator's signing key (Ed25519) before
onnxruntime sees it, so a gateway cannot make the device run a graph the coordinator did
not sign; and, as ``fedge device --runtime onnx`` does (:func:`fedge.edge.delivery.pull`),
the device keeps a freshness record and a lineage pin in its own state directory, so a
gateway cannot roll it back to an older signed graph of its model (an older run's, another
model) nor switch it to another lineage the owner did not name.
"""

from __future__ import annotations

import http.client
import json
import logging
import secrets
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from fedge.clients import secagg_device
from fedge.clients.device_data import DeviceArrays, device_arrays
from fedge.clients.gateway.protocol import (
    ASYNCHRONOUS,
    CHECK_IN_DEVICE,
    COUNTER_HEADER,
    DEVICE_SEED,
    ENCODINGS,
    FRAME_TYPE,
    INT8_DELTA,
    MAC_HEADER,
    NONCE_BYTES,
    PREFIX,
    SECURE_AGGREGATION,
    TASK_CAPABILITIES,
    TASK_ID,
    b64,
    certified_gateway_name,
    check_in_message,
    decode_frame,
    encode_frame,
    int8_delta,
    records_from_json,
    records_to_json,
    request_mac,
    task_weights,
    unb64,
)
from fedge.edge.bundle import FreshnessStore
from fedge.edge.delivery import LINEAGE_PIN, pin_lineage, pinned_lineage
from fedge.edge.signing import ensure_private_dir
from fedge.edge.trainer import OnnxTrainer
from fedge.edge.training_bundle import TrainingBundle, read_training_bundle
from fedge.errors import BundleVerificationError, ConfigError, DeviceProtocolError, ProtocolError
from fedge.files import write_bytes_atomic
from fedge.listeners import GATEWAY_CN_PREFIX
from fedge.preprocessing import prepare_device_inputs
from fedge.secagg import ProtocolViolation
from fedge.wire import TrainInstruction

PrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey
log = logging.getLogger("fedge.protocol_device")
def default_state_dir(name: str) -> Path:
    """``~/.fedge-protocol-device/NAME``: where device ``name`` keeps its graph, freshness records and lineage pin."""
    return Path.home() / ".fedge-protocol-device" / name


def _common_name(certificate: dict[str, Any]) -> str:
    """The subject CN of a verified peer certificate (``SSLSocket.getpeercert()``), "" when it has none or two."""
    names = [value for rdn in certificate.get("subject", ()) for key, value in rdn if key == "commonName"]
    return str(names[0]) if len(names) == 1 else ""


@dataclass(frozen=True)
class Outcome:
    """What one poll did, and when to come back.

    ``kind``: ``wait``, ``train``, ``evaluate``, ``secagg`` (a secure step), ``refused``,
    ``late`` (the result came after its round closed: 409, normal) or ``done`` (the run is
    over; ``note`` says why, in the gateway's words).
    """

    kind: str
    next_in_s: float
    server_round: int | None = None
    loss: float | None = None
    note: str | None = None


def _printable(text: object, limit: int = 300) -> str:
    """A gateway's free text, fit for one log line (no control characters, at most ``limit`` characters)."""
    return "".join(c if c.isprintable() else " " for c in str(text))[:limit]


def load_private_key(path: Path) -> PrivateKey:
    """A protocol device key (PEM, ECDSA P-256 or Ed25519), or a ConfigError saying which it must be."""
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"'{path}' is not a PEM private key ({exc}); make one with "
                          "`fedge gateway add-device NAME`") from None
    if isinstance(key, ed25519.Ed25519PrivateKey) or \
            (isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1)):
        return key
    raise ConfigError(f"'{path}' is a {type(key).__name__}; protocol device keys are ECDSA P-256 or Ed25519")


def sign(key: PrivateKey, message: bytes) -> bytes:
    """Ed25519, or ECDSA P-256 over SHA-256 (DER; WebCrypto's raw r||s is accepted too)."""
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(message)
    return key.sign(message, ec.ECDSA(hashes.SHA256()))


def _gateway_address(gateway: str, *, insecure: bool, ca: Path | None) -> tuple[str, int, bool]:
    """``(host, port, tls)`` of a gateway URL, or a refusal saying which URLs work."""
    url = urlsplit(gateway)
    if url.scheme not in ("https", "http") or (url.scheme == "http" and not insecure) or not url.hostname:
        raise ConfigError(f"gateway {gateway!r}: use https://HOST:PORT (http:// only with insecure=True)")
    if url.scheme == "https" and ca is None:
        raise ConfigError("a protocol device needs the CA that signed the gateway's certificate (ca=...)")
    return url.hostname, url.port or (443 if url.scheme == "https" else 80), url.scheme == "https"


class ResumingHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS that offers the gateway's last TLS session (TLS 1.3 resumption, RFC 8446 §2.2): a device's
    next poll skips the gateway's certificate signature and its own chain check, which cost a phone
    (and the gateway) most of a handshake. The gateway decides whether to resume; a session is only
    ever offered to the host and port that issued it, and the certificate a resumed session carries is
    the one verified when it was made (the check-in's gateway name is still read from it)."""

    def __init__(self, host: str, port: int, *, timeout: float, context: ssl.SSLContext,
                 sessions: dict[tuple[str, int], ssl.SSLSession]) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self.sessions = sessions

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)  # the TCP connection; TLS below, offering the kept session
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self.host,  # type: ignore[attr-defined]
                                              session=self.sessions.get((self.host, self.port)))

    def keep_session(self) -> None:
        """Keep this connection's TLS session for the next connection (TLS 1.3 sends it after the handshake,
        so it is known once a response was read)."""
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.session is not None:
            self.sessions[(self.host, self.port)] = self.sock.session


class ProtocolDevice:
    """A device that speaks fedge's device protocol to one gateway.

    Parameters
    ----------
    gateway : str or sequence of str
        The gateway's base URL, ``https://HOST:PORT`` (``http://`` only with ``insecure``), or
        several: when the one in use cannot be reached, the device checks in at the next (in
        order, round robin). A device trains at most once a round whichever gateway asks: a
        train task for a round it already trained (its result went through another gateway) is
        not trained again, so the coordinator counts its update at most once a round.
    name : str
        This device's name in the gateway's allow-list.
    key : Path or private key
        Its ECDSA P-256 or Ed25519 private key (``fedge gateway add-device``).
    data : Path or (inputs, targets)
        Its own examples (``.npz``/``.csv``, read for the graph's inputs), or arrays already read.
    trust : Path
        The coordinator's bundle signing public key: the training graph must be signed with it.
    ca : Path, optional
        The CA that signed the gateway's certificate (``fedge keys add-gateway``: its subject
        names the gateway, and that is the name this device signs at check-in).
    state_dir : Path, optional
        This device's own state, created 0700 (default ``~/.fedge-protocol-device/NAME``): the
        verified training graph, the freshness records that refuse an older graph of its lineage
        (rollback) and the lineage pin (``freshness/training/``, as ``fedge device`` keeps them).
        Keep it on storage only the device's user can write: deleting it resets both checks.
    model_id : str, optional
        The training graphs' lineage (signed ``model_id``) to accept. Without it, the lineage of
        the first graph accepted is pinned and a graph of any other is refused.
    secure : bool
        Require secure aggregation: refuse plain train tasks (the gateway would see this
        device's update) and answer only the SecAgg+ steps, in which the gateway learns
        only its pool's sum (:mod:`fedge.clients.gateway.secure_pool`).
    """

    def __init__(self, *, gateway: str | Sequence[str], name: str, key: Path | PrivateKey, data: Path | DeviceArrays,
                 trust: Path, ca: Path | None, state_dir: Path | None = None, insecure: bool = False,
                 timeout_s: float = 120.0, secure: bool = False, model_id: str | None = None) -> None:
        self.gateways = [_gateway_address(url, insecure=insecure, ca=ca)
                         for url in ([gateway] if isinstance(gateway, str) else gateway)]
        if not self.gateways:
            raise ConfigError("a protocol device needs at least one gateway URL")
        self.host, self.port, self.tls = self.gateways[0]
        self.name, self.trust, self.timeout_s, self.model_id = name, trust, timeout_s, model_id
        self.state_dir = state_dir if state_dir is not None else default_state_dir(name)
        self.freshness = FreshnessStore(self.state_dir / "freshness" / "training")  # as `fedge device` keeps it
        self.key = key if not isinstance(key, Path) else load_private_key(key)
        self._data_source = data
        self._context = ssl.create_default_context(cafile=str(ca)) if self.tls else None
        self._connection: http.client.HTTPConnection | None = None
        self._tls_sessions: dict[tuple[str, int], ssl.SSLSession] = {}  # each gateway's last TLS session
        self._peer = ""  # the subject CN of the TLS certificate the open connection verified
        self._session: tuple[str, bytes] | None = None
        self._counter = 0
        self._bundle: TrainingBundle | None = None
        self._trainer: OnnxTrainer | None = None
        self._data: DeviceArrays | None = None
        self.gateway_name: str | None = None
        self.secure = secure
        self._secagg: dict[str, Any] | None = None  # this round's secure-aggregation secrets
        # the last secure step answered: its task id, reply and encoded frame (a step sent again, its answer lost
        # on the way, gets the same answer again instead of being taken for a replay)
        self._answered: tuple[str, dict[str, Any], bytes] | None = None
        self._unmasked: int | None = None  # the last round this device unmasked in
        self.run_over: str | None = None  # once the gateway said the run is over: why (its words)
        self._work: tuple[int, float] | None = None  # (examples, loss) of the masked step just trained
        self._trained_round = -1  # the last round this device trained a plain task for (at any gateway)
        self._unsent: tuple[str, bytes] | None = None  # (task id, result) of a train result no gateway answered yet

    def next_gateway(self) -> None:
        """Check in at the next gateway named (the one in use cannot be reached): a new connection,
        session and gateway name; what was trained and unmasked is remembered across gateways."""
        gone = f"{self.host}:{self.port}"
        self.close()
        self.gateways.append(self.gateways.pop(0))
        self.host, self.port, self.tls = self.gateways[0]
        self._session, self.gateway_name, self._peer, self._answered = None, None, "", None
        log.warning("device %s: gateway %s cannot be reached; checking in at %s:%s", self.name, gone, self.host,
                    self.port)

    # ----------------------------------------------------------------------- transport
    def _connect(self) -> http.client.HTTPConnection:
        if self._connection is None:
            if self._context is not None:
                self._connection = ResumingHTTPSConnection(self.host, self.port, timeout=self.timeout_s,
                                                           context=self._context, sessions=self._tls_sessions)
            else:
                self._connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        if self.tls and self._connection.sock is None:  # a new TLS connection: whose certificate is it?
            self._connection.connect()
            sock = self._connection.sock
            assert isinstance(sock, ssl.SSLSocket)
            self._peer = _common_name(sock.getpeercert() or {})
        return self._connection

    def close(self) -> None:
        """Close the connection (devices should not hold one between polls); its TLS session is kept, so the
        next connection to that gateway resumes it."""
        if self._connection is not None:
            if isinstance(self._connection, ResumingHTTPSConnection):
                self._connection.keep_session()
            self._connection.close()
            self._connection = None

    def _send(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
              signed_for: str | None = None) -> tuple[int, str, bytes]:
        """One request; ``signed_for``: the gateway name ``body`` is signed for, sent only to that gateway."""
        for attempt in (0, 1):
            try:
                connection = self._connect()
                if signed_for is not None and self.tls:
                    self._check_peer(signed_for)
                connection.request(method, path, body=body or None, headers=headers or {})
                response = connection.getresponse()
                return response.status, response.getheader("content-type", ""), response.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()  # the gateway closed an idle keep-alive connection: once more on a new one
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _authenticated(self, method: str, path: str, body: bytes = b"") -> tuple[int, str, bytes]:
        for attempt in (0, 1):
            if self._session is None:
                self.check_in()
            assert self._session is not None
            token, key = self._session
            self._counter += 1
            mac = request_mac(key, method=method, path=path, counter=self._counter, body=body)
            status, kind, answer = self._send(method, path, body, {
                "Authorization": f"Fedge-Session {token}", COUNTER_HEADER: str(self._counter), MAC_HEADER: mac,
                "Content-Type": FRAME_TYPE})
            if status == 401 and not attempt:  # expired, or the gateway restarted: check in again
                self._session = None
                continue
            return status, kind, answer
        return status, kind, answer

    @staticmethod
    def _json(status: int, body: bytes, what: str) -> dict[str, Any]:
        try:
            answer = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            answer = {"error": body[:200].decode(errors="replace")}
        if status != 200:
            raise DeviceProtocolError(f"{what}: the gateway answered {status}: {answer.get('error', answer)}")
        return dict(answer)

    def _certified_name(self) -> str:
        """The gateway name in the open connection's verified certificate, or a refusal saying how to fix it."""
        certified = certified_gateway_name(self._peer)
        if certified is None:
            raise DeviceProtocolError(
                f"the gateway at {self.host}:{self.port} presents a TLS certificate for {self._peer!r}, which names no "
                "fedge gateway, so this device cannot tell which gateway it signs its check-in for; refusing to check "
                f"in. Its operator must serve the certificate of `fedge keys add-gateway NAME` (subject '"
                f"{GATEWAY_CN_PREFIX}NAME', signed by the CA this device holds)")
        return certified

    def _check_peer(self, signed_for: str) -> None:
        """Refuse to send a check-in signed for ``signed_for`` over a connection to another gateway."""
        certified = self._certified_name()
        if certified != signed_for:
            self.gateway_name = None  # ask hello again at the next check-in
            raise DeviceProtocolError(
                f"the gateway at {self.host}:{self.port} is now gateway '{certified}' (its TLS certificate), not "
                f"'{signed_for}' this check-in is signed for; refusing to send it")

    def _gateway_name(self, announced: str) -> str:
        """The gateway name to sign at check-in: its verified TLS certificate's, which ``hello`` must agree with."""
        if not self.tls:
            log.warning("device %s: insecure (plain HTTP): signing the gateway name '%s' that hello announces, "
                        "unverified; a gateway could pass this check-in on to gateway '%s'. Use https:// and the "
                        "gateway's `fedge keys add-gateway` certificate outside throwaway tests",
                        self.name, announced, announced)
            return announced
        certified = self._certified_name()
        if announced != certified:
            raise DeviceProtocolError(
                f"the gateway at {self.host}:{self.port} announces itself as '{announced}' in hello, but its TLS "
                f"certificate is gateway '{certified}'s; refusing to check in (a check-in signed for '{announced}' "
                f"could be passed on to that gateway, which would take this device for it). Its operator must start "
                f"it with --name {certified}, or serve the certificate of `fedge keys add-gateway {announced}`")
        return certified

    # ----------------------------------------------------------------------- protocol steps
    def check_in(self) -> float:
        """Prove this device's key to the gateway and open a session; the gateway's ``next-in-s``.

        The gateway name signed is the one in the gateway's verified TLS certificate (``hello``
        must announce the same), and the signed check-in goes only to a connection whose
        certificate names that gateway. Only with ``insecure`` (plain HTTP) is it ``hello``'s.
        """
        if self.gateway_name is None:
            status, _, body = self._send("GET", f"{PREFIX}/hello")
            self.gateway_name = self._gateway_name(str(self._json(status, body, "hello")["gateway"]))
        issued, nonce = int(time.time()), b64(secrets.token_bytes(NONCE_BYTES))
        message = check_in_message(device=self.name, gateway=self.gateway_name, issued_at=issued, nonce=nonce)
        request = {"protocol": 1, CHECK_IN_DEVICE: self.name, "time": issued, "nonce": nonce,
                   "signature": b64(sign(self.key, message)),
                   "capabilities": [*ENCODINGS, *TASK_CAPABILITIES, SECURE_AGGREGATION]}
        status, _, body = self._send("POST", f"{PREFIX}/check-in", json.dumps(request).encode(),
                                     {"Content-Type": "application/json"}, signed_for=self.gateway_name)
        answer = self._json(status, body, "check-in")
        self._session, self._counter = (str(answer["session"]), unb64(answer["key"], "key", size=32)), 0
        return float(answer.get("next-in-s", 0))

    def training_graph(self) -> tuple[TrainingBundle, OnnxTrainer]:
        """The run's training graph from the gateway, verified, then kept and recorded as accepted.

        Raises
        ------
        BundleVerificationError
            Not signed by the trusted key, altered, expired, older than a graph of its lineage
            this device accepted (rollback), or of another lineage than the pinned or named one.
            The graph held before stays in use.
        """
        status, _, body = self._authenticated("GET", f"{PREFIX}/bundles/training")
        if status != 200:
            self._json(status, body, "training graph")
        try:
            bundle = read_training_bundle(body, trusted_keys=[self.trust], freshness=self.freshness)
            self._check_lineage(str(bundle.manifest["model_id"]))
        except BundleVerificationError as exc:
            raise BundleVerificationError(f"the gateway's training graph is refused: {exc}. This device trains "
                                          "nothing with it and keeps the graph it held") from None
        trainer = OnnxTrainer(bundle.train_onnx, bundle.eval_onnx, bundle.manifest)  # its graph checks, first:
        ensure_private_dir(self.state_dir)  # a signed bundle whose graphs are refused is neither kept nor recorded
        write_bytes_atomic(self.state_dir / "training.zip", body)  # 0600
        ensure_private_dir(self.freshness.directory.parent)
        self.freshness.record(bundle.manifest)
        pin_lineage(self.freshness.directory / LINEAGE_PIN, str(bundle.manifest["model_id"]))
        self._bundle, self._trainer, self._data = bundle, trainer, None
        return bundle, self._trainer

    def _check_lineage(self, offered: str) -> None:
        """Refuse a graph of another lineage than the one the owner named, else than the pinned one."""
        followed = self.model_id or pinned_lineage(self.freshness.directory / LINEAGE_PIN)
        if followed is not None and offered != followed:
            why = "its owner named" if self.model_id else "pinned on the first graph it accepted"
            raise BundleVerificationError(
                f"it is of model '{offered}', but this device follows model '{followed}' ({why}); a graph of another "
                f"lineage is trained only when the owner names it: `fedge protocol-device --model-id '{offered}'` "
                "(ProtocolDevice(model_id=...)) switches to it")

    def _ready(self, graph: str) -> tuple[OnnxTrainer, DeviceArrays]:
        if self._trainer is None or self._bundle is None or (graph and self._bundle.architecture != graph):
            bundle, _ = self.training_graph()
            if graph and bundle.architecture != graph:
                raise ConfigError(f"the gateway's training graph is architecture {bundle.architecture[:12]}, the "
                                  f"task names {graph[:12]}; the gateway has not fetched the run's graph yet")
        assert self._trainer is not None and self._bundle is not None
        if self._data is None:
            source = self._data_source
            inputs, targets = device_arrays(source, self._bundle.manifest) if isinstance(source, Path) else source
            prepared, _ = prepare_device_inputs(inputs, self._bundle.manifest.get("preprocessing"))
            self._data = (prepared, targets)
        return self._trainer, self._data

    def poll(self) -> Outcome:
        """Ask for a task; train or evaluate it and send the result. What was done and when to come back."""
        status, kind, body = self._authenticated("GET", f"{PREFIX}/task")
        if status != 200 or not kind.startswith(FRAME_TYPE):
            answer = self._json(status, body, "task")
            if answer.get("kind") == "done":  # the run is over: the gateway's last word
                return Outcome("done", float(answer.get("next-in-s", 0.0)),
                               note=_printable(answer.get("reason") or "the gateway's run is over"))
            return Outcome("wait", float(answer.get("next-in-s", 1.0)))
        frame, scales = decode_frame(body)
        task = frame.header
        if task.get("kind") == "secagg":
            return self._secure_step(task, frame.tensors)
        if task.get("kind") == "train" and self.secure:
            log.warning("device %s: refusing a plain train task for round %s: this device requires secure "
                        "aggregation (its update would reach the gateway in the clear)", self.name,
                        task.get("server-round"))
            return Outcome("refused", 5.0, int(task.get("server-round", 0)))
        server_round = int(task["server-round"])
        if task["kind"] == "train" and self._unsent is not None and self._unsent[0] == task[TASK_ID]:
            return self._sent_train(server_round, "its result, trained before, sent again")  # it did not arrive
        # a synchronous run counts a device once a round, through whichever gateway; an asynchronous one hands a model
        # version out again and again (each gateway flush), and each training of it is a result of its own
        if task["kind"] == "train" and not task.get(ASYNCHRONOUS) and server_round <= self._trained_round:
            log.warning("device %s: not training round %d again: this device trained it already (its result went "
                        "through another gateway, where it is counted)", self.name, server_round)
            return Outcome("refused", 5.0, server_round)
        weights = task_weights(frame, scales)  # float32 writable copies, whatever the task's encoding
        trainer, (inputs, targets) = self._ready(str(task.get("graph", "")))
        if task["kind"] == "evaluate":
            scores = trainer.evaluate(weights, inputs, targets)
            result = encode_frame({TASK_ID: task[TASK_ID], "kind": "evaluate", "num-examples": len(targets),
                                   "metrics": {k: float(v) for k, v in scores.items()}}, {})
            shown = ", ".join(f"{k} {float(v):.4f}" for k, v in scores.items())
            return self._sent(result, "evaluate", server_round, f"evaluated on {len(targets)} examples, {shown}")
        loss, result = self.train(task, weights, trainer, inputs, targets)
        self._trained_round = server_round  # even if the result does not arrive: it may have, through this gateway
        self._unsent = (str(task[TASK_ID]), result)  # ... and if this task comes again, it did not: sent again
        return self._sent_train(server_round, f"trained on {len(targets)} examples, loss {loss:.4f}", loss)

    def _sent_train(self, server_round: int, work: str, loss: float | None = None) -> Outcome:
        """Send the train result not yet answered (:meth:`_sent`); once the gateway answers, it is sent."""
        assert self._unsent is not None
        outcome = self._sent(self._unsent[1], "train", server_round, work, loss)
        self._unsent = None
        return outcome

    def _sent(self, result: bytes, kind: str, server_round: int, work: str, loss: float | None = None) -> Outcome:
        """Send a round's result; its one line (sent, or the round had closed: 409, a normal outcome)."""
        status, answer = self._result_answer(result)
        if status == 409:
            log.info("device %s: round %d: %s; not counted: the round closed before it arrived (%s)", self.name,
                     server_round, work, _printable(answer.get("error", "409")))
            return Outcome("late", float(answer.get("next-in-s", 1.0)), server_round, loss)
        log.info("device %s: round %d: %s, sent", self.name, server_round, work)
        return Outcome(kind, float(answer.get("next-in-s", 1.0)), server_round, loss)

    def train(self, task: dict[str, Any], weights: dict[str, np.ndarray], trainer: OnnxTrainer,
              inputs: tuple[np.ndarray, ...], targets: np.ndarray) -> tuple[float, bytes]:
        """Train a task's weights; (loss, the result frame)."""
        instruction = TrainInstruction.read(task["config"])
        trained, work = trainer.train(
            weights, inputs, targets, epochs=instruction.local_epochs, batch_size=instruction.batch_size,
            learning_rate=instruction.learning_rate, momentum=instruction.momentum, seed=int(task[DEVICE_SEED]),
            proximal_mu=instruction.proximal_term, max_steps=None)
        header = {TASK_ID: task[TASK_ID], "kind": "train", "num-examples": work.num_examples,
                  "samples-processed": work.samples_processed, "steps": work.steps,
                  "metrics": {"train-loss": float(work.loss)}, "encoding": task.get("uplink", "fp32")}
        if header["encoding"] == INT8_DELTA:
            quantised, scales = int8_delta(trained, weights)
            return work.loss, encode_frame(header, quantised, scales)
        return work.loss, encode_frame(header, {name: np.asarray(trained[name], np.float32) for name in weights})

    # ----------------------------------------------------------------------- secure aggregation
    def _secure_step(self, task: dict[str, Any], tensors: dict[str, np.ndarray]) -> Outcome:
        """One SecAgg+ step the gateway asked for (:mod:`fedge.clients.secagg_device`), answered.

        A step this device refuses (a protocol violation, a malformed step) is answered with
        the reason and forgets the round's secrets: it takes no further part in that round.
        """
        action, server_round = str(task.get("action", "")), task.get("server-round")
        known_round = server_round if isinstance(server_round, int) else None
        if self._answered is not None and task.get(TASK_ID) == self._answered[0]:
            # the step this device answered last, sent again: its answer did not reach the gateway (a POST lost
            # to a timeout or a reset connection); the same answer again, not a second (refused) run of the step
            log.info("device %s: round %s: the %s step came again (its answer was lost); answering it again",
                     self.name, known_round, action)
            _, reply, frame = self._answered
        else:
            reply, frame = self._secure_reply(action, task, tensors)
            self._answered = (str(task.get(TASK_ID)), reply, frame)
        status, answer = self._result_answer(frame)
        if status == 409:  # the step was over (this device counts as its dropout): normal, not an error
            log.info("device %s: round %s: the %s step closed before this device's answer arrived (%s)", self.name,
                     known_round, action, _printable(answer.get("error", "409")))
            return Outcome("late", float(answer.get("next-in-s", 0.5)), known_round)
        if action == "secagg_masked" and "error" not in reply and self._work is not None:
            examples, loss = self._work
            log.info("device %s: round %s: trained on %d examples, loss %.4f, sent masked (secure aggregation)",
                     self.name, known_round, examples, loss)
        # a round counts as trained once this device's update is in an unmasked sum (its last step)
        kind = "train" if action == "secagg_unmask" and "error" not in reply else "secagg"
        return Outcome(kind, float(answer.get("next-in-s", 0.5)), known_round)

    def _secure_reply(self, action: str, task: dict[str, Any],
                      tensors: dict[str, np.ndarray]) -> tuple[dict[str, Any], bytes]:
        """A step's reply header and its encoded frame: the step's answer, or the reason it is refused."""
        server_round = task.get("server-round")
        out_tensors: dict[str, np.ndarray] = {}
        self._work = None
        try:
            if isinstance(server_round, bool) or not isinstance(server_round, int):
                raise DeviceProtocolError(f"malformed {action} step: 'server-round' is not a whole number")
            records, out_tensors = self._secure_answer(action, task, records_from_json(task.get("records", {})),
                                                       tensors)
            reply: dict[str, Any] = {TASK_ID: task[TASK_ID], "kind": "secagg", "records": records_to_json(records)}
        except (ProtocolError, DeviceProtocolError, KeyError, TypeError, ValueError) as exc:
            self._secagg = None
            reason = str(exc) if isinstance(exc, ProtocolError | DeviceProtocolError) else \
                f"malformed {action} step ({type(exc).__name__}: {exc})"
            log.warning("device %s: %s", self.name, reason)
            reply = {TASK_ID: task.get(TASK_ID), "kind": "secagg", "error": reason}
        return reply, encode_frame(reply, out_tensors)

    def _secure_answer(self, action: str, task: dict[str, Any], records: dict[str, dict[str, Any]],
                       tensors: dict[str, np.ndarray]) -> tuple[dict[str, dict[str, Any]], dict[str, np.ndarray]]:
        node, server_round = int(task["node"]), int(task["server-round"])
        if action == "secagg_setup":
            secagg_device.check_not_unmasked(self._unmasked, server_round=server_round)
            state, keys = secagg_device.setup(server_round=server_round)
            self._secagg = {**state, "me": node}
            return {"keys": keys}, {}
        state = self._secagg
        if state is None:
            raise ProtocolViolation(f"refusing {action}: this device has no secure-aggregation round in progress "
                                    "(a replayed or reordered step)")
        if state["me"] != node:
            raise ProtocolViolation(f"refusing {action}: the gateway changed this device's node id mid-round")
        if action == "secagg_share":
            return {"sealed": secagg_device.share(state, records["peers"], me=node)}, {}
        if action == "secagg_masked":
            return self._masked(state, task, records, tensors, node)
        if action == "secagg_consistency":
            return {"consistency": {"signature": secagg_device.consistency(state, records["check"], me=node)}}, {}
        if action == "secagg_unmask":
            revealed = secagg_device.unmask(state, records["ask"], me=node)
            self._secagg, self._unmasked = None, int(state["round"])
            return {"revealed": revealed}, {}
        raise ProtocolViolation(f"refusing {action!r:.40}: not a secure-aggregation step")

    def _masked(self, state: dict[str, Any], task: dict[str, Any], records: dict[str, dict[str, Any]],
                tensors: dict[str, np.ndarray], node: int) -> tuple[dict[str, dict[str, Any]], dict[str, np.ndarray]]:
        """Train on the step's global arrays, mask the update, sign what was received."""
        weights = {name.partition("/")[2]: np.array(value) for name, value in tensors.items()
                   if name.startswith("arrays/")}
        config = records["config"]
        trainer, (inputs, targets) = self._ready(str(task.get("graph", "")))
        instruction = TrainInstruction.read(config)

        def train() -> secagg_device.Trained:
            trained, work = trainer.train(
                {name: value.copy() for name, value in weights.items()}, inputs, targets,
                epochs=instruction.local_epochs, batch_size=instruction.batch_size,
                learning_rate=instruction.learning_rate, momentum=instruction.momentum,
                seed=int(task[DEVICE_SEED]), proximal_mu=instruction.proximal_term, max_steps=None)
            self._work = (work.num_examples, float(work.loss))
            return secagg_device.Trained(arrays=trained, num_examples=work.num_examples, steps=work.steps)

        answer = secagg_device.masked(state, inbox=records["inbox"], params=records["secagg"], config=config,
                                      global_arrays=weights, me=node, train=train)
        if answer.bad:
            self._secagg = None
            return {"secagg-bad-shares": {"senders": list(answer.bad)}}, {}
        assert answer.vector is not None and answer.received is not None
        return ({"secagg-received": answer.received, "fedge": {"server-round": int(state["round"])}},
                {"masked/vector": answer.vector})

    def _result_answer(self, frame: bytes) -> tuple[int, dict[str, Any]]:
        """POST a result: (200, the answer), or (409, the answer) when its round or step had closed;
        any other status raises :class:`DeviceProtocolError`."""
        status, _, body = self._authenticated("POST", f"{PREFIX}/result", frame)
        if status == 409:
            try:
                answer = json.loads(body)
            except (UnicodeDecodeError, json.JSONDecodeError):
                answer = None
            return 409, dict(answer) if isinstance(answer, dict) else {}
        return 200, self._json(status, body, "result")

    def run(self, *, stop: threading.Event | None = None, rounds: int | None = None, max_wait_s: float = 30.0) -> int:
        """Poll until ``stop`` is set, ``rounds`` train tasks are done or the gateway says the run is over;
        how many were trained.

        Waits what the gateway says between polls (at most ``max_wait_s``), and closes the
        connection while it waits. The gateway's ``done`` ends it with one log line, and
        :attr:`run_over` keeps the gateway's reason.
        """
        stop = stop or threading.Event()
        trained = unreachable = 0
        while not stop.is_set() and (rounds is None or trained < rounds):
            try:
                outcome = self.poll()
                unreachable = 0
            except (OSError, http.client.HTTPException):
                self.close()
                outcome = Outcome("wait", 2.0)  # the gateway is down or restarting: try again soon
                unreachable += 1
                if len(self.gateways) > 1:  # ... or at the next gateway named: at once, until each was tried
                    self.next_gateway()
                    outcome = Outcome("wait", 0.0 if unreachable % len(self.gateways) else 2.0)
            except (KeyError, TypeError, ValueError) as exc:  # a malformed task from the gateway: not this device's
                log.warning("device %s: the gateway sent a malformed task (%s: %s)", self.name, type(exc).__name__, exc)
                self.close()
                outcome = Outcome("wait", 2.0)
            except (DeviceProtocolError, ConfigError, BundleVerificationError) as exc:  # refused, or no graph yet
                log.warning("device %s: %s", self.name, exc)
                self.close()
                outcome = Outcome("wait", 2.0)
            if outcome.kind == "done":
                self.run_over = outcome.note or "the gateway's run is over"
                log.info("device %s: the run is over: %s; %d rounds trained, stopping", self.name, self.run_over,
                         trained)
                break
            trained += outcome.kind == "train"
            if outcome.next_in_s > 0:
                self.close()
                stop.wait(min(outcome.next_in_s, max_wait_s))
        self.close()
        return trained
