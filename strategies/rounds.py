"""The round services every driver runs over: select devices, instruct them, screen replies into the round's report.

A driver (:mod:`fedge.strategies.drivers`) runs rounds over a :class:`Rounds`, never over a
whole strategy: :class:`Rounds` holds the collaborators a round needs (the rule, selector,
round policy, reply validator, privacy, downlink codec, sub-models) and the run's explicit
server state (:class:`RoundState`, after fedjax's ``ServerState``), and offers the few steps
a driver takes. :class:`fedge.strategies.FedAvg` is the thin adapter from Flower's
``Strategy`` API onto it; a gateway's secure pool builds a :class:`Rounds` alone
(:class:`FixedSampling` stands in for Flower's sampling settings).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log as flower_log
from numpy.typing import NDArray

from fedge import wire
from fedge.distributed_noise import DistributedNoise
from fedge.errors import ConfigError
from fedge.strategies.drivers.base import RoundReport
from fedge.strategies.norm_bound import NORM_BOUND_STATE, NormBounds
from fedge.strategies.policies import RoundPolicy, SyncPolicy
from fedge.strategies.registry import names_where
from fedge.strategies.rule import RoundContext, Rule, Update
from fedge.strategies.selection import SELECTOR_STATE, RandomSelector
from fedge.strategies.submodels import SubModels
from fedge.strategies.timing import durations
from fedge.strategies.validation import ReplyValidator

log = logging.getLogger("fedge.strategies")

# What a round's lines call its nodes when they are gateways (gateways = true): a noun, not the run-config key
GATEWAY_NODES = "gateways"


class Sampling(Protocol):
    """Flower's sampling settings and record keys (a Flower ``FedAvg``'s attributes)."""

    fraction_train: float
    min_train_nodes: int
    min_available_nodes: int
    fraction_evaluate: float
    min_evaluate_nodes: int
    arrayrecord_key: str
    configrecord_key: str


@dataclass
class FixedSampling:
    """:class:`Sampling` without a Flower strategy (Flower's defaults)."""

    fraction_train: float = 1.0
    min_train_nodes: int = 2
    min_available_nodes: int = 2
    fraction_evaluate: float = 1.0
    min_evaluate_nodes: int = 2
    arrayrecord_key: str = wire.ARRAYS
    configrecord_key: str = wire.CONFIG


class FlowerSide(Protocol):
    """The Flower strategy whose rounds these are: its own steps count (FedProx's ``configure_train``,
    Flower's DP wrapper around it, a user's override)."""

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]: ...

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]: ...

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]: ...

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None: ...


class PrivacyLayer(Protocol):
    """What rounds need from differential privacy (see :mod:`fedge.server.privacy`)."""

    wrapper: Any  # Flower's DP strategy wrapped around the Flower side
    client_side: bool
    num_sampled: int

    def attach(self, strategy: Any) -> None: ...

    def release(self) -> float: ...

    def state_dict(self) -> dict[str, NDArray[np.generic]]: ...

    def load_state_dict(self, state: dict[str, NDArray[np.generic]]) -> None: ...


@runtime_checkable
class NoiseLayer(Protocol):
    """What the secure driver needs from distributed DP (see :class:`fedge.server.privacy.DistributedPrivacy`)."""

    clipping_norm: float

    def noise(self, *, scale: float, dimension: int, min_survivors: int, bits: int) -> DistributedNoise: ...

    def release_sum(self, noise: DistributedNoise, *, survivors: int, dimension: int) -> float: ...

    def release_pools(self) -> float: ...


class DownlinkLayer(Protocol):
    """What rounds need to compress the downlink (see :mod:`fedge.server.compression`)."""

    def record_for(self, node: int, record: RecordDict, grid: Grid, server_round: int) -> RecordDict: ...

    def learn(self, replies: list[Message]) -> None: ...


@dataclass
class RoundState:
    """What changes from round to round (the server state a driver reads and writes)."""

    round_target: int  # devices the current round wants
    global_arrays: ArrayRecord | None = None  # what this round's replies are checked against
    stragglers: set[int] = field(default_factory=set)  # this round's simulated stragglers
    reports: list[RoundReport] = field(default_factory=list)  # one per training round
    evaluated: dict[int, MetricRecord] = field(default_factory=dict)  # the devices' aggregated evaluation


