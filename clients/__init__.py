"""The device side: the ClientApp every device runs and the runtimes behind it (torch, onnx), the
device process, the secure-aggregation device steps, the gateway tier (``fedge gateway``: an HTTPS
service for phones and browsers that is one node of the federation) and the device protocol's
reference client (:mod:`fedge.clients.protocol_device`).

The SDK entry point is :func:`fedge.clients.app.make_client_app` (in its module, which a
torch-free device imports without pulling in torch); ``fedge device`` is
:mod:`fedge.clients.device`. This package itself only re-exports the fleet profile types a
device app names (:mod:`fedge.profiles`).
"""

from fedge.profiles import BUILTIN_PROFILES, DeviceProfile, Fleet, parse_fleet

__all__ = ["BUILTIN_PROFILES", "DeviceProfile", "Fleet", "parse_fleet"]
