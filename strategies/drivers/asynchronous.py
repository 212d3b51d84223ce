"""The asynchronous driver: FedBuff's buffered aggregation over model versions (Nguyen et al., AISTATS 2022).

``concurrency`` devices train at once on whatever global model was current when they
started; each arrival is folded into the strategy's rule with weight ``1/(1 + s)^exponent``
(``s``: how many versions old its model is), and every ``buffer_size`` arrivals the rule's
result becomes the next model version. A server "round" is one flush. In simulation arrivals
are ordered by fedge's virtual clock; in deployment they come in real time through the Grid's
push/pull API. Rules that take stale updates run under it (FedBuff's own, and every linear
rule: an update counts as its change applied to the current model).
"""

from __future__ import annotations

import heapq
import logging
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from numpy.typing import NDArray

from fedge import knobs, wire
from fedge.aggregate import c_contiguous, staleness_weight
from fedge.config import Scalar
from fedge.errors import ConfigError, UpdateRejected
from fedge.strategies.drivers.base import EvaluateFn, RoundReport
from fedge.strategies.registry import names_where
from fedge.strategies.rule import RoundContext
from fedge.strategies.screening import counted
from fedge.strategies.timing import TimedGrid, timed, virtual
from fedge.strategies.validation import AcceptedUpdate, Rejection, spec_of

if TYPE_CHECKING:
    from fedge.strategies.rounds import Rounds

log = logging.getLogger("fedge.strategies")


@dataclass(order=True)
class _InFlight:
    arrival: float
    sequence: int
    node: int = field(compare=False)
    version: int = field(compare=False)
    reply: Message = field(compare=False)
    duration: float = field(default=0.0, compare=False)  # how long the device took (what selectors learn)


