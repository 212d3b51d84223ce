"""``fedge gateway``: a tier between protocol devices (phones, browsers) and the coordinator.

A gateway is one node of the Flower federation (a SuperNode, started as ``fedge device``
starts one, with its own node key) and an HTTPS server for devices that speak fedge's device
protocol (``docs/device-protocol.md``). When the coordinator sends the gateway a train (or
evaluate) instruction, the gateway's ClientApp (:mod:`fedge.clients.gateway.bridge`) hands
it to this process over a loopback control port; the gateway offers the round to its
checked-in devices, folds their validated results into a weighted mean as they arrive, and
replies with the mean and the examples behind it: hierarchical FedAvg (Bonawitz et al.,
"Towards Federated Learning at Scale: System Design", SysML 2019), equal to flat FedAvg over
the same devices.

Why a hand-written HTTP service rather than Flower's Fleet API: see
:mod:`fedge.clients.gateway.protocol` and ``docs/device-protocol.md`` (one signature per check-in
instead of per request, the body bound by a MAC, no protobuf or gRPC in the device, and the
coordinator's SuperLink keeps one node per gateway instead of one per phone).

State: everything of a round lives in this process's memory; a restarted gateway loses only
the round in flight (the coordinator counts the gateway as failed for that round), and its
devices check in again on the 401 they get.

The run's end: Flower tells a SuperNode nothing when its run finishes; the coordinator stops
its SuperLink. A gateway that was handed the run's last round (``num-rounds``, which its
ClientApp passes on) and then finds the coordinator's port closed knows the run is over
(:func:`watch_run_end`); so does one whose node stopped because the coordinator stayed away
(``fedge device``'s offline limit). From then on every poll is answered
``{"kind": "done", ...}`` (docs/device-protocol.md), and the gateway stops only once each
device seen lately has heard it, or after a short grace period.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedge import knobs
from fedge.aggregate import DEVICE_RULES
from fedge.clients.gateway.pool import (
    AllowList,
    DeviceBounds,
    GatewayRound,
    LateResult,
    RoundResult,
    Sessions,
    device_seed,
    new_session_answer,
    refused,
)
from fedge.clients.gateway.protocol import (
    ASYNCHRONOUS,
    COUNTER_HEADER,
    DEADLINE_S,
    DEVICE_SEED,
    ENCODINGS,
    FRAME_TYPE,
    MAC_HEADER,
    NUM_ROUNDS,
    PREFIX,
    SESSION_HEADER,
    TASK_ID,
    VERSION,
    assemble_frame,
    certified_gateway_name,
    decode_frame,
    encode_frame,
    read_json,
)
from fedge.clients.gateway.secure_pool import (
    MIN_DEVICES,
    SecureExchange,
    check_secure_settings,
    pool_node_id,
    secure_pool_round,
)
from fedge.clients.gateway.web import WebSite, check_origins, check_web, cors_middleware, demo_page_warning, web_routes
from fedge.codec import FP32, TASK_ENCODINGS
from fedge.errors import ConfigError, DeviceProtocolError, FedgeError
from fedge.listeners import ListenerLimits, bind, server_tls, uvicorn_options
from fedge.wire import LATE_EXPONENT

log = logging.getLogger("fedge.gateway")

INSECURE_WARNING = ("WARNING: INSECURE MODE. This gateway serves devices over plain HTTP: their sessions and "
                    "updates are readable on the network. Use only on a trusted test network.")
CONTROL_TOKEN = "control-token"  # in the gateway's state directory, 0600: what its own ClientApp presents
# one address (devices behind a carrier NAT share one) holds at most 256 connections, and at most
# GatewaySettings.max_per_address requests in progress: well below the gateway's max_in_flight
DEVICE_LIMITS = ListenerLimits(per_address=256, concurrency=20_000, idle_timeout_s=5, body_timeout_s=30.0,
                               handshake_timeout_s=10.0)
MAX_RESULT_SLACK = 2 << 20  # bytes a result may hold beyond 8 per model element (frame header, secure records)
RUN_OVER_NEXT_IN_S = 600.0  # "done": when an app that wants to join a later run may ask again
RUN_END_PROBE_S = 1.0  # after the run's last round, how often the gateway checks whether the coordinator closed
ROUND_PROGRESS_S = 30.0  # while a round waits for its devices, how often the gateway says how many it has
GRAPH_WAIT_SAY_S = 300.0  # while the training graph is not published, how often the gateway says it waits
LATE_ROUNDS = 4  # an asynchronous run: how many closed train rounds a device's late result may still answer
MAX_PENDING_LATE = 256  # ... and how many such results may wait for the next round (each holds a model's change)
# A gateway's node asks the coordinator for work every second while idle, not Flower's 3 s (fedge.clients.supernode):
# a coordinator has few gateways (one per ~1,000 phones), and each round's instruction reaches its phones sooner
GATEWAY_IDLE_PULL_S = 1.0


@dataclass(frozen=True)
class GatewaySettings:
    """How a gateway runs its devices' part of each round."""

    name: str = "gateway"
    devices_per_round: int = 0  # 0: every device seen in the last two poll intervals (at least min_devices)
    min_devices: int = 1
    round_deadline_s: float = 120.0
    idle_poll_s: float = 10.0
    max_in_flight: int = 512  # requests in progress before new ones get 503 + Retry-After
    max_per_address: int = 32  # ... of which one client address may hold at most this many
    max_num_examples: int = 100_000
    uplink: str = "fp32"  # what devices send: fp32 weights, or int8-delta
    downlink: str = "fp32"  # how tasks carry the model to devices that read it: fp32, fp16 or int8
    device_rule: str = "mean"  # a plain round's reply over its devices: "mean" (hierarchical FedAvg), or a robust
    # "median" / "trimmed-mean" (unweighted; O(devices x model) memory; secure pools reveal only the mean)
    device_trim_fraction: float = 0.2  # device_rule = "trimmed-mean": the share cut at each end of each coordinate

    def __post_init__(self) -> None:
        if self.device_rule not in DEVICE_RULES:
            raise ConfigError(f"gateway device rule {self.device_rule!r}: use one of {', '.join(DEVICE_RULES)}")
        if not 0 <= self.device_trim_fraction < 0.5:
            raise ConfigError(f"gateway device trim fraction {self.device_trim_fraction}: give a fraction in [0, 0.5)")


