"""The SuperLink guard serves the Control and runtime APIs only on the operator's loopback
listener (issue 12, finding 1; a review found the first version checked the port alone)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from fedge.errors import ConfigError
from fedge.server.coordinator import Coordinator
from fedge.server.superlink import PublicListenerGuard

OPERATOR_PORT = 9096


def _status(server: tuple[str, int], path: str, kind: str = "http") -> int | None:
    """What the guard answers (None: passed on to Flower's app)."""
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        sent.append({"type": "passed"})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    guard = PublicListenerGuard(app, OPERATOR_PORT)
    asyncio.run(guard({"type": kind, "server": server, "path": path}, None, send))
    if not sent:
        return -1  # dropped
    return None if sent[0]["type"] == "passed" else int(sent[0]["status"])


@pytest.mark.parametrize(("server", "path", "expected"), [
    (("127.0.0.1", OPERATOR_PORT), "/v1/control/start-run", None),     # the operator
    (("127.0.0.1", OPERATOR_PORT), "/v1/runtime/get-nodes", None),
    (("::1", OPERATOR_PORT), "/v1/runtime/get-nodes", None),
    (("192.0.2.2", OPERATOR_PORT), "/v1/runtime/get-nodes", 403),      # same port on a public address
    (("192.0.2.2", OPERATOR_PORT), "/v1/control/register-node", 403),
    (("192.0.2.2", 9095), "/v1/control/start-run", 403),               # the device address
    (("127.0.0.1", 9095), "/v1/runtime/push-messages", 403),
    (("192.0.2.2", 9095), "/v1/fleet/pull-messages", None),            # devices' own API
    (("192.0.2.2", 9095), "/health", None),
    (("192.0.2.2", 9095), "/v1/fleetX", 403),
])
def test_only_the_loopback_operator_listener_serves_control_and_runtime(server: tuple[str, int], path: str,
                                                                       expected: int | None) -> None:
    # Execute / Assert
    assert _status(server, path) == expected


def test_websockets_are_not_served() -> None:
    # Execute / Assert: neither passed on nor answered
    assert _status(("192.0.2.2", 9095), "/v1/fleet/x", kind="websocket") == -1


def test_the_control_port_cannot_be_the_device_port(tmp_path: Path) -> None:
    # Execute / Assert: refused before anything starts
    with pytest.raises(ConfigError, match="a port of its own"):
        Coordinator(tmp_path / "state", None, port=9500, control_port=9500).start()
    assert not (tmp_path / "state" / "superlink.log").exists()


def test_a_token_others_can_read_is_refused(tmp_path: Path) -> None:
    # Prepare: an operator token left world-readable
    (tmp_path / "state").mkdir()
    token = tmp_path / "state" / "operator-token"
    token.write_text("x" * 43)
    os.chmod(token, 0o644)
    # Execute / Assert
    with pytest.raises(ConfigError, match="readable by others"):
        Coordinator(tmp_path / "state", None, port=9501)._operator_token()
