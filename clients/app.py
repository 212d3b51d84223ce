"""The client SDK: turn a task (model, data, loss, metrics) into a Flower ``ClientApp``.

A device app calls :func:`make_client_app` with its :class:`fedge.task.Task` (or none: the
task the run config names). The returned ``ClientApp`` runs unchanged in fedge's inline
simulator, on Flower's Ray simulation engine, and under a SuperNode.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable

from fedge import wire
from fedge.clients.secure import add_secure_handlers
from fedge.codec import Codec, codec_for, decode_update, encode_update, is_encoded
from fedge.config import RunConfig, resolve_run_config
from fedge.errors import ConfigError
from fedge.profiles import parse_fleet, time_budget_steps
from fedge.task.api import Task, TaskData, seeded_model
from fedge.task.models import load_arrays, model_arrays
from fedge.task.training import evaluate, pick_device, train_local
from fedge.tasks import load_task, task_reference

log = logging.getLogger("fedge.clients")


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
    """
    app = ClientApp()

    def setup(context: Context) -> tuple[RunConfig, Task, TaskData]:
        config = _effective_config(context, config_defaults)
        chosen = task if task is not None else device_task(context, config)
        return config, chosen, local_data(chosen, context, config)

    def train_content(msg: Message, context: Context) -> RecordDict:
        """Train on the instruction in ``msg``; the reply's content (arrays, metrics, meta)."""
        config, chosen, data = setup(context)
        instruction = msg.content[wire.CONFIG]
        model = seeded_model(chosen, config.integer("seed"))
        base = received_weights(msg.content.array_records[wire.ARRAYS])
        load_arrays(model, ArrayRecord({k: Array(v) for k, v in base.items()}), source="global arrays")
        setting = {**config, **instruction}  # the coordinator's instruction wins
        round_ = int(setting.get(wire.SERVER_ROUND, 0))
        profile = device_profile_name(context, config)
        stats = train_local(
            chosen,
            model,
            data,
            epochs=int(setting["local-epochs"]),
            batch_size=int(setting["batch-size"]),
            learning_rate=float(setting["learning-rate"]),
            momentum=float(setting["momentum"]),
            device=pick_device(config.text("device")),
            seed=_training_seed(context, config.integer("seed"), round_),
            proximal_mu=float(instruction.get("proximal-mu", 0.0)),  # type: ignore[arg-type]  # only FedProx sends it
            max_steps=_step_budget(context, setting),
        )
        seed = _training_seed(context, config.integer("seed"), round_)
        codec = codec_for(profile, setting)
        if codec.lossless and is_encoded(msg.content.array_records[wire.ARRAYS]):
            codec = Codec(quantiser=None, fraction=None, delta=True)  # trained from a lossy copy: send the change
        arrays = compressed(model_arrays(model), base, codec, context, seed)
        meta = ConfigRecord({
            wire.SERVER_ROUND: round_,
            wire.PROFILE: profile,
            wire.SAMPLES_PROCESSED: stats.samples_processed,
            wire.STEPS: stats.steps,
        })
        metrics = MetricRecord({wire.TRAIN_LOSS: stats.loss, wire.NUM_EXAMPLES: stats.num_examples})
        return RecordDict({wire.ARRAYS: arrays, wire.METRICS: metrics, wire.REPLY_META: meta})

    @app.train(mods=[dp_clipping_mod])  # per handler: app-wide, Flower's DP mods break evaluate replies
    def train(msg: Message, context: Context) -> Message:
        return Message(train_content(msg, context), reply_to=msg)

    add_secure_handlers(app, train_content)

    @app.evaluate()
    def evaluate_(msg: Message, context: Context) -> Message:
        config, chosen, data = setup(context)
        model = seeded_model(chosen, config.integer("seed"))
        load_arrays(model, msg.content[wire.ARRAYS], source="global arrays")
        scores = evaluate(chosen, model, data, device=pick_device(config.text("device")), summarize=False)
        metrics = MetricRecord({**{wire.EVAL_PREFIX + name: value for name, value in scores.items()},
                                wire.NUM_EXAMPLES: len(data)})
        return Message(RecordDict({wire.METRICS: metrics}), reply_to=msg)

    return app


RESIDUAL = "codec-residual"


