"""The torch-free device runtime: local training on the run's signed ONNX training graph.

A phone, a browser or any device without Python torch trains with the task's training
graph (:mod:`fedge.edge.training_graph` exports it on the coordinator) run by stock
onnxruntime, and numpy for the optimiser step (:class:`fedge.edge.trainer.OnnxTrainer`).
The replies are the torch device's (same codecs, secure aggregation, DP clipping,
FedProx term, time budgets): :mod:`fedge.clients.common` packs both.

Where the graph comes from: a deployed device pulls the coordinator's published
training bundle (``fedge pull``; ``fedge device --runtime onnx`` does it before joining)
and names it with its public signing key in its node config (``training-bundle``,
``trusted-key``); a simulated device reads the run directory's
``bundles/training.zip``, signed by the run's key ``keys/signing.pub``.

Threat model: the graph is code the device runs, so it is verified (Ed25519 signature by
a key the device trusts, every file's hash) each time it is loaded, and the train
instruction names the architecture hash the coordinator expects: a device holding
another graph refuses the round instead of training the wrong model. A signature only
says who shipped the graph: before any onnxruntime session, :class:`OnnxTrainer` refuses
a graph that references external data (a file on the device, which onnxruntime would
read relative to the working directory and the graph would return as the update) or an
op outside the standard ONNX domain, or whose ops differ from the signed manifest's
``graph_ops`` list (:mod:`fedge.edge.graph_check`). What a graph legitimately computes
from the device's examples it can still send, as any federated client code can; secure
aggregation and differential privacy bound what one update reveals.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict

from fedge import knobs, wire
from fedge.clients.common import (
    LocalWork,
    TrainOrder,
    evaluation_content,
    instructed_width,
    received_weights,
    reply_content,
)
from fedge.clients.device_data import DeviceArrays as DeviceArrays
from fedge.clients.device_data import device_arrays as device_arrays
from fedge.config import RunConfig
from fedge.edge.trainer import OnnxTrainer
from fedge.edge.training_bundle import SIGNING_PUBLIC_KEY, TrainingBundle, read_training_bundle, training_bundle_for
from fedge.errors import ConfigError

log = logging.getLogger("fedge.clients")

_loaded: dict[tuple[str, int, int, str], tuple[TrainingBundle, OnnxTrainer]] = {}
_lock = threading.Lock()


def bundle_location(context: Context, config: RunConfig, width: float = 1.0) -> tuple[Path, Path]:
    """The training bundle this device uses (for a sub-model of ``width``: that width's, beside the
    whole model's) and the public key it trusts for it."""
    node = context.node_config
    if "training-bundle" in node or knobs.DATA_PATH in node:  # deployed: its own files only, never the run's
        own = Path(str(node.get("training-bundle", "")))
        return (own if width >= 1 else own.with_name(training_bundle_for(width).name),
                Path(str(node.get("trusted-key", ""))))
    run_dir = Path(config.text(knobs.RUN_DIR))
    return run_dir / training_bundle_for(width), run_dir / SIGNING_PUBLIC_KEY


def load_trainer(context: Context, config: RunConfig, expected: str | None,
                 width: float = 1.0) -> tuple[TrainingBundle, OnnxTrainer]:
    """The verified training bundle and its trainer (verified once per file version and process).

    Raises
    ------
    ConfigError
        No bundle, no trusted key, or a bundle of another architecture than ``expected``.
    BundleVerificationError
        The bundle is not signed by the trusted key or was altered.
    """
    path, key = bundle_location(context, config, width)
    if not path.is_file() and width < 1 and key.is_file():  # a sub-model's graph, needed for the first time
        refresh_training_bundle(context, path, key, width)
    if not path.is_file():
        pull = "`fedge pull --kind training`" + (f" --width {width:g}" if width < 1 else "")
        raise ConfigError(f"this device trains with onnx (runtime = onnx) but has no training graph at '{path}'; "
                          f"fetch it with {pull} (or run torch devices)")
    if not key.is_file():
        raise ConfigError(f"no trusted signing key at '{key}' to verify the training graph; pass the "
                          "coordinator's bundle signing public key (`fedge device --trust KEY.pub`)")
    stat = path.stat()
    cache_key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, str(key.resolve()))
    with _lock:
        if cache_key not in _loaded:
            bundle = read_training_bundle(path, trusted_keys=[key])
            _loaded[cache_key] = (bundle, OnnxTrainer(bundle.train_onnx, bundle.eval_onnx, bundle.manifest))
        bundle, trainer = _loaded[cache_key]
    if expected and bundle.architecture != expected and refresh_training_bundle(context, path, key, width):
        return load_trainer(context, config, expected, width)  # the new one; refused below if not the run's either
    if expected and bundle.architecture != expected:
        raise ConfigError(f"this device's training graph '{path}' is architecture {bundle.architecture[:12]}, the "
                          f"run trains {expected[:12]}; fetch the current one with `fedge pull --kind training`")
    return bundle, trainer