class AsynchronousDriver:
    """Buffered asynchronous aggregation (FedBuff).

    Parameters
    ----------
    concurrency : int
        Devices training at once.
    buffer_size : int
        Arrivals folded into one new model version.
    staleness_exponent : float
        An update ``s`` versions old weighs ``1 / (1 + s)^staleness_exponent`` (0.5 in the paper).
    """

    federated_evaluation = True  # after each flush, idle devices evaluate the new model (fraction_evaluate)
    asynchronous = True

    def __init__(self, *, concurrency: int = 20, buffer_size: int = 10, staleness_exponent: float = 0.5) -> None:
        if buffer_size < 1 or concurrency < 1:
            raise ConfigError("FedBuff needs buffer-size >= 1 and concurrency >= 1")
        self.concurrency, self.buffer_size, self.staleness_exponent = concurrency, buffer_size, staleness_exponent

    @classmethod
    def from_config(cls, config: Mapping[str, Scalar], num_nodes: int | None) -> AsynchronousDriver:
        """The driver a run config asks for (``concurrency`` at most the fleet's size, when known)."""
        concurrency = int(config[knobs.CONCURRENCY])
        return cls(concurrency=min(concurrency, num_nodes or concurrency), buffer_size=int(config[knobs.BUFFER_SIZE]),
                   staleness_exponent=float(config[knobs.STALENESS_EXPONENT]))

    def bind(self, rounds: Rounds) -> None:
        """Refuse a rule that cannot fold updates trained from older models."""
        if not rounds.rule.takes_stale_updates:
            raise ConfigError(f"{rounds.name}'s rule {type(rounds.rule).__name__} cannot run "
                              "asynchronously (it needs each update, or local steps stale arrivals do not carry); "
                              f"use {names_where(lambda rule: rule.takes_stale_updates)}")

    def weight(self, staleness: int) -> float:
        """The weight of an update ``staleness`` versions old."""
        return staleness_weight(staleness, self.staleness_exponent)

    def start(self, rounds: Rounds, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int, timeout: float,
              train_config: ConfigRecord, evaluate_config: ConfigRecord, evaluate_fn: EvaluateFn | None,
              start_round: int) -> Result:
        """Run ``num_rounds`` buffer flushes (resuming after ``start_round - 1``)."""
        clock = virtual(grid)
        arrivals: _Arrivals = _SimulatedArrivals(clock, timeout) if clock is not None else _LiveArrivals(grid, timeout)
        run = _AsyncRun(self, rounds, grid, arrivals, initial_arrays, train_config, start_round - 1)
        result = Result()
        result.arrays = initial_arrays
        if evaluate_fn and start_round == 1:
            evaluate_fn(0, initial_arrays)
        while run.version < num_rounds and run.step():
            if run.flushed:
                result.arrays = run.arrays
                metrics = self.evaluate_idle(rounds, grid, run.version, run.arrays, evaluate_config,
                                             run.arrivals.busy(), timeout)
                if metrics is not None:
                    result.evaluate_metrics_clientapp[run.version] = rounds.state.evaluated[run.version] = metrics
                if evaluate_fn and (res := evaluate_fn(run.version, run.arrays)) is not None:
                    result.evaluate_metrics_serverapp[run.version] = res
        return result

    def evaluate_idle(self, rounds: Rounds, grid: Grid, version: int, arrays: ArrayRecord, config: ConfigRecord,
                      busy: set[int], timeout: float) -> MetricRecord | None:
        """Federated evaluation of a new model version on devices not training now.

        Flower's sample size (``fraction_evaluate`` of the connected devices, at least
        ``min_evaluate_nodes``), drawn (seeded) from those with no work in flight: a busy one
        would answer only after its training. Flower's own sampling is not used: it waits for
        ``min_available_nodes`` idle devices, which an asynchronous run may never have. The
        replies are aggregated by ``evaluate_metrics_aggr_fn``; None when nothing is asked.
        """
        connected = list(grid.get_node_ids())
        idle = sorted(node for node in connected if node not in busy)
        sampling = rounds.sampling
        size = min(len(idle), max(int(len(connected) * sampling.fraction_evaluate), sampling.min_evaluate_nodes))
        if sampling.fraction_evaluate <= 0 or size <= 0:
            return None
        record = RecordDict({sampling.arrayrecord_key: arrays,
                             sampling.configrecord_key: ConfigRecord({**config, wire.SERVER_ROUND: version})})
        chosen = random.Random(rounds.selector.seed * 7_907 + version).sample(idle, size)
        messages = [Message(record, dst_node_id=node, message_type=MessageType.EVALUATE) for node in chosen]
        return rounds.evaluation_metrics(version, grid.send_and_receive(messages, timeout=timeout))


class _SimulatedArrivals:
    """Arrivals ordered by the virtual clock: the inline grid runs a device's work at launch,
    and its reply is delivered when the clock reaches launch time + its simulated duration."""

    def __init__(self, grid: TimedGrid, timeout: float) -> None:
        self.grid, self.timeout = grid, timeout
        self.heap: list[_InFlight] = []
        self.sequence = 0

    def busy(self) -> set[int]:
        """Nodes with work in flight."""
        return {event.node for event in self.heap}

    def versions(self) -> set[int]:
        """Model versions that work in flight started from."""
        return {event.version for event in self.heap}

    def connected(self, rounds: Rounds, server_round: int) -> list[int]:
        """The simulated devices online now (the fleet exists from the start: nothing to wait for)."""
        return list(self.grid.get_node_ids())

    def launch(self, message: Message, node: int, version: int) -> None:
        """Give ``node`` work (a device that drops out never arrives)."""
        for reply, seconds in self.grid.exchange_timed([message], self.timeout):
            self.sequence += 1
            heapq.heappush(self.heap, _InFlight(self.grid.sim_time + seconds, self.sequence, node, version, reply,
                                                seconds))

    def next(self) -> _InFlight | None:
        """The earliest arrival, with the clock moved to it; ``None`` when nothing is in flight."""
        if not self.heap:
            return None
        event = heapq.heappop(self.heap)
        self.grid.advance(max(event.arrival - self.grid.sim_time, 0.0))
        return event


