"""FedAvg: the strategy every fedge strategy is, Flower's ``Strategy`` API over a rule, a driver and its rounds.

:class:`FedAvg` is the Flower-facing adapter (Flower's ``FedAvg`` name, arguments and
defaults). What happens to accepted updates is its rule (:mod:`fedge.strategies.rule`; here
:class:`~fedge.strategies.rule.Mean`); how rounds run is its driver
(:mod:`fedge.strategies.drivers`); what a round needs (selection, instructions, screening
into the round's report, the run's state) is its :class:`~fedge.strategies.rounds.Rounds`,
which drivers run over. The other strategies are this class with another rule (or driver).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info
from numpy.typing import NDArray

from fedge.strategies.drivers.base import Driver, RoundReport
from fedge.strategies.drivers.sync import SyncDriver
from fedge.strategies.flower_args import CurrentArrays, WeightedByKey, flower_constructor, weighing
from fedge.strategies.policies import RoundPolicy, SyncPolicy
from fedge.strategies.registry import register
from fedge.strategies.rounds import DownlinkLayer, Forwarded, PrivacyLayer, Rounds
from fedge.strategies.rule import Mean, Rule
from fedge.strategies.screening import aggregate_replies
from fedge.strategies.selection import RandomSelector
from fedge.strategies.submodels import SubModels
from fedge.strategies.validation import ReplyValidator

__all__ = ["DownlinkLayer", "FedAvg", "Mean", "PrivacyLayer"]

log = logging.getLogger("fedge.strategies")


@register("fedavg", dp=True)
@flower_constructor(FlowerFedAvg)
class FedAvg(FlowerFedAvg):
    """Federated Averaging (McMahan et al., AISTATS 2017) that never trusts a reply.

    A subclass of Flower's message-based ``FedAvg``, usable in any Flower ``ServerApp`` and a
    drop-in for it: Flower's arguments (``fraction_train``, ``min_train_nodes``, ...) keep
    Flower's meaning and defaults, and a standard Flower ClientApp's replies are accepted.
    Every reply goes through a :class:`~fedge.strategies.validation.ReplyValidator`; rejected
    replies are logged, counted in the round's report and left out; accepted updates are
    folded into the rule one at a time (O(model) memory). With fewer than
    ``min_train_replies`` accepted, the global model stays as it was.

    Parameters
    ----------
    rule : Rule, optional
        What accepted updates become (default :class:`~fedge.strategies.rule.Mean`).
    driver : Driver, optional
        How rounds run (default :class:`~fedge.strategies.drivers.sync.SyncDriver`); it refuses
        a rule it cannot run (secure aggregation: a rule that is not linear).
    clients_per_round : int, optional
        A fixed number of devices a round; without it Flower's ``fraction_train`` rule.
    validator, selector, policy
        Reply checks (default: standard Flower replies pass), which devices train (seeded
        random), which replies a round keeps (all).
    privacy, downlink
        Differential privacy (:mod:`fedge.server.privacy`, attached here) and per-device downlink
        codecs (:mod:`fedge.server.compression`).
    buffer_names : frozenset, optional
        The model's statistics (BatchNorm buffers): averaged, never stepped.
    submodels : SubModels, optional
        Width-scaled sub-models (HeteroFL, FedRolex; :mod:`fedge.strategies.submodels`), for
        rules that take them (``Rule.takes_sub_models``).
    min_train_replies, wait_for_nodes_s, straggler_fraction, flower_lines
        Accepted updates needed to change the model; how long a round waits for devices (None,
        as Flower: until they come); simulated stragglers (FedProx §5.2); Flower's log lines.
    **kwargs
        Passed to Flower's ``FedAvg``.
    """

    keeps_partial_work = False  # FedAvg drops stragglers' replies; FedProx keeps them
    current_arrays_as_numpy: bool = False  # Flower's FedOpt family keeps a dict of numpy arrays
    current_arrays = CurrentArrays()
    weighted_by_key = WeightedByKey()

    rule: Forwarded[Rule] = Forwarded()
    selector: Forwarded[RandomSelector] = Forwarded()
    policy: Forwarded[RoundPolicy] = Forwarded()
    validator: Forwarded[ReplyValidator] = Forwarded()
    privacy: Forwarded[PrivacyLayer | None] = Forwarded()
    downlink: Forwarded[DownlinkLayer | None] = Forwarded()
    submodels: Forwarded[SubModels | None] = Forwarded()
    buffer_names: Forwarded[frozenset[str] | None] = Forwarded()
    clients_per_round: Forwarded[int | None] = Forwarded()
    min_train_replies: Forwarded[int] = Forwarded()
    wait_for_nodes_s: Forwarded[float | None] = Forwarded()
    wait_log_every_s: Forwarded[float] = Forwarded()
    node_word: Forwarded[str] = Forwarded()
    global_arrays: Forwarded[ArrayRecord | None] = Forwarded(state=True)
    reports: Forwarded[list[RoundReport]] = Forwarded(state=True)
    evaluated: Forwarded[dict[int, MetricRecord]] = Forwarded(state=True)
    stragglers: Forwarded[set[int]] = Forwarded(state=True)

    def __init__(self, *, rule: Rule | None = None, driver: Driver | None = None, privacy: PrivacyLayer | None = None,
                 downlink: DownlinkLayer | None = None, buffer_names: frozenset[str] | None = None,
                 submodels: SubModels | None = None, clients_per_round: int | None = None,
                 validator: ReplyValidator | None = None, selector: RandomSelector | None = None,
                 policy: RoundPolicy | None = None, min_train_replies: int = 1, wait_for_nodes_s: float | None = None,
                 straggler_fraction: float = 0.0, flower_lines: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rounds = Rounds(
            type(self).__name__, rule or Mean(), sampling=self, flower=self, selector=selector or RandomSelector(),
            policy=policy or SyncPolicy(), validator=weighing(validator or ReplyValidator(require_round_tag=False),
                                                               self.weighted_by_key),
            privacy=privacy, downlink=downlink, submodels=submodels, buffer_names=buffer_names,
            clients_per_round=clients_per_round, min_train_replies=min_train_replies,
            wait_for_nodes_s=wait_for_nodes_s, straggler_fraction=straggler_fraction,
            keeps_partial_work=self.keeps_partial_work, flower_lines=flower_lines)
        self.driver: Driver = driver or SyncDriver()
        if privacy is not None:
            privacy.attach(self)
        self.driver.bind(self.rounds)

    @property
    def federated_evaluation(self) -> bool:
        """Whether the driver runs Flower's federated evaluation rounds."""
        return self.driver.federated_evaluation

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,  # type: ignore[override]
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None, *,
              start_round: int = 1) -> Result:
        """Flower's ``Strategy.start``, run by the driver, able to resume at ``start_round``."""
        if self.rounds.flower_lines:
            self.rounds.say("Starting %s strategy:", type(self).__name__)
            log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
            self.summary()
        return self.driver.start(self.rounds, grid, initial_arrays, num_rounds, timeout,
                                 train_config or ConfigRecord(), evaluate_config or ConfigRecord(), evaluate_fn,
                                 start_round)

    def train_round(self, grid: Grid, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                    timeout: float) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """One training round, as the driver runs it (synchronous drivers only)."""
        return self.driver.train_round(self.rounds, grid, server_round, arrays, config, timeout)  # type: ignore[attr-defined]

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Remember the arrays replies must match, select devices, build their messages."""
        return self.rounds.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate each reply, then aggregate the accepted ones; the metrics are ``train_metrics_aggr_fn``'s
        over the accepted replies (:func:`fedge.strategies.screening.aggregate_replies`)."""
        return aggregate_replies(self.rounds, server_round, replies, self._train_metrics)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Flower's evaluate instructions; under sub-models each device evaluates the window it can hold."""
        messages = super().configure_evaluate(server_round, arrays, config, grid)
        if (submodels := self.submodels) is None:
            return messages
        submodels.begin_round(server_round)
        return [Message(submodels.record_for(m.metadata.dst_node_id, m.content, grid, server_round, train=False),
                        dst_node_id=m.metadata.dst_node_id, message_type=m.metadata.message_type)
                for m in messages if submodels.width_of(m.metadata.dst_node_id, grid) is not None]

    def checkpoint_state(self) -> dict[str, NDArray[np.generic]]:
        """What a checkpoint keeps beside the model (:meth:`~fedge.strategies.rounds.Rounds.checkpoint_state`)."""
        return self.rounds.checkpoint_state()

    def restore_state(self, state: dict[str, NDArray[np.generic]]) -> None:
        """Restore :meth:`checkpoint_state`, refusing state neither the rule nor DP keeps (named)."""
        self.rounds.restore_state(state)

    def _train_metrics(self, server_round: int, records: list[RecordDict]) -> MetricRecord | None:
        """``train_metrics_aggr_fn`` over the accepted replies' metrics; one that fails on what devices sent
        costs the round its metrics, not its model."""
        try:
            return self.train_metrics_aggr_fn(records, self.weighted_by_key)
        except Exception as exc:  # the devices' metrics, not the model: the round goes on
            log.error("round %d: train metrics not aggregated (%s: %s); the model is aggregated as usual",
                      server_round, type(exc).__name__, exc)
            return None
