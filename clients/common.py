"""What every device runtime shares (torch or onnx): config, profile, seeds, codecs, DP, replies.

Torch-free on purpose: a phone-class device (``runtime = "onnx"``) imports this module and
:mod:`fedge.clients.onnx_client`, never torch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable

from fedge import knobs, wire
from fedge.codec import Codec, codec_for, decode_update, encode_update, is_encoded
from fedge.config import RunConfig, Scalar, resolve_run_config
from fedge.preprocessing import AS_GIVEN, RAW_SCALED, Preprocessing, prepare_device_inputs
from fedge.profiles import BUILTIN_PROFILES, DeviceProfile, fleet_of, load_profiles_toml, time_budget_steps
from fedge.wire import LocalWork

log = logging.getLogger("fedge.clients")

RESIDUAL = "codec-residual"

# What a deployed device decides for itself, never the coordinator: what trains (torch runs the task's
# Python, onnx a graph), where its trust anchors and graph are (a run directory), which profiles file
# it reads, which data it trains on.
DEVICE_OWNED = (knobs.RUNTIME, knobs.RUN_DIR, knobs.FLEET_FILE, knobs.DATA_PATH)


def is_deployed(context: Context) -> bool:
    """A real device under a SuperNode: ``fedge device`` names its own ``data-path`` in the node config."""
    return knobs.DATA_PATH in context.node_config


def own_settings(context: Context) -> dict[str, Scalar]:
    """A deployed device's runtime and paths, from its own node config (``fedge device`` sets them).

    Threat model: the run config and every instruction come from the coordinator. Taking a
    runtime, a run directory (where an onnx device would find its training graph *and* the
    key that verifies it), a fleet file or a data path from there would let a coordinator,
    or whoever holds its Control API, switch a torch device to a graph it chose, make the
    device read any of its files, or probe which paths exist on it.
    """
    node = context.node_config
    return {knobs.RUNTIME: str(node.get(knobs.RUNTIME, "torch")), knobs.RUN_DIR: "",
            knobs.FLEET_FILE: str(node.get(knobs.FLEET_FILE, "")), knobs.DATA_PATH: str(node[knobs.DATA_PATH])}


@dataclass(frozen=True)
class TrainOrder:
    """A train instruction read once (:class:`fedge.wire.TrainInstruction`) and what this device
    derives from it: the round, its profile, its seed and its step budget."""

    instruction: wire.TrainInstruction
    server_round: int
    profile: str
    seed: int
    max_steps: int | None


def train_order(msg: Message, context: Context, config: RunConfig) -> TrainOrder:
    """The instruction in ``msg``, read once; the run config fills the training keys it does not carry
    (the coordinator's instruction wins; :data:`DEVICE_OWNED` settings are never read from it).

    Raises
    ------
    ConfigError
        A training key of the instruction with the wrong type or value (naming it).
    """
    record = msg.content[wire.CONFIG]
    instruction = wire.TrainInstruction.read(record, defaults=config)
    server_round = int(record.get(wire.SERVER_ROUND, 0))  # type: ignore[arg-type]
    profile = device_profile_name(context, config)
    return TrainOrder(
        instruction=instruction,
        server_round=server_round,
        profile=profile,
        seed=training_seed(context, config.integer(knobs.SEED), server_round),
        max_steps=step_budget(context, config, instruction, profile),
    )


def prepared_device_inputs(inputs: tuple[np.ndarray, ...], preprocessing: Mapping[str, Any] | None, *,
                           source: str, context: Context) -> tuple[np.ndarray, ...]:
    """A deployed device's own inputs as the model takes them (:mod:`fedge.preprocessing`): raw ones
    get the task's declared preprocessing, as on every runtime; ones outside both declared ranges
    are used as they are, with a warning here and a mark in every train reply (the coordinator
    counts them). Logged once per device (its state remembers what it said) and verdict."""
    prepared, verdict = prepare_device_inputs(inputs, preprocessing)
    said = context.state.config_records.get(wire.INPUT_STATE)
    told = said is not None and said.get(wire.INPUTS) == verdict and said.get("source") == source
    context.state[wire.INPUT_STATE] = ConfigRecord({wire.INPUTS: verdict, "source": source})
    if not told and verdict != AS_GIVEN:
        ranges = Preprocessing.of(preprocessing).describe_ranges()
        if verdict == RAW_SCALED:
            log.info("'%s' holds raw inputs (%s): the task's preprocessing is applied on this device", source, ranges)
        else:
            log.warning("'%s': inputs fall outside the task's declared range (%s); they are used as they are, and "
                        "the coordinator is told: check the file (units, scaling)", source, ranges)
    return prepared


def reply_content(msg: Message, context: Context, order: TrainOrder, trained: ArrayRecord,
                  base: dict[str, np.ndarray], work: LocalWork) -> RecordDict:
    """The train reply (arrays under the profile's codec, metrics, meta): the same for every runtime."""
    codec = codec_for(order.profile, order.instruction.codecs)
    if codec.lossless and is_encoded(msg.content.array_records[wire.ARRAYS]):
        codec = Codec(quantiser=None, fraction=None, delta=True)  # trained from a lossy copy: send the change
    arrays = compressed(trained, base, codec, context, order.seed)
    meta = ConfigRecord({
        wire.SERVER_ROUND: order.server_round,
        wire.PROFILE: order.profile,
        wire.SAMPLES_PROCESSED: work.samples_processed,
        wire.STEPS: work.steps,
    })
    inputs = context.state.config_records.get(wire.INPUT_STATE)
    if inputs is not None and inputs.get(wire.INPUTS) in wire.INPUT_VERDICTS:
        meta[wire.INPUTS] = inputs[wire.INPUTS]
    metrics = MetricRecord({wire.TRAIN_LOSS: work.loss, wire.NUM_EXAMPLES: work.num_examples})
    return RecordDict({wire.ARRAYS: arrays, wire.METRICS: metrics, wire.REPLY_META: meta})


def evaluation_content(scores: Mapping[str, float], num_examples: int) -> RecordDict:
    """An evaluate reply: each unsummarised metric as ``eval-<name>``, and the example count."""
    metrics = MetricRecord({**{wire.EVAL_PREFIX + name: float(value) for name, value in scores.items()},
                            wire.NUM_EXAMPLES: num_examples})
    return RecordDict({wire.METRICS: metrics})


def instructed_width(msg: Message) -> float:
    """The sub-model width an instruction names (1: the whole model; a value out of (0, 1] counts as 1)."""
    record = msg.content.config_records.get(wire.CONFIG)
    width = record.get(wire.MODEL_WIDTH, 1.0) if record is not None else 1.0
    return float(width) if isinstance(width, int | float) and 0 < width <= 1 else 1.0


def instructed_scale(msg: Message) -> float:
    """The width HeteroFL's scaler divides by (the instruction's width if it asks for the scaler; 1: none)."""
    record = msg.content.config_records.get(wire.CONFIG)
    return instructed_width(msg) if record is not None and record.get(wire.MODEL_SCALER) is True else 1.0


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


def step_budget(context: Context, config: Mapping[str, Any], instruction: wire.TrainInstruction,
                profile_name: str) -> int | None:
    """With ``local-budget = "time"``: the SGD steps that fit ``time-budget-s`` on this device's profile."""
    seconds = instruction.time_budget
    if seconds is None:
        return None
    profile = device_profiles(context, config).get(profile_name)
    rate = profile.compute_rate if profile else 1.0
    return time_budget_steps(seconds, rate, instruction.batch_size)


def device_profiles(context: Context, config: Mapping[str, Any]) -> dict[str, DeviceProfile]:
    """The profiles this device knows: a deployed device's built-ins and its own fleet file
    (``fedge device --fleet-file``), a simulated device's the run's fleet."""
    if is_deployed(context):
        own = str(context.node_config.get(knobs.FLEET_FILE, ""))
        return {**BUILTIN_PROFILES, **(load_profiles_toml(own)[0] if own else {})}
    return dict(fleet_of(config).profiles)


def training_seed(context: Context, seed: int, server_round: int) -> int:
    """Per device and round; from the partition id, so every backend draws the same batches."""
    device = int(context.node_config.get("partition-id", context.node_id))
    return (seed * 1_000_003 + server_round * 10_007 + device) % 2**63


def effective_config(context: Context, defaults: Mapping[str, Any] | None) -> RunConfig:
    """The run config as this device sees it: ``defaults`` under the run's own values; a deployed
    device's :data:`DEVICE_OWNED` settings from its own node config (:func:`own_settings`)."""
    merged = dict(defaults or {})
    merged.update(context.run_config)
    if is_deployed(context):
        merged.update(own_settings(context))
    return resolve_run_config(merged)


def device_profile_name(context: Context, config: Mapping[str, Any]) -> str:
    """The device's profile: ``node_config["profile"]``, else the fleet's assignment."""
    if "profile" in context.node_config:
        return str(context.node_config["profile"])
    fleet = fleet_of(config)
    partition_id = int(context.node_config.get("partition-id", 0))
    assignment = fleet.assignment(int(config[knobs.SEED]))
    return assignment[partition_id] if partition_id < len(assignment) else "unknown"


def device_runtime(context: Context, config: RunConfig) -> str:
    """What trains on this device: ``"torch"`` or ``"onnx"``.

    A deployed device's own choice (``fedge device --runtime``, in its node config; torch when
    it names none) and nothing else; else the run's ``runtime`` knob when it names one for every device; else the device
    profile's ``runtime`` (built-in profiles: torch).
    """
    own = context.node_config.get(knobs.RUNTIME)
    if own or is_deployed(context):
        return str(own or "torch")
    if config.text(knobs.RUNTIME) != "profile":
        return config.text(knobs.RUNTIME)
    fleet = fleet_of(config)
    profile = fleet.profiles.get(device_profile_name(context, config))
    return profile.runtime if profile else "torch"


def num_partitions(context: Context, config: RunConfig) -> int:
    """How many shards the data set is split into (the simulated fleet's size)."""
    if "num-partitions" in context.node_config:
        return int(context.node_config["num-partitions"])
    return fleet_of(config).size
