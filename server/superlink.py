"""fedge's SuperLink launcher: Flower's SuperLink with its Control and runtime APIs kept for the operator.

Why not plain ``flower-superlink``: Flower 1.42 serves the Fleet API (devices), the
Control API (``flwr run``, ``flwr supernode register``) and the runtime API (the
ServerApp's own link to the SuperLink) on ONE HTTPS port, and open-source Flower
authenticates Control API callers with a no-op plugin (account authentication is an
enterprise feature). An outsider holding only ``ca.crt`` could therefore register its
own device key and start its own ServerApp on the coordinator host (reproduced in
``tests/test_control_api.py``). No option of ``flower-superlink`` closes that, so this
module runs Flower's own SuperLink app (``flwr.superlink.main.create_app``, built from
Flower's own argument parser) with two changes:

1. **Two listeners.** The address devices use (``--host``/``--port``) serves only the
   Fleet API and ``/health``; every other path is refused with 403 there. The Control and
   runtime APIs are reachable only on a loopback listener (``--operator-port``), which is
   also where Flower's own SuperExec and ServerApp processes connect.
2. **An operator token on the Control API.** Requests to ``/v1/control/*`` must carry
   ``Authorization: Bearer <token>``; the token is random per coordinator state directory,
   stored 0600 in it and handed to the operator's ``flwr`` CLI through Flower's own
   credential store (``FLWR_HOME/credentials.yaml``, 0600).

3. **Connection limits** (:mod:`fedge.listeners`) on both listeners: request headers
   at most 32 KiB (431 beyond), complete within 10 s of connecting, idle connections closed
   after 5 s, at most 128 connections per client address. Flower 1.42 serves the Fleet API
   over HTTPS through uvicorn; its gRPC servers (legacy Fleet and Control APIs) start only
   when ``FLWR_INTERNAL_GRPC_*`` asks for them, which this launcher clears, so there is no
   gRPC port whose options (``grpc.max_metadata_size``, keepalive) would need setting.

Threat model: network attackers and devices reach only the Fleet API, where SuperNode
authentication admits only keys the operator registered (Flower refuses self-registration
when ``--enable-supernode-auth`` is on). Local users of the coordinator host who cannot read
the state directory cannot use the Control API. The runtime API on loopback is not
authenticated by Flower in subprocess isolation: anyone with a shell on the coordinator
host is trusted as the operator (run the coordinator on a host or container of its own).
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import ipaddress
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedge.errors import ConfigError
from fedge.listeners import ListenerLimits, bind, uvicorn_options

PUBLIC_PATHS = ("/v1/fleet/", "/health")
AUTHN_TYPE = "oidc"  # the CLI-side plugin that sends a stored bearer token (Flower's own)
# Devices behind one NAT share an address (and a loopback federation runs every device on one): a wide cap
LIMITS = ListenerLimits(max_header_bytes=32 * 1024, header_timeout_s=10.0, idle_timeout_s=5, per_address=128,
                        concurrency=2048)


class OperatorTokenAuthn:
    """A Flower ``ControlAuthnPlugin`` that admits exactly one bearer token: the operator's.

    Parameters
    ----------
    token : str
        The secret the operator's ``flwr`` CLI sends (compared in constant time).
    """

    def __init__(self, token: str) -> None:
        if len(token) < 32:
            raise ConfigError("the operator token must be at least 32 characters; delete STATE_DIR/operator-token "
                              "and `fedge coordinator start` makes a new one")
        self._token = token.encode()

    def get_login_details(self) -> None:
        """No interactive login: the token is provisioned by ``fedge coordinator start``."""
        return None

    def validate_tokens_in_metadata(self, metadata: Sequence[tuple[str, str | bytes]]) -> tuple[bool, Any]:
        """Accept the request only if its access token is the operator's."""
        from flwr.common.constant import ACCESS_TOKEN_KEY, NOOP_ACCOUNT_NAME, NOOP_FLWR_AID
        from flwr.supercore.auth.typing import AccountInfo

        for key, value in metadata:
            given = value.encode() if isinstance(value, str) else bytes(value)
            if key == ACCESS_TOKEN_KEY and hmac.compare_digest(given, self._token):
                # Flower's single-account identity: runs and registered devices keep the
                # owner they have when account authentication is off.
                return True, AccountInfo(flwr_aid=NOOP_FLWR_AID, account_name=NOOP_ACCOUNT_NAME)
        return False, None

    def get_auth_tokens(self, device_code: str) -> None:
        """No device-code flow."""
        return None

    def refresh_tokens(self, metadata: Sequence[tuple[str, str | bytes]]) -> tuple[None, None]:
        """Nothing to refresh: a wrong token stays wrong."""
        return None, None