@dataclass
class Rounds:
    """The round services a driver runs over, and the run's :class:`RoundState`.

    ``name`` is the strategy's, in messages; ``keeps_partial_work``: stragglers' replies are
    aggregated (FedProx) rather than dropped (FedAvg). The other fields are FedAvg's
    arguments of the same names (see :class:`fedge.strategies.FedAvg`).
    """

    name: str
    rule: Rule
    sampling: Sampling = field(default_factory=FixedSampling)
    flower: FlowerSide | None = None
    selector: RandomSelector = field(default_factory=RandomSelector)
    policy: RoundPolicy = field(default_factory=SyncPolicy)
    validator: ReplyValidator = field(default_factory=lambda: ReplyValidator(require_round_tag=False))
    privacy: PrivacyLayer | None = None  # central DP (Flower's wrappers), or distributed DP (a NoiseLayer)
    downlink: DownlinkLayer | None = None
    submodels: SubModels | None = None
    norm_bounds: NormBounds | None = None  # gateways = true: the device tier's norm bounds, moved round by round
    buffer_names: frozenset[str] | None = None
    clients_per_round: int | None = None
    min_train_replies: int = 1
    wait_for_nodes_s: float | None = None
    straggler_fraction: float = 0.0
    keeps_partial_work: bool = False
    flower_lines: bool = True
    node_word: str = "devices"  # what its nodes are, in its lines: "gateways" under gateways = true
    wait_log_every_s: float = 10.0
    state: RoundState = field(init=False)

    def __post_init__(self) -> None:
        if self.clients_per_round is not None and self.clients_per_round < 1:
            raise ConfigError(f"clients_per_round must be >= 1, got {self.clients_per_round}")
        if self.submodels is not None and not self.rule.takes_sub_models:
            raise ConfigError(f"{self.name}'s rule {type(self.rule).__name__} needs every update whole "
                              "(order statistics, distances or whole-model normalisation are not per-entry means); "
                              f"sub-models run with {names_where(lambda rule: rule.takes_sub_models)}")
        self.state = RoundState(round_target=self.clients_per_round or self.sampling.min_train_nodes)

    # ---- lines
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

    @property
    def central_privacy(self) -> PrivacyLayer | None:
        """Central DP (the coordinator clips or adds the noise), or ``None``: off, or distributed."""
        return None if isinstance(self.privacy, NoiseLayer) else self.privacy

    @property
    def noise_layer(self) -> NoiseLayer | None:
        """Distributed DP (the devices add the noise inside secure aggregation), or ``None``."""
        return self.privacy if isinstance(self.privacy, NoiseLayer) else None

    def replies_hint(self) -> str:
        """Under gateways, how a run with fewer gateways than ``min-train-replies`` changes the model."""
        if self.node_word != GATEWAY_NODES:
            return ""
        return (f" (each gateway is one reply a round, for all its devices: with fewer than {self.min_train_replies} "
                "gateways, lower min-train-replies, e.g. --run-config 'min-train-replies=1' for one gateway)")

    # ---- selection
    def devices_needed(self) -> int:
        """Devices that must be connected before a round starts."""
        if self.clients_per_round is not None:
            return self.clients_per_round
        return max(self.sampling.min_available_nodes, self.sampling.min_train_nodes)

    def round_size(self, connected: int) -> int:
        """Devices a round trains: ``clients_per_round``, or Flower's fraction rule."""
        if self.clients_per_round is not None:
            return self.clients_per_round
        return max(int(connected * self.sampling.fraction_train), self.sampling.min_train_nodes)

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
                        server_round, len(nodes), self.node_word, self.min_train_replies, self.replies_hint())
            return []
        self.state.round_target = min(self.round_size(len(nodes)), len(nodes))
        return self.selector.select(server_round, nodes, self.policy.selection_size(self.state.round_target))

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

    # ---- instructions
    def train_messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                       grid: Grid) -> list[Message]:
        """This round's train instructions, through the Flower side's ``configure_train`` when there is one
        (its additions count), else :meth:`configure_train`."""
        make = self.flower.configure_train if self.flower is not None else self.configure_train
        return list(make(server_round, arrays, config, grid))

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> list[Message]:
        """Remember the arrays replies must match, select devices, build their messages, open the round's report."""
        self.state.global_arrays = arrays
        node_ids = self.select_nodes(server_round, grid)
        config[wire.SERVER_ROUND] = server_round
        bounds = self._norm_bounds(config)
        record = RecordDict({self.sampling.arrayrecord_key: arrays, self.sampling.configrecord_key: config})
        self.state.stragglers = self.pick_stragglers(server_round, node_ids)
        messages = [Message(self.instruction(node, record, config, server_round, grid), dst_node_id=node,
                            message_type=MessageType.TRAIN) for node in node_ids]
        self.state.reports.append(RoundReport(server_round=server_round, selected=len(messages), norm_bounds=bounds))
        return messages

    def _norm_bounds(self, config: ConfigRecord) -> tuple[float, float] | None:
        """This round's device-tier norm bounds, moved by the last round's norms: the devices' goes to the gateways
        in ``config``, the gateways' to the validator; None without them (no gateways)."""
        if self.norm_bounds is None:
            return None
        if self.state.reports:
            self.norm_bounds.observe(self.state.reports[-1])
        config[wire.DEVICE_NORM_BOUND] = self.norm_bounds.device
        self.validator.gateway_norm_bound = self.norm_bounds.gateway
        return self.norm_bounds.device, self.norm_bounds.gateway

    def instruction(self, node: int, record: RecordDict, config: ConfigRecord, server_round: int,
                    grid: Grid) -> RecordDict:
        """One device's train instruction: fewer epochs for a straggler, its sub-model, the model in its
        downlink codec."""
        if node in self.state.stragglers:
            record = self._straggler_record(record, config, server_round, node)
        if self.submodels is not None:
            record = self.submodels.record_for(node, record, grid, server_round)
        if self.downlink is not None:
            record = self.downlink.record_for(node, record, grid, server_round)
        return record

    def pick_stragglers(self, server_round: int, node_ids: list[int]) -> set[int]:
        """Simulated stragglers (FedProx, Li et al. 2020, sec. 5.2): a seeded fraction of the round."""
        if not self.straggler_fraction or not node_ids:
            return set()
        rng = random.Random(self.selector.seed * 7_919 + server_round)
        return set(rng.sample(sorted(node_ids), int(round(self.straggler_fraction * len(node_ids)))))

    def _straggler_record(self, record: RecordDict, config: ConfigRecord, server_round: int, node: int) -> RecordDict:
        """A straggler's instruction: a random 1..E-1 of the E local epochs (as the FedProx code draws).

        Raises
        ------
        ConfigError
            The train config is no fedge train instruction (it names the missing key): a straggler needs
            the epochs it would have trained.
        """
        instruction = wire.TrainInstruction.read(config)
        partial = random.Random(server_round * 1_000_003 + node).randint(1, max(instruction.local_epochs - 1, 1))
        keys = self.sampling
        return RecordDict({keys.arrayrecord_key: record[keys.arrayrecord_key],
                           keys.configrecord_key: instruction.with_epochs(partial).written_over(config)})

    def drops(self, node: int) -> bool:
        """Whether ``node``'s reply is left out as a straggler's (FedAvg drops them; FedProx keeps them)."""
        return node in self.state.stragglers and not self.keeps_partial_work

    # ---- replies
    def learn(self, server_round: int, replies: list[Message], grid: Grid) -> None:
        """What selection and the downlink learn from replies (metrics, profiles; never the update)."""
        self.selector.observe(server_round, replies, durations(grid))
        if self.downlink is not None:
            self.downlink.learn(replies)
        if self.submodels is not None:
            self.submodels.learn(replies)

    def report_for(self, server_round: int) -> RoundReport:
        """The report of ``server_round`` (a new one if it has none yet)."""
        reports = self.state.reports
        if not reports or reports[-1].server_round != server_round:
            reports.append(RoundReport(server_round=server_round, selected=0))
        return reports[-1]

    def round_context(self) -> RoundContext:
        """What the rule knows of this round: the model it started from (read only if the rule
        asks) and the model's statistics."""
        sent = self.state.global_arrays
        if sent is None:
            return RoundContext(None, self.buffer_names)
        return RoundContext(lambda: {name: array.numpy() for name, array in sent.items()}, self.buffer_names)

    def fold(self, updates: Iterable[Update]) -> dict[str, NDArray[np.generic]] | None:
        """Fold ``updates`` into the rule, one at a time as they come; its result (None without any)."""
        self.rule.begin(self.round_context())
        for update in updates:
            self.rule.fold(update)
        return self.rule.result()

    def global_numpy(self) -> dict[str, NDArray[np.generic]]:
        """The arrays this round's replies are measured against, as numpy."""
        if self.state.global_arrays is None:
            raise RuntimeError("no global arrays yet: configure_train has not run")
        return {name: array.numpy() for name, array in self.state.global_arrays.items()}

    def evaluation_metrics(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The Flower side's ``aggregate_evaluate`` on the evaluate replies; what devices sent wrongly (metric
        keys that differ between replies, a missing weight key: Flower's ``InconsistentMessageReplies``)
        costs the round its evaluation, logged, not the run."""
        if self.flower is None:
            return None
        try:
            return self.flower.aggregate_evaluate(server_round, replies)
        except Exception as exc:  # the devices' evaluation metrics, not the model: the run goes on
            log.error("round %d: evaluation not aggregated (%s: %s); the run goes on", server_round,
                      type(exc).__name__, exc)
            return None

    # ---- checkpoints
    def checkpoint_state(self) -> dict[str, NDArray[np.generic]]:
        """What a checkpoint keeps beside the model: the rule's state, the privacy accountant's, the selector's,
        the device tier's norm bounds (moved by the round just ended: what the next round uses)."""
        bounds = {}
        if self.norm_bounds is not None:
            if self.state.reports:
                self.norm_bounds.observe(self.state.reports[-1])
            bounds = self.norm_bounds.state_dict()
        return {**self.rule.state_dict(), **(self.privacy.state_dict() if self.privacy else {}),
                **self.selector.state_dict(), **bounds}

    def restore_state(self, state: dict[str, NDArray[np.generic]]) -> None:
        """Restore :meth:`checkpoint_state`, refusing state neither the rule nor DP keeps (named)."""
        privacy_keys = set(self.privacy.state_dict()) if self.privacy else set()
        rule_state = {key: value for key, value in state.items() if key not in privacy_keys
                      and not key.startswith(SELECTOR_STATE) and not key.startswith(NORM_BOUND_STATE)}
        self.rule.check_state(rule_state)
        self.rule.load_state_dict(rule_state)
        if self.privacy:
            self.privacy.load_state_dict(state)
        self.selector.load_state_dict({key: value for key, value in state.items() if key.startswith(SELECTOR_STATE)})
        if self.norm_bounds is not None:
            self.norm_bounds.load_state_dict(state)


T = TypeVar("T")


class Forwarded(Generic[T]):
    """An attribute of a strategy's :class:`Rounds` (``"state."``: of their :class:`RoundState`), read and set
    through the strategy under the same name (Flower's and fedge's users read ``strategy.reports``, ...)."""

    def __init__(self, *, state: bool = False) -> None:
        self.state = state
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def _holder(self, strategy: Any) -> Any:
        rounds = strategy.rounds
        return rounds.state if self.state else rounds

    def __get__(self, strategy: Any, owner: type | None = None) -> T:
        if strategy is None:
            return self  # type: ignore[return-value]  # the class attribute: the descriptor itself
        return getattr(self._holder(strategy), self.name)  # type: ignore[no-any-return]

    def __set__(self, strategy: Any, value: T) -> None:
        setattr(self._holder(strategy), self.name, value)
