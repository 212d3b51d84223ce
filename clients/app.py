"""The client SDK: turn a task (model, data, loss, metrics) into a Flower ``ClientApp``.

A device app calls :func:`make_client_app` with its :class:`fedge.task.api.Task` (or none: the
task the run config names). The returned ``ClientApp`` runs unchanged in fedge's inline
simulator, on Flower's Ray simulation engine, and under a SuperNode.

Each device trains with its runtime (:func:`fedge.clients.common.device_runtime`), whose
handlers the runtime registry holds (:mod:`fedge.clients.runtimes`): torch, or the run's
signed ONNX training graph on onnxruntime (:mod:`fedge.clients.onnx_client`) for devices
without torch. Importing this module does not import torch, so the same
``fedge.clients.app:app`` serves an onnx device whose install has no torch at all.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedge import knobs, wire
from fedge.clients.common import (
    RESIDUAL,
    compressed,
    device_profile_name,
    device_runtime,
    dp_clipping_mod,
    effective_config,
    is_deployed,
    received_weights,
    train_order,
)
from fedge.clients.gateway.bridge import gateway_content, is_gateway
from fedge.clients.runtimes import device_task, handlers_for, local_data, onnx_data
from fedge.clients.secure import add_secure_handlers
from fedge.errors import FedgeError

if TYPE_CHECKING:
    from fedge.task.api import Task

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

    @private_failures
    def train_content(msg: Message, context: Context) -> RecordDict:
        """Train on the instruction in ``msg``; the reply's content (arrays, metrics, meta)."""
        config = effective_config(context, config_defaults)
        if is_gateway(context):  # a gateway node: its protocol devices train, it sends their aggregate
            return gateway_content(msg, context, config, "train")
        order = train_order(msg, context, config)
        return handlers_for(device_runtime(context, config)).train(msg, context, config, order, task)

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
        return Message(handlers_for(device_runtime(context, config)).evaluate(msg, context, config, task),
                       reply_to=msg)

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
    return str(context.node_config.get(knobs.RUNTIME, "torch"))


def make_default_client_app(config_defaults: Mapping[str, Any] | None = None) -> ClientApp:
    """The ClientApp for the task the run config names (fedge's ``flwr run`` entry point)."""
    return make_client_app(None, config_defaults=config_defaults)


app = make_default_client_app()

__all__ = ["RESIDUAL", "app", "compressed", "device_profile_name", "device_task", "local_data", "make_client_app",
           "make_default_client_app", "onnx_data", "received_weights"]
