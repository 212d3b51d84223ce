"""The client SDK: turn a task (model, data, loss, metrics) into a Flower ``ClientApp``.

A device app calls :func:`make_client_app` with its :class:`fedge.task.api.Task` (or none: the
task the run config names). The returned ``ClientApp`` runs unchanged in fedge's inline
simulator, on Flower's Ray simulation engine, and under a SuperNode.

Each device trains with its runtime (:func:`fedge.clients.common.device_runtime`): torch,
or the run's signed ONNX training graph on onnxruntime (:mod:`fedge.clients.onnx_client`)
for devices without torch. Importing this module does not import torch, so the same
``fedge.clients.app:app`` serves an onnx device whose install has no torch at all.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedge import wire
from fedge.clients.common import (
    RESIDUAL,
    compressed,
    device_profile_name,
    device_runtime,
    dp_clipping_mod,
    effective_config,
    evaluation_content,
    is_deployed,
    num_partitions,
    prepared_device_inputs,
    received_weights,
    reply_content,
    train_order,
)
from fedge.clients.gateway_bridge import gateway_content, is_gateway
from fedge.clients.secure import add_secure_handlers
from fedge.config import RunConfig
from fedge.errors import ConfigError, FedgeError

if TYPE_CHECKING:
    from fedge.clients.onnx_client import DeviceArrays
    from fedge.task.api import Task, TaskData

log = logging.getLogger("fedge.clients")

# The one reason a deployed device gives the coordinator for any failure (see private_failures)
PRIVATE_FAILURE = ("the device could not take part in this round; the reason is in the device's own log "
                   "(its owner sees it on the `fedge device` console)")


def make_client_app(
    task: Task | None = None,
    *,
    config_defaults: Mapping[str, Any] | None = None,
) -> ClientApp:
    """Build a Flower ClientApp that trains and evaluates ``task``'s model on this device's data.

    Parameters
    ----------
    task : Task, optional
        The task (model, data, loss, optimiser, metrics). None: the task the run config
        names (``task``, else the built-in for ``dataset``), as the coordinator loads it.
        A deployed device that set its own task (``fedge device --task``) refuses a run
        that names another one.
    config_defaults : Mapping, optional
        Run-config values used where the run does not set them.

    Returns
    -------
    ClientApp
        With ``@app.train()`` and ``@app.evaluate()`` handlers (and the secure-aggregation
        steps). Its data: a simulated device's partition (``partition-id`` of
        ``num-partitions`` in the node config), or a real device's ``data-path``.
        A device whose runtime is ``onnx`` trains with the run's training graph instead
        of torch and sends the same replies.
    """
    app = ClientApp()

    def torch_setup(context: Context, config: RunConfig) -> tuple[Task, TaskData]:
        chosen = task if task is not None else device_task(context, config)
        return chosen, local_data(chosen, context, config)

    @private_failures
    def train_content(msg: Message, context: Context) -> RecordDict:
        """Train on the instruction in ``msg``; the reply's content (arrays, metrics, meta)."""
        config = effective_config(context, config_defaults)
        if is_gateway(context):  # a gateway node: its protocol devices train, it sends their aggregate
            return gateway_content(msg, context, config, "train")
        order = train_order(msg, context, config)
        if device_runtime(context, config) == "onnx":
            from fedge.clients.onnx_client import current_trainer, onnx_train_content  # noqa: PLC0415

            current_trainer(msg, context, config)  # the run's graph (fetched if new) before the data is read for it
            return onnx_train_content(msg, context, config, order, onnx_data(task, context, config))
        from fedge.clients.torch_client import torch_local_work  # noqa: PLC0415 - torch only on torch devices

        chosen, data = torch_setup(context, config)
        trained, base, work = torch_local_work(msg, config, order, chosen, data)
        return reply_content(msg, context, order, trained, base, work)

    @app.train(mods=[dp_clipping_mod])  # per handler: app-wide, Flower's DP mods break evaluate replies
    def train(msg: Message, context: Context) -> Message:
        content = train_content(msg, context)
        report_work(context, content)
        return Message(content, reply_to=msg)

    add_secure_handlers(app, train_content)

    @app.evaluate()
    @private_failures
    def evaluate_(msg: Message, context: Context) -> Message:
        config = effective_config(context, config_defaults)
        if is_gateway(context):
            return Message(gateway_content(msg, context, config, "evaluate"), reply_to=msg)
        if device_runtime(context, config) == "onnx":
            from fedge.clients.onnx_client import current_trainer, onnx_evaluate_content  # noqa: PLC0415

            current_trainer(msg, context, config)
            return Message(onnx_evaluate_content(msg, context, config, onnx_data(task, context, config)),
                           reply_to=msg)
        from fedge.clients.torch_client import torch_scores  # noqa: PLC0415

        chosen, data = torch_setup(context, config)
        return Message(evaluation_content(torch_scores(msg, config, chosen, data), len(data)), reply_to=msg)

    return app


