"""FedAvg: the strategy every fedge strategy is, a composition of an aggregation rule and a round driver.

:class:`FedAvg` is the Flower-facing strategy (Flower's ``FedAvg`` name, arguments and
defaults) and holds what all of them share: selection, the round policy, reply
validation, privacy, the downlink codec and the round reports. What happens to accepted
updates is its rule (:mod:`fedge.strategies.rule`; here :class:`Mean`); how rounds run
is its driver (:mod:`fedge.strategies.drivers`). The other strategies are this class with
another rule (or driver) given in their constructor, nothing overridden.
"""

from __future__ import annotations

import copy
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
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
from fedge.aggregate import c_contiguous, weighted_mean_metrics
from fedge.errors import ConfigError
from fedge.preprocessing import OUTSIDE, RAW_SCALED
from fedge.strategies.drivers.base import Driver, RoundReport
from fedge.strategies.drivers.sync import SyncDriver
from fedge.strategies.flower_args import flower_constructor
from fedge.strategies.policies import RoundPolicy, SyncPolicy
from fedge.strategies.registry import names_where, register
from fedge.strategies.rule import LinearRule, RoundContext, Rule, Update
from fedge.strategies.selection import SELECTOR_STATE, RandomSelector
from fedge.strategies.submodels import SubModels
from fedge.strategies.timing import durations
from fedge.strategies.validation import AcceptedUpdate, Failure, Rejection, ReplyValidator

log = logging.getLogger("fedge.strategies")


