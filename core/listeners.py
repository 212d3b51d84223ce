"""Limits every fedge HTTP listener applies to each connection (uvicorn's h11 protocol, guarded).

The SuperLink's device port (Flower's Fleet API, served over HTTPS by uvicorn), the bundle
service and the metrics endpoint / dashboard all run uvicorn. Left to itself uvicorn picks
``httptools`` when it is installed, which reads request headers without any size limit,
and no uvicorn protocol times out a connection that never sends a request. One client could
therefore grow a listener's memory without bound (never-ending headers) or hold every
connection slot with idle TLS connections (uvicorn then answers 503 to everyone).
:func:`uvicorn_options` gives a listener uvicorn's h11 protocol with:

- a header size limit: headers larger than ``max_header_bytes`` are answered ``431`` and
  the connection is closed (h11 buffers at most that much of an incomplete request);
- a header deadline: a connection whose request headers are not complete
  ``header_timeout_s`` after it opened (or after its previous response) is closed, so
  slow-trickled headers and idle connections hold a slot for at most that long;
- an idle timeout between requests (``idle_timeout_s``, uvicorn's keep-alive timeout);
- a per-client-address cap: one address holds at most ``per_address`` connections, so it
  cannot take every one of the listener's ``concurrency`` slots; further connections from
  it are closed at once.

Threat model: bounds what one network client (one address) can hold. Residual risk: many
addresses together can still fill the ``concurrency`` slots for up to ``header_timeout_s``
each; devices behind one NAT address share its cap; a TLS handshake that never completes is
held by asyncio until its own handshake timeout (60 s) but takes no slot; a request body
is not time-limited here (the bundle service reads none; Flower reads the Fleet API's).
"""

from __future__ import annotations

import asyncio
import functools
import socket
from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ListenerLimits:
    """Per-connection limits of one listener (see the module docstring)."""

    max_header_bytes: int = 32 * 1024
    header_timeout_s: float = 10.0
    idle_timeout_s: int = 5
    per_address: int = 16
    concurrency: int = 512


@functools.cache
def _guarded_base() -> type[Any]:
    """uvicorn's h11 protocol with a header deadline, a 431 for large headers and a per-address cap.

    Built on first use: uvicorn and h11 are imported only by a process that serves HTTP.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class _RecordingConnection(h11.Connection):
        """h11's connection, remembering the status h11 suggests for the last protocol error (431 for size)."""

        error_status = 400

        def next_event(self) -> Any:  # noqa: D102
            try:
                return super().next_event()
            except h11.RemoteProtocolError as exc:
                self.error_status = exc.error_status_hint
                raise


    class _GuardedH11(H11Protocol):
        """uvicorn's h11 protocol with a header deadline, a 431 for large headers and a per-address cap."""

        limits: ListenerLimits = ListenerLimits()
        by_address: Counter[str] = Counter()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.conn = _RecordingConnection(h11.SERVER, self.limits.max_header_bytes)
            self._deadline: asyncio.TimerHandle | None = None
            self._counted: str | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # noqa: D102
            super().connection_made(transport)
            address = self.client[0] if self.client else "?"
            if self.by_address[address] >= self.limits.per_address:
                self.logger.warning("%s holds %d connections already (the most one address may); closed a new one",
                                    address, self.limits.per_address)
                transport.abort()
                return
            self.by_address[address] += 1
            self._counted = address
            self._start_deadline()

        def connection_lost(self, exc: Exception | None) -> None:  # noqa: D102
            self._stop_deadline()
            if self._counted is not None:
                self.by_address[self._counted] -= 1
                if self.by_address[self._counted] <= 0:
                    del self.by_address[self._counted]
                self._counted = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:  # noqa: D102
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the request's headers are complete (or it failed)
                self._stop_deadline()

        def on_response_complete(self) -> None:  # noqa: D102
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._start_deadline()  # the next request's headers get the same deadline

        def send_400_response(self, msg: str) -> None:
            """Answer a malformed request: 431 when h11 says the headers were too large, else 400."""
            status = self.conn.error_status if isinstance(self.conn, _RecordingConnection) else 400
            if status != 431:
                super().send_400_response(msg)
                return
            body = f"request headers larger than {self.limits.max_header_bytes} bytes".encode()
            response = h11.Response(status_code=431, reason=b"Request Header Fields Too Large",
                                    headers=[(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close"),
                                             (b"content-length", str(len(body)).encode())])
            self.transport.write(self.conn.send(response) or b"")
            self.transport.write(self.conn.send(h11.Data(data=body)) or b"")
            self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
            self.transport.close()

        def _start_deadline(self) -> None:
            self._stop_deadline()
            self._deadline = self.loop.call_later(self.limits.header_timeout_s, self._headers_too_late)

        def _stop_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _headers_too_late(self) -> None:
            self._deadline = None
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.transport.abort()

    return _GuardedH11


def guarded_protocol(limits: ListenerLimits) -> type[asyncio.Protocol]:
    """A uvicorn HTTP protocol class for one listener: its own ``limits`` and its own per-address counts."""
    return type("GuardedH11", (_guarded_base(),), {"limits": limits, "by_address": Counter()})


def uvicorn_options(limits: ListenerLimits | None = None) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` that apply ``limits`` (defaults: :class:`ListenerLimits`)."""
    limits = limits or ListenerLimits()
    return {"http": guarded_protocol(limits), "h11_max_incomplete_event_size": limits.max_header_bytes,
            "timeout_keep_alive": limits.idle_timeout_s, "limit_concurrency": limits.concurrency}


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (IPv6 when ``host`` is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