class _LiveArrivals:
    """Arrivals in real time through the Grid's push/pull API (deployment).

    Replies are matched by ``reply_to_message_id`` (SuperLink-generated errors come from
    node 1); work older than ``timeout`` is given up and its device freed.
    """

    def __init__(self, grid: Grid, timeout: float, poll_s: float = 0.1) -> None:
        self.grid, self.timeout, self.poll_s = grid, timeout, poll_s
        self.pending: dict[str, tuple[int, int, float]] = {}
        self.ready: list[_InFlight] = []
        self.sequence = 0
        self.started = False  # work was launched: the run does not wait for devices to connect again

    def busy(self) -> set[int]:  # noqa: D102
        return {node for node, _, _ in self.pending.values()} | {event.node for event in self.ready}

    def versions(self) -> set[int]:  # noqa: D102
        return {version for _, version, _ in self.pending.values()} | {event.version for event in self.ready}

    def connected(self, rounds: Rounds, server_round: int) -> list[int]:
        """The devices online now. Before the first launch, and whenever none is online and none
        has work, first waits for the devices a round needs, as a synchronous round does: devices
        connect after the coordinator starts, and with none online FedBuff would have nothing to
        wait for and stop. Once the run has started it never waits for more than are online (a
        gateway or device that went away must not hold up the others)."""
        online = list(self.grid.get_node_ids())
        if self.pending or self.ready or (self.started and online):
            return online
        return rounds.wait_for_devices(server_round, self.grid)

    def launch(self, message: Message, node: int, version: int) -> None:  # noqa: D102
        self.started = True
        for message_id in self.grid.push_messages([message]):
            self.pending[message_id] = (node, version, time.monotonic())
        if (clock := timed(self.grid)) is not None:
            clock.count_bytes(down=wire.payload_bytes(message.content))

    def next(self) -> _InFlight | None:
        """The next reply to arrive (waiting for it); ``None`` when nothing is in flight."""
        while not self.ready and self.pending:
            for reply in self.grid.pull_messages(list(self.pending)):
                node, version, started = self.pending.pop(reply.metadata.reply_to_message_id, (0, 0, 0.0))
                if node:
                    self.sequence += 1
                    took = time.monotonic() - started
                    self.ready.append(_InFlight(took, self.sequence, node, version, reply, took))
            expired = [i for i, (_, _, started) in self.pending.items() if time.monotonic() - started > self.timeout]
            for message_id in expired:
                log.warning("fedbuff: node %d did not reply within %.0f s", self.pending.pop(message_id)[0],
                            self.timeout)
            if not self.ready:
                time.sleep(self.poll_s)
        if not self.ready:
            return None
        event = self.ready.pop(0)
        if (clock := timed(self.grid)) is not None and not event.reply.has_error():
            clock.count_bytes(up=wire.payload_bytes(event.reply.content))
        return event


_Arrivals = _SimulatedArrivals | _LiveArrivals


