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

A web app served from its own site calls the gateway across origins: the operator names each
app origin (``--allow-origin https://app.example.org``, :func:`cors_middleware`); without one, only
same-origin pages (the demo page) reach ``/v1``. An origin allow-list is not authentication (any
non-browser client ignores CORS): devices still prove their key at check-in.

Demo examples (``--demo-data DIR``): one ``NAME.json`` per device, ``{"inputs": [ENTRY, ...],
"targets": ENTRY}``, each ENTRY ``{"dtype", "dims", "b64"}``: a numpy dtype name the page knows
(:data:`DEMO_DTYPES`), the array's shape, and its bytes little-endian, base64. Inputs may be raw
(the SDK applies the task's preprocessing) or preprocessed. :func:`write_demo_data` makes them
from a task (``fedge gateway demo-data``); :func:`check_demo_data` refuses a folder the page could
not use, at start.
"""

from __future__ import annotations

import base64
import inspect
import ipaddress
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from fedge.errors import ConfigError, DeviceProtocolError
from fedge.web import ASSETS, ORT_FILES, SDK_FILES, VENDOR_FILES

MEDIA = {".js": "text/javascript", ".mjs": "text/javascript", ".wasm": "application/wasm", ".html": "text/html",
         ".json": "application/json", ".pem": "text/plain"}
DATA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})
DEMO_DTYPES = ("float32", "float64", "int8", "int32", "int64", "uint32", "uint64")
"""The dtypes a demo examples file may name (the typed arrays of ``web/frame.js``)."""
# What a browser page may send the device API across origins: the session's headers (device_protocol's
# SESSION_HEADER, COUNTER_HEADER, MAC_HEADER) and the body's type
CORS_HEADERS = ("Authorization", "X-Fedge-Counter", "X-Fedge-Mac", "Content-Type")

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
    if site.data is not None:
        check_demo_data(site.data)


def check_demo_data(folder: Path) -> list[str]:
    """The device names ``folder`` holds examples for; refuses a folder the demo page could not use.

    Raises
    ------
    ConfigError
        Not a directory, no ``NAME.json`` in it, or a file that is not the page's format (naming
        the file and what is wrong, and how to make good ones).
    """
    make = "make them with `fedge gateway demo-data --task TASK --devices N --out DIR` (docs/devices.md)"
    if not folder.is_dir():
        raise ConfigError(f"--demo-data {folder} is not a directory (it holds NAME.json per demo device): {make}")
    names = sorted(path.stem for path in folder.glob("*.json") if DATA_NAME.match(path.stem))
    if not names:
        raise ConfigError(f"--demo-data {folder} holds no NAME.json: a device joining the demo page would find no "
                          f"examples; {make}")
    for name in names:
        path = folder / f"{name}.json"
        try:
            _check_examples(json.loads(path.read_text()))
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"--demo-data {path} is not a demo examples file ({exc}): the page reads "
                              '{"inputs": [{"dtype", "dims", "b64"}, ...], "targets": {"dtype", "dims", "b64"}}; '
                              f"{make}") from None
    return names


def _check_examples(examples: Any) -> None:
    """Raise ValueError/TypeError/KeyError naming what in one NAME.json the page could not read."""
    if not isinstance(examples, dict) or not isinstance(examples.get("inputs"), list) or not examples["inputs"]:
        raise ValueError("no 'inputs' list")
    if not isinstance(examples.get("targets"), dict):
        raise ValueError("no 'targets' entry")
    rows = {_entry_rows(entry, f"inputs[{index}]") for index, entry in enumerate(examples["inputs"])}
    rows.add(_entry_rows(examples["targets"], "targets"))
    if len(rows) != 1:
        raise ValueError(f"the inputs and targets hold different numbers of examples ({sorted(rows)})")


def _entry_rows(entry: Any, where: str) -> int:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is not an object")
    dtype, dims = entry.get("dtype"), entry.get("dims")
    if dtype not in DEMO_DTYPES:
        raise ValueError(f"{where}: dtype {dtype!r:.40} is not one of {', '.join(DEMO_DTYPES)}")
    if not isinstance(dims, list) or not dims or not all(isinstance(d, int) and d >= 0 for d in dims):
        raise ValueError(f"{where}: 'dims' must be the array's shape, a list of sizes, examples first")
    size = int(np.prod(dims)) * np.dtype(dtype).itemsize
    data = base64.b64decode(str(entry.get("b64", "")), validate=True)
    if len(data) != size:
        raise ValueError(f"{where}: 'b64' holds {len(data)} bytes, its dims and dtype say {size}")
    return int(dims[0])


def demo_examples(inputs: tuple[np.ndarray, ...] | list[np.ndarray], targets: np.ndarray) -> dict[str, Any]:
    """One device's examples as the demo page reads them (``NAME.json``): little-endian bytes, base64."""
    def entry(array: np.ndarray) -> dict[str, Any]:
        array = np.asarray(array)
        if array.dtype.name not in DEMO_DTYPES:
            raise ConfigError(f"demo examples of dtype {array.dtype.name}: the page reads {', '.join(DEMO_DTYPES)}")
        little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        return {"dtype": array.dtype.name, "dims": list(array.shape),
                "b64": base64.b64encode(little.tobytes()).decode()}
    return {"inputs": [entry(array) for array in inputs], "targets": entry(targets)}


def write_demo_data(task_name: str, out: Path, devices: int, *, prefix: str = "browser", raw: bool = False,
                    seed: int | None = None) -> list[Path]:
    """Write ``PREFIX0.json`` .. for ``devices`` demo devices: the task's simulated partitions.

    ``raw``: the inputs before the task's affine preprocessing (``(x - offset) / scale``), as a
    sensor gives them; the SDK applies the preprocessing, as Python devices do.

    Raises
    ------
    ConfigError
        An unknown task, a count below 1, a prefix that makes no device name, or ``raw`` for a task
        whose preprocessing is not affine.
    """
    from fedge import knobs  # noqa: PLC0415
    from fedge.config import resolve_run_config  # noqa: PLC0415
    from fedge.preprocessing import AFFINE, Preprocessing  # noqa: PLC0415
    from fedge.task.loading import load_task  # noqa: PLC0415

    if devices < 1:
        raise ConfigError(f"--devices {devices}: give how many demo devices to make examples for (1 or more)")
    if not DATA_NAME.match(f"{prefix}{devices - 1}"):
        raise ConfigError(f"--prefix {prefix!r}: device names are letters, digits, '.', '_', '-' (e.g. browser)")
    overrides: dict[str, Any] = {knobs.TASK: task_name}
    if seed is not None:
        overrides[knobs.SEED] = seed
    config = resolve_run_config(overrides)
    task = load_task(config)
    preprocessing = Preprocessing.of(task.preprocessing)
    if raw and preprocessing.kind != AFFINE:
        raise ConfigError(f"--raw: task '{task_name}' declares no affine preprocessing ({preprocessing.kind}); "
                          "its examples are written as the model takes them without --raw")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for index in range(devices):
        shard = task.partition(index, devices, config)
        inputs = list(shard.inputs)
        if raw:
            inputs = [((np.asarray(x, np.float32) - np.float32(preprocessing.offset)) / np.float32(preprocessing.scale))
                      .astype(np.float32) if np.asarray(x).dtype.kind == "f" else x for x in inputs]
        path = out / f"{prefix}{index}.json"
        path.write_text(json.dumps(demo_examples(inputs, np.asarray(shard.targets))))
        written.append(path)
    return written


def check_origins(origins: tuple[str, ...] | list[str]) -> None:
    """Refuse an ``--allow-origin`` that is not one web origin (``scheme://host[:port]``, nothing more)."""
    for origin in origins:
        parts = urlsplit(origin)
        if origin == "*" or parts.scheme not in ("https", "http") or not parts.hostname or \
                parts.path or parts.query or parts.fragment or parts.username or origin.endswith("/"):
            raise ConfigError(f"--allow-origin {origin!r}: give one web app's origin, as a browser sends it: "
                              "scheme://host[:port] with no path or '/' (e.g. https://app.example.org); "
                              "no wildcard: name each app's origin")


def cors_middleware(origins: tuple[str, ...] | list[str]) -> list[Any]:
    """Starlette's CORSMiddleware for ``origins`` (the device API's methods and headers); none: no middleware.

    Preflights from an allowed origin are answered 200; from another origin 400 (and its page's
    requests carry no ``Access-Control-Allow-Origin``, so the browser refuses the answers).
    """
    if not origins:
        return []
    from starlette.middleware import Middleware  # noqa: PLC0415
    from starlette.middleware.cors import CORSMiddleware  # noqa: PLC0415

    check_origins(origins)
    return [Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"],
                       allow_headers=list(CORS_HEADERS), expose_headers=["Retry-After"], max_age=600)]


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
    """Starlette routes for ``/web/...``: the SDK (and ``vendor/``, the pinned code it imports), ``ort/``,
    ``data/NAME.json`` and ``bundle-key.pem``.

    ``data/NAME.json`` is answered only to a request ``authenticate`` accepts as device NAME's
    session (401/403 otherwise, before anything is looked up); the other files are public.
    """
    from starlette.responses import FileResponse, JSONResponse  # noqa: PLC0415
    from starlette.routing import Route  # noqa: PLC0415

    files = {f"/web/{name}": ASSETS / name for name in (*SDK_FILES, *VENDOR_FILES)}
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