def refresh_training_bundle(context: Context, path: Path, key: Path, width: float = 1.0) -> bool:
    """Fetch the coordinator's current training graph into ``path`` (a run that trains another
    architecture); whether a new one came.

    Only what ``fedge device`` put in this device's own node config is used: its bundle service,
    device key, CA, trusted signing key and freshness records, as for the pull at start; the
    bundle is verified (signature, hashes, not older than one accepted) before it replaces the old.
    A device started without them (``fedge device`` of an older fedge) keeps the old refusal.
    """
    from fedge.edge.delivery import DeliveryError, inference_kind, pull  # noqa: PLC0415 - numpy, cryptography, http

    node = context.node_config
    if "bundle-service" not in node or path.name != training_bundle_for(width).name:
        return False
    insecure = str(node.get("bundles-insecure", "")) == "yes"
    try:
        result = pull(url_or_address=str(node["bundle-service"]), kind=inference_kind(width, "training"),
                      directory=path.parent,
                      device_key=None if insecure else str(node.get("device-key", "")),
                      ca=None if insecure else str(node.get("ca", "")), trusted_keys=[key],
                      freshness_dir=str(node.get("freshness-dir", "")) or None, insecure=insecure)
    except DeliveryError as exc:
        log.warning("the run trains another architecture and the new training graph could not be fetched: %s", exc)
        return False
    if result.changed:
        log.info("fetched the run's training graph (%d bytes): the run trains another architecture",
                 result.bytes_downloaded)
    return result.changed



def expected_graph(msg: Message) -> str | None:
    """The architecture of the run's training graph, as a train or evaluate instruction names it."""
    record = msg.content.config_records.get(wire.CONFIG)
    named = record.get(wire.TRAINING_GRAPH) if record is not None else None
    return str(named) if named else None


def current_trainer(msg: Message, context: Context, config: RunConfig) -> tuple[TrainingBundle, OnnxTrainer]:
    """The trainer of the graph ``msg`` names (its sub-model's width's), fetched first if this device holds
    another (before its data is read: the new graph's inputs and preprocessing are what the data must meet)."""
    return load_trainer(context, config, expected_graph(msg), instructed_width(msg))


def onnx_local_work(msg: Message, context: Context, config: RunConfig, order: TrainOrder,
                    data: DeviceArrays) -> tuple[ArrayRecord, dict[str, np.ndarray], LocalWork]:
    """Train the instruction's weights on ``data`` with the training graph; the trained arrays."""
    _, trainer = current_trainer(msg, context, config)
    base = received_weights(msg.content.array_records[wire.ARRAYS])
    inputs, targets = data
    if len(targets) == 0:
        raise ConfigError("this device has no training examples")
    instruction = order.instruction
    weights, stats = trainer.train(
        base, inputs, targets, epochs=instruction.local_epochs, batch_size=instruction.batch_size,
        learning_rate=instruction.learning_rate, momentum=instruction.momentum, seed=order.seed,
        proximal_mu=instruction.proximal_term, max_steps=order.max_steps)
    trained = ArrayRecord({name: Array(np.ascontiguousarray(weights[name])) for name in base})
    return trained, base, stats


def onnx_train_content(msg: Message, context: Context, config: RunConfig, order: TrainOrder,
                       data: DeviceArrays) -> RecordDict:
    """The train reply of an onnx device (the same content a torch device sends)."""
    trained, base, work = onnx_local_work(msg, context, config, order, data)
    return reply_content(msg, context, order, trained, base, work)


def onnx_evaluate_content(msg: Message, context: Context, config: RunConfig, data: DeviceArrays) -> RecordDict:
    """The evaluate reply of an onnx device: the graph's metrics as unsummarised means."""
    _, trainer = current_trainer(msg, context, config)
    weights = received_weights(msg.content.array_records[wire.ARRAYS])
    inputs, targets = data
    scores = trainer.evaluate(weights, inputs, targets)
    return evaluation_content(scores, len(targets))