class _AsyncRun:
    """The event loop of one asynchronous run (explicit server state)."""

    def __init__(self, driver: AsynchronousDriver, rounds: Rounds, grid: Grid, arrivals: _Arrivals,
                 arrays: ArrayRecord, config: ConfigRecord, version: int) -> None:
        self.driver, self.rounds, self.grid, self.arrivals, self.config = driver, rounds, grid, arrivals, config
        self.arrays, self.version = arrays, version
        self.snapshots: dict[int, dict[str, NDArray[Any]]] = {version: _numpy(arrays)}
        self.launches = 0
        self.buffered = 0
        self.replies: list[Message] = []
        self.report = RoundReport(server_round=version + 1, selected=0)
        self.flushed = False
        self._begin()

    def _begin(self) -> None:
        """A new buffer: the rule folds arrivals onto the current model version."""
        self.rounds.rule.begin(RoundContext(self.snapshots[self.version], self.rounds.buffer_names))

    def step(self) -> bool:
        """Start devices up to the concurrency, then take the next arrival; False when none can run."""
        self.flushed = False
        self._launch()
        event = self.arrivals.next()
        if event is None:
            log.warning("fedbuff: no device available to train; stopping")
            return False
        self._receive(event)
        if self.buffered >= self.driver.buffer_size:
            self._flush()
        return True

    def _launch(self) -> None:
        """Start idle devices, as a round of the synchronous strategies would: chosen by the
        selector for the current server round, stragglers simulated, each model in its
        device's downlink codec."""
        rounds = self.rounds
        busy = self.arrivals.busy()
        server_round = self.version + 1
        idle = [node for node in self.arrivals.connected(rounds, server_round) if node not in busy]
        wanted = self.driver.concurrency - len(busy)
        chosen = rounds.selector.select(server_round, idle, wanted) if wanted > 0 else []
        rounds.state.stragglers = rounds.pick_stragglers(server_round * 1_009 + self.launches, chosen)
        config = ConfigRecord({**self.config, wire.SERVER_ROUND: server_round,
                               wire.LATE_EXPONENT: self.driver.staleness_exponent})  # gateways weigh late results
        record = RecordDict({rounds.sampling.arrayrecord_key: self.arrays, rounds.sampling.configrecord_key: config})
        for node in chosen:
            self.launches += 1
            content = rounds.instruction(node, record, config, server_round, self.grid)
            message = Message(content, dst_node_id=node, message_type=MessageType.TRAIN)
            self.report.selected += 1
            self.arrivals.launch(message, node, self.version)

    def _receive(self, event: _InFlight) -> None:
        node, reply, rounds = event.node, event.reply, self.rounds
        if reply.has_error():
            self.report.failed.append(Rejection(node, f"device error: {reply.error.reason}"))
            return
        rounds.selector.observe(event.version + 1, [reply], {node: event.duration})
        if rounds.downlink is not None:
            rounds.downlink.learn([reply])
        try:
            checked = rounds.validator.read(reply.content, server_round=event.version + 1, spec=spec_of(self.arrays),
                                            reference=self.snapshots[event.version], node_id=node)
        except UpdateRejected as exc:
            log.warning("fedbuff: rejected update from node %d: %s", node, exc.reason)
            self.report.rejected.append(Rejection(node, exc.reason))
            return
        update = counted(rounds, self.report, AcceptedUpdate(node, checked.arrays, checked.weight, reply.content,
                                                             checked.meta, checked.clipped, checked.pool_clipping,
                                                             checked.norm))
        # a gateway's partial flush stands for its devices' results: each counts towards the buffer
        update.devices = (checked.meta.aggregate_of or 1) if checked.meta is not None else 1
        update.weight = update.devices * self.driver.weight(self.version - event.version)
        update.base = self.snapshots[event.version] if event.version != self.version else None
        rounds.rule.fold(update)
        self.buffered += update.devices
        self.replies.append(reply)

    def _flush(self) -> None:
        new = self.rounds.rule.result()
        if new is None:  # cannot happen with arrivals folded in; a rule that found none keeps the model
            new = self.snapshots[self.version]
        self.version += 1
        self.arrays = ArrayRecord({k: Array(c_contiguous(v)) for k, v in new.items()})
        self.snapshots[self.version] = new
        live = self.arrivals.versions() | {self.version}
        self.snapshots = {v: a for v, a in self.snapshots.items() if v in live}
        if (clock := timed(self.grid)) is not None:
            clock.count_participants(self.replies)
        self.report.aggregated = True
        self.rounds.state.reports.append(self.report)
        self.buffered, self.replies = 0, []
        self.report = RoundReport(server_round=self.version + 1, selected=0)
        self.flushed = True
        self._begin()


def _numpy(arrays: ArrayRecord) -> dict[str, NDArray[Any]]:
    return {k: a.numpy() for k, a in arrays.items()}
