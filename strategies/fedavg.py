"""FedAvg with reply validation and streaming aggregation."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.exception import AggregationError
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info
from flwr.supercore import log as flower_log
from numpy.typing import NDArray

from fedge import wire
from fedge.aggregate import WeightedMeanAccumulator, c_contiguous, statistic_names, weighted_mean_metrics
from fedge.errors import ConfigError, RunFailed
from fedge.preprocessing import OUTSIDE, RAW_SCALED
from fedge.strategies.flower_args import flower_constructor
from fedge.strategies.policies import RoundPolicy, SyncPolicy, let_go
from fedge.strategies.registry import register
from fedge.strategies.selection import RandomSelector
from fedge.strategies.systematic import stop_message, systematic_reason
from fedge.strategies.timing import durations
from fedge.strategies.validation import AcceptedUpdate, Failure, Rejection, ReplyValidator

log = logging.getLogger("fedge.strategies")


@dataclass
class RoundReport:
    """What happened to the replies of one training round (explicit server state)."""

    server_round: int
    selected: int
    accepted: int = 0
    late: int = 0
    train_loss: float | None = None
    rejected: list[Rejection] = field(default_factory=list)
    failed: list[Rejection] = field(default_factory=list)
    aggregated: bool = False
    epsilon: float | None = None  # DP: privacy spent after this round
    inputs_raw: int = 0  # accepted updates whose device preprocessed raw inputs of its own (fedge.preprocessing)
    inputs_outside: int = 0  # ... whose device's inputs fall outside the task's declared range


class PrivacyLayer(Protocol):
    """What a strategy needs from differential privacy (see :mod:`fedge.server.privacy`)."""

    wrapper: Strategy
    client_side: bool
    num_sampled: int

    def release(self) -> float: ...

    def state_dict(self) -> dict[str, NDArray[np.generic]]: ...

    def load_state_dict(self, state: dict[str, NDArray[np.generic]]) -> None: ...


class DownlinkLayer(Protocol):
    """What a strategy needs to compress the downlink (see :mod:`fedge.server.compression`)."""

    def record_for(self, node: int, record: RecordDict, grid: Grid, server_round: int) -> RecordDict: ...

    def learn(self, replies: list[Message]) -> None: ...


@register("fedavg", dp=True)
@flower_constructor(FlowerFedAvg)
class FedAvg(FlowerFedAvg):
    """Federated Averaging (McMahan et al., AISTATS 2017) that never trusts a reply.

    A subclass of Flower's message-based ``FedAvg``, usable in any Flower
    ``ServerApp``. Before aggregation every reply goes through a
    :class:`~fedge.strategies.validation.ReplyValidator`; rejected replies are logged,
    counted in the round's metrics and left out. Accepted updates are folded into
    a running weighted sum one at a time (memory O(model size)). If fewer than
    ``min_train_replies`` updates survive, the round returns no arrays and the
    global model stays as it was.

    A drop-in for Flower's ``FedAvg``: ``fraction_train``, ``fraction_evaluate``,
    ``min_train_nodes``, ``min_evaluate_nodes``, ``min_available_nodes`` (and the rest of
    Flower's arguments) keep Flower's meaning and defaults, and replies of a standard Flower
    ClientApp (arrays + a MetricRecord with ``num-examples``) are accepted; fedge's reply
    meta is optional then, and validated when present.

    Parameters
    ----------
    clients_per_round : int, optional
        A fixed number of devices a round (fedge's runs). Without it, a round trains
        ``max(int(fraction_train * connected), min_train_nodes)`` devices, as Flower does.
    validator : ReplyValidator, optional
        Defaults to ``ReplyValidator(require_round_tag=False)`` (standard Flower replies pass).
    min_train_replies : int
        Accepted updates needed to change the global model.
    flower_lines : bool
        Log Flower's start, round and final lines through Flower's logger (fedge's own runs
        turn them off: their console has fedge's round lines).
    wait_for_nodes_s : float, optional
        How long a round waits for enough devices to connect (logging every 10 s); None
        (the default, as Flower) waits until they do. fedge's runs set ``round-timeout``.
    **kwargs
        Passed to Flower's ``FedAvg`` (``fraction_train``, ``min_train_nodes``, ...).
    """

    keeps_partial_work = False  # FedAvg drops stragglers' replies; FedProx keeps them
    needs_global_model = False  # its rule steps from the global model (FedAvgM, FedAdam, FedNova, ...)
    wait_log_every_s = 10.0

    def __init__(
        self,
        *,
        clients_per_round: int | None = None,
        validator: ReplyValidator | None = None,
        selector: RandomSelector | None = None,
        policy: RoundPolicy | None = None,
        min_train_replies: int = 1,
        wait_for_nodes_s: float | None = None,
        straggler_fraction: float = 0.0,
        flower_lines: bool = True,
        **kwargs: Any,
    ) -> None:
        if clients_per_round is not None and clients_per_round < 1:
            raise ConfigError(f"clients_per_round must be >= 1, got {clients_per_round}")
        super().__init__(**kwargs)
        self.clients_per_round = clients_per_round
        self.round_target = clients_per_round or self.min_train_nodes  # devices the current round wants
        self.validator = validator or ReplyValidator(require_round_tag=False)
        if self.validator.weight_key != self.weighted_by_key:  # Flower's weighted_by_key: what a reply's weight is
            self.validator = copy.copy(self.validator)  # a validator the caller shares stays as it was
            self.validator.weight_key = self.weighted_by_key
        self.selector = selector or RandomSelector()
        self.policy: RoundPolicy = policy or SyncPolicy()
        self.min_train_replies = min_train_replies
        self.buffer_names: frozenset[str] | None = None  # the model's buffers (statistics), set by the coordinator
        self.wait_for_nodes_s = wait_for_nodes_s
        self.straggler_fraction = straggler_fraction
        self.flower_lines = flower_lines
        self.stragglers: set[int] = set()
        self.global_arrays: ArrayRecord | None = None
        self.reports: list[RoundReport] = []
        self.evaluated: dict[int, MetricRecord] = {}  # the devices' aggregated evaluation, by round
        self.privacy: PrivacyLayer | None = None  # set by the coordinator when dp is on
        self.downlink: DownlinkLayer | None = None  # set by the coordinator for per-profile downlink codecs

    federated_evaluation = True  # runs Flower's evaluation rounds (FedBuff does not)

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
        """Flower's ``Strategy.start`` loop, able to resume at ``start_round``.

        Flower's own loop always begins at round 1 and has no way to continue a run
        from a checkpoint, so the loop (train -> federated evaluation -> central
        evaluation, per round) is restated here with the same semantics. Round 0
        (central evaluation of ``initial_arrays``) happens only on a fresh start.

        Raises
        ------
        RunFailed
            Every reply of two rounds in a row was left out for one and the same reason
            (:mod:`fedge.strategies.systematic`): the run stops instead of going on unchanged.
        """
        self._log_start(num_rounds, initial_arrays, train_config, evaluate_config)
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result, arrays, started = Result(), initial_arrays, time.time()
        result.arrays = arrays
        if evaluate_fn and start_round == 1 and (res := evaluate_fn(0, arrays)) is not None:
            result.evaluate_metrics_serverapp[0] = res
        for server_round in range(start_round, num_rounds + 1):
            self._say("[ROUND %s/%s]", server_round, num_rounds)
            new_arrays, train_metrics = self.train_round(grid, server_round, arrays, train_config, timeout)
            if self.reports and self.reports[-1].server_round == server_round:
                self._log_round(self.reports[-1], train_metrics)
            if (reason := systematic_reason(self.reports)) is not None:
                raise RunFailed(stop_message(self.reports, reason))
            if new_arrays is not None:
                result.arrays = arrays = new_arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[server_round] = train_metrics
            evaluate_messages = list(self.configure_evaluate(server_round, arrays, evaluate_config, grid))
            if evaluate_messages:
                evaluate_replies = grid.send_and_receive(evaluate_messages, timeout=timeout)
                if (metrics := self.evaluation_metrics(server_round, evaluate_replies)) is not None:
                    result.evaluate_metrics_clientapp[server_round] = self.evaluated[server_round] = metrics
            if evaluate_fn and (res := evaluate_fn(server_round, arrays)) is not None:
                result.evaluate_metrics_serverapp[server_round] = res
        self._say("Strategy execution finished in %.2fs", time.time() - started)
        self._say("Final results:\n%s", result)
        return result

    def _log_start(self, num_rounds: int, arrays: ArrayRecord, train_config: ConfigRecord | None,
                   evaluate_config: ConfigRecord | None) -> None:
        """Flower's start lines (strategy, rounds, arrays, configs, sampling), through Flower's logger."""
        if not self.flower_lines:
            return
        self._say("Starting %s strategy:", type(self).__name__)
        log_strategy_start_info(num_rounds, arrays, train_config, evaluate_config)
        self.summary()

    def _say(self, message: str, *args: Any) -> None:
        """One of Flower's round lines: through Flower's logger in a Flower app, at debug level in
        fedge's own runs (their console has fedge's round lines; Flower's crowded them out)."""
        if self.flower_lines:
            flower_log(logging.INFO, message, *args)
        else:
            log.debug(message, *args)

    def _log_round(self, report: RoundReport, train_metrics: MetricRecord | None) -> None:
        """One line per training round as Flower's, with what validation left out."""
        self._say("aggregate_train: %d of %d updates accepted (%d rejected, %d failed, %d late)%s",
                   report.accepted, report.selected, len(report.rejected), len(report.failed), report.late,
                   "" if report.aggregated else "; the global model is kept")
        if train_metrics is not None:
            self._say("\t└──> Aggregated MetricRecord: %s", train_metrics)

    def train_round(
        self, grid: Grid, server_round: int, arrays: ArrayRecord, config: ConfigRecord, timeout: float
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """One training round: select, exchange under the round policy, validate, aggregate.

        Override to change how a round talks to devices (secure aggregation does). With
        differential privacy, Flower's DP wrapper drives configure/aggregate (it clips and
        adds noise around this strategy's own steps) and the release is accounted.
        """
        driver: Strategy = self.privacy.wrapper if self.privacy else self
        messages = list(driver.configure_train(server_round, arrays, config, grid))
        if self.privacy is not None:  # Flower's DP wrappers take a list: O(replies x model) here
            exchange = self.policy.exchange(grid, messages, timeout, self.round_target)
            self.reports[-1].late = exchange.late
            self._learn(server_round, exchange.replies, grid)
            screened = self._screened(server_round, exchange.replies)
            new_arrays, metrics = driver.aggregate_train(server_round, screened)
            if screened:  # conservative: adaptive clipping released a noised count even if no model came out
                self.reports[-1].epsilon = self.privacy.release()
            return new_arrays, metrics
        stream = self.policy.stream(grid, messages, timeout, self.round_target)
        result = self.aggregate_train(server_round, self._learning(server_round, stream, grid))
        self._report_for(server_round).late += stream.late  # on top of stragglers dropped in aggregation
        return result

    def _learning(self, server_round: int, replies: Iterable[Message], grid: Grid) -> Iterator[Message]:
        """Pass each reply on as it arrives, after the selector and downlink learn from it.

        Nothing here keeps a reply: aggregation folds it in and it goes (O(model) memory).
        """
        for reply in replies:
            self._learn(server_round, [reply], grid)
            yield reply
            let_go(reply)  # aggregation asked for the next reply: this one is folded in

    def _learn(self, server_round: int, replies: list[Message], grid: Grid) -> None:
        """What selection and the downlink learn from replies (metrics, profiles; never the update)."""
        self.selector.observe(server_round, replies, durations(grid))
        if self.downlink is not None:
            self.downlink.learn(replies)

    def _screened(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The replies that pass validation (others recorded), before a DP wrapper clips them.

        Flower's wrappers skip a whole round on one error reply and clip before anything is
        validated; fedge keeps its rule: a bad reply is left out and the round goes on.
        """
        report, kept = self._report_for(server_round), []
        replies = list(replies)
        by_node = {reply.metadata.src_node_id: reply for reply in replies}
        for verdict in self.validator.screen(server_round, replies, self.global_arrays or ArrayRecord()):
            if isinstance(verdict, Failure):
                report.failed.append(verdict)
            elif isinstance(verdict, Rejection):
                report.rejected.append(verdict)
            else:
                kept.append(by_node[verdict.node_id])
        return kept

    def state_dict(self) -> dict[str, NDArray[np.generic]]:
        """Strategy state to checkpoint with the model (FedAvg has none; FedAvgM etc. do)."""
        return {}

    def load_state_dict(self, state: dict[str, NDArray[np.generic]]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def checkpoint_state(self) -> dict[str, NDArray[np.generic]]:
        """:meth:`state_dict` plus the privacy accountant's, what a checkpoint keeps."""
        return {**self.state_dict(), **(self.privacy.state_dict() if self.privacy else {})}

    def restore_state(self, state: dict[str, NDArray[np.generic]]) -> None:
        """Restore :meth:`checkpoint_state`."""
        self.load_state_dict(state)
        if self.privacy:
            self.privacy.load_state_dict(state)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Remember the arrays replies must match, select devices, build their messages."""
        self.global_arrays = arrays
        node_ids = self.select_nodes(server_round, grid)
        config[wire.SERVER_ROUND] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        self.stragglers = self._pick_stragglers(server_round, node_ids)
        messages = [Message(self._instruction(node, record, config, server_round, grid), dst_node_id=node,
                            message_type=MessageType.TRAIN) for node in node_ids]
        self.reports.append(RoundReport(server_round=server_round, selected=len(messages)))
        return messages

    def _instruction(self, node: int, record: RecordDict, config: ConfigRecord, server_round: int,
                     grid: Grid) -> RecordDict:
        """One device's train instruction: fewer epochs for a straggler, the model in its downlink codec."""
        if node in self.stragglers:
            record = self._straggler_record(record, config, server_round, node)
        if self.downlink is not None:
            record = self.downlink.record_for(node, record, grid, server_round)
        return record

    def _pick_stragglers(self, server_round: int, node_ids: list[int]) -> set[int]:
        """Simulated stragglers (FedProx, Li et al. 2020, sec. 5.2): a seeded fraction of the round."""
        if not self.straggler_fraction or not node_ids:
            return set()
        rng = random.Random(self.selector.seed * 7_919 + server_round)
        return set(rng.sample(sorted(node_ids), int(round(self.straggler_fraction * len(node_ids)))))

    def _straggler_record(self, record: RecordDict, config: ConfigRecord, server_round: int, node: int) -> RecordDict:
        """A straggler's instruction: a random 1..E-1 of the E local epochs (as the FedProx code draws)."""
        epochs = int(config.get("local-epochs", 1))  # type: ignore[arg-type]
        partial = random.Random(server_round * 1_000_003 + node).randint(1, max(epochs - 1, 1))
        return RecordDict({self.arrayrecord_key: record[self.arrayrecord_key],
                           self.configrecord_key: ConfigRecord({**config, "local-epochs": partial})})

    def devices_needed(self) -> int:
        """Devices that must be connected before a round starts."""
        if self.clients_per_round is not None:
            return self.clients_per_round
        return max(self.min_available_nodes, self.min_train_nodes)

    def round_size(self, connected: int) -> int:
        """Devices a round trains: ``clients_per_round``, or Flower's fraction rule."""
        if self.clients_per_round is not None:
            return self.clients_per_round
        return max(int(connected * self.fraction_train), self.min_train_nodes)

    def select_nodes(self, server_round: int, grid: Grid) -> list[int]:
        """Wait (up to ``wait_for_nodes_s``) for :meth:`devices_needed` devices, then select.

        With fewer devices connected by the deadline, selects all of them if there are at
        least ``min_train_replies``; otherwise none (the round fails and the model is kept).
        """
        nodes = self.wait_for_devices(server_round, grid)
        if len(nodes) < self.min_train_replies:
            log.warning("round %d: only %d devices connected (< min-train-replies %d); round skipped",
                        server_round, len(nodes), self.min_train_replies)
            return []
        self.round_target = min(self.round_size(len(nodes)), len(nodes))
        return self.selector.select(server_round, nodes, self.policy.selection_size(self.round_target))

    def wait_for_devices(self, server_round: int, grid: Grid) -> list[int]:
        """The connected devices, once :meth:`devices_needed` are, or whoever is at ``wait_for_nodes_s``.

        Devices connect after the coordinator starts (and reconnect after a restart), so a
        round waits for them; every ``wait_log_every_s`` seconds it logs how many are
        connected of how many are needed.
        """
        needed = self.devices_needed()
        deadline = time.monotonic() + (math.inf if self.wait_for_nodes_s is None else self.wait_for_nodes_s)
        next_log = time.monotonic()
        while len(nodes := list(grid.get_node_ids())) < needed:
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= next_log:  # through Flower's logger: `flwr run` and the coordinator stream show it
                flower_log(logging.INFO, "round %d: waiting for devices: %d connected of %d needed%s",
                           server_round, len(nodes), needed,
                           "" if math.isinf(deadline) else f" ({deadline - now:.0f} s left)")
                next_log = now + self.wait_log_every_s
            time.sleep(min(0.5, max(deadline - now, 0.0)))  # inf - now is inf: 0.5
        return nodes

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate each reply, then aggregate the accepted ones (streaming).

        The returned MetricRecord is ``train_metrics_aggr_fn`` (Flower's weighted mean by
        ``weighted_by_key`` unless given) over the accepted replies' metrics; what was
        accepted, rejected and failed is in :attr:`reports`, not mixed into the metrics.
        Called without :meth:`configure_train` (Flower's tests, custom loops), replies are
        checked against the array names, shapes and dtypes most of them share.
        """
        replies, reference = self._reference(replies)
        report = self._report_for(server_round)
        metric_rows: list[dict[str, float]] = []
        weights: list[float] = []
        records: list[RecordDict] = []

        def accepted() -> Iterator[AcceptedUpdate]:
            for verdict in self.validator.screen(server_round, replies, reference):
                if verdict.node_id in self.stragglers and not self.keeps_partial_work:
                    report.late += 1  # FedAvg drops stragglers
                    continue
                if isinstance(verdict, Failure):
                    report.failed.append(verdict)
                elif isinstance(verdict, Rejection):
                    report.rejected.append(verdict)
                else:
                    report.accepted += 1
                    self._count_inputs(report, verdict)
                    if self.privacy:  # DP noise is calibrated to the uniform mean
                        verdict = dataclasses.replace(verdict, weight=1.0)
                    metrics = next(iter(verdict.content.metric_records.values()))
                    records.append(RecordDict({"metrics": metrics}))
                    metric_rows.append({k: float(v) for k, v in metrics.items()  # type: ignore[arg-type]
                                        if k == wire.TRAIN_LOSS})
                    weights.append(verdict.weight)
                    yield verdict

        aggregate = self.aggregate_updates(accepted())
        if report.inputs_outside:
            log.warning("round %d: %d of %d accepted updates come from devices whose inputs fall outside the task's "
                        "declared range (their logs name the file): check those devices' data (units, scaling)",
                        server_round, report.inputs_outside, report.accepted)
        report.train_loss = weighted_mean_metrics(metric_rows, weights).get(wire.TRAIN_LOSS)
        metrics = self._train_metrics(server_round, records)
        if aggregate is not None and not all(np.all(np.isfinite(v)) for v in aggregate.values()):
            log.error("round %d: the aggregate is not finite (the update diverged); global model kept",
                      server_round)
            aggregate = None
        if aggregate is None or report.accepted < self.min_train_replies:
            log.warning("round %d: %d accepted updates (< min-train-replies %d); global model "
                        "kept as it was", server_round, report.accepted, self.min_train_replies)
            return None, metrics
        report.aggregated = True
        if self.privacy is not None:
            aggregate = self._fixed_denominator(aggregate, report.accepted)
        return ArrayRecord({k: Array(c_contiguous(v)) for k, v in aggregate.items()}), metrics

    def _reference(self, replies: Iterable[Message]) -> tuple[Iterable[Message], ArrayRecord]:
        """What replies are checked against: the arrays :meth:`configure_train` sent, or (called
        alone, as Flower's ``aggregate_train`` may be) the names, shapes and dtypes most replies share."""
        if self.global_arrays is not None:
            return replies, self.global_arrays
        if self.needs_global_model:
            raise AggregationError(f"{type(self).__name__} steps from the global model configure_train sent: "
                                   "call configure_train before aggregate_train")
        replies = list(replies)
        return replies, _shared_arrays(replies)

    @staticmethod
    def _count_inputs(report: RoundReport, update: AcceptedUpdate) -> None:
        """What the device said its inputs looked like against the task's declared range."""
        said = update.meta.inputs if update.meta is not None else None
        report.inputs_raw += said == RAW_SCALED
        report.inputs_outside += said == OUTSIDE

    def evaluation_metrics(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Flower's ``aggregate_evaluate`` on the evaluate replies; what devices sent wrongly (metric
        keys that differ between replies, a missing weight key: Flower's ``InconsistentMessageReplies``)
        costs the round its evaluation, logged, not the run."""
        try:
            return self.aggregate_evaluate(server_round, replies)
        except Exception as exc:  # the devices' evaluation metrics, not the model: the run goes on
            log.error("round %d: evaluation not aggregated (%s: %s); the run goes on", server_round,
                      type(exc).__name__, exc)
            return None

    def _train_metrics(self, server_round: int, records: list[RecordDict]) -> MetricRecord | None:
        """``train_metrics_aggr_fn`` over the accepted replies' metrics (None without any).

        A function that fails on what devices sent (list metrics of unequal lengths, a
        weight key one reply lacks) costs the round its metrics, not its model.
        """
        if not records:
            return None
        try:
            return self.train_metrics_aggr_fn(records, self.weighted_by_key)
        except Exception as exc:  # the devices' metrics, not the model: the round goes on
            log.error("round %d: train metrics not aggregated (%s: %s); the model is aggregated as usual",
                      server_round, type(exc).__name__, exc)
            return None

    def _fixed_denominator(self, mean: dict[str, NDArray[np.generic]], count: int) -> dict[str, NDArray[np.generic]]:
        """DP-FedAvg's fixed denominator: ``global + sum(delta) / K`` instead of the mean of the
        ``count`` updates that arrived, so one device changes the result by at most ``clip / K``
        whoever else dropped out, which is what the noise ``z * clip / K`` is calibrated to."""
        assert self.privacy is not None
        scale = count / self.privacy.num_sampled
        base = self.global_numpy()
        out: dict[str, NDArray[np.generic]] = {}
        for name, value in mean.items():
            start = np.asarray(base[name], np.float64)
            out[name] = (start + scale * (np.asarray(value, np.float64) - start)).astype(value.dtype)
        return out

    def aggregate_updates(
        self, updates: Iterator[AcceptedUpdate]
    ) -> dict[str, NDArray[np.generic]] | None:
        """Weighted mean of the accepted updates by ``num-examples``; ``None`` if none.

        Override this hook for another aggregation rule; consume ``updates`` lazily.
        """
        accumulator = WeightedMeanAccumulator()
        for update in updates:
            accumulator.add(update.arrays, update.weight)
            update.arrays.clear()  # folded in: let it go before the next reply is made or pulled
        return accumulator.result() if accumulator.count else None

    def statistics_of(self, arrays: Mapping[str, NDArray[np.generic]]) -> frozenset[str]:
        """Which of ``arrays`` are model statistics (BatchNorm buffers): averaged, never stepped.

        The coordinator sets :attr:`buffer_names` from its model; without it (a plain Flower
        app) torch's BatchNorm buffer names and integer arrays count.
        """
        return statistic_names(arrays, self.buffer_names)

    def global_numpy(self) -> dict[str, NDArray[np.generic]]:
        """The arrays this round's replies are measured against, as numpy."""
        if self.global_arrays is None:
            raise RuntimeError("no global arrays yet: configure_train has not run")
        return {name: array.numpy() for name, array in self.global_arrays.items()}

    def _report_for(self, server_round: int) -> RoundReport:
        if not self.reports or self.reports[-1].server_round != server_round:
            self.reports.append(RoundReport(server_round=server_round, selected=0))
        return self.reports[-1]


def _shared_arrays(replies: list[Message]) -> ArrayRecord:
    """The arrays of a reply whose names, shapes and dtypes more replies share than any other's.

    Without the global model (``aggregate_train`` called alone) one reply must not set what the
    others are checked against: the most common signature wins, and replies off it are rejected
    by validation. A tie has no answer: an empty reference, so every reply is rejected and the
    model is kept (Flower raises ``InconsistentMessageReplies`` on any disagreement).
    """
    counts: dict[tuple[tuple[str, tuple[int, ...], str], ...], list[ArrayRecord]] = {}
    for reply in replies:
        if reply.has_error() or len(reply.content.array_records) != 1:
            continue
        record = next(iter(reply.content.array_records.values()))
        signature = tuple(sorted((name, tuple(array.shape), str(array.dtype)) for name, array in record.items()))
        counts.setdefault(signature, []).append(record)
    ranked = sorted(counts.values(), key=len, reverse=True)
    if not ranked or (len(ranked) > 1 and len(ranked[0]) == len(ranked[1])):
        log.warning("aggregate_train without configure_train: the replies disagree on the model's arrays with no "
                    "majority; none is used (call configure_train first)")
        return ArrayRecord()
    log.info("aggregate_train without configure_train: replies are checked against the arrays most of them share")
    return ranked[0][0]
