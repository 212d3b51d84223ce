"""Build Flower train instructions and replies for unit tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge import wire


def global_arrays() -> ArrayRecord:
    """A tiny two-tensor 'model'."""
    return ArrayRecord({"w": Array(np.zeros((2, 3), np.float32)), "b": Array(np.zeros(3, np.float32))})


def instruction(node_id: int, server_round: int = 1) -> Message:
    """A train instruction as FedAvg sends it."""
    content = RecordDict({wire.ARRAYS: global_arrays(),
                          wire.CONFIG: ConfigRecord({wire.SERVER_ROUND: server_round})})
    message = Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN)
    message.metadata.__dict__["_message_id"] = f"ins-{node_id}"
    return message


def train_reply(
    node_id: int,
    arrays: dict[str, np.ndarray],
    num_examples: object = 10,
    server_round: int = 1,
    *,
    meta: bool = True,
) -> Message:
    """A train reply from ``node_id`` carrying ``arrays``."""
    content = RecordDict({
        wire.ARRAYS: ArrayRecord({k: Array(v) for k, v in arrays.items()}),
        wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: num_examples, "train-loss": 0.5}),  # type: ignore[dict-item]
    })
    if meta:
        content[wire.REPLY_META] = ConfigRecord({wire.SERVER_ROUND: server_round,
                                                  wire.PROFILE: "phone", wire.SAMPLES_PROCESSED: 20})
    return Message(content, reply_to=instruction(node_id, server_round))


def good_arrays(value: float) -> dict[str, np.ndarray]:
    """Arrays shaped like :func:`global_arrays`, all equal to ``value``."""
    return {"w": np.full((2, 3), value, np.float32), "b": np.full(3, value, np.float32)}


SECURE_STEPS = ("secagg_setup", "secagg_share", "secagg_masked", "secagg_consistency", "secagg_unmask")


def tampered_app(partition: int, step: str, tamper: Callable[[RecordDict], None]) -> ClientApp:
    """fedge's own ClientApp, except that device ``partition`` runs ``tamper`` on its reply's
    content at ``step`` ("train" or a secure-aggregation step); ``tamper`` may raise (a dropout)."""
    return tampered_apps({(partition, step): tamper})


def tampered_apps(tampers: dict[tuple[int, str], Callable[[RecordDict], None]]) -> ClientApp:
    """Like :func:`tampered_app` for several devices: ``tampers[(partition, step)]`` runs on
    the reply content of device ``partition`` at ``step``."""
    from fedge.clients.app import make_default_client_app

    honest = make_default_client_app()
    app = ClientApp()

    def handler(name: str) -> Any:
        def handle(msg: Message, context: Context) -> Message:
            reply = honest(msg, context)
            tamper = tampers.get((int(context.node_config["partition-id"]), name))
            if tamper is not None:
                tamper(reply.content)
            return reply
        return handle

    app.train()(handler("train"))
    for name in SECURE_STEPS:
        app.train(name)(handler(name))
    app.evaluate()(lambda msg, context: honest(msg, context))
    return app


def drop_out(_: RecordDict) -> None:
    """A ``tamper`` for :func:`tampered_app`: the device goes away instead of replying."""
    raise ConnectionError("device went away")


def capture_strategies(monkeypatch: Any) -> list[Any]:
    """Make ``fedge.server.app.build_strategy`` keep every strategy it builds in the returned list
    (so a test can read the round reports of a run it started through ``run_coordinator``)."""
    import fedge.server.app as server_app

    strategies: list[Any] = []
    build = server_app.build_strategy

    def keep(*args: Any, **kwargs: Any) -> Any:
        strategies.append(build(*args, **kwargs))
        return strategies[-1]

    monkeypatch.setattr(server_app, "build_strategy", keep)
    return strategies
