"""FedBuff in real time (deployment's code path): devices that connect after the run starts.

A deployment's coordinator starts before its devices connect. Synchronous rounds wait for
them; FedBuff found no device online, had nothing in flight and stopped after round 0 (CI's
fresh-clone run, under load: ``fedbuff: no device available to train; stopping``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge import wire
from fedge.simulation.grid import InlineGrid
from fedge.strategies.fedbuff import FedBuff

DEVICES = 3


def _plus_one(message: Message, context: Context) -> Message:
    """A device that sends the model it got plus 1 (an update of delta -1)."""
    arrays = {name: Array(array.numpy() + 1) for name, array in message.content[wire.ARRAYS].items()}
    server_round = message.content[wire.CONFIG][wire.SERVER_ROUND]
    content = RecordDict({
        wire.ARRAYS: ArrayRecord(arrays),
        wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: 10, "train-loss": 0.5}),
        wire.REPLY_META: ConfigRecord({wire.SERVER_ROUND: server_round, wire.PROFILE: "laptop",
                                       wire.SAMPLES_PROCESSED: 10}),
    })
    return Message(content, reply_to=message)


class LateGrid(InlineGrid):
    """Devices that connect ``delay`` seconds after the run starts; not a virtual clock, so
    FedBuff takes its real-time path, as with a SuperLink."""

    synchronous = False

    def __init__(self, app: ClientApp, delay: float) -> None:
        super().__init__(app, [{"partition-id": i, "profile": "laptop"} for i in range(DEVICES)], {})
        self.connects_at = time.monotonic() + delay

    def get_node_ids(self) -> Iterable[int]:
        return super().get_node_ids() if time.monotonic() >= self.connects_at else []


def test_fedbuff_waits_for_devices_that_connect_after_it_starts() -> None:
    # Prepare: 3 devices connecting 1.5 s in; 2 train at a time, every 2 arrivals applied
    app = ClientApp()
    app.train()(_plus_one)
    grid = LateGrid(app, delay=1.5)
    strategy = FedBuff(concurrency=2, buffer_size=2, clients_per_round=2, wait_for_nodes_s=30.0)
    evaluated: list[int] = []
    initial = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    # Execute
    result = strategy.start(grid, initial, num_rounds=3, timeout=60.0,
                            evaluate_fn=lambda version, arrays: evaluated.append(version) or None)
    # Assert: three flushes of two updates each; the model moved (each update adds 1, staleness shrinks it)
    assert evaluated == [0, 1, 2, 3]
    assert [(r.accepted, r.aggregated) for r in strategy.reports] == [(2, True)] * 3
    assert float(result.arrays["w"].numpy()[0]) > 1.0


class LeavingGrid(InlineGrid):
    """Two devices online at the start; once the run has launched work, one of them goes away for good."""

    synchronous = False

    def __init__(self, app: ClientApp) -> None:
        super().__init__(app, [{"partition-id": i, "profile": "laptop"} for i in range(2)], {})
        self.pushed = 0

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        self.pushed += 1
        return super().push_messages(messages)

    def get_node_ids(self) -> Iterable[int]:
        nodes = list(super().get_node_ids())
        return nodes if not self.pushed else nodes[:1]


def test_fedbuff_does_not_wait_again_for_a_device_that_left_once_the_run_has_started() -> None:
    # Prepare: one device training at a time, every arrival applied; 2 devices needed to start, waited for up to
    # 30 s; after the first launch only one is online (a gateway that died: nothing of it is in flight)
    app = ClientApp()
    app.train()(_plus_one)
    grid = LeavingGrid(app)
    strategy = FedBuff(concurrency=1, buffer_size=1, clients_per_round=2, wait_for_nodes_s=30.0)
    started = time.monotonic()
    # Execute
    strategy.start(grid, ArrayRecord({"w": Array(np.zeros(3, np.float32))}), num_rounds=3, timeout=60.0)
    # Assert: three flushes with the device that stayed, none of them waiting 30 s for the one that left
    assert [(r.accepted, r.aggregated) for r in strategy.reports] == [(1, True)] * 3
    assert time.monotonic() - started < 30.0
