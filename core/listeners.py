"""Limits every fedge HTTP listener applies to each connection (uvicorn's HTTP protocol, guarded).

The SuperLink's device port (Flower's Fleet API, served over HTTPS by uvicorn), the bundle
service and the metrics endpoint / dashboard all run uvicorn. Left to itself uvicorn picks
``httptools`` when it is installed, which reads request headers without any size limit,
and no uvicorn protocol times out a connection that never sends a request. One client could
therefore grow a listener's memory without bound (never-ending headers) or hold every
connection slot with idle TLS connections (uvicorn then answers 503 to everyone).
:func:`uvicorn_options` gives a listener uvicorn's httptools protocol (``ListenerLimits.parser``;
``h11``, uvicorn's pure-Python one, behind the same guard, is the other choice) with:

- a header size limit: headers larger than ``max_header_bytes`` are answered ``431`` and
  the connection is closed (h11 buffers at most that much of an incomplete request; httptools
  has no limit of its own, so fedge counts the bytes a request's headers take and stops at
  the limit, plus at most one read);
- a header deadline: a connection whose request headers are not complete
  ``header_timeout_s`` after it opened (or after its previous response) is closed, so
  slow-trickled headers and idle connections hold a slot for at most that long;
- an idle timeout between requests (``idle_timeout_s``, uvicorn's keep-alive timeout);
- a per-client-address cap: one address holds at most ``per_address`` connections, so it
  cannot take every one of the listener's ``concurrency`` slots; further connections from
  it are closed at once;
- a body deadline: a request's body must arrive within ``body_timeout_s`` plus its declared
  length at ``min_body_rate`` bytes a second, else it is answered ``408`` and the connection
  closed (a body trickled a byte at a time holds a slot for that long, not for ever);
- with ``tls`` (:func:`uvicorn_options`), TLS is started by fedge's protocol rather than by
  asyncio's server: a connection is counted against its address when it is *accepted*,
  before its handshake, and a handshake that does not finish within ``handshake_timeout_s``
  is closed (asyncio's own default holds it, and its file descriptor, for 60 s);
- a TLS close that waits at most ``tls_shutdown_timeout_s`` for the peer's close_notify: an idle
  kept-alive client (a device between polls) reads nothing, and asyncio's default of 30 s kept
  each connection the listener closed (idle timeout, shutdown) counted against its address for
  that long, and a listener's shutdown waiting on it.

Threat model: bounds what one network client (one address) can hold. Residual risk: many
addresses together can still fill the ``concurrency`` slots for up to ``header_timeout_s``
each (bodies: ``body_timeout_s`` and their length's share of ``min_body_rate``); devices behind
one NAT address share its cap. Listeners started without ``tls`` by uvicorn itself (the
SuperLink, the bundle service) keep asyncio's 60 s handshake and count a connection once its
handshake is done.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ListenerLimits:
    """Per-connection limits of one listener (see the module docstring)."""

    max_header_bytes: int = 32 * 1024
    header_timeout_s: float = 10.0
    idle_timeout_s: int = 5
    per_address: int = 16
    concurrency: int = 512
    body_timeout_s: float = 30.0
    min_body_rate: int = 16 * 1024  # bytes a second a declared body length must at least arrive at
    handshake_timeout_s: float = 10.0
    tls_shutdown_timeout_s: float = 1.0  # after the listener's close_notify, the wait for the peer's
    parser: str = "httptools"  # HTTP_PARSERS: httptools (C) or h11 (pure Python, 1.1-1.3x the gateway's CPU a result)

    def body_deadline_s(self, declared: int | None) -> float:
        """Seconds a request body of ``declared`` bytes (``None``: not declared) may take to arrive."""
        return self.body_timeout_s + (declared or 0) / self.min_body_rate


class _Guard:
    """What every guarded HTTP protocol adds to uvicorn's, whatever parses the requests: a per-address cap, a
    header deadline and a body deadline. The parser's subclass says where a request stands
    (:meth:`_awaiting_headers`, :meth:`_awaiting_body`) and writes a final response (:meth:`_send_final`)."""

    limits: ListenerLimits = ListenerLimits()
    by_address: Counter[str] = Counter()
    transport: Any
    loop: Any
    client: Any
    logger: Any

    def _guard_init(self) -> None:
        self._deadline: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None
        self._counted: str | None = None
        self.counted_at_accept = False  # the TLS acceptor counted this connection's address already

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # noqa: D102
        super().connection_made(transport)  # type: ignore[misc]  # the parser's protocol, next in the MRO
        self._count(transport)

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: D102
        self._uncount()
        super().connection_lost(exc)  # type: ignore[misc]

    def _count(self, transport: asyncio.BaseTransport) -> bool:
        """Count this connection against its address and start its header deadline; False: refused (aborted)."""
        if self.counted_at_accept:
            self._start_deadline()
            return True
        address = self.client[0] if self.client else "?"
        if self.by_address[address] >= self.limits.per_address:
            self.logger.warning("%s holds %d connections already (the most one address may); closed a new one",
                                address, self.limits.per_address)
            transport.abort()  # type: ignore[attr-defined]  # a stream transport
            return False
        self.by_address[address] += 1
        self._counted = address
        self._start_deadline()
        return True

    def _uncount(self) -> None:
        self._stop_deadline()
        self._stop_body_deadline()
        if self._counted is not None:
            self.by_address[self._counted] -= 1
            if self.by_address[self._counted] <= 0:
                del self.by_address[self._counted]
            self._counted = None

    def _awaiting_headers(self) -> bool:
        raise NotImplementedError

    def _awaiting_body(self) -> bool:
        raise NotImplementedError

    def _send_final(self, status: int, reason: bytes, content_type: bytes, body: bytes) -> None:
        raise NotImplementedError

    def _declared_length(self) -> int | None:
        headers = dict(getattr(self, "headers", []) or [])
        value = headers.get(b"content-length", b"").strip()
        return int(value) if value.isdigit() and len(value) <= 18 else None

    def _start_body_deadline(self) -> None:
        if self._body_deadline is None:
            self._body_deadline = self.loop.call_later(self.limits.body_deadline_s(self._declared_length()),
                                                       self._body_too_late)

    def _stop_body_deadline(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _body_too_late(self) -> None:
        """The body did not arrive in time: 408 (unless the app already answered) and close."""
        self._body_deadline = None
        if self.transport.is_closing() or not self._awaiting_body():
            return
        cycle = getattr(self, "cycle", None)
        if cycle is not None and not cycle.response_started:
            self._send_final(408, b"Request Timeout", b"application/json",
                             b'{"error": "the request body did not arrive in time; send it at once (or faster)"}')
        if cycle is not None:  # the app waiting for the body hears a disconnect, and sends nothing more
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def _too_large(self) -> None:
        """431: the request's headers grew past the limit; the connection is closed."""
        self._send_final(431, b"Request Header Fields Too Large", b"text/plain; charset=utf-8",
                         f"request headers larger than {self.limits.max_header_bytes} bytes".encode())
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
        if not self.transport.is_closing() and self._awaiting_headers():
            self.transport.abort()


