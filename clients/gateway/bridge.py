"""The gateway's ClientApp side: hand the coordinator's instruction to the gateway process and
turn its devices' aggregate into the reply a device would send.

A gateway's SuperNode runs fedge's ClientApp like any device; its node config names the
gateway's loopback control address and the file holding the control token
(``gateway-control``, ``gateway-token``), which :func:`is_gateway` looks for. The reply
carries the weighted mean of the devices' trained weights (fp32), ``num-examples`` = the
examples behind it, and the summed work, so the coordinator's FedAvg weights the gateway as
the devices it stands for. Each round also tells the gateway the run's ``num-rounds``: how it
knows, once the coordinator has closed after the last one, that the run is over. In an
asynchronous run the instruction's ``late-exponent`` goes with the round, and the reply says
how many of its devices' results were late ones.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedge import knobs, wire
from fedge.clients.common import evaluation_content, received_weights, train_order
from fedge.clients.gateway.protocol import FRAME_TYPE, NUM_ROUNDS, decode_frame, encode_frame
from fedge.clients.gateway.secure_pool import DP_MULTIPLIER
from fedge.config import RunConfig
from fedge.distributed_noise import DISTRIBUTED, DP_CLIP
from fedge.errors import FedgeError
from fedge.strategies.validation import POOL_CLIPPING

CONTROL = "gateway-control"
TOKEN_FILE = "gateway-token"


def is_gateway(context: Context) -> bool:
    """Whether this ClientApp runs for a gateway (``fedge gateway`` names its control port)."""
    return CONTROL in context.node_config


# the run's bounds on each device, sent with every round
BOUND_KEYS = (knobs.MAX_DEVICE_EXAMPLES, knobs.MAX_UPDATE_NORM)


def _config_of(msg: Message, context: Context, config: RunConfig, kind: str) -> dict[str, Any]:
    bounds = {key: config[key] for key in BOUND_KEYS}
    instruction = msg.content.config_records.get(wire.CONFIG)
    if instruction is not None and (bound := instruction.get(wire.DEVICE_NORM_BOUND)) is not None:
        bounds[knobs.MAX_UPDATE_NORM] = bound  # this round's (update-norm-bound = median); the gateway checks it
    if kind != "train":
        return {knobs.SEED: config.integer(knobs.SEED), **bounds}
    instruction = train_order(msg, context, config).instruction  # its devices' training keys: the protocol's form
    return {**instruction.protocol_config(), knobs.SEED: config.integer(knobs.SEED), **bounds}


def secure_settings(config: RunConfig) -> dict[str, float] | None:
    """The run's secure-aggregation settings for the gateway's pool round, or ``None`` when it is off."""
    if not config[knobs.SECURE_AGGREGATION]:
        return None
    settings = {"threshold": config.number(knobs.SECAGG_THRESHOLD),
                "neighbours": config.integer(knobs.SECAGG_NEIGHBOURS), "clip": config.number(knobs.SECAGG_CLIP),
                "precision": config.number(knobs.SECAGG_PRECISION), "bits": config.integer(knobs.SECAGG_BITS),
                "weight-clip": config.number(knobs.MAX_DEVICE_EXAMPLES)}
    if config.text(knobs.DP) == DISTRIBUTED:  # the pool's devices clip and add the noise (fedge.distributed_noise)
        settings |= {DP_MULTIPLIER: config.number(knobs.DP_NOISE_MULTIPLIER),
                     DP_CLIP: config.number(knobs.DP_CLIPPING_NORM)}
    return settings


def ask_gateway(context: Context, header: dict[str, Any], weights: dict[str, np.ndarray]) -> tuple[dict[str, Any],
                                                                                                   dict[str, Any]]:
    """POST the round to the gateway process; its result header and arrays."""
    host, _, port = str(context.node_config[CONTROL]).rpartition(":")
    token = Path(str(context.node_config[TOKEN_FILE])).read_text().strip()
    connection = http.client.HTTPConnection(host, int(port), timeout=24 * 3600)
    try:
        connection.request("POST", "/control/round", body=encode_frame(header, weights),
                           headers={"Authorization": f"Bearer {token}", "Content-Type": FRAME_TYPE})
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    if response.status != 200:
        text = body[:400].decode(errors="replace")
        reason = json.loads(body).get("error", text) if body.startswith(b"{") else text
        raise FedgeError(f"the gateway's round failed: {reason}")
    frame, _ = decode_frame(body)
    return frame.header, dict(frame.tensors)


def pool_clipping(result: dict[str, Any]) -> dict[str, int]:
    """A secure pool round's clipping counts for the reply meta (what the coordinator's metrics.jsonl shows
    as ``secagg_clipped_entries/devices``, ``secagg_capped_weights``); none for a plain round."""
    if not int(result.get("secure-pool", 0)):
        return {}
    counts = dict(result.get("pool-clipping", {}))
    return {key: int(counts.get(key, 0)) for key in POOL_CLIPPING}


def _norm_median(result: dict[str, Any]) -> dict[str, float]:
    """A plain round's median device update norm for the reply meta (none for a secure pool or an evaluation)."""
    median = result.get("device-norm-median")
    return {} if median is None else {wire.DEVICE_NORM_MEDIAN: float(median)}


def gateway_content(msg: Message, context: Context, config: RunConfig, kind: str) -> RecordDict:
    """The reply of a gateway node: its devices' aggregate for ``msg`` (train or evaluate)."""
    weights = received_weights(msg.content.array_records[wire.ARRAYS])
    instruction = msg.content.config_records.get(wire.CONFIG)
    server_round = int(instruction.get(wire.SERVER_ROUND, 0)) if instruction is not None else 0  # type: ignore[arg-type]
    graph = str(instruction.get(wire.TRAINING_GRAPH, "")) if instruction is not None else ""
    header = {"kind": kind, "server-round": server_round, NUM_ROUNDS: config.integer(knobs.NUM_ROUNDS), "graph": graph,
              "config": _config_of(msg, context, config, kind),
              "secure": secure_settings(config) if kind == "train" else None}
    late = instruction.get(wire.LATE_EXPONENT) if instruction is not None and kind == "train" else None
    if late is not None:  # an asynchronous run: the gateway folds its devices' late results, staleness-weighted
        header[wire.LATE_EXPONENT] = late
    result, arrays = ask_gateway(context, header, weights)
    metrics = {str(k): float(v) for k, v in dict(result.get("metrics", {})).items()}
    if kind == "evaluate":
        return evaluation_content(metrics, int(result["num-examples"]))
    record = ArrayRecord({name: Array(np.ascontiguousarray(arrays[name])) for name in weights})
    meta = ConfigRecord({wire.SERVER_ROUND: server_round, wire.PROFILE: str(context.node_config.get("profile", "")),
                         wire.SAMPLES_PROCESSED: int(result["samples-processed"]),
                         wire.STEPS: max(1, int(result["steps"])), wire.AGGREGATE_OF: int(result["devices"]),
                         wire.SECURE_POOL: int(result.get("secure-pool", 0)), wire.GATEWAY: str(result["gateway"]),
                         wire.CLIPPED: int(result.get("clipped", 0)), wire.CAPPED: int(result.get("capped", 0)),
                         wire.LATE: int(result.get("late", 0)),
                         **pool_clipping(result), **_norm_median(result)})
    reply_metrics = MetricRecord({wire.TRAIN_LOSS: metrics.get("train-loss", 0.0),
                                  wire.NUM_EXAMPLES: int(result["num-examples"])})
    return RecordDict({wire.ARRAYS: record, wire.METRICS: reply_metrics, wire.REPLY_META: meta})
