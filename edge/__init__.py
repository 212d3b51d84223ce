"""On-device inference: signed ONNX bundles and a runtime that needs no torch.

``from fedge.edge import EdgeModel`` imports only numpy, onnxruntime and
cryptography. Export (which needs torch) lives in :mod:`fedge.edge.export` and
:mod:`fedge.edge.build`, imported only by the coordinator.
"""

from fedge.edge.bundle import FreshnessStore
from fedge.edge.runtime import EdgeModel, Prediction

__all__ = ["EdgeModel", "FreshnessStore", "Prediction"]
