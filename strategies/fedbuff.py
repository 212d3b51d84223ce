"""FedBuff: asynchronous buffered aggregation."""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from numpy.typing import NDArray

from fedge import wire
from fedge.errors import ConfigError, UpdateRejected
from fedge.server.validation import Rejection, spec_of
from fedge.simulation.clock import MeteredGrid
from fedge.strategies.aggregate import apply_buffer, staleness_weight
from fedge.strategies.fedavg import FedAvg, RoundReport

log = logging.getLogger("fedge.strategies")


@dataclass(order=True)
class _InFlight:
    arrival: float
    sequence: int
    node: int = field(compare=False)
    version: int = field(compare=False)
    reply: Message = field(compare=False)


class FedBuff(FedAvg):
    """FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation",
    AISTATS 2022).

    ``concurrency`` devices train at once on whatever global model was current when
    they started; every ``buffer_size`` arrived updates are applied with weight
    ``1/sqrt(1 + staleness)`` and a new device starts as each one finishes. A server
    "round" is one buffer flush. Arrivals are ordered by fedge's virtual clock, so
    this runs in simulation (on a :class:`MeteredGrid` over the inline grid); in
    deployment it is refused at start for now.
    """

    def __init__(self, *, concurrency: int = 20, buffer_size: int = 10, server_learning_rate: float = 1.0,
                 staleness_exponent: float = 0.5, **kwargs: Any) -> None:
        if buffer_size < 1 or concurrency < 1:
            raise ConfigError("FedBuff needs buffer-size >= 1 and concurrency >= 1")
        super().__init__(**kwargs)
        self.concurrency, self.buffer_size = concurrency, buffer_size
        self.server_learning_rate, self.staleness_exponent = server_learning_rate, staleness_exponent

    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        *,
        start_round: int = 1,
    ) -> Result:
        """Run ``num_rounds`` buffer flushes (resuming after ``start_round - 1``)."""
        if not isinstance(grid, MeteredGrid) or not getattr(grid.inner, "synchronous", False):
            raise ConfigError("strategy 'fedbuff' runs in simulation (inline backend) only for now")
        run = _AsyncRun(self, grid, initial_arrays, train_config or ConfigRecord(), timeout, start_round - 1)
        result = Result()
        result.arrays = initial_arrays
        if evaluate_fn and start_round == 1:
            evaluate_fn(0, initial_arrays)
        while run.version < num_rounds and run.step():
            if run.flushed:
                result.arrays = run.arrays
                if evaluate_fn:
                    evaluate_fn(run.version, run.arrays)
        return result

    def weight(self, staleness: int) -> float:
        """The weight of an update ``staleness`` versions old."""
        return staleness_weight(staleness, self.staleness_exponent)


class _AsyncRun:
    """The event loop of one FedBuff run on the virtual clock (explicit server state)."""

    def __init__(self, strategy: FedBuff, grid: MeteredGrid, arrays: ArrayRecord, config: ConfigRecord,
                 timeout: float, version: int) -> None:
        self.strategy, self.grid, self.config, self.timeout = strategy, grid, config, timeout
        self.arrays, self.version = arrays, version
        self.snapshots: dict[int, dict[str, NDArray[Any]]] = {version: _numpy(arrays)}
        self.in_flight: list[_InFlight] = []
        self.sequence = 0
        self.buffer: list[tuple[dict[str, NDArray[Any]], float]] = []
        self.replies: list[Message] = []
        self.report = RoundReport(server_round=version + 1, selected=0)
        self.flushed = False

    def step(self) -> bool:
        """Start devices up to the concurrency, then take the next arrival; False when none can run."""
        self.flushed = False
        self._launch()
        if not self.in_flight:
            log.warning("fedbuff: no device available to train; stopping")
            return False
        event = heapq.heappop(self.in_flight)
        self.grid.advance(max(event.arrival - self.grid.sim_time, 0.0))
        self._receive(event)
        if len(self.buffer) >= self.strategy.buffer_size:
            self._flush()
        return True

    def _launch(self) -> None:
        busy = {event.node for event in self.in_flight}
        idle = [node for node in self.grid.get_node_ids() if node not in busy]
        wanted = self.strategy.concurrency - len(self.in_flight)
        chosen = self.strategy.selector.select(self.version * 7919 + self.sequence, idle, wanted) if wanted > 0 else []
        for node in chosen:
            self.config[wire.SERVER_ROUND] = self.version + 1
            message = Message(RecordDict({"arrays": self.arrays, "config": self.config}), dst_node_id=node,
                              message_type=MessageType.TRAIN)
            self.report.selected += 1
            for reply, seconds in self.grid.exchange_timed([message], self.timeout):  # empty: dropped out
                self.sequence += 1
                heapq.heappush(self.in_flight, _InFlight(self.grid.sim_time + seconds, self.sequence, node,
                                                         self.version, reply))

    def _receive(self, event: _InFlight) -> None:
        node, reply = event.node, event.reply
        if reply.has_error():
            self.report.failed.append(Rejection(node, f"device error: {reply.error.reason}"))
            return
        try:
            arrays, weight = self.strategy.validator.check(reply.content, server_round=event.version + 1,
                                                           spec=spec_of(self.arrays))
        except UpdateRejected as exc:
            log.warning("fedbuff: rejected update from node %d: %s", node, exc.reason)
            self.report.rejected.append(Rejection(node, exc.reason))
            return
        start = self.snapshots[event.version]
        delta = {k: np.asarray(start[k], np.float64) - np.asarray(v, np.float64) for k, v in arrays.items()}
        self.buffer.append((delta, self.strategy.weight(self.version - event.version)))
        self.replies.append(reply)
        self.report.accepted += 1

    def _flush(self) -> None:
        deltas, weights = zip(*self.buffer, strict=True)
        new = apply_buffer(self.snapshots[self.version], list(deltas), list(weights),
                           self.strategy.server_learning_rate)
        self.version += 1
        self.arrays = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in new.items()})
        self.snapshots[self.version] = new
        live = {event.version for event in self.in_flight} | {self.version}
        self.snapshots = {v: a for v, a in self.snapshots.items() if v in live}
        self.grid.count_participants(self.replies)
        self.report.aggregated = True
        self.strategy.reports.append(self.report)
        self.buffer, self.replies = [], []
        self.report = RoundReport(server_round=self.version + 1, selected=0)
        self.flushed = True


def _numpy(arrays: ArrayRecord) -> dict[str, NDArray[Any]]:
    return {k: a.numpy() for k, a in arrays.items()}