class Gateway:
    """A gateway's state: its allow-list, sessions, the training graph it serves and the round in flight."""

    def __init__(self, settings: GatewaySettings, allow_dir: Path, training_bundle: Path | None,
                 inference_bundle: Path | None = None) -> None:
        self.settings = settings
        self.allow = AllowList(allow_dir)
        self.sessions = Sessions(self.allow, settings.name)
        self.training_bundle = training_bundle
        self.inference_bundle = inference_bundle  # the coordinator's latest, pulled and verified by this gateway
        self.round: GatewayRound | None = None
        self.exchange: SecureExchange | None = None  # a secure round's steps in flight
        self.earlier: dict[str, GatewayRound] = {}  # an asynchronous run's last LATE_ROUNDS closed train rounds
        self.pending: list[LateResult] = []  # their late results that arrived while no train round was open
        self._late_lock = threading.Lock()
        self.in_flight = 0
        self.in_flight_by: Counter[str] = Counter()  # requests in progress per client address
        self.model_elements = 0  # the open round's model size: what bounds a result's body
        self.rounds_done = 0
        self.last_round = 0  # the run's last round (its num-rounds), as the coordinator's instructions say
        self.final_round_seen = False  # the coordinator handed this gateway the run's last round
        self.over: str | None = None  # why the run is over, once it is: every poll is answered "done"
        self.run_over = threading.Event()  # set with ``over``
        self.all_heard = threading.Event()  # every device seen lately when the run ended has been told
        self._expecting: set[str] = set()  # those devices
        self._told: set[str] = set()  # devices answered "done"
        self._over_lock = threading.Lock()
        self._rng = random.Random()
        self.progress_every_s = ROUND_PROGRESS_S  # how often a waiting round says how many devices it has

    def say_waiting(self, server_round: int, *, wanted: int, deadline: float, taken: int | None = None,
                    answered: int = 0, secure: bool = False) -> None:
        """One line while a round waits for its devices: who is checked in, who took the task, time left.

        Said when the round opens and every :attr:`progress_every_s` seconds after, so a round
        with no devices ("0 checked in") is visible at the gateway, not a silent wait.
        """
        live = len(self.sessions.live_devices(3 * self.settings.idle_poll_s, secure=secure))
        left = max(0.0, deadline - time.monotonic())
        checked_in = f"{len(self.sessions)} checked in ({live} polled in the last " \
                     f"{3 * self.settings.idle_poll_s:.0f} s{', able to run secure aggregation' if secure else ''})"
        progress = "" if taken is None else f", {taken} took the task, {answered} answered"
        hint = "; devices check in at this gateway's /v1/check-in (is its address in their configuration, and " \
               "their key in its allow-list?)" if not len(self.sessions) else ""
        log.info("round %d: waiting for devices: %s of %d wanted%s, deadline in %.0f s%s", server_round, checked_in,
                 wanted, progress, left, hint)

    def next_in_s(self, device: str | None = None) -> float:
        """Pace steering: when a device should come back, spread over the poll interval.

        Soon (0.2-1 s) while a plain round is open, or, during a secure round, for ``device``
        when it is in that round's pool; otherwise the idle interval (a secure round's steps
        go to its pool only, so the others need not poll faster).
        """
        current, exchange = self.round, self.exchange
        if exchange is not None:
            busy = device is None or device in exchange.members
        else:
            busy = current is not None and not current.complete.is_set() and not current.closed
        if busy:
            return round(self._rng.uniform(0.2, 1.0), 2)
        return round(self.settings.idle_poll_s * self._rng.uniform(0.5, 1.5), 2)

    def note_round(self, header: dict[str, Any]) -> None:
        """Record where in the run the coordinator's instruction ``header`` is (its last round or not).

        A round that comes after the run was declared over (the coordinator came back, or
        started a new run on this node) puts the gateway back to serving rounds.
        """
        server_round, total = header.get("server-round"), header.get(NUM_ROUNDS)
        known = all(isinstance(value, int) and not isinstance(value, bool) for value in (server_round, total))
        self.last_round = int(total) if known else 0  # type: ignore[arg-type]
        self.final_round_seen = known and 0 < int(total) <= int(server_round)  # type: ignore[arg-type]
        with self._over_lock:
            if self.over is None:
                return
            self.over = None
            self.run_over.clear()
            self.all_heard.clear()
        log.info("round %s: the coordinator sent a round after this gateway took its run to be over; serving rounds "
                 "again", server_round)

    def finish(self, reason: str, *, seen_within_s: float | None = None) -> bool:
        """Declare the run over (once): from now on polls are answered ``done`` with ``reason``.

        The devices that made a request in the last ``seen_within_s`` seconds (default: three
        poll intervals, at least 30 s) are the ones :attr:`all_heard` waits for. Returns whether
        this call declared it.
        """
        window = seen_within_s if seen_within_s is not None else max(30.0, 3 * self.settings.idle_poll_s)
        with self._over_lock:
            if self.over is not None:
                return False
            self._expecting, self._told = set(self.sessions.live_devices(window)), set()
            self.over = reason
            self.run_over.set()
            if not self._expecting:
                self.all_heard.set()
        print(f"the run is over ({reason}); this gateway tells its devices so when they poll "
              f"({len(self._expecting)} seen in the last {window:.0f} s)", flush=True)
        return True

    def done_answer(self, device: str) -> dict[str, Any] | None:
        """The ``done`` answer to a poll of ``device`` once the run is over (``None`` before)."""
        with self._over_lock:
            reason = self.over
            if reason is None:
                return None
            self._told.add(device)
            if self._expecting <= self._told:
                self.all_heard.set()
        return {"kind": "done", "reason": reason, "next-in-s": RUN_OVER_NEXT_IN_S}

    def heard(self) -> tuple[int, int]:
        """(devices told the run is over, of those seen lately when it ended)."""
        with self._over_lock:
            return len(self._expecting & self._told), len(self._expecting)

    def task_for(self, session: Any) -> bytes | None:
        """The frame of the open round's task for ``session``, or ``None`` (nothing for it now)."""
        if self.exchange is not None:
            return self.exchange.task_for(session.device)
        current = self.round
        if current is None or current.closed or current.complete.is_set() or current.has_answered(session.device):
            return None
        left = max(0.0, self.settings.round_deadline_s - (time.monotonic() - current.opened))
        header = {"kind": current.kind, TASK_ID: current.task_id, "server-round": current.server_round,
                  "graph": current.graph, "config": current.config, "uplink": self.settings.uplink,
                  DEADLINE_S: round(left, 1)}
        # an asynchronous run hands one model version out again and again (each gateway flush): a device trains it
        # again (no round to be counted twice in), with a seed of that task's, so no two of its results are the same
        asynchronous = current.late_exponent is not None
        header[DEVICE_SEED] = device_seed(int(current.config.get(knobs.SEED, 0)), current.server_round,
                                          session.device + (current.task_id if asynchronous else ""))
        if asynchronous:
            header[ASYNCHRONOUS] = True
        if self.last_round > 0:  # the run's number of rounds: a device follows the run (the web demo page's progress)
            header[NUM_ROUNDS] = self.last_round
        task = current.task(session)
        return assemble_frame(header, task.entries, task.data)

    def result_limit(self) -> int:
        """The most bytes a result for the round in flight can take (409 when none is in flight; in an
        asynchronous run, a result for one of its last closed train rounds is taken too)."""
        current = self.round
        open_round = self.exchange is not None or (current is not None and not current.closed) or bool(self.earlier)
        if not open_round or not self.model_elements:
            if current is not None and current.closed and self.exchange is None:
                raise refused(409, f"round {current.server_round} closed before this result arrived (it had its "
                                   "results, or its deadline passed); it was not counted")
            raise refused(409, "no round is open; ask for a task first (GET /v1/task)")
        return 8 * self.model_elements + MAX_RESULT_SLACK

    def remember(self, closed: GatewayRound) -> None:
        """Keep a closed train round of an asynchronous run (its devices still training may answer late): the
        last LATE_ROUNDS of them."""
        if closed.late_exponent is not None and closed.kind == "train":
            self.earlier = dict(list(self.earlier.items())[-(LATE_ROUNDS - 1):]) | {closed.task_id: closed}

    def take_late(self, late: LateResult) -> None:
        """Fold a late result into the train round open now, or keep it for the next one (at most
        MAX_PENDING_LATE wait: beyond, 409 and not counted)."""
        with self._late_lock:
            current = self.round
            if current is not None and current.fold_late(late):
                return
            if len(self.pending) >= MAX_PENDING_LATE:
                raise refused(409, f"{MAX_PENDING_LATE} late results already wait for this gateway's next round; "
                                   "this one was not counted")
            self.pending.append(late)

    def open_round(self, current: GatewayRound) -> None:
        """Make ``current`` the round in flight, folding in the late results that waited for it."""
        with self._late_lock:
            self.round = current
            self.pending = [late for late in self.pending if not current.fold_late(late)]  # an evaluate round: none

    def round_target(self) -> int:
        """How many device results complete a round."""
        if self.settings.devices_per_round:
            return self.settings.devices_per_round
        return max(self.settings.min_devices, self.sessions.live(2 * self.settings.idle_poll_s))

    async def run_round(self, header: dict[str, Any], frame_tensors: dict[str, Any]) -> RoundResult:
        """Open a round for the coordinator's instruction, wait for results, close it."""
        kind = header.get("kind")
        if kind not in ("train", "evaluate"):
            raise refused(400, f"control: kind must be train or evaluate, got {kind!r:.20}")
        self.note_round(header)
        self.model_elements = sum(math.prod(np.shape(value)) for value in frame_tensors.values())  # bounds results
        if kind == "train" and header.get("secure") is not None:
            if self.settings.downlink != FP32.spec:  # the masked sum is taken against the model as the steps carry it
                log.info("round %s: a secure round sends its tasks as fp32 (--downlink %s applies to plain rounds)",
                         header.get("server-round"), self.settings.downlink)
            return await asyncio.to_thread(self.run_secure_round, header, frame_tensors)
        current = GatewayRound(kind=str(kind), server_round=int(header.get("server-round", 0)),
                               late_exponent=_late(header),
                               config=dict(header.get("config", {})), graph=str(header.get("graph", "")),
                               weights=frame_tensors, target=self.round_target(),
                               max_num_examples=self.settings.max_num_examples,
                               bounds=DeviceBounds.of(dict(header.get("config", {}))),
                               device_rule=self.settings.device_rule if kind == "train" else "mean",
                               trim_fraction=self.settings.device_trim_fraction, downlink=self.settings.downlink)
        self.open_round(current)
        log.info("round %d (%s): offered to this gateway's devices, waiting for %d results (deadline %.0f s)",
                 current.server_round, kind, current.target, self.settings.round_deadline_s)
        deadline = time.monotonic() + self.settings.round_deadline_s
        said = -math.inf
        while not current.complete.is_set() and time.monotonic() < deadline:
            if time.monotonic() - said >= self.progress_every_s:
                said = time.monotonic()
                self.say_waiting(current.server_round, wanted=current.target, deadline=deadline,
                                 taken=current.taken, answered=current.answered)
            await asyncio.sleep(0.05)
        result = current.close()
        self.rounds_done += 1
        self.remember(current)
        if result is None:
            raise refused(504, f"round {current.server_round}: none of this gateway's devices answered within "
                               f"{self.settings.round_deadline_s:.0f} s ({len(self.sessions)} checked in)")
        late = f", {result.late} of them late (for an earlier round, staleness-weighted)" if result.late else ""
        log.info("round %d (%s): %d device results%s (%d rejected, %d clipped to the norm bound, %d weights capped), "
                 "%d examples", current.server_round, kind, result.devices, late, result.rejected, result.clipped,
                 result.capped, result.num_examples)
        return result

    def pool(self, server_round: int = 0) -> dict[int, str]:
        """A secure round's devices, by pool node id: fixed when it starts (secrets are shared among them).

        Waits, up to the round deadline, until ``devices-per-round`` devices (else ``min-devices``
        and at least 3) were seen in the last three poll intervals, then takes
        ``devices-per-round`` of them at random (else all).
        """
        wanted = self.settings.devices_per_round or max(self.settings.min_devices, MIN_DEVICES)
        deadline = time.monotonic() + self.settings.round_deadline_s
        said = -math.inf
        while len(names := self.sessions.live_devices(3 * self.settings.idle_poll_s, secure=True)) < wanted and \
                time.monotonic() < deadline:
            if time.monotonic() - said >= self.progress_every_s:
                said = time.monotonic()
                self.say_waiting(server_round, wanted=wanted, deadline=deadline, secure=True)
            time.sleep(0.05)
        if self.settings.devices_per_round:
            names = self._rng.sample(names, min(len(names), self.settings.devices_per_round))
        return {pool_node_id(name): name for name in names}

    def run_secure_round(self, header: dict[str, Any], weights: dict[str, Any]) -> RoundResult:
        """A train round under secure aggregation over this gateway's pool (a worker thread:
        it blocks while the devices poll for each step)."""
        secure = check_secure_settings(header.get("secure"))
        self.sessions.secure_run = True  # from now on, devices that cannot do secure aggregation are refused
        server_round, config = int(header.get("server-round", 0)), dict(header.get("config", {}))
        run_seed = int(config.get(knobs.SEED, 0))
        if self.exchange is not None:
            raise refused(409, f"round {server_round}: a secure-aggregation round is still running on this gateway; "
                               "this one is refused (the coordinator goes on without this gateway)")
        exchange = self.exchange = SecureExchange(lambda device: device_seed(run_seed, server_round, device),
                                                  str(header.get("graph", "")))
        try:
            devices = self.pool(server_round)
            exchange.members.update(devices.values())  # paced to come back soon from now on
            log.info("round %d (train, secure aggregation): %d devices in this gateway's pool", server_round,
                     len(devices))
            if self.settings.device_rule != "mean":
                log.warning("round %d: device rule %s does not apply to a secure pool (this gateway sees only its "
                            "sum): the pool's mean is sent", server_round, self.settings.device_rule)
            pooled = secure_pool_round(exchange, devices, server_round=server_round, weights=weights,
                                       config=config, secure=secure, step_timeout_s=self.settings.round_deadline_s)
        finally:
            if self.exchange is exchange:  # only this round's: a later round's exchange is not cleared
                self.exchange = None
            self.rounds_done += 1
        log.info("round %d (train, secure aggregation): %d devices' masked inputs summed, weight %.0f; clipped %s",
                 server_round, pooled.devices, pooled.weight,
                 ", ".join(f"{key} {count}" for key, count in pooled.clipping.items()) or "nothing")
        return RoundResult(kind="train", arrays=pooled.arrays, num_examples=max(1, round(pooled.weight)), metrics={},
                           samples_processed=0, steps=1, devices=pooled.devices,
                           rejected=len(devices) - pooled.devices, secure=True, pool_clipping=pooled.clipping)