class PublicListenerGuard:
    """ASGI middleware: on the public listener, only the Fleet API and ``/health`` are served.

    Parameters
    ----------
    app : ASGI app
        Flower's SuperLink app.
    operator_port : int
        Port of the loopback listener that serves everything.
    """

    def __init__(self, app: Any, operator_port: int) -> None:
        self.app, self.operator_port = app, operator_port

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:  # noqa: D102
        if scope["type"] == "lifespan" or scope["type"] == "http" and self._allowed(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await _forbidden(send)
        # anything else (websockets, ...) is not served at all

    def _allowed(self, scope: dict[str, Any]) -> bool:
        host, port = scope.get("server") or ("", -1)
        if port == self.operator_port and _is_loopback(str(host)):  # the operator listener, and only it
            return True
        path = str(scope.get("path", ""))
        return any(path == prefix.rstrip("/") or path.startswith(prefix) for prefix in PUBLIC_PATHS)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def _forbidden(send: Any) -> None:
    body = (b"this address serves devices only (Fleet API); the Control and runtime APIs are for the "
            b"coordinator's operator, on the coordinator host's loopback listener")
    await send({"type": "http.response.start", "status": 403,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m fedge.server.superlink", add_help=False)
    parser.add_argument("--operator-port", type=int, required=True)
    parser.add_argument("--operator-token-file", type=Path, required=True)
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run Flower's SuperLink (arguments as ``flower-superlink``) behind fedge's two guards."""
    import uvicorn
    from flwr.supercore.http_logging import get_uvicorn_log_config
    from flwr.supercore.logger import console_handler
    from flwr.superlink.cli.flower_superlink import SuperLinkLifespan, _parse_superlink_lifespan_config
    from flwr.superlink.main import create_app

    ours, flower_args = _parse(list(sys.argv[1:] if argv is None else argv))
    for name in ("FLWR_INTERNAL_GRPC_CONTROL_API", "FLWR_INTERNAL_GRPC_FLEET_API"):
        os.environ.pop(name, None)  # Flower's legacy gRPC Control/Fleet servers would listen off loopback
    sys.argv = ["flower-superlink", *flower_args]
    config = _parse_superlink_lifespan_config()  # Flower's own parsing and checks
    token = ours.operator_token_file.read_text().strip()
    # The lifespan's host/port only tell Flower's SuperExec (and the ServerApps it
    # starts) where the runtime API is: the loopback listener.
    internal = dataclasses.replace(config, host="127.0.0.1", port=ours.operator_port,
                                   authn_plugin=OperatorTokenAuthn(token))  # type: ignore[arg-type]
    app = PublicListenerGuard(create_app(internal, SuperLinkLifespan), ours.operator_port)
    sockets = [bind(config.host, config.port), bind("127.0.0.1", ours.operator_port)]
    server = uvicorn.Server(uvicorn.Config(
        app=app, reload=False, access_log=True, workers=1,
        log_config=get_uvicorn_log_config(console_handler.level),
        ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile, **uvicorn_options(LIMITS)))
    server.run(sockets=sockets)


if __name__ == "__main__":
    main()
