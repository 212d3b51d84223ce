"""The web device SDK and its demo page, served by a gateway to browsers (``--demo-page``).

Same origin as the device protocol (``/v1/...``), so a browser tab needs no CORS: the page at
``https://GATEWAY/web/demo.html?name=NAME`` loads the SDK (:mod:`fedge.web`), onnxruntime-web's
WebAssembly build (``--ort-web DIR``, the ``dist`` folder of the pinned npm package), the
coordinator's bundle signing public key the gateway was started with (``--trust``), and the
examples the operator left for that device (``--demo-data DIR``, ``NAME.json``).

Threat model: only the listed files are served, by name (no path from the request reaches
the file system). Serving the bundle key from the gateway is a demo shortcut: a real app pins
the key in its own code, since a gateway that could swap the key could also swap the graph.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge.errors import ConfigError
from fedge.web import ASSETS, ORT_FILES, SDK_FILES

MEDIA = {".js": "text/javascript", ".mjs": "text/javascript", ".wasm": "application/wasm", ".html": "text/html",
         ".json": "application/json", ".pem": "text/plain"}
DATA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


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


def web_routes(site: WebSite) -> list[Any]:
    """Starlette routes for ``/web/...``: the SDK, ``ort/``, ``data/NAME.json`` and ``bundle-key.pem``."""
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
        path = None if site.data is None or not DATA_NAME.match(name) else site.data / f"{name}.json"
        if path is None or not path.is_file():
            return JSONResponse({"error": f"no demo examples for '{name[:64]}' (--demo-data DIR/NAME.json)"}, 404)
        return send(path)

    async def index(request: Any) -> Any:
        from starlette.responses import RedirectResponse  # noqa: PLC0415

        return RedirectResponse("/web/demo.html")

    return [*(Route(route, asset(path), methods=["GET"]) for route, path in files.items()),
            Route("/web/data/{name}.json", data, methods=["GET"]), Route("/web/", index, methods=["GET"])]
