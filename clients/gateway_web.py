"""The web device SDK and its demo page, served by a gateway to browsers (``--demo-page``).

Same origin as the device protocol (``/v1/...``), so a browser tab needs no CORS: the page at
``https://GATEWAY/web/demo.html?name=NAME`` loads the SDK (:mod:`fedge.web`), onnxruntime-web's
WebAssembly build (``--ort-web DIR``, the ``dist`` folder of the pinned npm package), the
coordinator's bundle signing public key the gateway was started with (``--trust``), and the
examples the operator left for that device (``--demo-data DIR``, ``NAME.json``).

Threat model: only the listed files are served, by name (no path from the request reaches
the file system). A device's examples (``data/NAME.json``) are training data: they are served
only to NAME's own session, a request signed with the device protocol's session MAC (the
``authenticate`` callable the ``/v1`` routes use), never to an anonymous request or to another
device. The rest is public (code, onnxruntime-web, the public bundle key). Serving the bundle
key from the gateway is a demo shortcut: a real app pins the key in its own code, since a
gateway that could swap the key could also swap the graph. The page is a demo: a gateway that
serves it beyond loopback says so loudly at start (:func:`demo_page_warning`).
"""

from __future__ import annotations

import inspect
import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge.errors import ConfigError, DeviceProtocolError
from fedge.web import ASSETS, ORT_FILES, SDK_FILES

MEDIA = {".js": "text/javascript", ".mjs": "text/javascript", ".wasm": "application/wasm", ".html": "text/html",
         ".json": "application/json", ".pem": "text/plain"}
DATA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})

Authenticate = Callable[[Any, bytes], Any]
"""``authenticate(request, body)``: the device session (with ``.device``) of a request signed with its
session MAC, or an awaitable of it; raises :class:`~fedge.errors.DeviceProtocolError` (``.status``)."""


@dataclass(frozen=True)
class WebSite:
    """What ``--demo-page`` serves: onnxruntime-web's folder, the bundle key, the demo examples."""

    ort: Path
    bundle_key: Path
    data: Path | None = None


def check_web(site: WebSite) -> None:
    """Refuse a demo page that could not run, naming what is missing."""
    missing = [name for name in ORT_FILES if not (site.ort / name).is_file()]
    if missing:
        raise ConfigError(f"--ort-web {site.ort} lacks {', '.join(missing)}: give the dist folder of the npm package "
                          "onnxruntime-web (npm install onnxruntime-web@1.31.1; `make test` puts it in "
                          ".cache/ortweb/node_modules/onnxruntime-web/dist)")
    if site.data is not None and not site.data.is_dir():
        raise ConfigError(f"--demo-data {site.data} is not a directory (it holds NAME.json per demo device)")


def demo_page_warning(host: str) -> str | None:
    """A loud line for a demo page served on ``host`` beyond loopback; None on loopback."""
    if host.strip("[]").lower() in LOOPBACK_NAMES:
        return None
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return None
    except ValueError:
        pass
    return (f"WARNING: the web demo page is served on {host}, beyond this machine: anyone who reaches the port "
            "loads the SDK and the bundle key from this gateway, and each admitted device fetches its "
            "--demo-data examples over its own session. It is a demo: serve a real app from your own site, "
            "and bind --host 127.0.0.1 unless other machines must reach the page.")


def web_routes(site: WebSite, *, authenticate: Authenticate) -> list[Any]:
    """Starlette routes for ``/web/...``: the SDK, ``ort/``, ``data/NAME.json`` and ``bundle-key.pem``.

    ``data/NAME.json`` is answered only to a request ``authenticate`` accepts as device NAME's
    session (401/403 otherwise, before anything is looked up); the other files are public.
    """
    from starlette.responses import FileResponse, JSONResponse  # noqa: PLC0415
    from starlette.routing import Route  # noqa: PLC0415

    files = {f"/web/{name}": ASSETS / name for name in SDK_FILES}
    files.update({f"/web/ort/{name}": site.ort / name for name in ORT_FILES})
    files["/web/bundle-key.pem"] = site.bundle_key

    def send(path: Path) -> Any:
        return FileResponse(path, media_type=MEDIA.get(path.suffix, "application/octet-stream"),
                            headers={"Cache-Control": "no-store"})

    def asset(path: Path) -> Any:  # each route bound to its own file: no request value picks a path
        async def serve(request: Any) -> Any:
            return send(path)
        return serve

    async def data(request: Any) -> Any:
        name = str(request.path_params["name"])
        try:
            session = await _session(authenticate, request)
        except DeviceProtocolError as exc:
            return JSONResponse({"error": str(exc)}, getattr(exc, "status", 400))
        if session.device != name:
            return JSONResponse({"error": f"device '{session.device}' may fetch only its own examples "
                                          f"(/web/data/{session.device}.json)"}, 403)
        path = None if site.data is None or not DATA_NAME.match(name) else site.data / f"{name}.json"
        if path is None or not path.is_file():
            return JSONResponse({"error": f"no demo examples for '{name[:64]}' (--demo-data DIR/NAME.json)"}, 404)
        return send(path)

    async def index(request: Any) -> Any:
        from starlette.responses import RedirectResponse  # noqa: PLC0415

        return RedirectResponse("/web/demo.html")

    return [*(Route(route, asset(path), methods=["GET"]) for route, path in files.items()),
            Route("/web/data/{name}.json", data, methods=["GET"]), Route("/web/", index, methods=["GET"])]


async def _session(authenticate: Authenticate, request: Any) -> Any:
    """The session ``authenticate`` finds for a GET whose body must be empty (as the MAC covers it)."""
    declared = request.headers.get("content-length")
    body = b""
    if declared not in (None, "0"):
        raise _refused(413, "a GET of demo examples carries no body")
    async for chunk in request.stream():
        body += chunk
        if body:
            raise _refused(413, "a GET of demo examples carries no body")
    session = authenticate(request, body)
    return await session if inspect.isawaitable(session) else session


def _refused(status: int, reason: str) -> DeviceProtocolError:
    error = DeviceProtocolError(reason)
    error.status = status
    return error
