"""The coordinator dashboard: a small web app over a run directory, live or finished.

Starlette + uvicorn; the page (``dashboard_static/``) is plain HTML/CSS/JS that draws its
charts as SVG from the JSON API, with no CDN and no third-party script. Everything is
read from the run directory the coordinator (or ``fedge simulate``) writes:
``config.json``, ``metrics.jsonl`` (one row per round), ``devices.jsonl`` (one line per
device reply), ``summary.json`` (when finished) and ``bundles/*/manifest.json``. Lines
that do not parse (a run still writing its last line) are skipped and counted.

Threat model: the dashboard is read-only and shows metrics, device ids and profiles, not
updates or data. It binds to 127.0.0.1 by default; on any other address a token is
required (``?token=`` once, then a cookie, or ``Authorization: Bearer``), compared in
constant time; on loopback the Host header must name loopback (no DNS rebinding). Its
listener has :mod:`fedge.listeners`' connection limits. ``/metrics`` escapes every
label value (device-sent reasons included) as the Prometheus text format asks, keeps at
most :data:`MAX_REASONS` reason labels, and reads only what ``devices.jsonl`` gained since
the last scrape (a scrape costs O(new lines + metrics), not O(device replies)). It has
no TLS of its own: put it behind a TLS proxy when it leaves loopback. A bundle's signature
is shown as present, not verified: ``fedge verify`` does that against a trusted key.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
import socket
import threading
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from fedge import knobs
from fedge.errors import ConfigError
from fedge.listeners import ListenerLimits, uvicorn_options

STATIC = Path(__file__).resolve().parent / "dashboard_static"
LOOPBACK_NAMES = ["127.0.0.1", "localhost", "::1", "[::1]"]
COOKIE = "fedge-dashboard-token"
MAX_REASONS = 100  # distinct (status, reason) labels of fedge_replies_failed_total; more are counted as "other"
LIMITS = ListenerLimits(max_header_bytes=16 * 1024, header_timeout_s=10.0, idle_timeout_s=5, per_address=16,
                        concurrency=256)


def is_loopback(host: str) -> bool:
    """Whether ``host`` only listens on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_lines(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a JSONL file, and how many lines did not parse (partial or garbled)."""
    if not path.exists():
        return [], 0
    rows, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


Live = Callable[[], dict[str, Any]]  # the coordinator's own state (FleetWatch.live): SuperLink, devices online


class RunView:
    """What the API serves, read fresh from ``run_dir`` on every request.

    ``live``, given by a running coordinator, adds what the run directory cannot know: whether
    the SuperLink is up and how many devices are online and registered right now.
    """

    def __init__(self, run_dir: Path, state_dir: Path | None = None, live: Live | None = None) -> None:
        self.run_dir, self.state_dir, self.live = run_dir, state_dir, live
        self.replies = ReplyTally(run_dir / "devices.jsonl")

    def names(self) -> dict[str, str]:
        """``{node id: device name}`` from the coordinator's registered keys (``STATE_DIR/device-names.json``)."""
        if self.state_dir is None:
            return {}
        from fedge.server.coordinator import read_names

        return read_names(self.state_dir / "device-names.json")

    def rounds(self) -> dict[str, Any]:
        rows, bad = read_lines(self.run_dir / "metrics.jsonl")
        rows = [row for row in rows if isinstance(row.get("round"), int)]
        return {"rounds": rows, "skipped_lines": bad}

    def summary(self) -> dict[str, Any]:
        rows = self.rounds()["rounds"]
        config = _read_json(self.run_dir / "config.json") or {}
        finished = _read_json(self.run_dir / "summary.json")
        last = rows[-1] if rows else {}
        named_task = str(config.get(knobs.TASK) or "")  # a custom or registered task: dataset and model are not its
        return {
            "run": self.run_dir.name,
            "status": "finished" if finished is not None else ("running" if rows else "starting"),
            "rounds_done": int(last.get("round", 0)),
            "rounds_total": int(config.get(knobs.NUM_ROUNDS, 0)),
            "metric": last.get("metric", "accuracy"), "higher_is_better": last.get("higher_is_better", True),
            "headline": last.get("headline", last.get("accuracy")), "best_headline": _best_headline(rows),
            "accuracy": last.get("accuracy"), "loss": last.get("loss"),
            "sim_time_s": last.get("sim_time_s"), "wall_time_s": last.get("wall_time_s"),
            "dp_epsilon": last.get("dp_epsilon"), "dp_delta": last.get("dp_delta"),
            "strategy": config.get(knobs.STRATEGY), "task": (finished or {}).get("task") or named_task or None,
            "dataset": None if named_task else config.get(knobs.DATASET),
            "model": None if ":" in named_task else config.get(knobs.MODEL),  # a task of the user's own: its own model
            "secure_aggregation": config.get(knobs.SECURE_AGGREGATION), "dp": config.get(knobs.DP),
            "summary": finished, "config": config,
        }

    def devices(self) -> dict[str, Any]:
        events, bad = read_lines(self.run_dir / "devices.jsonl")
        devices: dict[str, dict[str, Any]] = {}
        names = self.names()
        for event in events:
            raw = event.get("node_id", event.get("node"))
            if not isinstance(raw, int | str) or isinstance(raw, bool) or not str(raw).isdigit():
                continue
            node = str(raw)  # a string: browsers' numbers lose the last digits of 19-digit ids
            device = devices.setdefault(node, {"node": node, "name": event.get("name") or names.get(node, ""),
                                               "profile": "", "rounds_joined": 0, "rejected": 0,
                                               "errors": 0, "last_round": 0, "last_reply_s": None})
            device["profile"] = event.get("profile") or device["profile"]
            device["last_round"] = max(device["last_round"], int(event.get("round", 0)))
            device["last_seen_sim_s"] = event.get("sim_time_s")
            device["last_seen_wall_s"] = event.get("wall_time_s")
            status = event.get("status")
            if status == "ok":
                device["rounds_joined"] += 1
                device["last_reply_s"] = event.get("reply_s")
            elif status == "rejected":
                device["rejected"] += 1
            else:
                device["errors"] += 1
        ordered = sorted(devices.values(), key=lambda d: (-d["last_round"], d["name"], int(d["node"])))
        return {"devices": ordered, "skipped_lines": bad}

    def rejections(self) -> dict[str, Any]:
        rows = self.rounds()["rounds"]
        names = self.names()
        found = []
        for row in rows:
            for rejection in row.get("rejections", []):
                if isinstance(rejection, dict):
                    item = {"round": row["round"], **rejection}
                    if "node_id" in item:
                        item["node_id"] = str(item["node_id"])
                        item["name"] = names.get(item["node_id"], "")
                    found.append(item)
        return {"rejections": found}

    def health(self) -> dict[str, Any]:
        """Liveness for a supervisor or load balancer: the run's status and last completed round.

        With a coordinator's ``live`` state, ``ok`` is false (HTTP 503) when its SuperLink died
        or the run failed; a finished run whose SuperLink was stopped on purpose stays ok.
        """
        summary = self.summary()
        health: dict[str, Any] = {"ok": True, "status": summary["status"], "rounds_done": summary["rounds_done"]}
        if self.live is not None:
            live = self.live()
            if live.get("run") == "failed":
                health["status"] = "failed"
            health.update(superlink=live.get("superlink"), devices_online=live.get("devices_online"))
            health["ok"] = live.get("superlink") != "down" and live.get("run") != "failed"
        return health

    def metrics(self) -> str:
        """Prometheus text format: rounds, participants, rejected and failed replies by reason, bytes,
        round latency, devices that replied in the last round and, from a coordinator, devices online."""
        summary_rows = self.rounds()["rounds"]
        rows = [row for row in summary_rows if int(row.get("round", 0)) > 0]
        summary = self.summary()
        tally = self.replies.update()
        last = rows[-1] if rows else {}
        lines = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP fedge_{name} {_help(help_text)}", f"# TYPE fedge_{name} {kind}"])
            lines.extend(f"fedge_{name}{labels} {value:g}" for labels, value in samples)

        metric("rounds_completed", "gauge", "Rounds completed by the current run.", [("", len(rows))])
        metric("rounds_total", "gauge", "Rounds the current run was asked for.", [("", summary["rounds_total"])])
        metric("run_finished", "gauge", "1 once the run wrote its summary.", [("", summary["status"] == "finished")])
        metric("participants", "gauge", "Devices whose update the last round kept.",
               [("", last.get("participants", 0))])
        metric("participants_total", "counter", "Updates kept over the run.",
               [("", sum(r.get("participants", 0) for r in rows))])
        metric("replies_failed_total", "counter", "Device replies rejected or failed, by reason.",
               [(f'{{status="{_label(status)}",reason="{_label(reason)}"}}', count)
                for (status, reason), count in sorted(tally.by_reason.items())])
        metric("bytes_total", "counter", "Model bytes moved over the run.",
               [('{direction="up"}', sum(r.get("bytes_up", 0) for r in rows)),
                ('{direction="down"}', sum(r.get("bytes_down", 0) for r in rows))])
        walls = [float(r.get("wall_time_s") or 0.0) for r in summary_rows]
        latency = walls[-1] - walls[-2] if len(walls) >= 2 else 0.0
        metric("round_latency_seconds", "gauge", "Wall-clock seconds of the last round.", [("", latency)])
        metric("devices_replied_last_round", "gauge", "Devices that replied (any status) in the last round.",
               [("", len(tally.by_round.get(last.get("round"), ())))])
        live = self.live() if self.live is not None else {}
        if live:
            metric("superlink_up", "gauge", "1 while the coordinator's SuperLink runs.",
                   [("", live.get("superlink") == "up")])
        if live.get("devices_online") is not None:
            metric("devices_online", "gauge", "Devices connected to the coordinator now (online at its SuperLink).",
                   [("", live["devices_online"])])
            metric("devices_registered", "gauge", "Device keys the coordinator admits (registered, not revoked).",
                   [("", live["devices_registered"])])
        if last.get("headline") is not None:
            metric("headline", "gauge", f"The task's headline metric ({last.get('metric', 'accuracy')}).",
                   [("", float(last["headline"]))])
        return "\n".join(lines) + "\n"


    def bundle(self) -> dict[str, Any]:
        manifests = sorted((self.run_dir / "bundles").glob("*/manifest.json"))
        if not manifests:
            return {"bundle": None}
        latest = manifests[-1]
        return {"bundle": str(latest.parent.relative_to(self.run_dir)), "manifest": _read_json(latest),
                "has_signature": (latest.parent / "manifest.sig").exists()}


def _label(value: str) -> str:
    """A Prometheus label value: backslash, double quote and line feed escaped as the text format asks.

    Any other control character (a carriage return, ...) has no escape in the format and is
    replaced with U+FFFD, so a device-sent value can never end a line or forge a sample.
    """
    value = "".join("\ufffd" if ch != "\n" and unicodedata.category(ch) == "Cc" else ch for ch in value)
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _help(text: str) -> str:
    """A ``# HELP`` text: backslash and line feed escaped (and other control characters replaced)."""
    return _label(text).replace('\\"', '"')


class ReplyTally:
    """What ``/metrics`` needs from ``devices.jsonl``, kept current by reading only the lines appended since.

    ``by_reason``: replies rejected or failed per ``(status, reason)`` (reasons cut to 80
    characters; beyond :data:`MAX_REASONS` distinct ones, ``"other"``). ``by_round``: node ids
    that replied in each of the last few rounds. A file replaced or cut short is read again
    from its start; a last line without its newline yet waits for the next look.
    """

    KEEP_ROUNDS = 4
    BLOCK = 1 << 20

    def __init__(self, path: Path) -> None:
        self.path = path
        self.by_reason: dict[tuple[str, str], int] = {}
        self.by_round: dict[Any, set[str]] = {}
        self._offset, self._identity = 0, (0, 0)
        self._lock = threading.Lock()

    def update(self) -> ReplyTally:
        """Fold in the lines appended since the last call; returns ``self``."""
        with self._lock:
            try:
                handle = self.path.open("rb")
            except FileNotFoundError:
                self._restart((0, 0))
                return self
            with handle:
                info = os.fstat(handle.fileno())
                if (info.st_dev, info.st_ino) != self._identity or info.st_size < self._offset:
                    self._restart((info.st_dev, info.st_ino))
                handle.seek(self._offset)
                while block := handle.read(self.BLOCK):
                    end = block.rfind(b"\n") + 1
                    if end == 0:
                        break
                    self._offset += end
                    handle.seek(self._offset)
                    for line in block[:end].splitlines():
                        self._fold(line)
        return self

    def _restart(self, identity: tuple[int, int]) -> None:
        self.by_reason, self.by_round = {}, {}
        self._offset, self._identity = 0, identity

    def _fold(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        status = event.get("status")
        if status in ("rejected", "error"):
            key = (str(status), str(event.get("reason", ""))[:80])
            if key not in self.by_reason and len(self.by_reason) >= MAX_REASONS:
                key = (str(status), "other")
            self.by_reason[key] = self.by_reason.get(key, 0) + 1
        round_ = event.get("round")
        if isinstance(round_, int) and not isinstance(round_, bool):
            if round_ not in self.by_round:
                self.by_round[round_] = set()
                for old in sorted(self.by_round)[:-self.KEEP_ROUNDS]:
                    del self.by_round[old]
            self.by_round.get(round_, set()).add(str(event.get("node_id", event.get("node"))))


def check_exposure(host: str, token: str | None, what: str, fix: str) -> None:
    """The rule of every fedge HTTP endpoint for the operator: loopback, or a token.

    Raises
    ------
    ConfigError
        A non-loopback ``host`` without a token (``fix`` names how to give one).
    """
    if not is_loopback(host) and not token:
        raise ConfigError(f"{what} on {host} (not loopback) needs a token: {fix}, or bind 127.0.0.1")


def _guards(host: str, token: str | None) -> list[Middleware]:
    """The token gate (when a token is set) and, on loopback, the Host check against DNS rebinding."""
    middleware = [Middleware(TokenGate, token=token)] if token else []
    if is_loopback(host):  # a page on another site cannot reach us through a rebound DNS name
        middleware.insert(0, Middleware(TrustedHostMiddleware, allowed_hosts=LOOPBACK_NAMES))
    return middleware


def _service_routes(view: RunView) -> list[Route]:
    """``/health`` (HTTP 503 when not ok) and ``/metrics`` (Prometheus text format)."""

    async def health(request: Request) -> Response:
        state = view.health()
        return JSONResponse(state, status_code=200 if state["ok"] else 503)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(view.metrics(), media_type="text/plain; version=0.0.4")

    return [Route("/health", health), Route("/metrics", metrics)]


def create_service_app(run_dir: Path, *, host: str = "127.0.0.1", token: str | None = None,
                       state_dir: Path | None = None, live: Live | None = None) -> Starlette:
    """The coordinator's operator endpoint: ``/health`` and ``/metrics`` only, under the dashboard's rules.

    Raises
    ------
    ConfigError
        A non-loopback ``host`` without a token.
    """
    check_exposure(host, token, "the metrics endpoint", "pass --metrics-token-file FILE")
    return Starlette(routes=_service_routes(RunView(run_dir, state_dir, live)), middleware=_guards(host, token))


def create_app(run_dir: Path, *, host: str = "127.0.0.1", token: str | None = None,
               state_dir: Path | None = None, live: Live | None = None) -> Starlette:
    """The dashboard for ``run_dir``; ``token`` is required unless ``host`` is loopback.

    Raises
    ------
    ConfigError
        A non-loopback ``host`` without a token.
    """
    check_exposure(host, token, "the dashboard", "pass --token")
    view = RunView(run_dir, state_dir, live)

    def api(method: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            return JSONResponse(method())
        return endpoint

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    async def openapi(request: Request) -> Response:
        return JSONResponse(OPENAPI)

    routes = [
        Route("/", index),
        *_service_routes(view),
        Route("/api/summary", api(view.summary)),
        Route("/api/rounds", api(view.rounds)),
        Route("/api/devices", api(view.devices)),
        Route("/api/rejections", api(view.rejections)),
        Route("/api/bundle", api(view.bundle)),
        Route("/api/openapi.json", openapi),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    return Starlette(routes=routes, middleware=_guards(host, token))


class TokenGate(BaseHTTPMiddleware):
    """Every request needs the token: ``?token=`` (then remembered in a cookie) or a Bearer header."""

    def __init__(self, app: Any, token: str) -> None:
        super().__init__(app)
        self.token = token

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        given = (request.query_params.get("token") or request.cookies.get(COOKIE)
                 or request.headers.get("authorization", "").removeprefix("Bearer ").strip())
        if not given or not hmac.compare_digest(given.encode(), self.token.encode()):
            return JSONResponse({"error": "a valid token is required: open the URL the dashboard printed "
                                          "(it ends in ?token=...) or send 'Authorization: Bearer <token>'"},
                                status_code=401)
        response = await call_next(request)
        if request.query_params.get("token"):
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
        return response


def new_token() -> str:
    """A random URL-safe token (128 bits)."""
    return secrets.token_urlsafe(16)


def serve(run_dir: Path, *, host: str = "127.0.0.1", port: int = 8765, token: str | None = None) -> None:
    """Serve the dashboard until interrupted (prints the URL to open)."""
    import uvicorn

    if not is_loopback(host) and not token:
        token = new_token()
    app = create_app(run_dir, host=host, token=token)
    print(f"fedge dashboard for {run_dir}: http://{host}:{port}/" + (f"?token={token}" if token else ""), flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", **uvicorn_options(LIMITS))


def listen(host: str, port: int, what: str, flag: str) -> socket.socket:
    """Bind ``host:port`` now (before anything is started or written), naming the flag to change on failure.

    Raises
    ------
    ConfigError
        The address is taken or cannot be bound.
    """
    from fedge.listeners import bind

    try:
        return bind(host, port)
    except OSError as exc:
        raise ConfigError(f"{what} cannot listen on {host}:{port} ({exc.strerror or exc}); pass another {flag} "
                          "(0: a free one)") from None


def serve_in_background(app: Starlette, sock: socket.socket, name: str) -> Any:
    """Serve ``app`` on the bound ``sock`` in a daemon thread; returns the uvicorn server (``should_exit`` stops it)."""
    import threading

    import uvicorn

    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           **uvicorn_options(LIMITS)))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=name, daemon=True).start()
    return server


def url_of(sock: socket.socket) -> str:
    """``http://HOST:PORT`` of a bound socket (IPv6 in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _best_headline(rows: list[dict[str, Any]]) -> float | None:
    """The best headline value of ``rows`` (max, or min for lower-is-better metrics such as MSE)."""
    values = [row["headline"] for row in rows if isinstance(row.get("headline"), int | float)]
    if not values:
        return None
    return max(values) if rows[-1].get("higher_is_better", True) else min(values)


def _schema(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties}


_ROW = _schema({"round": {"type": "integer"}, "metric": {"type": "string"}, "headline": {"type": ["number", "null"]},
                "accuracy": {"type": "number"}, "loss": {"type": "number"},
                "sim_time_s": {"type": "number"}, "wall_time_s": {"type": "number"},
                "participants_by_profile": {"type": "object"}, "bytes_up_by_profile": {"type": "object"},
                "bytes_down_by_profile": {"type": "object"}, "rejections": {"type": "array"},
                "dp_epsilon": {"type": "number"}})


def _get(summary: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {
        "200": {"description": "OK", "content": {"application/json": {"schema": schema}}},
        "401": {"description": "token missing or wrong (only when not on loopback)"}}}}


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "fedge dashboard API", "version": "1",
             "description": "Read-only view of one fedge run directory (live or finished)."},
    "paths": {
        "/api/summary": _get("Run status, progress, the task's headline metric (latest and best), loss, DP "
                             "epsilon, config and final summary",
                             _schema({"status": {"enum": ["starting", "running", "finished"]},
                                      "rounds_done": {"type": "integer"}, "rounds_total": {"type": "integer"},
                                      "metric": {"type": "string"}, "headline": {"type": ["number", "null"]},
                                      "best_headline": {"type": ["number", "null"]},
                                      "accuracy": {"type": ["number", "null"]},
                                      "dp_epsilon": {"type": ["number", "null"]},
                                      "summary": {"type": ["object", "null"]}, "config": {"type": "object"}})),
        "/api/rounds": _get("Every completed round (metrics.jsonl), unparseable lines skipped and counted",
                            _schema({"rounds": {"type": "array", "items": _ROW},
                                     "skipped_lines": {"type": "integer"}})),
        "/api/devices": _get("Devices seen: profile, rounds joined, rejected, errors, last round, last reply time",
                             _schema({"devices": {"type": "array", "items": _schema({
                                 "node": {"type": "string", "description": "node id (a string: 19 digits)"},
                                 "name": {"type": "string", "description": "the registered device name"},
                                 "profile": {"type": "string"},
                                 "rounds_joined": {"type": "integer"}, "rejected": {"type": "integer"},
                                 "errors": {"type": "integer"}, "last_round": {"type": "integer"},
                                 "last_reply_s": {"type": ["number", "null"]}})},
                                 "skipped_lines": {"type": "integer"}})),
        "/api/rejections": _get("Rejected updates with their reasons",
                                _schema({"rejections": {"type": "array", "items": _schema({
                                    "round": {"type": "integer"}, "node_id": {"type": "string"},
                                    "name": {"type": "string"},
                                    "reason": {"type": "string"}})}})),
        "/api/bundle": _get("The latest signed edge bundle and its manifest",
                            _schema({"bundle": {"type": ["string", "null"]}, "manifest": {"type": "object"},
                                     "has_signature": {"type": "boolean"}})),
    },
}