def _final_response(status: int, reason: bytes, content_type: bytes, body: bytes) -> bytes:
    """A whole HTTP/1.1 response that closes the connection."""
    return b"".join([b"HTTP/1.1 %d %s\r\n" % (status, reason), b"content-type: ", content_type, b"\r\n",
                     b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body), body])


@functools.cache
def _guarded_h11() -> type[Any]:
    """uvicorn's h11 protocol, guarded (:class:`_Guard`); h11 bounds an incomplete request's headers itself.

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

    class _GuardedH11(_Guard, H11Protocol):
        """uvicorn's h11 protocol with a header deadline, a 431 for large headers and a per-address cap."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.conn = _RecordingConnection(h11.SERVER, self.limits.max_header_bytes)
            self._guard_init()

        def data_received(self, data: bytes) -> None:  # noqa: D102
            super().data_received(data)
            cycle = getattr(self, "cycle", None)
            if not self._awaiting_headers():  # the request's headers are complete (or it failed)
                self._stop_deadline()
            elif self._deadline is None and (cycle is None or cycle.response_complete) \
                    and not self.transport.is_closing():  # answered before its body came: no response restarts it
                self._start_deadline()
            if self._awaiting_body():
                self._start_body_deadline()
            else:
                self._stop_body_deadline()

        def _awaiting_headers(self) -> bool:
            return self.conn.their_state is h11.IDLE

        def _awaiting_body(self) -> bool:
            return self.conn.their_state is h11.SEND_BODY

        def on_response_complete(self) -> None:  # noqa: D102
            super().on_response_complete()
            if not self.transport.is_closing() and self._awaiting_headers():
                self._start_deadline()  # the next request's headers get the same deadline

        def send_400_response(self, msg: str) -> None:
            """Answer a malformed request: 431 when h11 says the headers were too large, else 400."""
            status = self.conn.error_status if isinstance(self.conn, _RecordingConnection) else 400
            if status != 431:
                super().send_400_response(msg)
                return
            self._too_large()

        def _send_final(self, status: int, reason: bytes, content_type: bytes, body: bytes) -> None:
            if self.conn.our_state is not h11.SEND_RESPONSE:  # the app has started its answer
                return
            response = h11.Response(status_code=status, reason=reason,
                                    headers=[(b"content-type", content_type), (b"connection", b"close"),
                                             (b"content-length", str(len(body)).encode())])
            self.transport.write(self.conn.send(response) or b"")
            self.transport.write(self.conn.send(h11.Data(data=body)) or b"")
            self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")

    return _GuardedH11


