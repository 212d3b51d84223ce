"""Refuse ONNX graphs that could make onnxruntime read files, before any session exists.

Threat model: a graph is code a device runs, and a valid signature only says who shipped
it; a compromised or curious coordinator signs whatever it ships. ONNX lets any tensor
keep its bytes in an "external data" file (``data_location = EXTERNAL`` and an
``external_data`` ``location``), and onnxruntime resolves that location for a model given
as bytes against the process's working directory: a training graph whose initializer
pointed at ``phone-017.key`` returned the device's private key inside its update (measured
with onnxruntime 1.32: a file in the working directory, or below it, is read; ``../`` and
absolute paths are refused by that release itself, but the ``edge`` install does not pin
onnxruntime and fedge does not rely on it). So a device refuses, before creating a session:

* every tensor with external data or any data location but the default, wherever it is:
  graph initializers, sparse initializers (values and indices), node attributes (``t``,
  ``tensors``, ``sparse_tensor(s)``), and the same inside every subgraph (``If``/``Loop``/
  ``Scan`` bodies, ``g`` and ``graphs`` attributes) at any depth up to :data:`MAX_DEPTH`;
* every node outside :data:`ALLOWED_DOMAINS`, the standard ONNX domain, which is all that
  fedge's exports use (measured: fp32 and int8 inference graphs, dynamic and static-QDQ
  quantization, and the training/evaluation graphs of the mlp and cnn models use domain
  ``""`` only; the quantizer *imports* ``com.microsoft`` and others in ``opset_import``
  without using them, so imports are not refused, nodes are): custom-domain ops
  (``com.microsoft`` contrib ops, ``EPContext`` nodes that name cache files, anything a
  custom-op library would register) never run;
* model-local functions and training info, which fedge's exporters never emit (refusing
  them keeps the walk to one place a node can be), and the ``ort_config`` metadata key
  through which onnxruntime (with ``ORT_LOAD_CONFIG_FROM_MODEL=1``) takes session options
  such as file paths from the model;
* bytes that do not parse as an ONNX model, or nest subgraphs deeper than :data:`MAX_DEPTH`;
* bytes that onnxruntime would take for an *ORT-format* model: the flatbuffer file identifier
  ``ORTM`` at bytes 4..8 (:data:`ORT_FORMAT_ID`). onnxruntime picks the format from those bytes,
  and a file can be both: a valid ONNX message (the field holding ``ORTM`` and the flatbuffer is
  one protobuf skips) whose ORT reading is another graph (``tests/ort_polyglot.py`` builds one
  whose hidden graph runs ``com.microsoft`` ops). Checking one reading and running the other
  would check nothing, so such bytes are refused by name.

The session is then built by :func:`session_of` from the *checked* message re-serialized
(fields this ``onnx`` release does not know are dropped, so onnxruntime cannot read a field
the checker never saw) and with onnxruntime's external-data folder set to a fresh, private,
empty directory, removed once the session exists: even a path the checker missed would
resolve to nothing there. The session also pins the ONNX format (:data:`LOAD_FORMAT_OPTION`), so
onnxruntime parses the bytes as the protobuf the checker read, whatever their first bytes say.

Why the ``onnx`` package and not a hand-written protobuf walker: ``onnx`` is the schema's
own reference implementation, its parser is protobuf's (bounded recursion; broken bytes
raise), and the fields that matter (tensor data location, subgraph attributes, sparse
tensors, functions) are read by name rather than by field numbers a walker would have to
keep in step with the schema. onnxruntime already depends on ``protobuf``, so the ``edge``
and ``device`` installs add one wheel (``onnx``) and no native toolchain.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fedge.errors import BundleVerificationError

ALLOWED_DOMAINS = frozenset({"", "ai.onnx"})
"""Node domains a device runs: the standard ONNX operator set (``""`` and its alias ``ai.onnx``)."""
STANDARD_DOMAIN = "ai.onnx"
MAX_DEPTH = 16
"""Deepest subgraph nesting accepted (fedge's graphs have none; ``If`` inside ``Loop`` is 2)."""
MAX_OPS = 1024
"""Most distinct op types one graph may use (the standard set has about 200)."""
ORT_CONFIG_KEY = "ort_config"
EXTERNAL_FOLDER_OPTION = "session.model_external_initializers_file_folder_path"
LOAD_FORMAT_OPTION = "session.load_model_format"
"""onnxruntime's session config entry naming the model format; set to ``ONNX`` for every checked graph."""
ORT_FORMAT_ID = b"ORTM"
"""The ORT-format flatbuffer's file identifier, at bytes 4..8 (where onnxruntime looks for it)."""
FIX = "re-export it with fedge, whose graphs keep every weight inside the model and use standard ONNX ops only"


@dataclass(frozen=True)
class CheckedGraph:
    """A graph that passed :func:`check_graph`.

    Attributes
    ----------
    model_bytes : bytes
        The checked message re-serialized: what a session is built from.
    ops : tuple of str
        Sorted op types of every node, subgraphs included (all in the standard domain).
    """

    model_bytes: bytes
    ops: tuple[str, ...]

    def op_list(self) -> dict[str, list[str]]:
        """The graph's ops as a manifest records them: ``{"domains": [...], "ops": [...]}``."""
        return {"domains": [STANDARD_DOMAIN], "ops": list(self.ops)}


def check_graph(model_bytes: bytes, *, what: str) -> CheckedGraph:
    """Refuse a graph that references external data or ops outside the standard ONNX domain.

    Threat model: ``model_bytes`` may come from a signer that wants the device's files (see
    the module docstring); nothing here trusts the signature.

    Parameters
    ----------
    model_bytes : bytes
        A serialized ONNX ``ModelProto``.
    what : str
        The graph's name in messages (``train.onnx``, ``model.int8.onnx``...).

    Returns
    -------
    CheckedGraph
        The re-serialized checked model and its op types.

    Raises
    ------
    BundleVerificationError
        Naming what was found and where; no session exists yet.
    """
    model = _parse(model_bytes, what)
    if len(model.functions):
        raise _refused(what, f"defines model-local functions ({_names(f.name for f in model.functions)})")
    if len(model.training_info):
        raise _refused(what, "carries training info (initialization/algorithm graphs)")
    if any(prop.key == ORT_CONFIG_KEY for prop in model.metadata_props):
        raise _refused(what, f"sets onnxruntime session options in its metadata ('{ORT_CONFIG_KEY}')")
    ops: set[str] = set()
    for graph, where, depth in _graphs(model.graph, what):
        if depth > MAX_DEPTH:
            raise _refused(what, f"nests subgraphs deeper than {MAX_DEPTH} levels ({where})")
        _check_graph_body(graph, where, ops, what)
    if len(ops) > MAX_OPS:
        raise _refused(what, f"uses {len(ops)} op types (at most {MAX_OPS})")
    model.DiscardUnknownFields()
    checked = model.SerializeToString()
    _refuse_ort_format(checked[:8], what)  # fields in another order can put "ORTM" at byte 4 once re-serialized
    return CheckedGraph(model_bytes=checked, ops=tuple(sorted(ops)))


def session_of(checked: CheckedGraph, *, threads: int = 1) -> Any:
    """An onnxruntime CPU session of a graph :func:`check_graph` accepted.

    Threat model: as :func:`check_graph`; also, no path in the model can reach a user file,
    as the session resolves external data in a private empty directory (removed once the
    session exists) instead of the working directory, and onnxruntime reads the bytes as
    ONNX only (never as an ORT-format flatbuffer hidden in them). onnxruntime's own errors
    (a graph it cannot load) pass through for the caller to word.
    """
    import onnxruntime as ort  # noqa: PLC0415 - only what runs a model pays for it

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    with tempfile.TemporaryDirectory(prefix="fedge-ort-") as empty:
        options.add_session_config_entry(EXTERNAL_FOLDER_OPTION, empty)
        options.add_session_config_entry(LOAD_FORMAT_OPTION, "ONNX")
        return ort.InferenceSession(checked.model_bytes, sess_options=options, providers=["CPUExecutionProvider"])


def check_op_list(checked: CheckedGraph, declared: object, *, what: str) -> None:
    """Refuse a graph whose ops differ from the op list its signed manifest declares.

    Raises
    ------
    BundleVerificationError
        Naming the ops found but not declared and declared but not found.
    """
    if not isinstance(declared, dict) or not isinstance(declared.get("ops"), list):
        raise BundleVerificationError(f"the manifest declares no op list for {what}; a device runs only graphs "
                                      "whose ops the signed manifest lists: re-export the bundle")
    listed = {str(op) for op in declared["ops"]}
    domains = {str(domain) for domain in declared.get("domains", [STANDARD_DOMAIN])}
    extra, missing = sorted(set(checked.ops) - listed), sorted(listed - set(checked.ops))
    if extra or missing or not domains <= ALLOWED_DOMAINS:
        raise BundleVerificationError(f"{what} uses ops {extra[:10]} its signed manifest does not list (and lacks "
                                      f"{missing[:10]} it lists; domains {sorted(domains)}): the graph is not the "
                                      "one the manifest describes, refused; fetch the bundle again")


# --------------------------------------------------------------------------- the walk


def _parse(model_bytes: bytes, what: str) -> Any:
    import onnx  # noqa: PLC0415 - 0.5 s to import; only a device that loads a graph pays for it

    if not isinstance(model_bytes, bytes | bytearray | memoryview):
        raise BundleVerificationError(f"{what} is not bytes ({type(model_bytes).__name__}); pass the model file's "
                                      "contents")
    _refuse_ort_format(bytes(model_bytes[:8]), what)
    model = onnx.ModelProto()
    try:
        model.ParseFromString(bytes(model_bytes))
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError, RuntimeWarning or others on broken bytes
        raise _refused(what, f"is not a valid ONNX model ({type(exc).__name__})") from None
    if not model.HasField("graph"):
        raise _refused(what, "holds no graph")
    return model


def _refuse_ort_format(head: bytes, what: str) -> None:
    """Refuse bytes onnxruntime would read as an ORT-format flatbuffer (its identifier at byte 4)."""
    if head[4:8] == ORT_FORMAT_ID:
        raise _refused(what, f"is an ORT-format model (file identifier '{ORT_FORMAT_ID.decode()}' at byte 4), which "
                             "onnxruntime would run instead of the ONNX graph checked here")


def _graphs(root: Any, what: str) -> Iterator[tuple[Any, str, int]]:
    """Every graph in ``root`` with where it sits and its nesting depth (iterative: no Python recursion)."""
    stack = [(root, what, 0)]
    while stack:
        graph, where, depth = stack.pop()
        yield graph, where, depth
        if depth >= MAX_DEPTH + 1:
            continue
        for node in graph.node:
            for attr in node.attribute:
                inner = ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
                stack.extend((sub, f"{where} > {node.op_type} '{node.name}' attribute '{attr.name}'", depth + 1)
                             for sub in inner)


def _check_graph_body(graph: Any, where: str, ops: set[str], what: str) -> None:
    """The graph's own tensors and nodes (its subgraphs come separately from :func:`_graphs`)."""
    for tensor in graph.initializer:
        _check_tensor(tensor, f"{where} initializer '{tensor.name}'", what)
    for sparse in graph.sparse_initializer:
        _check_sparse(sparse, f"{where} sparse initializer", what)
    for node in graph.node:
        if not isinstance(node.op_type, str) or not isinstance(node.domain, str):  # protobuf gives bytes for bad UTF-8
            raise _refused(what, f"has a node whose op type or domain is not UTF-8 text ({where})")
        if node.domain not in ALLOWED_DOMAINS:
            raise _refused(what, f"has op '{node.op_type}' of domain '{_short(node.domain)}' ({where}); devices run "
                                 "standard ONNX ops only")
        ops.add(node.op_type)
        for attr in node.attribute:
            place = f"{where} > {node.op_type} '{_short(node.name)}' attribute '{_short(attr.name)}'"
            tensors = ([attr.t] if attr.HasField("t") else []) + list(attr.tensors)
            for tensor in tensors:
                _check_tensor(tensor, place, what)
            for sparse in ([attr.sparse_tensor] if attr.HasField("sparse_tensor") else []) + list(attr.sparse_tensors):
                _check_sparse(sparse, place, what)


def _check_sparse(sparse: Any, where: str, what: str) -> None:
    for part in ("values", "indices"):
        if sparse.HasField(part):
            _check_tensor(getattr(sparse, part), f"{where} ({part})", what)


def _check_tensor(tensor: Any, where: str, what: str) -> None:
    if tensor.data_location != 0 or len(tensor.external_data):
        location = next((entry.value for entry in tensor.external_data if entry.key == "location"), "?")
        raise _refused(what, f"keeps tensor data outside the model ({where}: external data '{_short(location)}'); "
                             "a device never reads files a graph names")
    if tensor.HasField("segment"):
        raise _refused(what, f"splits a tensor into segments ({where})")


def _refused(what: str, problem: str) -> BundleVerificationError:
    return BundleVerificationError(f"{what} {problem}: refused before any onnxruntime session; {FIX}")


def _short(text: str | bytes, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters; a name protobuf gave back as bytes (not UTF-8) as its repr."""
    shown = text if isinstance(text, str) else repr(text)
    return shown if len(shown) <= limit else shown[:limit] + "..."


def _names(names: Iterator[str] | Any) -> str:
    listed = [_short(str(name), 40) for name in names]
    return ", ".join(listed[:5]) + (f" and {len(listed) - 5} more" if len(listed) > 5 else "")
