"""On-device inference: ONNX export of global models (runtime without torch: see runtime)."""
