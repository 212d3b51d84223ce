"""Both request parsers a fedge listener may run (``ListenerLimits.parser``) hold the same limits.

httptools (llhttp, in C) is the default since it took 1.1-1.3x more results a gateway CPU-second than
h11 (bench/README.md); it has no header size limit of its own, so fedge counts header bytes itself.
Each attack is replayed on a real uvicorn listener on 127.0.0.1 with each parser: headers that never
end (431, memory bounded), a half-sent request (closed at the header deadline), a body trickled too
slowly (408, closed), a connection too many from one address (closed at once); and a kept-alive
connection that sends two requests with bodies is answered both times.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import uvicorn
from http_attacks import never_ending_headers, open_connections, wait_until
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from fedge.listeners import HTTP_PARSERS, MAX_PIPELINED, ListenerLimits, bind, guarded_protocol, uvicorn_options

LIMITS = ListenerLimits(max_header_bytes=4 * 1024, header_timeout_s=1.0, per_address=3, body_timeout_s=1.0,
                        min_body_rate=1024 * 1024)


async def _echo(request: Request) -> PlainTextResponse:
    body = await request.body()
    return PlainTextResponse(f"{len(body)} bytes")


async def _streamed(_: Request) -> StreamingResponse:
    async def parts() -> AsyncIterator[bytes]:
        for index in range(4):
            yield f"part{index};".encode()
            await asyncio.sleep(0.4)
    return StreamingResponse(parts())


@pytest.fixture(params=sorted(HTTP_PARSERS))
def parser(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def port(parser: str) -> Iterator[int]:
    """A listener with LIMITS and the parser named by the parameter; its port."""
    limits = ListenerLimits(**{**LIMITS.__dict__, "parser": parser})
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/echo", _echo, methods=["GET", "POST"]),
                                                           Route("/stream", _streamed)]),
                                           log_level="critical", access_log=False, **uvicorn_options(limits)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: bool(server.started), 60, "the listener starting")
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(30)


def _connection(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    _READERS.pop(sock.fileno(), None)  # a reader of an earlier socket with the same number
    return sock


def _response(sock: socket.socket) -> bytes:
    """One whole response (the listener answers with a content-length or chunks), read from the socket's buffered
    reader (pipelined answers may come in one read); ConnectionError once the listener closed the connection."""
    reader = _READERS.setdefault(sock.fileno(), sock.makefile("rb"))
    status = reader.readline()
    fields = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip()
    if not status or not line:
        raise ConnectionError("the listener closed the connection")
    if b"content-length" in fields:
        body = reader.read(int(fields[b"content-length"]))
    else:  # chunked
        body = b""
        while size := int(reader.readline().strip() or b"0", 16):
            body += reader.read(size)
            reader.readline()
        reader.readline()
    return status.rstrip(b"\r\n") + b" | " + body


_READERS: dict[int, Any] = {}


def test_never_ending_headers_get_431_near_the_limit(port: int) -> None:
    outcome = never_ending_headers(port, None, path="/echo")
    # the 431, or a reset that overtook it (the listener closes while the attacker is still sending)
    assert outcome.closed and outcome.status in (431, None)
    assert outcome.sent <= LIMITS.max_header_bytes + 256 * 1024  # the limit, plus what the kernel buffered


def test_a_request_whose_headers_stop_halfway_is_closed_at_the_header_deadline(port: int) -> None:
    sock = _connection(port)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    wait_until(lambda: open_connections([sock]) == 0, 60, "closing a connection whose headers stopped")


def test_a_body_trickled_too_slowly_gets_408_and_is_closed(port: int) -> None:
    sock = _connection(port)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-length: 1000\r\n\r\nonly a part")
    answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    wait_until(lambda: open_connections([sock]) == 0, 60, "closing the trickling connection")


def test_one_address_holds_at_most_its_share_of_connections(port: int) -> None:
    held = [_connection(port) for _ in range(LIMITS.per_address + 2)]
    try:
        wait_until(lambda: open_connections(held) == LIMITS.per_address, 60,
                   f"closing the connections beyond {LIMITS.per_address}")
    finally:
        for sock in held:
            sock.close()


def test_a_kept_alive_connection_is_answered_request_after_request(port: int) -> None:
    sock = _connection(port)
    body = b"x" * 50_000
    for _ in range(2):  # the header deadline restarts after each response; the connection stays open
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        assert _response(sock) == b"HTTP/1.1 200 OK | 50000 bytes"
    sock.close()


def test_an_unknown_parser_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown HTTP parser 'picohttp'; choose one of httptools, h11"):
        guarded_protocol(ListenerLimits(parser="picohttp"))


def _everything(sock: socket.socket) -> bytes:
    """What the listener sends until it closes the connection (bounded by the socket's 30 s timeout)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:  # a reset
        pass
    return data


@pytest.mark.parametrize("framing", [b"Transfer-Encoding: gzip, chunked", b"Content-Length: 10 ",
                                     b"Content-Length: 0000000000000000010"])
def test_a_body_in_any_framing_the_parser_accepts_has_a_deadline(port: int, framing: bytes) -> None:
    # review of the httptools guard: these framings started no body deadline and held the connection for ever
    sock = _connection(port)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\n" + framing + b"\r\n\r\nab")
    answer = _everything(sock)
    assert answer.startswith((b"HTTP/1.1 408", b"HTTP/1.1 400")), answer


def test_a_connection_answered_before_its_body_came_still_gets_a_header_deadline(port: int) -> None:
    # review: the app answered (404) before the declared body; the body, then half a request: held for ever before
    sock = _connection(port)
    sock.sendall(b"POST /missing HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-length: 5\r\n\r\n")
    assert _response(sock).startswith(b"HTTP/1.1 404")
    sock.sendall(b"abcdeGET /echo HTTP/1.1\r\n")
    wait_until(lambda: open_connections([sock]) == 0, 60, "closing a connection whose next headers stopped")


def test_a_pipelined_flood_is_answered_in_order_or_refused_never_queued_without_bound(parser: str, port: int) -> None:
    # review: httptools parsed a whole read of pipelined requests into queued cycles (853 MiB in 12 s)
    sock = _connection(port)
    sock.sendall(b"GET /echo HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 50)
    answered = 0
    try:
        while answered < 50:
            answered += _response(sock).startswith(b"HTTP/1.1 200")
    except OSError:  # closed by the listener (ConnectionError, a reset)
        pass
    if parser == "h11":  # h11 reads the next request only once the last is answered
        assert answered == 50
    else:  # httptools queues at most MAX_PIPELINED behind the one being answered, then closes the connection
        assert answered <= MAX_PIPELINED + 1
        wait_until(lambda: open_connections([sock]) == 0, 60, "closing the flooding connection")


def test_a_431_never_lands_inside_another_response(port: int) -> None:
    # review: a pipelined request with oversized headers got its 431 written into a streamed 200's body
    sock = _connection(port)
    sock.sendall(b"GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # the stream has started
    sock.sendall(b"GET /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 6000 + b"\r\n")
    assert b"HTTP/1.1 4" not in _everything(sock)


def test_a_websocket_upgrade_is_not_served_and_gives_its_slot_back(port: int) -> None:
    # review: an upgraded connection left the guard without giving its address's count back: per_address upgrades
    # locked the address out for good
    upgrade = (b"GET /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
               b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    for _ in range(LIMITS.per_address + 1):
        sock = _connection(port)
        try:
            sock.sendall(upgrade)
            assert not _response(sock).startswith(b"HTTP/1.1 101")
        except OSError:  # refused: the address's earlier connections not yet seen closed (a reset is no upgrade)
            pass
        sock.close()
    held: list[socket.socket] = []

    def answered() -> bool:  # the address's slots come back as the listener sees each close
        sock = _connection(port)
        held.append(sock)
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        try:
            return _response(sock).startswith(b"HTTP/1.1 200")
        except OSError:
            return False
        finally:
            sock.close()

    wait_until(answered, 60, "a plain request answered after the upgrades")
