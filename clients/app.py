"""The client SDK: turn a torch model and local data into a Flower ``ClientApp``.

A device app calls :func:`make_client_app` with two functions of the Flower
``Context``: one that builds its ``torch.nn.Module`` and one that returns its
local data. The returned ``ClientApp`` runs unchanged in fedge's inline
simulator, on Flower's Ray simulation engine, and under a SuperNode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable
from torch import nn
from torch.utils.data import Dataset

from fedge import wire
from fedge.clients.secure import add_secure_handlers
from fedge.codec import Codec, codec_for, decode_update, encode_update, is_encoded
from fedge.config import RunConfig, resolve_run_config
from fedge.profiles import parse_fleet, time_budget_steps
from fedge.task.data import federated_data, load_local_file
from fedge.task.models import build_model, load_arrays, model_arrays
from fedge.task.training import as_dataset, evaluate, pick_device, train_local

LocalData = Dataset | tuple[np.ndarray, np.ndarray]  # type: ignore[type-arg]
ModelFn = Callable[[Context], nn.Module]
DataFn = Callable[[Context], tuple[LocalData, LocalData | None]]

log = logging.getLogger("fedge.clients")


def make_client_app(
    model_fn: ModelFn,
    data_fn: DataFn,
    *,
    config_defaults: Mapping[str, Any] | None = None,
) -> ClientApp:
    """Build a Flower ClientApp that trains ``model_fn(context)`` on ``data_fn(context)``.

    Parameters
    ----------
    model_fn : Callable[[Context], nn.Module]
        Returns the device's model (its architecture must match the coordinator's).
    data_fn : Callable[[Context], tuple[train, test | None]]
        Returns the device's local data: torch Datasets or ``(x, y)`` numpy pairs.
        Without a test set, evaluation runs on the training data.
    config_defaults : Mapping, optional
        Run-config values used where the run does not set them.

    Returns
    -------
    ClientApp
        With ``@app.train()`` and ``@app.evaluate()`` handlers.
    """
    app = ClientApp()

    def train_content(msg: Message, context: Context) -> RecordDict:
        """Train on the instruction in ``msg``; the reply's content (arrays, metrics, meta)."""
        config = _effective_config(context, config_defaults)
        instruction = msg.content[wire.CONFIG]
        model = model_fn(context)
        base = received_weights(msg.content.array_records[wire.ARRAYS])
        load_arrays(model, ArrayRecord({k: Array(v) for k, v in base.items()}), source="global arrays")
        train_data, _ = data_fn(context)
        setting = {**config, **instruction}  # the coordinator's instruction wins
        round_ = int(setting.get(wire.SERVER_ROUND, 0))
        profile = device_profile_name(context, config)
        stats = train_local(
            model,
            as_dataset(train_data),
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
        config = _effective_config(context, config_defaults)
        model = model_fn(context)
        load_arrays(model, msg.content[wire.ARRAYS], source="global arrays")
        train_data, test_data = data_fn(context)
        dataset = as_dataset(test_data if test_data is not None else train_data)
        loss, accuracy = evaluate(model, dataset, device=pick_device(config.text("device")))
        metrics = MetricRecord({"eval-loss": loss, "eval-acc": accuracy,
                                wire.NUM_EXAMPLES: len(dataset)})  # type: ignore[arg-type]
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


def make_default_client_app(config_defaults: Mapping[str, Any] | None = None) -> ClientApp:
    """The ClientApp for fedge's built-in data sets and models (driven by run config)."""

    def data_fn(context: Context) -> tuple[LocalData, LocalData | None]:
        if "data-path" in context.node_config:  # a real device: its own file
            return load_local_file(str(context.node_config["data-path"])), None
        config = _effective_config(context, config_defaults)
        data = federated_data(config, num_partitions(context, config))
        return data.partitions[int(context.node_config.get("partition-id", 0))], None

    def model_fn(context: Context) -> nn.Module:
        config = _effective_config(context, config_defaults)
        data = federated_data(config, num_partitions(context, config))
        return build_model(config.text("model"), data.num_features, data.num_classes)

    return make_client_app(model_fn, data_fn, config_defaults=config_defaults)


app = make_default_client_app()

__all__ = ["app", "make_client_app", "make_default_client_app"]