MAX_PIPELINED = 4  # requests queued behind the one being answered (fedge's devices send one at a time)


@functools.cache
def _guarded_httptools() -> type[Any]:
    """uvicorn's httptools protocol (llhttp, in C), guarded (:class:`_Guard`).

    httptools has no header size limit of its own: the bytes a request's headers take are counted
    as they arrive, and past ``max_header_bytes`` the request is answered 431 and the connection
    closed, so what one connection buffers is bounded by the limit plus one read (a TLS record,
    16 KiB, on fedge's TLS listeners).
    """
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class _GuardedHttpTools(_Guard, HttpToolsProtocol):
        """uvicorn's httptools protocol with a header size limit, header and body deadlines, a per-address cap
        and at most MAX_PIPELINED requests queued behind the one being answered."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._guard_init()
            self._in_headers, self._header_bytes, self._in_body, self._refused = True, 0, False, False

        def data_received(self, data: bytes) -> None:  # noqa: D102
            if self._refused:
                return
            if self._in_headers:
                self._header_bytes += len(data)
            super().data_received(data)
            if self._in_headers and self._header_bytes > self.limits.max_header_bytes \
                    and not self.transport.is_closing():
                self._too_large()

        def _busy(self) -> bool:
            """A request's response is not complete yet (what arrives now is pipelined behind it)."""
            return bool(self.pipeline) or (self.cycle is not None and not self.cycle.response_complete)

        def on_message_begin(self) -> None:  # noqa: D102
            if not self._refused:
                super().on_message_begin()

        def on_url(self, url: bytes) -> None:  # noqa: D102
            if not self._refused:
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:  # noqa: D102
            if not self._refused:
                super().on_header(name, value)

        def on_headers_complete(self) -> None:  # noqa: D102
            if self._refused:
                return
            if self._busy() and len(self.pipeline) >= MAX_PIPELINED:  # each queued request holds a cycle: refuse
                self._refused = True  # the rest of this read is parsed and dropped
                self.transport.abort()
                return
            self._in_headers, self._header_bytes = False, 0  # (queued requests are capped just above)
            self._stop_deadline()
            super().on_headers_complete()
            if not self.transport.is_closing():  # llhttp ends a request without a body at once (below)
                self._in_body = True
                self._start_body_deadline()

        def on_body(self, body: bytes) -> None:  # noqa: D102
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:  # noqa: D102
            if self._refused:
                return
            self._in_headers, self._in_body = True, False
            self._stop_body_deadline()
            super().on_message_complete()
            if not self._busy() and not self.transport.is_closing():  # answered before its body came: the next
                self._start_deadline()  # request's headers get the deadline now (no response will restart it)

        def on_response_complete(self) -> None:  # noqa: D102
            super().on_response_complete()
            if not self.transport.is_closing() and self._in_headers and not self._busy():
                self._start_deadline()  # the next request's headers get the same deadline

        def _awaiting_headers(self) -> bool:
            return self._in_headers

        def _awaiting_body(self) -> bool:
            return self._in_body

        def _send_final(self, status: int, reason: bytes, content_type: bytes, body: bytes) -> None:
            """Write the final answer only where it cannot land inside another response: after every earlier
            response (a 431), or for the request being answered before its response started (a 408)."""
            if self.pipeline:
                return
            if self.cycle is None or self.cycle.response_complete or \
                    (self._in_body and not self.cycle.response_started):
                self.transport.write(_final_response(status, reason, content_type, body))

    return _GuardedHttpTools


