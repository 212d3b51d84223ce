"""Signed edge bundles of the global model, for the coordinator and ``fedge export``."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from torch import nn

from fedge import knobs
from fedge.config import RunConfig
from fedge.edge.build import BuiltBundle, BundleSpec, build_bundle, default_model_id
from fedge.edge.signing import PRIVATE_NAME, fingerprint, generate_signing_key, load_private_key
from fedge.errors import ExportError
from fedge.task.api import Task, TaskData

log = logging.getLogger("fedge.server")

CALIBRATION_SIZE = 256
HELD_OUT_SIZE = 256  # held-out examples taken from the training split of a task without central data


def run_signing_key(config: RunConfig, run_dir: Path) -> Ed25519PrivateKey:
    """The key named by ``signing-key``, else one made for this run under ``run_dir/keys``.

    A per-run key keeps simulation bundles signed (devices still verify them) without
    asking a researcher for key management; its public half is ``keys/signing.pub``.
    """
    if config[knobs.SIGNING_KEY]:
        return load_private_key(config.text(knobs.SIGNING_KEY))
    keys = run_dir / "keys"
    if not (keys / PRIVATE_NAME).exists():
        generate_signing_key(keys)
        log.info("bundles are signed with a key made for this run; its public key is %s",
                 keys / "signing.pub")
    return load_private_key(keys / PRIVATE_NAME)


def export_global_model(
    model: nn.Module,
    out_dir: Path,
    *,
    config: RunConfig,
    task: Task,
    server_round: int,
    source_run: str,
    private_key: Ed25519PrivateKey,
    make_zip: bool = False,
    valid_for: dt.timedelta | None = None,
    variant: str = "",
) -> BuiltBundle:
    """Build and sign the bundle of ``model`` (the global model of ``task`` after ``server_round``).

    The task gives the bundle its name, input signature, preprocessing, labels, output
    meaning and headline; its metrics score the fp32 and int8 models on the held-out set
    (:meth:`Task.central_data`, else the first :data:`HELD_OUT_SIZE` examples of the
    single-partition split), and :meth:`Task.calibration_data` calibrates int8.

    The manifest's ``model_id`` is ``<source_run>/<task name>``, shared by every bundle of
    the run (the coordinator's and ``fedge export``'s alike), and its ``version`` is
    ``server_round``, so a device with a freshness store refuses an earlier round of the
    run once it has run a later one. ``valid_for`` sets ``expires_at`` (default: no expiry).
    ``variant`` (a width-scaled sub-model's ``w0.25``) names the bundle ``<task>@<variant>``: its own
    lineage, so a device of that width keeps to it.
    """
    refuse_non_finite(model, server_round)
    held_out = held_out_data(task, config)
    name = f"{task.name}@{variant}" if variant else task.name
    spec = BundleSpec(
        model_name=name,
        source_run=source_run,
        server_round=server_round,
        preprocessing=dict(task.preprocessing),
        labels=bundle_labels(task, model, held_out),
        output_meaning=task.output,
        headline=task.headline,
        model_id=default_model_id(source_run, name),
        valid_for=valid_for,
    )
    built = build_bundle(exported_module(task, model), out_dir, spec=spec, private_key=private_key, inputs=task.inputs,
                         sample=held_out.inputs, score=task_score(task, held_out.targets),
                         calibration=task.calibration_data(CALIBRATION_SIZE, config.integer(knobs.SEED)),
                         make_zip=make_zip)
    log.info("round %d: signed bundle %s (model %s version %d, signer %s)", server_round, built.path,
             spec.lineage, server_round, fingerprint(private_key.public_key()))
    return built


def refuse_non_finite(model: nn.Module, server_round: int) -> None:
    """Refuse to sign a model with NaN or inf weights or buffers (a diverged run): devices would run it.

    Raises
    ------
    ExportError
        Naming the first such tensor.
    """
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ExportError(f"the model of round {server_round} is not finite ({name} holds NaN or inf): it is not "
                              "signed; export a round before it diverged (`fedge export RUN --round N`)")


class TaskForward(nn.Module):
    """``task.forward(model, inputs)`` as a module, for tasks whose forward is not ``model(*inputs)``."""

    def __init__(self, task: Task, model: nn.Module) -> None:
        super().__init__()
        self.task, self.model = task, model

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.task.forward(self.model, inputs)


def exported_module(task: Task, model: nn.Module) -> nn.Module:
    """What the bundle runs: ``model``, or ``model`` inside the task's own :meth:`Task.forward`."""
    return model if type(task).forward is Task.forward else TaskForward(task, model)


def held_out_data(task: Task, config: RunConfig) -> TaskData:
    """The task's central data, else the first :data:`HELD_OUT_SIZE` examples of its one-partition split."""
    central = task.central_data()
    if central is not None and len(central):
        return central
    try:
        return task.partition(0, 1, config).take(slice(0, HELD_OUT_SIZE))
    except NotImplementedError:
        raise ExportError(f"task '{task.name}' has neither central_data() nor train_data(): a bundle needs "
                          "held-out examples to check and score the export; define central_data()") from None


def bundle_labels(task: Task, model: nn.Module, held_out: TaskData) -> list[str] | None:
    """The task's labels; for a classifier without them, the class indices as names.

    A task without labels is a classifier when its targets are integers and its model gives
    ``(batch, classes)`` scores; any other (regression, per-token scores...) gets None: its
    bundle has no labels, and devices read its outputs with ``EdgeModel.run``.
    """
    if task.labels is not None:
        return [str(label) for label in task.labels]
    if not np.issubdtype(np.dtype(task.target_dtype), np.integer):
        return None
    with torch.no_grad():
        scores = task.forward(model.cpu().eval(), [torch.as_tensor(a[:1]) for a in held_out.inputs])
    return [str(index) for index in range(int(scores.shape[1]))] if scores.ndim == 2 else None


def task_score(task: Task, targets: np.ndarray) -> Callable[[np.ndarray], dict[str, float]]:
    """The task's (summarized) metrics of a model output on the held-out ``targets``."""
    expected = torch.from_numpy(np.ascontiguousarray(targets))

    def score(outputs: np.ndarray) -> dict[str, float]:
        with torch.no_grad():
            return task.summarize(task.metrics(torch.from_numpy(np.ascontiguousarray(outputs)), expected))

    return score
