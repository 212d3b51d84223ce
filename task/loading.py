"""Find, build and check the task a run names.

Threat model: loading a task imports and runs Python code. Only the operator names it: the
coordinator reads ``task`` from the run config the operator submits through the Control API
(token-protected, :mod:`fedge.server.superlink`); a deployed device runs the task its owner
configured (``fedge device --task``) and refuses a run that names another one, so a
coordinator cannot make devices import code of its choosing.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import warnings
from functools import lru_cache

import numpy as np
import torch

import fedge.task.builtin  # noqa: E402,F401 - registers the built-in tasks before any lookup
from fedge import knobs
from fedge.config import RunConfig, Scalar, resolve_run_config
from fedge.errors import ConfigError
from fedge.task.api import Task, TaskData, seeded_model
from fedge.task.registry import TASKS

log = logging.getLogger("fedge.task")


def task_reference(config: RunConfig) -> str:
    """What names the run's task: ``task``, else the built-in for ``dataset``."""
    return config.text(knobs.TASK) or config.text(knobs.DATASET)


def load_task(config: RunConfig) -> Task:
    """The run's task, built once per process and setting.

    ``task`` is a registered name (``fedge.task.builtin``' built-ins or ``register_task``) or
    ``"package.module:object"`` where the object is a :class:`Task`, a Task subclass or a
    factory ``(RunConfig) -> Task``. Empty: the built-in task for ``dataset``.

    Raises
    ------
    ConfigError
        Naming the registered tasks, or what the reference points at and why it is no task.
    """
    return _load(tuple(sorted(config.items())))


@lru_cache(maxsize=8)
def _load(items: tuple[tuple[str, Scalar], ...]) -> Task:
    config = resolve_run_config(dict(items))
    reference = task_reference(config)
    if ":" in reference:
        target = _imported(reference)
    elif reference in TASKS:
        target = TASKS[reference]
    else:
        raise ConfigError(f"run-config 'task' = {reference!r} is not a registered task or 'package.module:object'; "
                          f"registered tasks: {', '.join(sorted(TASKS))}")
    task = _built(target, config, reference)
    log.info("%s", task.describe())
    return task


def _imported(reference: str) -> object:
    module_name, _, attribute = reference.partition(":")
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"task {reference!r}: cannot import module '{module_name}' ({exc}); install the "
                          "task's package where fedge runs, or fix the name") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"task {reference!r}: module '{module_name}' has no '{attribute}'")
        target = getattr(target, part)
    return target


def _built(target: object, config: RunConfig, reference: str) -> Task:
    if isinstance(target, Task):
        return target
    if not callable(target):
        raise ConfigError(f"task {reference!r} is a {type(target).__name__}, not a fedge Task, Task subclass or "
                          "factory (RunConfig) -> Task")
    takes_config = bool(inspect.signature(target).parameters)
    task = target(config) if takes_config else target()
    if not isinstance(task, Task):
        raise ConfigError(f"task {reference!r} returned a {type(task).__name__}, not a fedge Task; subclass "
                          "fedge.task.Task")
    return task


def check_task(task: Task, config: RunConfig) -> None:
    """Refuse a task that cannot work, at start, with the method and the fix named.

    Checks: the model builds the same twice from one seed (deterministic init, or devices
    and coordinator would start from different weights); then, on two examples of
    ``train_data()`` (what devices train on) and of ``central_data()`` (what the coordinator
    evaluates on) each: the inputs match the declared signature (rank, sizes, dtype) and the
    targets are ``target_dtype``; one real training step (forward, loss, backward) and one
    evaluation run; the loss gets outputs and targets of one shape per example, without
    broadcasting (a ``[batch, 2]`` head for ``[batch]`` targets, or torch's "target size that
    is different to the input size"), and is a finite scalar; the metrics include the headline.

    Raises
    ------
    ConfigError
        Naming what failed, in which of the task's methods, and how to fix it.
    """
    seed = config.integer(knobs.SEED)
    first, second = seeded_model(task, seed), seeded_model(task, seed)
    if not isinstance(first, torch.nn.Module):
        raise ConfigError(f"task '{task.name}': build_model() returned {type(first).__name__}, not a torch nn.Module")
    differing = [name for name, value in first.state_dict().items()
                 if not torch.equal(value, second.state_dict()[name])]
    if differing:
        raise ConfigError(f"task '{task.name}': build_model() is not deterministic under torch.manual_seed "
                          f"({differing[0]} differs between two builds); create every weight with torch's RNG "
                          "inside build_model(), not numpy's or Python's")
    if not task.inputs:
        raise ConfigError(f"task '{task.name}' declares no inputs; set inputs = (InputSpec('x', ('batch', ...)),)")
    for method, sample in _samples(task, config):
        _check_sample(task, first, method, sample)


