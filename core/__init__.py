"""fedge: federated learning across heterogeneous edge fleets, built on Flower.

The subpackages map to the repository's top-level folders:
``fedge.server`` (coordinator), ``fedge.clients`` (device SDK), ``fedge.edge``
(on-device inference), ``fedge.strategies`` (aggregation), ``fedge.simulation``
(one-machine fleets) and ``fedge.cli``. This package holds only what every side
shares: the error hierarchy and the run configuration.
"""

from fedge.errors import (
    BundleVerificationError,
    CheckpointMismatch,
    ConfigError,
    FedgeError,
    UpdateRejected,
)

__version__ = "0.1.0"

__all__ = [
    "BundleVerificationError",
    "CheckpointMismatch",
    "ConfigError",
    "FedgeError",
    "UpdateRejected",
    "__version__",
]
