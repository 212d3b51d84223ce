"""A deployed device's hold on its state directory, its last session, and what reaches its console.

Three things ``fedge device`` keeps across its SuperNode's lifetimes:

- **One process per state directory.** Two devices sharing ``--state-dir`` would share Flower's
  home, bundles and freshness records and stop each other's SuperNodes; the second is refused
  with the holder's pid (an advisory ``flock``, released by the kernel when the holder dies).
- **Its last session.** Flower's SuperLink keeps a node whose SuperNode died listed online
  until two heartbeats are missed (Flower 1.42 sends one every 30 s and offers no setting),
  and refuses to activate the same key meanwhile, with the same code as an unknown key. The
  device records the node id the coordinator gave it; a restarted device whose key is
  refused deactivates that node itself, signed with its own key (the SuperLink checks that the
  key owns the node), and joins at once instead of losing a minute and the round.
- **A console with fedge's lines.** Flower's log lines (level prefixes, ANSI colours, uvicorn's
  start-up) go to ``STATE_DIR/supernode.log``; the console keeps fedge's own lines (rounds
  trained, refusals, stops) unless ``--verbose``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from fedge.errors import ConfigError

LOCK_NAME = "device.lock"
SESSION_NAME = "session.json"
SUPERNODE_LOG = "supernode.log"
# Flower's and uvicorn's log records: an optional colour code, then the level name
_FLOWER_RECORD = re.compile(r"^(?:\x1b\[[0-9;]*m)?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Flower's own lines without a level: FAB installs, and the exit banner of a SuperNode that could not
# connect (fedge says why in its own line: a refused key, an unreachable coordinator)
_FLOWER_PLAIN = ("Successfully installed ", "Failed to initialize the connection to the SuperLink", "[code: ",
                 "The SuperNode could not establish a connection", "For more information, visit: <https://flower.ai")


@contextlib.contextmanager
def hold_state_dir(state: Path) -> Iterator[None]:
    """Hold ``state`` for this process; refuse if another ``fedge device`` holds it.

    Raises
    ------
    ConfigError
        Another live process holds the directory: its pid is named, and the fix.
    """
    try:
        import fcntl  # noqa: PLC0415 - POSIX only
    except ImportError:  # Windows: no advisory lock; one device per state directory is on the user
        yield
        return
    fd = os.open(state / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(f"another `fedge device` (pid {holder}) is using --state-dir {state}; stop it, "
                              "or give this device a state directory of its own (--state-dir DIR)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def key_id(key: Path) -> str:
    """A short fingerprint of the device key file ``key`` (which key a recorded session belongs to)."""
    return hashlib.sha256(key.read_bytes()).hexdigest()[:16]


def remember_session(state: Path, key: Path | None, node_id: int) -> None:
    """Record that the coordinator activated ``key`` as node ``node_id`` (an insecure device has no key)."""
    if key is None:
        return
    record = {"node-id": node_id, "key": key_id(key)}
    (state / SESSION_NAME).write_text(json.dumps(record) + "\n", encoding="utf-8")


def previous_session(state: Path, key: Path | None) -> int | None:
    """The node id this state directory's last session had with ``key``, or None."""
    if key is None:
        return None
    try:
        record = json.loads((state / SESSION_NAME).read_text(encoding="utf-8"))
        return int(record["node-id"]) if record.get("key") == key_id(key) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def end_previous_session(*, coordinator: str, key: Path, ca: Path, node_id: int) -> str | None:
    """Deactivate node ``node_id`` on ``coordinator``, authenticated by the device key ``key``.

    Threat model: the request is signed with the device's own key, and the SuperLink
    deactivates a node only for the key registered to it, so a device can end only its own
    sessions. The caller holds the state directory's lock, so no live ``fedge device`` of
    this directory runs that session; a copy of the key elsewhere (its own state directory)
    has no record and never calls this.

    Returns
    -------
    str | None
        None once the node is deactivated, else why not (in one line).
    """
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key  # noqa: PLC0415
    from flwr.proto.fleet_pb2 import DeactivateNodeRequest  # noqa: PLC0415
    from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor  # noqa: PLC0415
    from flwr.supercore.protobuf.client import ProtobufClientInterceptor  # noqa: PLC0415
    from flwr.supernode.fleet_http_client import FleetHttpClient  # noqa: PLC0415
    from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor  # noqa: PLC0415

    private = load_ssh_private_key(key.read_bytes(), password=None)
    interceptors: list[ProtobufClientInterceptor] = [
        RuntimeVersionHttpInterceptor(component_name="SuperNode"),
        NodeAuthHttpInterceptor(private, private.public_key())]  # type: ignore[arg-type]
    try:
        with FleetHttpClient.from_server_address(coordinator, False, str(ca.resolve()), interceptors) as client:
            client.DeactivateNode(DeactivateNodeRequest(node_id=node_id))
    except Exception as exc:  # noqa: BLE001 - any failure only means the old way: wait for the heartbeat
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def console_line(line: str, *, verbose: bool) -> str | None:
    """What of a SuperNode output ``line`` the device console shows (None: the log file only).

    Flower's log records and its plain install lines stay in the log; everything else (fedge's
    own lines, printed by its ClientApp) is shown without colour codes. ``verbose`` shows all.
    """
    plain = _ANSI.sub("", line)
    if verbose:
        return plain
    if _FLOWER_RECORD.match(line) or not plain.strip() or plain.startswith(_FLOWER_PLAIN):
        return None
    return plain
