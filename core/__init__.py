"""fedge: federated learning across heterogeneous edge fleets, built on Flower.

The subpackages map to the repository's top-level folders: ``fedge.server`` (coordinator),
``fedge.clients`` (device SDK, gateways, the device protocol's reference client),
``fedge.edge`` (signed bundles, ONNX export and on-device training), ``fedge.strategies``
(aggregation), ``fedge.task`` / ``fedge.task.builtin`` (the Task API / the built-in tasks),
``fedge.web`` (the browser SDK's files), ``fedge.simulation`` (one-machine fleets) and
``fedge.cli``. This package (the core, folder ``core/``) holds what every side shares: errors,
the run configuration and its knobs, the wire contract, codecs, fleet profiles, aggregation
and secure-aggregation math, the batch order, the device protocol's wire format and process
and listener helpers (ARCHITECTURE.md lists them).

It is also the public API's front door: ``from fedge import Task, TaskData, InputSpec,
EdgeModel, make_client_app, simulate``. Those names resolve on first use (PEP 562), so
``import fedge`` loads nothing above the core (no torch on a torch-free device); the table
below is the one place the core names upper layers, as strings, never as imports
(ARCHITECTURE.md; tests/test_architecture.py checks both).
"""

import importlib
from typing import Any

from fedge.errors import (
    BundleVerificationError,
    CheckpointMismatch,
    ConfigError,
    FedgeError,
    UpdateRejected,
)

__version__ = "0.1.0"

# name -> the module that defines it (resolved by __getattr__ on first use)
_PUBLIC_API = {
    "Task": "fedge.task.api",
    "TaskData": "fedge.task.api",
    "InputSpec": "fedge.signature",
    "EdgeModel": "fedge.edge.runtime",
    "make_client_app": "fedge.clients.app",
    "simulate": "fedge.simulation.runner",
}


def __getattr__(name: str) -> Any:
    """``fedge.Task`` and the rest of :data:`_PUBLIC_API`, imported when first asked for."""
    if name not in _PUBLIC_API:
        raise AttributeError(f"module 'fedge' has no attribute '{name}'")
    value = getattr(importlib.import_module(_PUBLIC_API[name]), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC_API})

__all__ = [
    "BundleVerificationError",
    "EdgeModel",
    "InputSpec",
    "Task",
    "TaskData",
    "make_client_app",
    "simulate",
    "CheckpointMismatch",
    "ConfigError",
    "FedgeError",
    "UpdateRejected",
    "__version__",
]
