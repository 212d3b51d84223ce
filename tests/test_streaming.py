"""Issue 16 item 3: a round folds each reply into the aggregate as it arrives (O(model) memory).

A reply is let go before the next one exists, on the inline grid (each ClientApp call runs
as its reply is pulled) and on a real-time grid (replies pulled as they arrive) alike.
Checked with weak references to every reply a device made: when a device starts work,
at most one earlier reply (the one being folded in) may still be alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge import wire
from fedge.config import resolve_run_config
from fedge.profiles import parse_fleet
from fedge.server.app import run_coordinator
from fedge.server.metering import MeteredGrid
from fedge.server.report import read_jsonl
from fedge.simulation.grid import FIRST_NODE_ID, InlineGrid
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.median import Median
from fedge.strategies.policies import DeadlinePolicy
from replies import tampered_apps

DEVICES = 12


class ReplyWatch:
    """A ClientApp whose reply is ``global + (index + 1)``; it notes how many earlier replies still
    hold their arrays (a reply's record may outlive it, empty, in Flower's reference cycles)."""

    def __init__(self) -> None:
        self.alive: list[weakref.ref[ArrayRecord]] = []
        self.most_alive = 0
        self.app = ClientApp()
        self.app.train()(self.train)

    def train(self, message: Message, context: Context) -> Message:
        self.most_alive = max(self.most_alive, sum(bool(record) for ref in self.alive if (record := ref()) is not None))
        index = int(message.metadata.dst_node_id) - FIRST_NODE_ID
        arrays = {name: array.numpy() + (index + 1) for name, array in message.content[wire.ARRAYS].items()}
        record = ArrayRecord({name: Array(value) for name, value in arrays.items()})
        self.alive.append(weakref.ref(record))
        content = RecordDict({wire.ARRAYS: record,
                              wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: 10, "train-loss": 0.5})})
        return Message(content, reply_to=message)


def model() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros((4, 5), np.float32)), "b": Array(np.ones(5, np.float32))})


def inline_grid(watch: ReplyWatch) -> InlineGrid:
    return InlineGrid(watch.app, [{"partition-id": i, "profile": "laptop"} for i in range(DEVICES)], {})


class ArrivingGrid(InlineGrid):
    """Devices elsewhere: each pull returns at most one reply, made when it arrives (not in-process)."""

    synchronous = False

    def pull_messages(self, message_ids: Iterable[str]) -> Iterator[Message]:
        return iter(list(super().pull_messages(list(message_ids)[:1])))


def one_round(strategy: FedAvg, grid: Any) -> ArrayRecord | None:
    arrays, _ = strategy.train_round(grid, 1, model(), ConfigRecord(), timeout=60.0)
    return arrays


@pytest.mark.parametrize("poll_interval", [None, 0.0001], ids=["inline", "real-time"])
def test_fedavg_holds_one_reply_at_a_time(poll_interval: float | None) -> None:
    # Prepare: 12 devices, device i sends global + (i + 1), equal weights
    watch = ReplyWatch()
    inner = inline_grid(watch) if poll_interval is None else ArrivingGrid(
        watch.app, [{"partition-id": i, "profile": "laptop"} for i in range(DEVICES)], {})
    grid = MeteredGrid(inner, parse_fleet("laptop=12"), poll_interval=poll_interval)
    strategy = FedAvg(clients_per_round=DEVICES)
    # Execute
    arrays = one_round(strategy, grid)
    # Assert: mean of 1..12 = 6.5 added to the model; never more than one earlier reply alive
    assert arrays is not None
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((4, 5), 6.5))
    np.testing.assert_allclose(arrays["b"].numpy(), np.full(5, 7.5))
    assert len(watch.alive) == DEVICES
    assert watch.most_alive <= 1, f"{watch.most_alive} replies held at once"
    assert strategy.reports[-1].accepted == DEVICES


def test_a_robust_rule_still_aggregates_replies_that_arrive_one_at_a_time() -> None:
    # Prepare: the median needs all updates at once (its registry entry says so); the stream must feed it
    watch = ReplyWatch()
    grid = MeteredGrid(inline_grid(watch), parse_fleet("laptop=12"))
    # Execute
    arrays = one_round(Median(clients_per_round=DEVICES), grid)
    # Assert: median of 1..12 = 6.5; the decoded updates are kept (the replies themselves need not be)
    assert arrays is not None
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((4, 5), 6.5))


def test_a_virtual_deadline_keeps_at_most_k_replies() -> None:
    # Prepare: K = 4 of 12 over-selected devices, all on time on the virtual clock
    watch = ReplyWatch()
    grid = MeteredGrid(inline_grid(watch), parse_fleet("laptop=12"))
    strategy = FedAvg(clients_per_round=4, policy=DeadlinePolicy(1e9, over_selection=3.0))
    # Execute
    arrays = one_round(strategy, grid)
    # Assert: 4 kept (the first 4 of equal arrivals), never more than K + 1 alive
    assert arrays is not None and strategy.reports[-1].accepted == 4
    assert len(watch.alive) == 12
    assert watch.most_alive <= 5


def test_the_secure_coordinator_holds_one_masked_input_at_a_time(tmp_path: Path) -> None:
    # Prepare: a secure round of 8 devices; each device notes how many earlier masked inputs
    # still hold their bytes when it sends its own
    alive: list[weakref.ref[ArrayRecord]] = []
    most = [0]

    def note(content: RecordDict) -> None:
        most[0] = max(most[0], sum(bool(record) for ref in alive if (record := ref()) is not None))
        alive.append(weakref.ref(content["masked"]))  # type: ignore[arg-type]

    config = resolve_run_config({"fleet": "laptop=8", "clients-per-round": 8, "num-rounds": 1, "model": "logreg",
                                 "local-epochs": 1, "export-onnx": False, "secure-aggregation": True,
                                 "run-dir": str(tmp_path / "r")})
    nodes = [{"partition-id": i, "num-partitions": 8, "profile": "laptop"} for i in range(8)]
    grid = InlineGrid(tampered_apps({(i, "secagg_masked"): note for i in range(8)}), nodes, config)
    # Execute
    run_coordinator(grid, config, progress=False)
    # Assert: the round aggregated all 8; at most one earlier masked input alive at a time
    assert read_jsonl(tmp_path / "r" / "metrics.jsonl")[-1]["aggregated"]
    assert len(alive) == 8
    assert most[0] <= 1, f"{most[0]} masked inputs held at once"
