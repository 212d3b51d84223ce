"""One file, two models: a valid ONNX message that onnxruntime, left to guess, runs as an ORT-format model.

onnxruntime takes bytes for an ORT-format flatbuffer when bytes 4..8 are its file identifier
``ORTM`` (unless the session pins ``session.load_model_format``). The ONNX parser and the graph
checks read the same bytes as a protobuf message. :func:`polyglot` lays the two readings over
each other:

====== ================================================ ==========================================
bytes  protobuf (ONNX ModelProto)                       flatbuffer (ORT format)
====== ================================================ ==========================================
0..2   field 1 (ir_version) = 0, a varint               root table offset (uint32 little-endian:
2..11  field 1 as a fixed64: protobuf keeps it as an    ``08 00 09 00`` = 0x90008), then the file
       unknown field (``00 'ORTM' 00 00 00``)           identifier ``ORTM`` at 4..8
11..   field 9, bytes: padding, then the hidden         the hidden model's tables, shifted so its
       model's flatbuffer from its byte 8 on            root table lands at 0x90008
after  the visible model's own fields (ir_version       ignored
       again, opset, graph): the graph a checker reads
====== ================================================ ==========================================

The flatbuffer verifier checks alignment relative to the buffer's start, so the shift must be a
multiple of 8: the root offset is 0 mod 8 (a varint tag's low bits), and the hidden model is
re-exported with a doc string of another length until its own root offset is too.
"""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

ORT_FORMAT_ID = b"ORTM"
HEAD = bytes([0x08, 0x00, 0x09, 0x00]) + ORT_FORMAT_ID + bytes(3)  # see the table above
HIDDEN_SCALE = 100.0  # the hidden graph: logits = com.microsoft.Gelu(input @ (W * 100))


def hidden_ort_model(doc: str = "") -> bytes:
    """An ORT-format model of ``logits = com.microsoft.Gelu(input @ (arange(12).reshape(4, 3) * 100))``.

    Saved by onnxruntime itself (``session.save_model_format = ORT``); its root table offset is a
    multiple of 8 (another ``doc`` length is tried until it is)."""
    import onnxruntime as ort

    for pad in range(16):
        weights = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) * HIDDEN_SCALE, "W")
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["input", "W"], ["h"]),
             helper.make_node("Gelu", ["h"], ["logits"], domain="com.microsoft")], "hidden",
            [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])], initializer=[weights])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)])
        model.ir_version, model.doc_string = 8, doc + "d" * pad
        with tempfile.TemporaryDirectory() as folder:
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            options.optimized_model_filepath = str(Path(folder) / "hidden.ort")
            options.add_session_config_entry("session.save_model_format", "ORT")
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            saved = (Path(folder) / "hidden.ort").read_bytes()
        if saved[4:8] == ORT_FORMAT_ID and struct.unpack("<I", saved[:4])[0] % 8 == 0:
            return saved
    raise AssertionError("onnxruntime never saved the hidden model with its root table at a multiple of 8")


def _varint(number: int) -> bytes:
    out = bytearray()
    while True:
        low, number = number & 0x7F, number >> 7
        out.append(low | (0x80 if number else 0))
        if not number:
            return bytes(out)


def polyglot(visible: bytes, hidden: bytes | None = None) -> bytes:
    """``visible`` (a serialized ONNX model) with the ORT-format model ``hidden`` laid under it.

    ``onnx.load_from_string`` gives ``visible``'s graph; onnxruntime without a pinned format runs
    ``hidden`` (default :func:`hidden_ort_model`)."""
    hidden = hidden_ort_model() if hidden is None else hidden
    root = struct.unpack("<I", hidden[:4])[0]
    shift = struct.unpack("<I", HEAD[:4])[0] - root  # where hidden's byte 8 goes, less 8
    start = len(HEAD) + 1 + len(_varint(shift + len(hidden)))  # field 9's payload starts here (tag, length)
    payload = bytes(8 + shift - start) + hidden[8:]
    out = HEAD + b"\x4a" + _varint(len(payload)) + payload + visible
    assert out[8 + shift:8 + shift + len(hidden) - 8] == hidden[8:] and out[4:8] == ORT_FORMAT_ID
    return out