class PrivacyLayer(Protocol):
    """What a strategy needs from differential privacy (see :mod:`fedge.server.privacy`)."""

    wrapper: Strategy
    client_side: bool
    num_sampled: int

    def attach(self, strategy: Strategy) -> None: ...

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
    ``ServerApp``: its rule (default :class:`Mean`) and its driver (default
    :class:`~fedge.strategies.drivers.sync.SyncDriver`) are given to the constructor, so
    ``FedAvg(driver=SecureAggregation())`` runs FedAvg's rounds under secure aggregation and
    ``FedAdam(driver=AsynchronousDriver())`` runs FedAdam's step asynchronously.
    Before aggregation every reply goes through a
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
    rule : Rule, optional
        What accepted updates become (default :class:`Mean`, FedAvg's weighted mean).
    driver : Driver, optional
        How rounds run (default :class:`~fedge.strategies.drivers.sync.SyncDriver`); it refuses
        a rule it cannot run (secure aggregation: a rule that is not linear).
    validator : ReplyValidator, optional
        Defaults to ``ReplyValidator(require_round_tag=False)`` (standard Flower replies pass).
    selector, policy
        Which devices train (default: seeded random) and which replies a round keeps (default: all).
    privacy : PrivacyLayer, optional
        Differential privacy (:mod:`fedge.server.privacy`); attached to this strategy here.
    downlink : DownlinkLayer, optional
        Per-device downlink codecs (:mod:`fedge.server.compression`).
    buffer_names : frozenset, optional
        The model's statistics (BatchNorm buffers): averaged, never stepped.
    submodels : SubModels, optional
        Width-scaled sub-models (HeteroFL, FedRolex; :mod:`fedge.strategies.submodels`): each
        device is sent, and replies with, the window of the model its profile can hold, and
        each entry is averaged over the devices that held it. Only rules that take them
        (``Rule.takes_sub_models``: the FedAvg family's linear rules).
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
    wait_log_every_s = 10.0

    def __init__(
        self,
        *,
        rule: Rule | None = None,
        driver: Driver | None = None,
        privacy: PrivacyLayer | None = None,
        downlink: DownlinkLayer | None = None,
        buffer_names: frozenset[str] | None = None,
        submodels: SubModels | None = None,
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
        self.node_word = "devices"  # what its nodes are, in its lines: "gateways" under gateways = true
        self.clients_per_round = clients_per_round
        self.round_target = clients_per_round or self.min_train_nodes  # devices the current round wants
        self.validator = validator or ReplyValidator(require_round_tag=False)
        if self.validator.weight_key != self.weighted_by_key:  # Flower's weighted_by_key: what a reply's weight is
            self.validator = copy.copy(self.validator)  # a validator the caller shares stays as it was
            self.validator.weight_key = self.weighted_by_key
        self.selector = selector or RandomSelector()
        self.policy: RoundPolicy = policy or SyncPolicy()
        self.min_train_replies = min_train_replies
        self.buffer_names = buffer_names  # the model's buffers (statistics)
        self.wait_for_nodes_s = wait_for_nodes_s
        self.straggler_fraction = straggler_fraction
        self.flower_lines = flower_lines
        self.stragglers: set[int] = set()
        self.global_arrays: ArrayRecord | None = None
        self.reports: list[RoundReport] = []
        self.evaluated: dict[int, MetricRecord] = {}  # the devices' aggregated evaluation, by round
        self.rule: Rule = rule or Mean()
        self.driver: Driver = driver or SyncDriver()
        self.downlink = downlink
        self.privacy = privacy
        self.submodels = submodels
        if submodels is not None and not self.rule.takes_sub_models:
            raise ConfigError(f"{type(self).__name__}'s rule {type(self.rule).__name__} needs every update whole "
                              "(order statistics, distances or whole-model normalisation are not per-entry means); "
                              f"sub-models run with {names_where(lambda rule: rule.takes_sub_models)}")
        if privacy is not None:
            privacy.attach(self)
        self.driver.bind(self)

    @property
    def federated_evaluation(self) -> bool:
        """Whether the driver runs Flower's federated evaluation rounds."""
        return self.driver.federated_evaluation

    @property
    def needs_global_model(self) -> bool:
        """Whether the rule steps from the global model ``configure_train`` sent."""
        return self.rule.needs_global_model

    current_arrays_as_numpy: bool = False  # Flower's FedOpt family keeps a dict of numpy arrays, others an ArrayRecord

    @property
    def current_arrays(self) -> ArrayRecord | dict[str, NDArray[Any]] | None:
        """Flower's name for the global model: the arrays the next ``aggregate_train`` checks replies
        against and steps from (:attr:`global_arrays`; ``configure_train`` sets it each round).

        Set it, as Flower's own tests do, to call ``aggregate_train`` without ``configure_train``;
        an ``ArrayRecord`` or a mapping of names to numpy arrays. It reads back as Flower's class
        keeps it: a ``dict`` of numpy arrays (a copy) for FedAdam, FedYogi and FedAdagrad, the
        ``ArrayRecord`` otherwise.
        """
        if self.global_arrays is None or not self.current_arrays_as_numpy:
            return self.global_arrays
        return {name: array.numpy() for name, array in self.global_arrays.items()}

    @current_arrays.setter
    def current_arrays(self, arrays: ArrayRecord | Mapping[str, Any] | None) -> None:
        if arrays is None or isinstance(arrays, ArrayRecord):
            self.global_arrays = arrays
        elif isinstance(arrays, Mapping):
            self.global_arrays = ArrayRecord({name: value if isinstance(value, Array) else
                                              Array(c_contiguous(np.asarray(value)))
                                              for name, value in arrays.items()})
        else:
            raise TypeError(f"current_arrays takes an ArrayRecord or a dict of numpy arrays by name, got "
                            f"{type(arrays).__name__}")

    @property
    def weighted_by_key(self) -> str:
        """Flower's ``weighted_by_key``: the train metric a reply's weight is read from (set after
        construction too: the validator reads the new key)."""
        return self._weighted_by_key

    @weighted_by_key.setter
    def weighted_by_key(self, key: str) -> None:
        self._weighted_by_key = key
        validator: ReplyValidator | None = self.__dict__.get("validator")  # None while Flower's __init__ runs
        if validator is not None and validator.weight_key != key:
            self.validator = copy.copy(validator)  # a validator the caller shares stays as it was
            self.validator.weight_key = key

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
        """Flower's ``Strategy.start``, run by the driver, able to resume at ``start_round``."""
        self.log_start(num_rounds, initial_arrays, train_config, evaluate_config)
        return self.driver.start(self, grid, initial_arrays, num_rounds, timeout,
                                 ConfigRecord() if train_config is None else train_config,
                                 ConfigRecord() if evaluate_config is None else evaluate_config,
                                 evaluate_fn, start_round)

    def train_round(
        self, grid: Grid, server_round: int, arrays: ArrayRecord, config: ConfigRecord, timeout: float
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """One training round, as the driver runs it (synchronous drivers only)."""
        return self.driver.train_round(self, grid, server_round, arrays, config, timeout)  # type: ignore[attr-defined]

    def log_start(self, num_rounds: int, arrays: ArrayRecord, train_config: ConfigRecord | None,
                  evaluate_config: ConfigRecord | None) -> None:
        """Flower's start lines (strategy, rounds, arrays, configs, sampling), through Flower's logger."""
        if not self.flower_lines:
            return
        self.say("Starting %s strategy:", type(self).__name__)
        log_strategy_start_info(num_rounds, arrays, train_config, evaluate_config)
        self.summary()

    def say(self, message: str, *args: Any) -> None:
        """One of Flower's round lines: through Flower's logger in a Flower app, at debug level in
        fedge's own runs (their console has fedge's round lines; Flower's crowded them out)."""
        if self.flower_lines:
            flower_log(logging.INFO, message, *args)
        else:
            log.debug(message, *args)

    def log_round(self, report: RoundReport, train_metrics: MetricRecord | None) -> None:
        """One line per training round as Flower's, with what validation left out."""
        self.say("aggregate_train: %d of %d updates accepted (%d rejected, %d failed, %d late)%s",
                 report.accepted, report.selected, len(report.rejected), len(report.failed), report.late,
                 "" if report.aggregated else "; the global model is kept")
        if train_metrics is not None:
            self.say("\t└──> Aggregated MetricRecord: %s", train_metrics)

    def learn(self, server_round: int, replies: list[Message], grid: Grid) -> None:
        """What selection and the downlink learn from replies (metrics, profiles; never the update)."""
        self.selector.observe(server_round, replies, durations(grid))
        if self.downlink is not None:
            self.downlink.learn(replies)
        if self.submodels is not None:
            self.submodels.learn(replies)

    def state_dict(self) -> dict[str, NDArray[np.generic]]:
        """The rule's state, checkpointed with the model (FedAvg's has none; FedAvgM's velocity, ...)."""
        return self.rule.state_dict()

    def load_state_dict(self, state: dict[str, NDArray[np.generic]]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.rule.load_state_dict(state)

    def checkpoint_state(self) -> dict[str, NDArray[np.generic]]:
        """:meth:`state_dict` plus the privacy accountant's and the selector's, what a checkpoint keeps."""
        return {**self.state_dict(), **(self.privacy.state_dict() if self.privacy else {}),
                **self.selector.state_dict()}

    def restore_state(self, state: dict[str, NDArray[np.generic]]) -> None:
        """Restore :meth:`checkpoint_state`, refusing state neither the rule nor DP keeps (named)."""
        privacy_keys = set(self.privacy.state_dict()) if self.privacy else set()
        rule_state = {key: value for key, value in state.items()
                      if key not in privacy_keys and not key.startswith(SELECTOR_STATE)}
        self.rule.check_state(rule_state)
        self.load_state_dict(rule_state)
        if self.privacy:
            self.privacy.load_state_dict(state)
        self.selector.load_state_dict({key: value for key, value in state.items() if key.startswith(SELECTOR_STATE)})

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
        """One device's train instruction: fewer epochs for a straggler, its sub-model, the model in its
        downlink codec."""
        if node in self.stragglers:
            record = self._straggler_record(record, config, server_round, node)
        if self.submodels is not None:
            record = self.submodels.record_for(node, record, grid, server_round)
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

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Flower's evaluate instructions; under sub-models each device evaluates the window it can hold."""
        messages = super().configure_evaluate(server_round, arrays, config, grid)
        if self.submodels is None:
            return messages
        submodels = self.submodels
        submodels.begin_round(server_round)
        return [Message(submodels.record_for(message.metadata.dst_node_id, message.content, grid, server_round,
                                             train=False),
                        dst_node_id=message.metadata.dst_node_id, message_type=message.metadata.message_type)
                for message in messages if submodels.width_of(message.metadata.dst_node_id, grid) is not None]

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
        if self.submodels is not None:  # `exclude`: devices too small for the model sit out
            nodes = self.submodels.eligible(nodes, grid)
        if len(nodes) < self.min_train_replies:
            log.warning("round %d: only %d %s connected (< min-train-replies %d); round skipped%s",
                        server_round, len(nodes), self.node_word, self.min_train_replies, self._replies_hint())
            return []
        self.round_target = min(self.round_size(len(nodes)), len(nodes))
        return self.selector.select(server_round, nodes, self.policy.selection_size(self.round_target))

    def _replies_hint(self) -> str:
        """Under gateways, how a run with fewer gateways than ``min-train-replies`` changes the model."""
        if self.node_word != "gateways":
            return ""
        return (f" (each gateway is one reply a round, for all its devices: with fewer than {self.min_train_replies} "
                "gateways, lower min-train-replies, e.g. --run-config 'min-train-replies=1' for one gateway)")

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
                flower_log(logging.INFO, "round %d: waiting for %s: %d connected of %d needed%s",
                           server_round, self.node_word, len(nodes), needed,
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
        checked against :attr:`current_arrays` when the caller set it (and a server step starts
        from it), otherwise against the array names, shapes and dtypes most of them share.
        """
        replies, reference = self._reference(replies)
        report = self.report_for(server_round)
        metric_rows: list[dict[str, float]] = []
        weights: list[float] = []
        records: list[RecordDict] = []

        def accepted() -> Iterator[Update]:
            reference_of = self.submodels.reference_of if self.submodels is not None else None
            for verdict in self.validator.screen(server_round, replies, reference, reference_of):
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
                    self._count_bounds(report, verdict)
                    update = _update_of(verdict, uniform=self.privacy is not None)  # DP: the uniform mean
                    if self.submodels is not None:
                        update.window = self.submodels.windows.get(verdict.node_id)
                    records.append(RecordDict({"metrics": next(iter(verdict.content.metric_records.values()))}))
                    metric_rows.append({k: float(v) for k, v in update.metrics.items() if k == wire.TRAIN_LOSS})
                    weights.append(update.weight)
                    yield update

        aggregate = self.aggregate(accepted())
        if report.clipped_gateways or report.clipped_devices or report.capped_devices:
            log.warning("round %d: bounds applied: %d gateway update(s) clipped to max-update-norm here; gateways "
                        "clipped %d device update(s) and capped %d device weight(s) at max-device-examples",
                        server_round, report.clipped_gateways, report.clipped_devices, report.capped_devices)
        if report.secagg_clipped_entries or report.secagg_capped_weights:
            log.warning("round %d: the gateways' secure pools clipped %d update entries on %d device(s) (above "
                        "secagg-clip, or the ring's range at secagg-bits) and capped %d device weight(s) at "
                        "max-device-examples: raise secagg-clip (or secagg-bits) if entries are clipped every round",
                        server_round, report.secagg_clipped_entries, report.secagg_clipped_devices,
                        report.secagg_capped_weights)
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
            log.warning("round %d: %d accepted updates from %s (< min-train-replies %d); global model "
                        "kept as it was%s", server_round, report.accepted, self.node_word, self.min_train_replies,
                        self._replies_hint())
            return None, metrics
        report.aggregated = True
        if self.privacy is not None:
            aggregate = self._fixed_denominator(aggregate, report.accepted)
        return ArrayRecord({k: Array(c_contiguous(v)) for k, v in aggregate.items()}), metrics

    def aggregate(self, updates: Iterable[Update]) -> dict[str, NDArray[np.generic]] | None:
        """Fold ``updates`` into the rule, one at a time as they come; its result (None without any)."""
        self.rule.begin(self.round_context())
        for update in updates:
            self.rule.fold(update)
        return self.rule.result()

    def round_context(self) -> RoundContext:
        """What the rule knows of this round: the model it started from (read only if the rule
        asks) and the model's statistics."""
        sent = self.global_arrays
        if sent is None:
            return RoundContext(None, self.buffer_names)
        return RoundContext(lambda: {name: array.numpy() for name, array in sent.items()}, self.buffer_names)

    def _reference(self, replies: Iterable[Message]) -> tuple[Iterable[Message], ArrayRecord]:
        """What replies are checked against: the arrays :meth:`configure_train` sent, or (called
        alone, as Flower's ``aggregate_train`` may be) the names, shapes and dtypes most replies share."""
        if self.global_arrays is not None:
            return replies, self.global_arrays
        if self.needs_global_model:
            raise AggregationError(f"{type(self).__name__} steps from the global model configure_train sent: "
                                   "call configure_train before aggregate_train (or set current_arrays, Flower's "
                                   "name for the global model)")
        replies = list(replies)
        return replies, _shared_arrays(replies)

    @staticmethod
    def _count_bounds(report: RoundReport, update: AcceptedUpdate) -> None:
        """What the device tier's bounds did to this update (its gateway's counts, and the coordinator's clip)."""
        report.clipped_gateways += update.clipped
        for key, count in update.pool_clipping.items():  # a gateway's secure pool: its devices' encodings' clips
            name = key.replace("-", "_")
            setattr(report, name, getattr(report, name) + count)
        if update.meta is not None:
            report.clipped_devices += update.meta.clipped
            report.capped_devices += update.meta.capped

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

    def global_numpy(self) -> dict[str, NDArray[np.generic]]:
        """The arrays this round's replies are measured against, as numpy."""
        if self.global_arrays is None:
            raise RuntimeError("no global arrays yet: configure_train has not run")
        return {name: array.numpy() for name, array in self.global_arrays.items()}

    def report_for(self, server_round: int) -> RoundReport:
        """The report of ``server_round`` (a new one if it has none yet)."""
        if not self.reports or self.reports[-1].server_round != server_round:
            self.reports.append(RoundReport(server_round=server_round, selected=0))
        return self.reports[-1]


class Mean(LinearRule):
    """FedAvg's rule: the weighted mean of the updates (McMahan et al., AISTATS 2017), streaming."""


def _update_of(accepted: AcceptedUpdate, *, uniform: bool) -> Update:
    """An accepted reply as the rule sees it: numpy arrays, a weight (1 when ``uniform``), local steps, metrics."""
    meta = accepted.meta
    metrics = next(iter(accepted.content.metric_records.values()))
    return Update(accepted.node_id, accepted.arrays, 1.0 if uniform else accepted.weight,
                  steps=meta.steps if meta is not None else None, metrics=dict(metrics))


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