# the request parsers a listener may run (``ListenerLimits.parser``), each behind the same guard
HTTP_PARSERS = {"httptools": _guarded_httptools, "h11": _guarded_h11}


def guarded_protocol(limits: ListenerLimits, tls: ssl.SSLContext | None = None) -> type[asyncio.Protocol]:
    """A uvicorn HTTP protocol class for one listener: its own ``limits`` and its own per-address counts.

    With ``tls``, the class accepts the connection, counts it, then runs the TLS handshake
    itself (:class:`TlsAcceptor`)."""
    counts: Counter[str] = Counter()
    if limits.parser not in HTTP_PARSERS:
        raise ValueError(f"unknown HTTP parser {limits.parser!r}; choose one of {', '.join(HTTP_PARSERS)}")
    inner = type("Guarded", (HTTP_PARSERS[limits.parser](),), {"limits": limits, "by_address": counts})
    if tls is None:
        return inner
    return type("GuardedTls", (TlsAcceptor,), {"limits": limits, "by_address": counts, "inner": inner, "context": tls})


HANDSHAKES: set[asyncio.Task[None]] = set()


class TlsAcceptor(asyncio.Protocol):
    """A connection's protocol from the moment it is accepted: per-address count, TLS handshake
    with a deadline, then uvicorn's (guarded) HTTP protocol over the TLS transport.

    Stays the TLS transport's protocol and relays to the HTTP protocol, so the address's count
    is given back however the connection ends (before, during or after its handshake).
    """

    limits: ListenerLimits
    by_address: Counter[str]
    inner: type[Any]
    context: ssl.SSLContext

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._loop = kwargs.get("_loop") or asyncio.get_event_loop()
        self._http: Any = None
        self._early: list[bytes] = []
        self._address: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # noqa: D102
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if peer else "?"
        if self.by_address[address] >= self.limits.per_address:
            transport.abort()  # type: ignore[attr-defined]
            return
        self.by_address[address] += 1
        self._address = address
        _no_delay(transport)
        transport.pause_reading()  # type: ignore[attr-defined]  # nothing reaches us before TLS starts
        task = self._loop.create_task(self._handshake(transport))
        HANDSHAKES.add(task)  # held until done: the loop keeps only a weak reference to a task
        task.add_done_callback(HANDSHAKES.discard)

    async def _handshake(self, transport: Any) -> None:
        try:
            secured = await self._loop.start_tls(transport, self, self.context, server_side=True,
                                                 ssl_handshake_timeout=self.limits.handshake_timeout_s,
                                                 ssl_shutdown_timeout=self.limits.tls_shutdown_timeout_s)
        except (OSError, TimeoutError, RuntimeError):  # a failed or too slow handshake (SSLError is an OSError)
            transport.abort()
            self._release()
            return
        if secured is None or secured.is_closing():
            self._release()
            return
        _shrink_read_buffer(secured)
        http = self.inner(**self._kwargs)
        http.counted_at_accept = True
        http.connection_made(secured)
        self._http = http
        for data in self._early:  # what arrived between the handshake's end and this continuation
            http.data_received(data)
        self._early.clear()

    def _release(self) -> None:
        if self._address is not None:
            self.by_address[self._address] -= 1
            if self.by_address[self._address] <= 0:
                del self.by_address[self._address]
            self._address = None

    def data_received(self, data: bytes) -> None:  # noqa: D102
        if self._http is not None:
            self._http.data_received(data)
        elif sum(map(len, self._early)) < self.limits.max_header_bytes:
            self._early.append(data)

    def eof_received(self) -> bool | None:  # noqa: D102
        return self._http.eof_received() if self._http is not None else None

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: D102
        self._release()
        if self._http is not None:
            self._http.connection_lost(exc)

    def pause_writing(self) -> None:  # noqa: D102
        if self._http is not None:
            self._http.pause_writing()

    def resume_writing(self) -> None:  # noqa: D102
        if self._http is not None:
            self._http.resume_writing()


