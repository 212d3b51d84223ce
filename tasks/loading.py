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
from functools import lru_cache

import torch

from fedge.config import RunConfig, Scalar, resolve_run_config
from fedge.errors import ConfigError
from fedge.task.api import Task, TaskData, seeded_model
from fedge.task.registry import TASKS

log = logging.getLogger("fedge.tasks")


def task_reference(config: RunConfig) -> str:
    """What names the run's task: ``task``, else the built-in for ``dataset``."""
    return config.text("task") or config.text("dataset")


def load_task(config: RunConfig) -> Task:
    """The run's task, built once per process and setting.

    ``task`` is a registered name (``fedge.tasks``' built-ins or ``register_task``) or
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
    """Refuse a task that cannot work, at start, with the fix named.

    Checks: the model builds the same twice from one seed (deterministic init, or devices
    and coordinator would start from different weights); a batch of its data matches the
    declared input signature; the model's output goes into the loss, giving a finite scalar
    that backpropagates; the metrics include the headline.

    Raises
    ------
    ConfigError
        Naming what failed and how to fix it.
    """
    seed = config.integer("seed")
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
    sample = _sample(task, config)
    from fedge.signature import check_inputs  # noqa: PLC0415

    check_inputs(task.inputs, list(sample.inputs), source=f"task '{task.name}' data")
    inputs, targets = sample.tensors()
    try:
        outputs = task.forward(first, list(inputs))
        loss = task.loss(outputs, targets)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise ConfigError(f"task '{task.name}': the model's output does not fit the loss or the data ({exc}); make "
                          "build_model()'s output shape match what loss() expects for these targets") from None
    if loss.ndim != 0 or not math.isfinite(float(loss.detach())):
        raise ConfigError(f"task '{task.name}': loss() must return a finite scalar, got shape "
                          f"{tuple(loss.shape)} value {loss.detach().flatten()[:3].tolist()}")
    loss.backward()  # type: ignore[no-untyped-call]
    metrics = task.summarize(task.metrics(outputs.detach(), targets))
    if task.headline not in metrics:
        raise ConfigError(f"task '{task.name}': headline metric '{task.headline}' is not among its metrics "
                          f"{sorted(metrics)}; set headline to one of them")


def _sample(task: Task, config: RunConfig) -> TaskData:
    central = task.central_data()
    data = central if central is not None and len(central) else task.partition(0, 1, config)
    return data.take(slice(0, 2))
