"""A cache of ONNX translations: torch's translation of one traced training step, found by what it translates.

Translating a traced training step to ONNX (``torch.onnx.export(dynamo=True)`` of the
FX graph :mod:`fedge.edge.training_graph` traces) is about 90 % of an export (profiled):
the digits MLP's export took 12.7 s here, 5.6 s with the translation cached. A coordinator exported the same
graphs again at every start, resume and ServerApp restart. The translation reads only
the traced graph (its code and its tensor constants), the signature (input and output
names, named axes) and the code doing it (torch, onnxscript, onnx and fedge's own
export module), so an entry keyed by a digest of exactly those is the byte-for-byte
result a new translation would give. Nothing else is skipped: every graph, cached or
not, still goes through the parity check against torch before anything is signed.

Threat model: an entry is trusted as the directory holding it is. ``fedge coordinator
start`` keeps the cache in its state directory (0700, beside the SuperLink's database and
operator token) and hands it to its ServerApp in ``FEDGE_GRAPH_CACHE``; the variable
set beforehand names another one (the test suite shares one per run). Without it
nothing is cached. An entry that cannot be read is a miss, never an error.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
import os
from collections.abc import Iterator, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedge.files import write_bytes_atomic

if TYPE_CHECKING:  # torch and onnx load where a graph is exported (the coordinator reads GRAPH_CACHE_ENV alone)
    import torch

log = logging.getLogger("fedge.edge")

GRAPH_CACHE_ENV = "FEDGE_GRAPH_CACHE"
SUFFIX = ".onnx"


def graph_cache() -> Path | None:
    """The cache this process uses (``FEDGE_GRAPH_CACHE``), or None."""
    named = os.environ.get(GRAPH_CACHE_ENV, "")
    return Path(named) if named else None


def translation_key(graph: torch.fx.GraphModule, *, signature: Sequence[object], source: bytes) -> str:
    """The digest of everything the translation of ``graph`` reads.

    ``signature``: what else decides the ONNX file (input and output names, the named
    axes); ``source``: the exporting module's own code (its decompositions and clean-up).
    """
    import torch  # noqa: PLC0415

    digest = hashlib.sha256()
    for part in (*_versions(), hashlib.sha256(source).hexdigest(), graph.code, *map(repr, signature)):
        digest.update(part.encode())
        digest.update(b"\0")
    for name, tensor in _constants(graph):
        array = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{array.dtype}:{tuple(array.shape)}".encode())
        digest.update(array.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def cached(directory: Path | None, key: str) -> tuple[bytes, int] | None:
    """The translation stored under ``key`` and its opset, or None (none stored, or unreadable)."""
    if directory is None:
        return None
    import onnx  # noqa: PLC0415

    path = directory / f"{key}{SUFFIX}"
    try:
        data = path.read_bytes()
        opset = next(entry.version for entry in onnx.load_from_string(data).opset_import if entry.domain == "")
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a damaged entry is a miss, whatever the parser raises
        log.warning("graph cache: %s cannot be read (%s); translating again", path, exc)
        return None
    return data, int(opset)


def store(directory: Path | None, key: str, data: bytes) -> None:
    """Keep ``data`` under ``key`` (atomically: a reader never sees half of it); a failure is logged."""
    if directory is None:
        return
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_bytes_atomic(directory / f"{key}{SUFFIX}", data)
    except OSError as exc:
        log.warning("graph cache: cannot write to %s (%s); the next export translates again", directory, exc)


def forget(directory: Path | None, keys: Sequence[str]) -> None:
    """Remove the entries under ``keys`` (a translation that failed its parity check)."""
    if directory is None:
        return
    for key in keys:
        (directory / f"{key}{SUFFIX}").unlink(missing_ok=True)


@functools.cache
def _versions() -> tuple[str, ...]:
    """The translating packages' versions (read once a process)."""
    return tuple(_each_version())


def _each_version() -> Iterator[str]:
    import torch  # noqa: PLC0415

    yield f"torch {torch.__version__}"
    for package in ("onnxscript", "onnx"):
        try:
            yield f"{package} {version(package)}"
        except PackageNotFoundError:
            yield f"{package} absent"


def _constants(graph: torch.fx.GraphModule) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the graph holds (parameters, buffers and the attributes its ``get_attr`` nodes read), by name."""
    import torch  # noqa: PLC0415

    found: dict[str, torch.Tensor] = dict(graph.named_parameters())
    found.update(graph.named_buffers())
    for node in graph.graph.nodes:
        if node.op != "get_attr":
            continue
        value: Any = operator.attrgetter(str(node.target))(graph)
        if isinstance(value, torch.Tensor):
            found[str(node.target)] = value
        elif isinstance(value, torch.nn.Module):
            found.update({f"{node.target}.{name}": tensor for name, tensor in value.state_dict().items()})
    return sorted(found.items())
