"""The run's training bundle: the training graph exported, checked and signed (what devices without torch train with).

At the start of a run with onnx devices (and always under ``fedge coordinator start``,
where any device may be one), the coordinator exports the task's local-training step
as a plain ONNX graph (:func:`fedge.edge.training_graph.export_training_graphs`, checked
against torch before anything is signed), signs it with the run's bundle key and writes
``bundles/training.zip``. The graph depends on the architecture only (weights are
inputs), so a device fetches it once and gets weights in the round messages; each train
instruction names its architecture hash (:data:`fedge.wire.TRAINING_GRAPH`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from torch import nn

from fedge import knobs
from fedge.config import RunConfig
from fedge.edge.trainer import NUMPY_METRICS, OnnxTrainer
from fedge.edge.training_bundle import (
    SIGNING_PUBLIC_KEY,
    TRAINING_BUNDLE,
    graph_fields,
    training_manifest,
    write_training_bundle,
)
from fedge.errors import ConfigError, ExportError
from fedge.files import write_bytes_atomic
from fedge.profiles import Fleet, runtime
from fedge.task.api import Task

if TYPE_CHECKING:  # onnx and onnxruntime load only for a run that exports a training graph (0.7 s)
    from fedge.edge.training_graph import TrainingGraphs

log = logging.getLogger("fedge.server")

SAMPLE_SIZE = 32  # held-out examples the export traces and checks parity on
METRIC_TOLERANCE = 1e-5  # an onnx device reports a task metric only if it reproduces torch's this closely


def wants_training_graph(config: RunConfig, fleet: Fleet, *, simulated: bool) -> bool:
    """Whether this run exports a training graph: some device may train without torch."""
    if config.text(knobs.RUNTIME) != "profile":
        return runtime(config.text(knobs.RUNTIME)).needs_training_graph
    if not simulated:
        return True  # deployed devices choose their runtime themselves
    return any(runtime(fleet.profiles[name].runtime).needs_training_graph for name, count in fleet.mix if count)


def export_training_graph(task: Task, model: nn.Module, config: RunConfig) -> tuple[TrainingGraphs, list[str]]:
    """The task's training and evaluation graphs, and the task metrics an onnx device reproduces.

    Raises
    ------
    ExportError
        A layer has no ONNX training translation (named), or the graph differs from torch.
    """
    if type(task).optimizer is not Task.optimizer:
        raise ExportError(f"task '{task.name}' declares its own optimizer; onnx devices train with SGD + momentum "
                          "only. Remove optimizer() from the task or run torch devices (runtime = torch)")
    from fedge.edge.training_graph import export_training_graphs
    from fedge.server.bundles import exported_module, held_out_data

    sample = held_out_data(task, config).take(slice(0, SAMPLE_SIZE))
    graphs = export_training_graphs(exported_module(task, model), task.loss, list(sample.inputs), sample.targets,
                                    inputs=task.inputs)
    return graphs, reproduced_metrics(task, model, graphs, sample.inputs, sample.targets)


def reproduced_metrics(task: Task, model: nn.Module, graphs: TrainingGraphs,
                       inputs: tuple[np.ndarray, ...], targets: np.ndarray) -> list[str]:
    """The task metrics the evaluation graph reproduces within :data:`METRIC_TOLERANCE` of torch."""
    with torch.no_grad():
        wanted = task.metrics(task.forward(model.eval(), [torch.as_tensor(a) for a in inputs]),
                              torch.as_tensor(targets))
    candidates = [name for name in ("loss", *NUMPY_METRICS) if name in wanted]
    manifest = training_manifest(graph_fields(graphs), task=task.name,
                                 metrics=candidates, model_id=f"{task.name}-training", version=0)
    trainer = OnnxTrainer(graphs.train_onnx, graphs.eval_onnx, manifest)
    weights = {name: value.detach().cpu().numpy() for name, value in model.state_dict().items()}
    got = trainer.evaluate(weights, inputs, targets)
    kept = [name for name in candidates if abs(got[name] - wanted[name]) <= METRIC_TOLERANCE]
    missing = sorted(set(wanted) - set(kept))
    if missing:
        log.info("onnx devices report %s of task '%s' (not %s: federated evaluation of those needs torch devices)",
                 kept, task.name, missing)
    return kept


def write_run_training_bundle(graphs: TrainingGraphs, metrics: list[str], task: Task, run_dir: Path, *,
                              private_key: Ed25519PrivateKey, path: Path = TRAINING_BUNDLE) -> dict[str, Any]:
    """Sign and write ``run_dir/bundles/training.zip`` (a sub-model's: ``path``; its lineage is the file's
    name) and the public key devices verify it with."""
    (run_dir / path).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / SIGNING_PUBLIC_KEY).parent.mkdir(parents=True, exist_ok=True)
    lineage = f"{task.name}-{path.stem}"  # training, training-w0.25
    manifest = write_training_bundle(
        run_dir / path, graphs, task=task.name, metrics=metrics,
        model_id=lineage, version=int(time.time()), private_key=private_key,
        preprocessing=dict(task.preprocessing))
    public = private_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo)
    write_bytes_atomic(run_dir / SIGNING_PUBLIC_KEY, public)
    log.info("training graph for onnx devices: %s (architecture %s, %d KB train + %d KB eval, parity %.1e)",
             run_dir / path, manifest["architecture"][:12], len(graphs.train_onnx) // 1024,
             len(graphs.eval_onnx) // 1024, graphs.max_abs_diff)
    return manifest


def refuse_or_warn(exc: ExportError, *, simulated: bool) -> None:
    """A simulated fleet with onnx devices cannot run without the graph; a deployment can (torch devices)."""
    if simulated:
        raise ConfigError(f"this run has onnx devices, but {exc}") from None
    log.warning("no training graph for onnx devices (torch devices are unaffected): %s", exc)
