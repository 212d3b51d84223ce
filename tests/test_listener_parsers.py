"""Both request parsers a fedge listener may run (``ListenerLimits.parser``) hold the same limits.

httptools (llhttp, in C) is the default since it took 1.1-1.3x more results a gateway CPU-second than
h11 (bench/README.md); it has no header size limit of its own, so fedge counts header bytes itself.
Each attack is replayed on a real uvicorn listener on 127.0.0.1 with each parser: headers that never
end (431, memory bounded), a half-sent request (closed at the header deadline), a body trickled too
slowly (408, closed), a connection too many from one address (closed at once); and a kept-alive
connection that sends two requests with bodies is answered both times.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
import uvicorn
from http_attacks import never_ending_headers, open_connections, wait_until
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from fedge.listeners import HTTP_PARSERS, ListenerLimits, bind, guarded_protocol, uvicorn_options

LIMITS = ListenerLimits(max_header_bytes=4 * 1024, header_timeout_s=1.0, per_address=3, body_timeout_s=1.0,
                        min_body_rate=1024 * 1024)


async def _echo(request: Request) -> PlainTextResponse:
    body = await request.body()
    return PlainTextResponse(f"{len(body)} bytes")


@pytest.fixture(params=sorted(HTTP_PARSERS))
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    """A listener with LIMITS and the parser named by the parameter; its port."""
    limits = ListenerLimits(**{**LIMITS.__dict__, "parser": request.param})
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/echo", _echo, methods=["GET", "POST"])]),
                                           log_level="critical", access_log=False, **uvicorn_options(limits)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: bool(server.started), 60, "the listener starting")
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(30)


def _connection(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    return sock


def _response(sock: socket.socket) -> bytes:
    """One whole response (the listener answers with a content-length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b"\r\n")[0] + b" | " + body


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