def private_failures(handler: Callable[[Message, Context], Any]) -> Callable[[Message, Context], Any]:
    """On a deployed device, a failure reaches the coordinator as one generic reason.

    Threat model: Flower sends the text of a ClientApp's exception to the coordinator. A
    device's reasons name its files (no such file, a directory, not TOML, a bad signature),
    so a coordinator could probe which paths exist on the device. The device prints the
    detailed reason on its own console and the coordinator gets :data:`PRIVATE_FAILURE`.
    Simulated devices (one trusted process with the coordinator) keep the detailed error.
    """
    @functools.wraps(handler)
    def guarded(msg: Message, context: Context) -> Any:
        try:
            return handler(msg, context)
        except Exception as exc:
            if not is_deployed(context):
                raise
            print(f"this device refused the round: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            raise FedgeError(PRIVATE_FAILURE) from exc  # the chain stays in this process's log
    return guarded


def report_work(context: Context, content: RecordDict) -> None:
    """One line per round on a deployed device's console: round, samples, steps, loss, bytes sent.

    Simulated devices (hundreds in one process) log it at debug level instead.
    """
    deployed = is_deployed(context)
    if not deployed and not log.isEnabledFor(logging.DEBUG):
        return  # simulated devices: nothing to build on the hot path
    meta, metrics = content.config_records[wire.REPLY_META], content.metric_records[wire.METRICS]
    if meta.get(wire.SECURE_POOL):  # a gateway's secure pool sum: no per-device work or loss is known
        server_round, pool = int(meta[wire.SERVER_ROUND]), int(meta[wire.SECURE_POOL])  # type: ignore[arg-type]
        line = (f"round {server_round}: the secure sum of {pool} devices' updates (gateway), "
                f"{wire.payload_bytes(content):,} bytes to send")
        if deployed:
            print(line, flush=True)
        return
    done = {key: int(meta[key]) for key in (wire.SERVER_ROUND, wire.SAMPLES_PROCESSED, wire.STEPS)}  # type: ignore[arg-type]
    line = (f"round {done[wire.SERVER_ROUND]}: trained {done[wire.SAMPLES_PROCESSED]} samples in "
            f"{done[wire.STEPS]} steps ({work_label(context, meta)}), loss "
            f"{float(metrics[wire.TRAIN_LOSS]):.4f}, "  # type: ignore[arg-type]
            f"{wire.payload_bytes(content):,} bytes to send")
    if deployed:
        print(line, flush=True)
    else:
        log.debug("device %s: %s", context.node_config.get("partition-id", context.node_id), line)


def work_label(context: Context, meta: Any) -> str:
    """What did the work: ``onnx`` or ``torch``, or a gateway's devices (``gateway, 3 devices``)."""
    devices = meta.get(wire.AGGREGATE_OF)
    return f"gateway, {devices} devices" if devices else device_runtime_label(context)


def device_runtime_label(context: Context) -> str:
    """``onnx`` or ``torch`` as the node config says (``torch`` unless the device chose onnx)."""
    return str(context.node_config.get("runtime", "torch"))


def onnx_data(task: Task | None, context: Context, config: RunConfig) -> DeviceArrays:
    """An onnx device's examples: its own file (read without torch), else the simulated partition."""
    from fedge.clients.onnx_client import device_arrays, load_trainer  # noqa: PLC0415

    if is_deployed(context):
        bundle, _ = load_trainer(context, config, None)
        path = str(context.node_config["data-path"])
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
    from fedge.tasks import load_task, task_reference  # noqa: PLC0415 - tasks import torch

    wanted = task_reference(config)
    own = str(context.node_config.get("task", ""))
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
        path = str(context.node_config["data-path"])
        data = task.device_data(path)
        inputs = prepared_device_inputs(data.inputs, task.preprocessing, source=path, context=context)
        return dataclasses.replace(data, inputs=inputs)
    return task.partition(int(context.node_config.get("partition-id", 0)), num_partitions(context, config), config)


def make_default_client_app(config_defaults: Mapping[str, Any] | None = None) -> ClientApp:
    """The ClientApp for the task the run config names (fedge's ``flwr run`` entry point)."""
    return make_client_app(None, config_defaults=config_defaults)


app = make_default_client_app()

__all__ = ["RESIDUAL", "app", "compressed", "device_profile_name", "device_task", "local_data", "make_client_app",
           "make_default_client_app", "received_weights"]