TLS_READ_BUFFER = 17 * 1024  # one TLS record (16 KiB of plaintext) and its overhead


def _no_delay(transport: asyncio.BaseTransport) -> None:
    """Send each write at once (TCP_NODELAY). asyncio sets it only on sockets whose ``proto`` is TCP, and a
    socket made with ``proto`` 0 (``bind``'s, as most) accepts connections that have 0 too: the HTTP
    layer's headers and body then went as two TLS records, the second held by Nagle's algorithm until
    the device's delayed ACK, 40 ms later, on every response."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _shrink_read_buffer(transport: Any) -> None:
    """Give a connection's TLS layer a one-record read buffer instead of asyncio's 256 KiB.

    asyncio's ``SSLProtocol`` allocates 256 KiB per connection for reads; kept for a
    connection's life, that is 64 MiB for one address's 256 connections. One TLS record is all
    a read can return. Private attributes of CPython's asyncio, so only where they exist.
    """
    protocol = getattr(transport, "_ssl_protocol", None)
    if protocol is not None and hasattr(protocol, "_ssl_buffer") and hasattr(protocol, "_ssl_buffer_view"):
        protocol.max_size = TLS_READ_BUFFER
        protocol._ssl_buffer = bytearray(TLS_READ_BUFFER)
        protocol._ssl_buffer_view = memoryview(protocol._ssl_buffer)


def server_tls(cert: str | Path, key: str | Path) -> ssl.SSLContext:
    """A server TLS context (TLS 1.2 and up) holding ``cert`` and its ``key``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert), str(key))
    return context


def uvicorn_options(limits: ListenerLimits | None = None, *, tls: ssl.SSLContext | None = None) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` that apply ``limits`` (defaults: :class:`ListenerLimits`).

    ``tls``: serve HTTPS with fedge's acceptor (:class:`TlsAcceptor`); then give uvicorn no
    ``ssl_certfile`` of its own. Such a listener runs asyncio's own event loop: uvloop's
    server-side ``start_tls`` never completed a handshake here (uvloop 0.23, measured).
    """
    limits = limits or ListenerLimits()
    options = {"http": guarded_protocol(limits, tls), "h11_max_incomplete_event_size": limits.max_header_bytes,
               "timeout_keep_alive": limits.idle_timeout_s, "limit_concurrency": limits.concurrency,
               "ws": "none"}  # fedge serves no WebSocket; an upgraded connection would leave the guard uncounted
    if tls is not None:
        options["loop"] = "asyncio"
    return options


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (IPv6 when ``host`` is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


# the subject CN of a gateway's TLS certificate (`fedge keys add-gateway NAME`): the name devices sign at
# check-in; the PKI (fedge.server.pki) writes it, the gateway and its devices read it
GATEWAY_CN_PREFIX = "fedge gateway "