# --------------------------------------------------------------------------- the HTTP layer
def _late(header: dict[str, Any]) -> float | None:
    """The staleness exponent of an asynchronous run's round (``None``: a synchronous run, late results refused)."""
    value = header.get(LATE_EXPONENT)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 16:
        raise refused(400, f"control: '{LATE_EXPONENT}' must be a number in [0, 16], got {value!r:.20}")
    return float(value)


def _json(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Any:
    from starlette.responses import JSONResponse  # noqa: PLC0415 - only a serving process needs starlette

    return JSONResponse(body, status_code=status, headers=headers)


async def _body(request: Any, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes (checked while it streams in)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise refused(413, f"the body is larger than this gateway takes ({limit} bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise refused(413, f"the body is larger than this gateway takes ({limit} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


Handler = Callable[[Any], Awaitable[Any]]


def device_app(gateway: Gateway, *, max_body: int = 64 << 20, web: WebSite | None = None,
               allow_origins: tuple[str, ...] = ()) -> Any:
    """The Starlette app devices talk to (``/v1/...``), and with ``web`` the web SDK's demo page (``/web/...``).

    ``allow_origins`` (``--allow-origin``): the web apps' origins whose pages may call ``/v1`` (CORS,
    :func:`fedge.clients.gateway.web.cors_middleware`); none: same-origin pages only.
    """
    from starlette.applications import Starlette  # noqa: PLC0415
    from starlette.requests import ClientDisconnect  # noqa: PLC0415
    from starlette.responses import FileResponse, Response  # noqa: PLC0415
    from starlette.routing import Route  # noqa: PLC0415

    def guarded(handler: Handler) -> Handler:
        async def run(request: Any) -> Any:
            address = request.client.host if request.client else "?"
            if gateway.in_flight >= gateway.settings.max_in_flight or \
                    gateway.in_flight_by[address] >= gateway.settings.max_per_address:
                wait = gateway.next_in_s()
                return _json({"error": "the gateway is busy; come back later", "next-in-s": wait}, 503,
                             {"Retry-After": str(max(1, round(wait)))})
            gateway.in_flight += 1
            gateway.in_flight_by[address] += 1
            try:
                return await handler(request)
            except DeviceProtocolError as exc:
                return _json({"error": str(exc), "next-in-s": gateway.next_in_s()}, exc.status)
            except ClientDisconnect:  # its body came too late (answered 408) or it went away: nothing to send
                return Response(status_code=408)
            except Exception as exc:  # noqa: BLE001 - one line per request, never a traceback
                log.warning("%s %s from %s failed: %s: %.200s", request.method, request.url.path, address,
                            type(exc).__name__, exc)
                return _json({"error": "the gateway could not handle this request (its log says why)"}, 500)
            finally:
                gateway.in_flight -= 1
                gateway.in_flight_by[address] -= 1
                if gateway.in_flight_by[address] <= 0:
                    del gateway.in_flight_by[address]
        return run

    def headers_session(request: Any) -> Any:
        """The session the request's headers name, checked before its body is read (401/403 otherwise)."""
        return gateway.sessions.session_of(authorization=request.headers.get(SESSION_HEADER),
                                           counter=request.headers.get(COUNTER_HEADER),
                                           mac=request.headers.get(MAC_HEADER))[0]

    async def session_of(request: Any, body: bytes) -> Any:
        return gateway.sessions.authenticate(
            authorization=request.headers.get(SESSION_HEADER), counter=request.headers.get(COUNTER_HEADER),
            mac=request.headers.get(MAC_HEADER), method=request.method, path=request.url.path, body=body)

    async def hello(request: Any) -> Any:
        return _json({"protocol": VERSION, "gateway": gateway.settings.name, "next-in-s": 0})

    async def check_in(request: Any) -> Any:
        token, key, _ = gateway.sessions.check_in(read_json(await _body(request, 8192), "check-in body"))
        return _json(new_session_answer(token, key, gateway.sessions.ttl_s, gateway.next_in_s()))

    async def task(request: Any) -> Any:
        session = await session_of(request, await _body(request, 0))
        if (done := gateway.done_answer(session.device)) is not None:  # the run is over: the gateway's last word
            return _json(done)
        frame = gateway.task_for(session)
        if frame is None:
            return _json({"kind": "wait", "next-in-s": gateway.next_in_s(session.device)})
        return Response(frame, media_type=FRAME_TYPE)

    async def result(request: Any) -> Any:
        headers_session(request)  # an unauthenticated or stale request is refused before its body is read
        if gateway.over is not None:
            raise refused(409, f"the run is over ({gateway.over}); this result is dropped: poll (GET /v1/task) for "
                               "the gateway's last word")
        body = await _body(request, min(max_body, gateway.result_limit()))
        session = await session_of(request, body)
        current = gateway.round
        frame, scales = decode_frame(body)
        exchange = gateway.exchange
        if frame.header.get("kind") == "secagg":
            if exchange is None:
                raise refused(409, "no secure-aggregation round is in flight; ask for a task first (GET /v1/task)")
            exchange.answer(session.device, frame)
            return _json({"accepted": True, "next-in-s": gateway.next_in_s(session.device)})
        origin = gateway.earlier.get(str(frame.header.get(TASK_ID)))
        if origin is not None:  # an asynchronous run: a result for one of its closed train rounds (the last included)
            gateway.take_late(origin.late_result(session, frame, scales))
        elif current is None:
            raise refused(409, "no round is open; ask for a task first (GET /v1/task)")
        else:
            current.accept(session, frame, scales)
        return _json({"accepted": True, "next-in-s": gateway.next_in_s()})

    async def training_bundle(request: Any) -> Any:
        await session_of(request, await _body(request, 0))
        if gateway.training_bundle is None or not gateway.training_bundle.is_file():
            raise refused(404, "this gateway holds no training graph yet; come back after the coordinator's run starts")
        return FileResponse(gateway.training_bundle, media_type="application/zip")

    async def inference_bundle(request: Any) -> Any:
        await session_of(request, await _body(request, 0))
        if gateway.inference_bundle is None or not gateway.inference_bundle.is_file():
            raise refused(404, "the coordinator has published no inference bundle yet (it does every export-every "
                               "rounds and at the end of a run); come back later")
        return FileResponse(gateway.inference_bundle, media_type="application/zip")

    routes = [Route(f"{PREFIX}/hello", guarded(hello), methods=["GET"]),
              Route(f"{PREFIX}/check-in", guarded(check_in), methods=["POST"]),
              Route(f"{PREFIX}/task", guarded(task), methods=["GET"]),
              Route(f"{PREFIX}/result", guarded(result), methods=["POST"]),
              Route(f"{PREFIX}/bundles/training", guarded(training_bundle), methods=["GET"]),
              Route(f"{PREFIX}/bundles/inference", guarded(inference_bundle), methods=["GET"])]
    pages = [] if web is None else [Route(route.path, guarded(route.endpoint), methods=route.methods)
                                    for route in web_routes(web, authenticate=session_of)]
    return Starlette(routes=routes + pages, middleware=cors_middleware(allow_origins))


def control_app(gateway: Gateway, token: str) -> Any:
    """The loopback app the gateway's own ClientApp hands rounds to (bearer ``token``)."""
    from starlette.applications import Starlette  # noqa: PLC0415
    from starlette.responses import Response  # noqa: PLC0415
    from starlette.routing import Route  # noqa: PLC0415

    async def run_round(request: Any) -> Any:
        if not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {token}"):
            return _json({"error": "not this gateway's ClientApp"}, 401)
        try:
            frame, _ = decode_frame(await request.body())
            result = await gateway.run_round(frame.header, dict(frame.tensors))
        except DeviceProtocolError as exc:
            return _json({"error": str(exc)}, exc.status)
        header = {"num-examples": result.num_examples, "metrics": result.metrics, "devices": result.devices,
                  "rejected": result.rejected, "samples-processed": result.samples_processed, "steps": result.steps,
                  "secure-pool": result.devices if result.secure else 0, "gateway": gateway.settings.name,
                  "clipped": result.clipped, "capped": result.capped, "pool-clipping": dict(result.pool_clipping),
                  "device-norm-median": result.device_norm_median, "late": result.late}
        return Response(encode_frame(header, result.arrays), media_type=FRAME_TYPE)

    async def status(request: Any) -> Any:
        if not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {token}"):
            return _json({"error": "not this gateway's ClientApp"}, 401)
        current = gateway.round
        return _json({"sessions": len(gateway.sessions), "allowed": len(gateway.allow), "in-flight": gateway.in_flight,
                      "rounds-done": gateway.rounds_done,
                      "round-open": current is not None and not current.closed, "run-over": gateway.over,
                      "round-answered": 0 if current is None else current.answered})

    return Starlette(routes=[Route("/control/round", run_round, methods=["POST"]),
                             Route("/control/status", status, methods=["GET"])])


class Served:
    """A uvicorn server on a thread; :meth:`stop` ends it."""

    def __init__(self, app: Any, host: str, port: int, *, limits: ListenerLimits, cert: Path | None = None,
                 cert_key: Path | None = None, name: str = "fedge-gateway") -> None:
        import uvicorn  # noqa: PLC0415

        try:
            sock = bind(host, port)
        except OSError as exc:
            raise ConfigError(f"the gateway cannot listen on {host}:{port} ({exc.strerror or exc}); "
                              "pass another --port") from None
        self.port = int(sock.getsockname()[1])
        tls = None if cert is None or cert_key is None else server_tls(cert, cert_key)
        config = uvicorn.Config(app, log_level="warning", access_log=False, **uvicorn_options(limits, tls=tls))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name=name, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise FedgeError(f"the gateway's listener did not start on {host}:{port}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop serving."""
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _rule_note(settings: GatewaySettings) -> str:
    """The start line's note of a robust device rule ('' for the weighted mean)."""
    if settings.device_rule == "mean":
        return ""
    trim = f" (cutting {settings.device_trim_fraction:g} at each end)" if settings.device_rule == "trimmed-mean" else ""
    return f"; a plain round replies with the {settings.device_rule}{trim} of its devices' updates, unweighted"


def print_insecure_warning() -> None:
    """Say loudly that this gateway serves plain HTTP."""
    print(INSECURE_WARNING, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class GatewayOptions:
    """What ``fedge gateway start`` was asked to do."""

    coordinator: str
    devices: Path  # the allow-list directory (NAME.pub, revoked)
    key: Path | None  # this gateway's node key at the coordinator (`fedge keys add-device`)
    ca: Path | None  # the coordinator's CA
    trust: Path | None  # the coordinator's bundle signing public key (the training graph devices run)
    cert: Path | None = None  # this gateway's TLS certificate and key for its devices
    cert_key: Path | None = None
    host: str = "127.0.0.1"
    port: int = 9443
    insecure: bool = False
    state_dir: Path | None = None
    bundles: str = ""
    max_wait_s: float | None = None
    profile: str = "gpu-box"
    settings: GatewaySettings = GatewaySettings()
    web: WebSite | None = None  # --demo-page: serve the web SDK's demo page
    allow_origins: tuple[str, ...] = ()  # --allow-origin: web apps' origins that may call the device API (CORS)


def check_gateway(options: GatewayOptions) -> None:
    """Refuse a start that could not serve devices, before anything listens."""
    if not options.devices.is_dir():
        raise ConfigError(f"allow-list directory '{options.devices}' does not exist; admit devices with "
                          "`fedge gateway add-device NAME --devices DIR`")
    if options.trust is None or not options.trust.is_file():
        raise ConfigError("--trust KEY.pub is needed: the coordinator's bundle signing public key, which the training "
                          "graph this gateway hands its devices must be signed with")
    if options.web is not None:
        check_web(options.web)
    check_origins(options.allow_origins)
    if options.settings.uplink not in ENCODINGS:
        raise ConfigError(f"--uplink {options.settings.uplink!r}: use {' or '.join(ENCODINGS)}")
    if options.settings.downlink not in TASK_ENCODINGS:
        raise ConfigError(f"--downlink {options.settings.downlink!r}: use {' or '.join(TASK_ENCODINGS)}")
    if options.insecure:
        return
    for path, what in ((options.cert, "--cert"), (options.cert_key, "--cert-key")):
        if path is None or not path.is_file():
            raise ConfigError(f"{what} is needed: the gateway serves its devices over TLS (a certificate its devices' "
                              "CA signed, e.g. `fedge keys init --host NAME`); --insecure only for a throwaway test")
    assert options.cert is not None
    check_certificate_name(options.cert, options.settings.name)


def check_certificate_name(cert: Path, name: str) -> None:
    """Refuse a gateway whose ``--name`` is not the one its TLS certificate carries.

    Devices sign the certificate's gateway name at check-in (so a check-in cannot be relayed
    to another gateway); a gateway announcing another name would refuse every one of them.
    """
    from cryptography import x509  # noqa: PLC0415

    try:
        certificate = x509.load_pem_x509_certificate(cert.read_bytes())
    except ValueError:
        raise ConfigError(f"--cert {cert} is not a PEM certificate") from None
    names = certificate.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    certified = certified_gateway_name(str(names[0].value)) if len(names) == 1 else None
    if certified != name:
        held = f"names gateway '{certified}'" if certified else "names no fedge gateway"
        raise ConfigError(f"--cert {cert} {held}, but this gateway runs as --name '{name}': devices sign the name "
                          "their TLS connection certifies, so make its certificate with "
                          f"`fedge keys add-gateway {name}` (or start it with the certificate's name)")


def raise_file_limit() -> tuple[int, int]:
    """Raise this process's soft open-file limit to its hard limit; the (old, new) soft limits.

    Each device connection holds a file descriptor, from accept until it closes: a systemd
    service's default soft limit (1,024) is far below what a gateway serves (the documented
    unit sets ``LimitNOFILE=65536``, docs/operator.md).
    """
    import resource  # noqa: PLC0415 - POSIX only

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d (%s): the gateway serves at most about "
                        "%d connections; set LimitNOFILE in its service unit", soft, wanted, exc, soft)
            return soft, soft
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def run_gateway(options: GatewayOptions) -> int:
    """Serve devices and join the coordinator as a node until stopped; the node's exit status."""
    from fedge.clients.device import DeviceOptions, run_device  # noqa: PLC0415
    from fedge.edge.signing import ensure_private_dir  # noqa: PLC0415
    from fedge.files import write_bytes_atomic  # noqa: PLC0415

    check_gateway(options)
    before, after = raise_file_limit()
    if after != before:
        log.info("open-file limit raised from %d to %d (one per device connection)", before, after)
    state = ensure_private_dir(options.state_dir or Path.home() / ".fedge-gateway")
    token = secrets.token_urlsafe(32)
    token_file = state / CONTROL_TOKEN
    write_bytes_atomic(token_file, token.encode())  # 0600
    node_state = state / "node"
    gateway = Gateway(options.settings, options.devices, node_state / "bundles" / "training.zip",
                      node_state / "bundles" / "inference.zip")
    if options.insecure:
        print_insecure_warning()
    devices = Served(device_app(gateway, web=options.web, allow_origins=options.allow_origins), options.host,
                     options.port, limits=DEVICE_LIMITS,
                     cert=None if options.insecure else options.cert,
                     cert_key=None if options.insecure else options.cert_key, name="fedge-gateway-devices")
    control = Served(control_app(gateway, token), "127.0.0.1", 0, limits=ListenerLimits(), name="fedge-gateway-ctl")
    scheme = "http" if options.insecure else "https"
    print(f"gateway '{options.settings.name}' serves devices on {scheme}://{options.host}:{devices.port}{PREFIX} "
          f"({len(gateway.allow)} devices in its allow-list{_rule_note(options.settings)})", flush=True)
    if options.web is not None:
        print(f"web device demo page: {scheme}://{options.host}:{devices.port}/web/demo.html?name=NAME", flush=True)
        if (warning := demo_page_warning(options.host)) is not None:
            print(warning, file=sys.stderr, flush=True)
    stop = threading.Event()
    threading.Thread(target=relay_inference_bundles, args=(options, node_state, stop, gateway), daemon=True,
                     name="fedge-gateway-inference").start()
    threading.Thread(target=watch_run_end, args=(gateway, options.coordinator, stop), daemon=True,
                     name="fedge-gateway-run-end").start()
    try:
        wait_for_training_graph(options, node_state, stop=stop)  # a gateway may start before its coordinator
        code = run_device(DeviceOptions(
            coordinator=options.coordinator, profile=options.profile, data=Path("."), key=options.key, ca=options.ca,
            insecure=options.insecure, max_wait_s=options.max_wait_s, state_dir=node_state, runtime="onnx",
            trust=options.trust, bundles=options.bundles, gateway_control=f"127.0.0.1:{control.port}",
            gateway_token=token_file, idle_pull_s=GATEWAY_IDLE_PULL_S))
        if gateway.over is None and not coordinator_reachable(options.coordinator):
            gateway.finish("the coordinator has gone away: its run is over, or it stopped")
        if gateway.over is not None:
            tell_devices(gateway)
        return code
    finally:
        stop.set()
        devices.stop()
        control.stop()


def wait_for_training_graph(options: GatewayOptions, node_state: Path, *, fetch: Callable[[], Path] | None = None,
                            stop: threading.Event | None = None, say_every_s: float = GRAPH_WAIT_SAY_S,
                            retry_s: tuple[float, float] = (1.0, 10.0),
                            clock: Callable[[], float] = time.monotonic) -> Path | None:
    """Pull the coordinator's signed training graph for the devices, waiting as long as it takes.

    A gateway may start before its coordinator (or while the coordinator still exports the
    graph): it waits, saying so when it starts waiting and every ``say_every_s`` seconds after,
    instead of giving up. ``--max-wait`` bounds the wait when given. The graph's path, or
    ``None`` when ``stop`` was set first. ``fetch`` and ``clock`` stand in for the pull and the
    clock in tests; the retry delay doubles from ``retry_s[0]`` to ``retry_s[1]`` seconds.

    Raises
    ------
    FedgeError
        The graph did not come within ``--max-wait``.
    """
    from fedge.clients.device import bundle_service  # noqa: PLC0415
    from fedge.edge.delivery import DeliveryError, pull  # noqa: PLC0415

    where = options.bundles or bundle_service(options.coordinator)

    def pull_graph() -> Path:
        assert options.trust is not None
        return pull(url_or_address=where, kind="training", directory=node_state / "bundles", device_key=options.key,
                    ca=options.ca, trusted_keys=[options.trust], freshness_dir=node_state / "freshness",
                    insecure=options.insecure).path

    fetch = fetch or pull_graph
    stop = stop or threading.Event()
    started, said, delay = clock(), -math.inf, retry_s[0]
    while True:
        try:
            return fetch()
        except DeliveryError as exc:
            waited = clock() - started
            if options.max_wait_s is not None and waited + delay > options.max_wait_s:
                raise FedgeError(f"no training graph at {where} within --max-wait {options.max_wait_s:.0f} s "
                                 f"({exc}); start the coordinator (its run publishes the graph), or drop --max-wait "
                                 "to wait for it") from None
            if clock() - said >= say_every_s:
                said = clock()
                print(f"waiting for the coordinator's training graph at {where} (start the coordinator first, or "
                      f"it is still exporting); waited {waited:.0f} s so far: {exc}", flush=True)
        if stop.wait(delay):
            return None
        delay = min(2 * delay, retry_s[1])


def coordinator_reachable(coordinator: str, timeout_s: float = 5.0) -> bool:
    """Whether a TCP connection to the coordinator's ``HOST:PORT`` opens now."""
    import socket  # noqa: PLC0415

    from fedge.clients.device import split_address  # noqa: PLC0415

    try:
        with socket.create_connection(split_address(coordinator), timeout=timeout_s):
            return True
    except OSError:
        return False


def watch_run_end(gateway: Gateway, coordinator: str, stop: threading.Event,
                  reachable: Callable[[str], bool] = coordinator_reachable, every_s: float = RUN_END_PROBE_S) -> None:
    """Declare the run over once the gateway was handed its last round and the coordinator then closed.

    Flower tells a SuperNode nothing when the run finishes: the coordinator stops its
    SuperLink. Only after the run's last round does a closed port mean the run is over (before
    it, the coordinator may be restarting; ``fedge device``'s offline limit covers that).
    """
    while not stop.wait(every_s):
        if gateway.over is None and gateway.final_round_seen and not reachable(coordinator):
            gateway.finish(f"round {gateway.last_round} of {gateway.last_round} was its last and the coordinator "
                           "has closed")


def tell_devices(gateway: Gateway, grace_s: float | None = None) -> None:
    """Before the listener goes: wait until every device seen lately heard ``done``, at most ``grace_s``
    (default: three poll intervals plus 10 s, the longest a polling device stays away)."""
    grace = grace_s if grace_s is not None else 3 * gateway.settings.idle_poll_s + 10.0
    gateway.all_heard.wait(grace)
    told, expected = gateway.heard()
    print(f"gateway '{gateway.settings.name}' stops: {told} of {expected} devices heard that the run is over",
          flush=True)


INFERENCE_PULL_S = 30.0


def relay_inference_bundles(options: GatewayOptions, node_state: Path, stop: threading.Event,
                            gateway: Gateway | None = None) -> None:
    """Keep the coordinator's latest inference bundle for devices (``GET /v1/bundles/inference``).

    Pulled every :data:`INFERENCE_PULL_S` seconds as the gateway's node, with the same
    checks a device makes (:func:`fedge.edge.delivery.pull`: signature by the trusted key,
    hashes, expiry, and no rollback to an older version): a gateway never relays a bundle it
    would refuse itself, and devices verify it again. Once ``gateway``'s run is over it
    stops; after the run's last round, a bundle service that went away is expected (the
    coordinator is closing) and not warned about.
    """
    from fedge.clients.device import bundle_service  # noqa: PLC0415
    from fedge.edge.delivery import DeliveryError, NotPublished, pull  # noqa: PLC0415

    assert options.trust is not None

    def over() -> bool:
        return gateway is not None and gateway.over is not None

    said = False
    while not stop.is_set():
        if over():  # nothing to relay; a round that comes after all (a new run) wakes it again
            if not said:
                log.info("the run is over: this gateway pulls no further inference bundles")
            said = True
            stop.wait(1.0)
            continue
        said = False
        try:
            result = pull(url_or_address=options.bundles or bundle_service(options.coordinator), kind="inference",
                          directory=node_state / "bundles", device_key=options.key, ca=options.ca,
                          trusted_keys=[options.trust], freshness_dir=node_state / "freshness",
                          insecure=options.insecure)
            if result.changed:
                log.info("inference bundle for devices: %s (%d bytes downloaded)", result.path, result.bytes_downloaded)
        except NotPublished:
            pass  # not yet: the coordinator exports every export-every rounds and at the end
        except (DeliveryError, OSError) as exc:
            if over() or (gateway is not None and gateway.final_round_seen):
                log.debug("inference bundle not pulled after the run's last round: %s", exc)
            else:
                log.warning("could not pull the coordinator's inference bundle: %s; trying again in %.0f s", exc,
                            INFERENCE_PULL_S)
        deadline = time.monotonic() + INFERENCE_PULL_S
        while not stop.is_set() and not over() and (left := deadline - time.monotonic()) > 0:
            stop.wait(min(1.0, left))


def add_protocol_device(directory: Path, name: str, *, force: bool = False) -> tuple[Path, Path]:
    """A protocol device's key pair (ECDSA P-256, PEM) in the allow-list ``directory``: NAME.key, NAME.pub.

    The private key goes to the device (an app keeps it in the Android Keystore or the iOS
    Keychain instead, and only its public key comes here); the public key stays.
    """
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415

    from fedge.edge.signing import ensure_private_dir  # noqa: PLC0415
    from fedge.files import write_bytes_atomic  # noqa: PLC0415
    from fedge.wire import PROFILE_NAME  # noqa: PLC0415 - the same plain names as profiles

    if not PROFILE_NAME.match(name):
        raise ConfigError(f"device name '{name}' must be 1-64 letters, digits, '.', '_' or '-'")
    ensure_private_dir(directory)
    private_path, public_path = directory / f"{name}.key", directory / f"{name}.pub"
    if private_path.exists() and not force:
        raise ConfigError(f"{private_path} exists; pass --force to replace it")
    private = ec.generate_private_key(ec.SECP256R1())
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    write_bytes_atomic(private_path, pem)  # 0600
    write_bytes_atomic(public_path, private.public_key().public_bytes(serialization.Encoding.PEM,
                                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
    return private_path, public_path


def revoke_protocol_device(directory: Path, name: str) -> None:
    """Add ``name`` to the allow-list's ``revoked`` file (a running gateway refuses it within a second)."""
    revoked = directory / "revoked"
    names = set(revoked.read_text().split()) if revoked.exists() else set()
    revoked.write_text("".join(f"{n}\n" for n in sorted(names | {name})))