def received_weights(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The global weights in a train instruction (decoded if the downlink was compressed)."""
    if is_encoded(record):
        return decode_update(record, None)
    return {name: array.numpy() for name, array in record.items()}


def compressed(local: ArrayRecord, base: dict[str, np.ndarray], codec: Codec, context: Context,
               seed: int) -> ArrayRecord:
    """The reply's arrays under ``codec``: the trained weights as they are (fp32), or the
    encoded delta from ``base``; top-k's error-feedback residual lives in ``context.state``."""
    if codec.lossless:
        return local
    previous = context.state.array_records.get(RESIDUAL)
    residual = {name: array.numpy() for name, array in previous.items()} if previous is not None else None
    weights = {name: array.numpy() for name, array in local.items()}
    record, kept = encode_update(weights, base, codec, np.random.default_rng(seed), residual)
    if kept:
        context.state[RESIDUAL] = ArrayRecord({name: Array(value) for name, value in kept.items()})
    return record


def dp_clipping_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Run Flower's client-side clipping mod the instruction names (DP ``client-fixed`` /
    ``client-adaptive``); without DP, pass the message through."""
    config = msg.content.config_records.get(wire.CONFIG)
    kind = config.get(wire.DP_CLIENT_CLIPPING) if config is not None else None
    if kind == "fixed":
        return fixedclipping_mod(msg, context, call_next)
    if kind == "adaptive":
        return adaptiveclipping_mod(msg, context, call_next)
    return call_next(msg, context)


def _step_budget(context: Context, setting: Mapping[str, Any]) -> int | None:
    """With ``local-budget = "time"``: the SGD steps that fit ``time-budget-s`` on this device's profile."""
    if setting.get("local-budget") != "time":
        return None
    fleet = parse_fleet(str(setting["fleet"]), str(setting["fleet-file"]))
    profile = fleet.profiles.get(device_profile_name(context, setting))
    rate = profile.compute_rate if profile else 1.0
    return time_budget_steps(float(setting["time-budget-s"]), rate, int(setting["batch-size"]))


def _training_seed(context: Context, seed: int, server_round: int) -> int:
    """Per device and round; from the partition id, so every backend draws the same batches."""
    device = int(context.node_config.get("partition-id", context.node_id))
    return (seed * 1_000_003 + server_round * 10_007 + device) % 2**63


def _effective_config(context: Context, defaults: Mapping[str, Any] | None) -> RunConfig:
    merged = dict(defaults or {})
    merged.update(context.run_config)
    return resolve_run_config(merged)


def device_profile_name(context: Context, config: RunConfig) -> str:
    """The device's profile: ``node_config["profile"]``, else the fleet's assignment."""
    if "profile" in context.node_config:
        return str(context.node_config["profile"])
    fleet = parse_fleet(config.text("fleet"), config.text("fleet-file"))
    partition_id = int(context.node_config.get("partition-id", 0))
    assignment = fleet.assignment(config.integer("seed"))
    return assignment[partition_id] if partition_id < len(assignment) else "unknown"


def num_partitions(context: Context, config: RunConfig) -> int:
    """How many shards the data set is split into (the simulated fleet's size)."""
    if "num-partitions" in context.node_config:
        return int(context.node_config["num-partitions"])
    return parse_fleet(config.text("fleet"), config.text("fleet-file")).size


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
    wanted = task_reference(config)
    own = str(context.node_config.get("task", ""))
    if own and own != wanted:
        raise ConfigError(f"this device runs task '{own}', but the run asks for '{wanted}'; start the device "
                          f"with --task '{wanted}' to join this run")
    if not own and "data-path" in context.node_config and ":" in wanted:
        raise ConfigError(f"the run names task '{wanted}', which this device did not choose; start the device "
                          f"with --task '{wanted}' if you trust that code")
    return load_task(config)


def local_data(task: Task, context: Context, config: RunConfig) -> TaskData:
    """A real device's own file (``data-path``), else the simulated device's partition."""
    if "data-path" in context.node_config:
        return task.device_data(str(context.node_config["data-path"]))
    return task.partition(int(context.node_config.get("partition-id", 0)), num_partitions(context, config), config)


def make_default_client_app(config_defaults: Mapping[str, Any] | None = None) -> ClientApp:
    """The ClientApp for the task the run config names (fedge's ``flwr run`` entry point)."""
    return make_client_app(None, config_defaults=config_defaults)


app = make_default_client_app()

__all__ = ["app", "device_task", "local_data", "make_client_app", "make_default_client_app"]