def _samples(task: Task, config: RunConfig) -> list[tuple[str, TaskData]]:
    """Two examples of what devices train on and of what the coordinator evaluates on (when it has data)."""
    samples = [("train_data()", task.partition(0, 1, config).take(slice(0, 2)))]
    central = task.central_data()
    if central is not None and len(central):
        samples.append(("central_data()", central.take(slice(0, 2))))
    return samples


def _check_sample(task: Task, model: torch.nn.Module, method: str, sample: TaskData) -> None:
    """One training step and one evaluation of ``model`` on ``sample`` (from the task's ``method``)."""
    from fedge.signature import check_inputs  # noqa: PLC0415

    where = f"task '{task.name}' {method}"
    check_inputs(task.inputs, list(sample.inputs), source=where)
    if np.dtype(sample.targets.dtype) != np.dtype(task.target_dtype):
        raise ConfigError(f"{where}: targets are {sample.targets.dtype}, the task declares target_dtype "
                          f"{task.target_dtype!r}: return y.astype(np.{task.target_dtype}) from {method} (or set "
                          "target_dtype to what the loss expects)")
    inputs, targets = sample.tensors()
    model.train()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*target size.*different to the input size", category=UserWarning)
            outputs = task.forward(model, list(inputs))
            _check_shapes(task, where, outputs, targets)
            loss = task.loss(outputs, targets)
    except (RuntimeError, ValueError, TypeError, IndexError, UserWarning) as exc:
        raise ConfigError(f"{where}: the model's output does not fit the loss or the data ({exc}); make "
                          "build_model()'s output shape match what loss() expects for these targets") from None
    if loss.ndim != 0 or not math.isfinite(float(loss.detach())):
        raise ConfigError(f"{where}: loss() must return a finite scalar, got shape "
                          f"{tuple(loss.shape)} value {loss.detach().flatten()[:3].tolist()}")
    loss.backward()  # type: ignore[no-untyped-call]
    model.zero_grad()
    model.eval()
    with torch.no_grad():
        metrics = task.summarize(task.metrics(task.forward(model, list(inputs)), targets))
    if task.headline not in metrics:
        raise ConfigError(f"task '{task.name}': headline metric '{task.headline}' is not among its metrics "
                          f"{sorted(metrics)}; set headline to one of them")


def _check_shapes(task: Task, where: str, outputs: torch.Tensor, targets: torch.Tensor) -> None:
    """Float targets (regression): one output value per target value, per example (no silent broadcasting)."""
    if not targets.is_floating_point() or outputs.shape == targets.shape:
        return
    per_output, per_target = outputs[0].numel(), targets[0].numel() if targets.ndim else 1
    if outputs.shape[0] != targets.shape[0] or per_output != per_target:
        raise ConfigError(f"{where}: the model gives outputs {list(outputs.shape)} for targets "
                          f"{list(targets.shape)}: loss() would broadcast them into a wrong value; make "
                          f"build_model()'s head give {per_target} value(s) per example (e.g. "
                          f"nn.Linear(..., {per_target})), or reshape in loss()")
