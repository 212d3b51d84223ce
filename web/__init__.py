"""fedge's web device SDK: JavaScript files a browser runs (``web/*.js``), shipped inside the
Python package so that ``fedge gateway start --demo-page`` can serve them; the same folder is
the npm package ``fedge-web`` (``web/package.json``) an app bundles. See ``docs/devices.md``."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
"""Where the SDK's files are."""
SDK_FILES = ("fedge-device.js", "frame.js", "bundle.js", "onnx-check.js", "preprocessing.js", "worker.js",
             "batch-order.js", "secagg.js", "demo.html", "demo.js")
"""What a gateway serves at ``/web/`` (with :data:`VENDOR_FILES`; nothing else from this folder)."""
VENDOR_FILES = ("vendor/noble-ciphers/chacha.js", "vendor/noble-ciphers/_arx.js", "vendor/noble-ciphers/_poly1305.js",
                "vendor/noble-ciphers/utils.js", "vendor/noble-ciphers/LICENSE")
"""Third-party code the SDK imports (``secagg.js``: @noble/ciphers' ChaCha20), pinned and copied byte for byte
(``web/vendor/README.md``: version, source, hashes, license), served at ``/web/vendor/...``: no CDN at run time."""
ORT_FILES = ("ort.wasm.min.js", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")
"""The onnxruntime-web files the worker loads, served at ``/web/ort/`` from ``--ort-web DIR``."""
