"""The runtimes that train on a device, by name: each one's train and evaluate handlers.

A runtime is what trains on a device: ``torch``, or ``onnx`` (the run's signed ONNX training
graph on onnxruntime and numpy, no torch). What the coordinator and the CLI know of it (its
name, whether the coordinator must publish a training graph for it) is
:class:`fedge.profiles.Runtime`, registered in :data:`fedge.profiles.RUNTIMES`; its handlers are
registered here (:func:`register_handlers`), and the ClientApp (:mod:`fedge.clients.app`) calls
the handlers of the runtime a device uses. A new runtime is one file: it registers both, and
every list of runtimes (profiles, the ``runtime`` knob, ``fedge device --runtime``) offers it.

This module imports no torch: each handler imports its runtime when it first runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flwr.app import Context, Message, RecordDict

from fedge import knobs
from fedge.clients.common import (
    TrainOrder,
    evaluation_content,
    is_deployed,
    num_partitions,
    prepared_device_inputs,
    reply_content,
)
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.profiles import RUNTIMES

if TYPE_CHECKING:
    from fedge.clients.onnx_client import DeviceArrays
    from fedge.task.api import Task, TaskData

Train = Callable[[Message, Context, RunConfig, TrainOrder, "Task | None"], RecordDict]
Evaluate = Callable[[Message, Context, RunConfig, "Task | None"], RecordDict]


@dataclass(frozen=True)
class RuntimeHandlers:
    """A runtime's handlers.

    Attributes
    ----------
    name : str
        The runtime's name (:data:`fedge.profiles.RUNTIMES`).
    train : Callable
        ``(msg, context, config, order, task) -> content``: train on the instruction, the reply's content.
    evaluate : Callable
        ``(msg, context, config, task) -> content``: evaluate the model the message carries.
    warm : tuple of str
        Modules a deployed device's warm ClientApp parent imports ahead of its messages
        (:mod:`fedge.clients.warm_clientapp`): what the handlers import on first use.
    """

    name: str
    train: Train
    evaluate: Evaluate
    warm: tuple[str, ...] = ()


HANDLERS: dict[str, RuntimeHandlers] = {}


def register_handlers(handlers: RuntimeHandlers) -> RuntimeHandlers:
    """Make ``handlers`` what a device of that runtime runs.

    Raises
    ------
    ConfigError
        A runtime :data:`fedge.profiles.RUNTIMES` does not declare.
    """
    if handlers.name not in RUNTIMES:
        raise ConfigError(f"runtime '{handlers.name}' has handlers but no fedge.profiles.register_runtime(...); "
                          "register it there too")
    HANDLERS[handlers.name] = handlers
    return handlers


def handlers_for(name: str) -> RuntimeHandlers:
    """The handlers of runtime ``name``.

    Raises
    ------
    ConfigError
        Naming the runtimes there are.
    """
    if name not in HANDLERS:
        raise ConfigError(f"runtime {name!r} has no handlers on this device; use one of {', '.join(HANDLERS)}")
    return HANDLERS[name]


def _torch_train(msg: Message, context: Context, config: RunConfig, order: TrainOrder,
                 task: Task | None) -> RecordDict:
    from fedge.clients.torch_client import torch_local_work  # noqa: PLC0415 - torch only on torch devices

    chosen = task if task is not None else device_task(context, config)
    trained, base, work = torch_local_work(msg, config, order, chosen, local_data(chosen, context, config))
    return reply_content(msg, context, order, trained, base, work)


def _torch_evaluate(msg: Message, context: Context, config: RunConfig, task: Task | None) -> RecordDict:
    from fedge.clients.torch_client import torch_scores  # noqa: PLC0415

    chosen = task if task is not None else device_task(context, config)
    data = local_data(chosen, context, config)
    return evaluation_content(torch_scores(msg, config, chosen, data), len(data))


def _onnx_train(msg: Message, context: Context, config: RunConfig, order: TrainOrder,
                task: Task | None) -> RecordDict:
    from fedge.clients.onnx_client import current_trainer, onnx_train_content  # noqa: PLC0415

    current_trainer(msg, context, config)  # the run's graph (fetched if new) before the data is read for it
    return onnx_train_content(msg, context, config, order, onnx_data(task, context, config))


def _onnx_evaluate(msg: Message, context: Context, config: RunConfig, task: Task | None) -> RecordDict:
    from fedge.clients.onnx_client import current_trainer, onnx_evaluate_content  # noqa: PLC0415

    current_trainer(msg, context, config)
    return onnx_evaluate_content(msg, context, config, onnx_data(task, context, config))


register_handlers(RuntimeHandlers("torch", _torch_train, _torch_evaluate, warm=("fedge.clients.torch_client",)))
register_handlers(RuntimeHandlers("onnx", _onnx_train, _onnx_evaluate, warm=("fedge.clients.onnx_client",)))


def onnx_data(task: Task | None, context: Context, config: RunConfig) -> DeviceArrays:
    """An onnx device's examples: its own file (read without torch), else the simulated partition."""
    from fedge.clients.onnx_client import device_arrays, load_trainer  # noqa: PLC0415

    if is_deployed(context):
        bundle, _ = load_trainer(context, config, None)
        path = str(context.node_config[knobs.DATA_PATH])
        inputs, targets = device_arrays(path, bundle.manifest)
        return prepared_device_inputs(inputs, bundle.manifest.get("preprocessing"), source=path,
                                      context=context), targets
    chosen = task if task is not None else device_task(context, config)  # simulation: torch is there
    data = local_data(chosen, context, config)
    return tuple(data.inputs), data.targets


def device_task(context: Context, config: RunConfig) -> Task:
    """The task this device runs: the run's, checked against the device's own choice.

    Threat model: loading a task runs code. A deployed device (``data-path`` in its node
    config) runs a ``package.module:object`` task only when its owner named that same task
    (``fedge device --task``); otherwise only registered (installed, built-in) task names.
    A coordinator cannot make a device import code the device did not choose.

    Raises
    ------
    ConfigError
        The run names another task than the device's, or an unregistered one the device did not choose.
    """
    from fedge.task.loading import load_task, task_reference  # noqa: PLC0415 - tasks import torch

    wanted = task_reference(config)
    own = str(context.node_config.get(knobs.TASK, ""))
    if own and own != wanted:
        raise ConfigError(f"this device runs task '{own}', but the run asks for '{wanted}'; start the device "
                          f"with --task '{wanted}' to join this run")
    if not own and is_deployed(context) and ":" in wanted:
        raise ConfigError(f"the run names task '{wanted}', which this device did not choose; start the device "
                          f"with --task '{wanted}' if you trust that code")
    return load_task(config)


def local_data(task: Task, context: Context, config: RunConfig) -> TaskData:
    """A real device's own file (``data-path``), else the simulated device's partition."""
    if is_deployed(context):
        path = str(context.node_config[knobs.DATA_PATH])
        data = task.device_data(path)
        inputs = prepared_device_inputs(data.inputs, task.preprocessing, source=path, context=context)
        return dataclasses.replace(data, inputs=inputs)
    return task.partition(int(context.node_config.get("partition-id", 0)), num_partitions(context, config), config)
