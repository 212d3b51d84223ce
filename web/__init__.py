"""fedge's web device SDK: JavaScript files a browser runs (``web/*.js``), shipped inside the
Python package so that ``fedge gateway start --demo-page`` can serve them; the same folder is
the npm package ``fedge-web`` (``web/package.json``) an app bundles. See ``docs/devices.md``."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
"""Where the SDK's files are."""
SDK_FILES = ("fedge-device.js", "frame.js", "bundle.js", "onnx-check.js", "preprocessing.js", "worker.js",
             "batch-order.js", "demo.html", "demo.js")
"""What a gateway serves at ``/web/`` (nothing else from this folder)."""
ORT_FILES = ("ort.wasm.min.js", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")
"""The onnxruntime-web files the worker loads, served at ``/web/ort/`` from ``--ort-web DIR``."""
