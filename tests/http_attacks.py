"""Real-socket attacks on fedge's HTTP listeners (issue 23): never-ending headers, idle TLS connections."""

from __future__ import annotations

import select
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

ATTACK_BYTES = 8 * 1024 * 1024  # a listener still reading headers after this much has no header limit


@dataclass
class Outcome:
    """How a never-ending-headers attack ended."""

    sent: int          # header bytes the listener accepted before it stopped the attack
    closed: bool       # the listener closed the connection
    status: int | None  # the HTTP status it answered with, if any reached us


def _connect(port: int, context: ssl.SSLContext | None, source: str = "127.0.0.1") -> socket.socket:
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)  # little in flight: what was sent was read
    raw.settimeout(30)
    raw.bind((source, 0))
    raw.connect(("127.0.0.1", port))
    return context.wrap_socket(raw, server_hostname="127.0.0.1") if context is not None else raw


def _status(data: bytes) -> int | None:
    parts = data.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[0].startswith(b"HTTP/") and parts[1].isdigit() else None


def never_ending_headers(port: int, context: ssl.SSLContext | None = None, *, path: str = "/health") -> Outcome:
    """Send one request whose headers never end (1 KiB header lines) until the listener stops it.

    Stops after :data:`ATTACK_BYTES` at most (the listener did not stop it: no header limit).
    """
    sock = _connect(port, context)
    line = b"X-Pad: " + b"a" * 1015 + b"\r\n"
    sent = 0
    answer: bytes | None = b""
    try:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode())
        while sent < ATTACK_BYTES:
            try:
                answer = _poll(sock)
            except OSError:  # reset by the listener
                return Outcome(sent, closed=True, status=None)
            if answer is None or answer:
                break
            try:
                sock.settimeout(30)
                sock.sendall(line * 16)
            except OSError:  # reset: the listener closed while we wrote
                break
            sent += len(line) * 16
        return _answer(sock, sent, answer or b"")
    finally:
        sock.close()


def _poll(sock: socket.socket) -> bytes | None:
    """What the listener sent so far without waiting (b"": nothing yet; None: it closed the connection)."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return b""
    sock.settimeout(0.05)  # a TLS record that is not data (a session ticket) leaves nothing to read
    try:
        data = sock.recv(65536)
    except (TimeoutError, ssl.SSLWantReadError, BlockingIOError):
        return b""
    return data or None


def _answer(sock: socket.socket, sent: int, data: bytes) -> Outcome:
    if sent >= ATTACK_BYTES:
        return Outcome(sent, closed=False, status=None)
    sock.settimeout(30)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return Outcome(sent, closed=False, status=_status(data))
    except OSError:  # a reset after the answer, or instead of it
        pass
    return Outcome(sent, closed=True, status=_status(data))


def idle_tls_connections(port: int, context: ssl.SSLContext, count: int, *, source: str) -> list[socket.socket]:
    """``count`` TLS connections from ``source`` (a loopback address) that complete the handshake and send nothing."""
    held = []
    for _ in range(count):
        try:
            held.append(_connect(port, context, source))
        except OSError:  # refused or reset during the handshake: not held
            continue
    return held


def open_connections(sockets: list[socket.socket]) -> int:
    """How many of ``sockets`` the listener still holds open (not closed or reset by it)."""
    alive = 0
    for sock in sockets:
        try:
            sock.setblocking(False)
            try:
                data = sock.recv(1)
            except (ssl.SSLWantReadError, BlockingIOError):
                alive += 1
                continue
            alive += bool(data)
        except OSError:
            continue
    return alive


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait for ``condition()`` (an event the listener causes), failing with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.05)
