"""fedge strategies as drop-ins in a plain Flower app (issue 13, item 5).

A Flower user's own ServerApp and ClientApp (no fedge SDK, no fedge metadata in replies),
with a fedge strategy built from Flower's own arguments, run over the Flower Grid contract
(fedge's in-process Grid). Every device does gradient steps on ``||w - target||^2`` from
the global weights, so every strategy must drive the model to ``target`` (hand-picked).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedge.simulation.grid import InlineGrid
from fedge.strategies import STRATEGIES, FedAvg

TARGET = np.array([1.0, -2.0, 0.5], np.float32)


def plain_client_app() -> ClientApp:
    """A standard Flower ClientApp: two local gradient steps towards TARGET; num-examples = 10 + id."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        weights = msg.content["arrays"]["w"].numpy()
        for _ in range(2):
            weights = weights - 0.25 * 2 * (weights - TARGET)
        count = 10 + int(context.node_config["partition-id"])
        return Message(RecordDict({"arrays": ArrayRecord({"w": Array(weights.astype(np.float32))}),
                                   "metrics": MetricRecord({"num-examples": count, "train-loss": 0.1})}),
                       reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        weights = msg.content["arrays"]["w"].numpy()
        loss = float(np.sum((weights - TARGET) ** 2))
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 5, "eval-loss": loss})}), reply_to=msg)

    return app


OPTIONS: dict[str, dict[str, Any]] = {
    "fedadam": {"server_learning_rate": 0.05},   # adaptive steps of ~lr: more rounds to settle
    "fedyogi": {"server_learning_rate": 0.05},
    "trimmed-mean": {"trim_fraction": 0.2},
    "krum": {"num_byzantine": 1, "num_selected": 2},
    "fedbuff": {"concurrency": 4, "buffer_size": 2},
}


def _run(name: str, rounds: int, **flower_args: Any) -> tuple[np.ndarray, FedAvg]:
    """A plain Flower ServerApp that builds ``STRATEGIES[name]`` from Flower's arguments."""
    holder: dict[str, Any] = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = STRATEGIES[name](**flower_args, **OPTIONS.get(name, {}))
        holder["strategy"] = strategy
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord({"w": Array(np.zeros(3, np.float32))}),
                                num_rounds=rounds, timeout=30.0, train_config=ConfigRecord({"lr": 0.25}))
        holder["w"] = result.arrays["w"].numpy()

    nodes = [{"partition-id": i, "num-partitions": 5} for i in range(5)]
    grid = InlineGrid(plain_client_app(), nodes, {})
    server(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    return holder["w"], holder["strategy"]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_each_strategy_trains_a_plain_flower_app_to_the_known_answer(name: str) -> None:
    # Execute: Flower's defaults except a fraction: 4 of the 5 connected devices a round
    rounds = {"fedadam": 100, "fedyogi": 100, "fedavgm": 100}.get(name, 25)  # momentum needs longer to settle
    weights, strategy = _run(name, rounds=rounds, fraction_train=0.8, min_available_nodes=5, fraction_evaluate=0.4)
    # Assert: the model reached TARGET; no standard Flower reply was rejected
    np.testing.assert_allclose(weights, TARGET, atol=0.05)
    assert all(not report.rejected for report in strategy.reports)


@pytest.mark.parametrize(("flower_args", "expected"), [
    ({"fraction_train": 1.0}, 5),                           # Flower: int(5 * 1.0) = 5
    ({"fraction_train": 0.5}, 2),                           # int(2.5) = 2 >= min_train_nodes 2
    ({"fraction_train": 0.1, "min_train_nodes": 3}, 3),     # max(int(0.5), 3)
    ({"clients_per_round": 4}, 4),                          # fedge's fixed count
])
def test_flower_arguments_keep_flowers_meaning(flower_args: dict[str, Any], expected: int) -> None:
    # Execute
    _, strategy = _run("fedavg", rounds=1, fraction_evaluate=0.0, **flower_args)
    # Assert: devices selected in the round
    assert strategy.reports[0].selected == expected


def test_fedge_meta_is_validated_when_present() -> None:
    # Prepare: a plain reply plus a fedge meta record whose round is wrong
    app = plain_client_app()
    tagged = ClientApp()

    @tagged.train()
    def train(msg: Message, context: Context) -> Message:
        reply = app(msg, context)
        reply.content["fedge"] = ConfigRecord({"server-round": 99})
        return reply

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
    grid = InlineGrid(tagged, [{"partition-id": i, "num-partitions": 3} for i in range(3)], {})
    # Execute
    strategy.start(grid=grid, initial_arrays=ArrayRecord({"w": Array(np.zeros(3, np.float32))}), num_rounds=1,
                   timeout=10.0)
    # Assert: all three rejected for naming another round
    assert [r.reason for r in strategy.reports[0].rejected] == ["reply is for round 99, current round is 1"] * 3


def test_waiting_for_devices_says_how_many_are_connected(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: 3 devices connected, Flower's min_available_nodes = 5, a 1.2 s wait, a log line every 0.5 s
    strategy = FedAvg(min_available_nodes=5, fraction_evaluate=0.0, wait_for_nodes_s=1.2)
    strategy.wait_log_every_s = 0.5
    grid = InlineGrid(plain_client_app(), [{"partition-id": i, "num-partitions": 3} for i in range(3)], {})
    # Execute: the lines go through Flower's own logger, which `flwr run` streams (fedge's INFO lines it does not)
    flower = logging.getLogger("flwr")
    flower.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="flwr"):
            strategy.start(grid=grid, initial_arrays=ArrayRecord({"w": Array(np.zeros(3, np.float32))}),
                           num_rounds=1, timeout=10.0)
    finally:
        flower.removeHandler(caplog.handler)
    # Assert: at least 2 progress lines, then the round went on with the 3 it had
    waiting = [r.getMessage() for r in caplog.records if "waiting for devices" in r.getMessage()]
    assert len(waiting) >= 2 and "3 connected of 5 needed" in waiting[0]
    assert strategy.reports[0].selected == 3
