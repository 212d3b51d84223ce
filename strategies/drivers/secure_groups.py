"""Secure aggregation in random groups, then a robust rule over the groups' means (``secure-groups = K``).

A robust rule (median, trimmed mean, Krum/Multi-Krum, Bulyan) needs each update in the clear,
which secure aggregation hides. SHARE (Velicheti, Xia and Koyejo, "Secure Byzantine-Robust
Distributed Learning via Clustering", 2021) splits each round's devices into ``K`` random groups,
aggregates each group securely and runs the robust rule over the ``K`` group means: the
coordinator learns each group's weighted mean and nothing finer, and the rule's bound counts
groups that hold an attacker, not devices. (BREA, So, Güler and Avestimehr, IEEE JSAC 2021,
instead computes the distances Krum needs under secret sharing: one robust rule over every
device, at a cost quadratic in the devices; fedge does not implement it.)

:class:`SecureGroups` composes :class:`~fedge.strategies.drivers.secure.SecureAggregation`: one
SecAgg+ instance per group (:meth:`~fedge.strategies.drivers.secure.SecureAggregation.group_mean`,
as it runs one per width group for sub-models), each of at least
:data:`~fedge.strategies.drivers.secure.MIN_DEVICES` devices. A linear rule (FedAvg) takes the
groups' means weighted by their summed weights (the flat weighted mean, as one instance would
give); a robust rule (``takes_group_means``) takes them unweighted. Each group's update norm (its
mean's L2 distance from the round's model) is kept by round (:attr:`SecureGroups.group_norms`) and
in the round's train metrics.
"""

from __future__ import annotations

import logging
import math
import random

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid

from fedge.aggregate import c_contiguous
from fedge.errors import ConfigError, SecureRoundFailed
from fedge.strategies.drivers.secure import MIN_DEVICES, Clipping, SecureAggregation
from fedge.strategies.drivers.sync import SyncDriver
from fedge.strategies.registry import names_where
from fedge.strategies.rounds import Rounds
from fedge.strategies.rule import LinearRule, Mean, Update, check_groups, update_norms
from fedge.strategies.validation import Rejection

log = logging.getLogger("fedge.strategies.secure")


def check_group_size(groups: int, selected: int) -> None:
    """Refuse ``groups`` secure groups over ``selected`` devices a round unless each can have
    :data:`MIN_DEVICES` (with 2, each device of a group learns the other's update from the sum).

    Raises
    ------
    ConfigError
        Naming ``secure-groups`` and ``clients-per-round``.
    """
    if groups < 1:
        raise ConfigError(f"secure-groups = {groups}: give 1 or more groups (0 turns secure groups off)")
    if selected < MIN_DEVICES * groups:
        raise ConfigError(f"secure-groups = {groups} over clients-per-round = {selected} devices: each group needs at "
                          f"least {MIN_DEVICES} devices (with 2, each learns the other's update from the sum), so "
                          f"{MIN_DEVICES * groups} devices a round; raise clients-per-round or lower secure-groups")


def split_groups(nodes: list[int], groups: int, seed: int) -> list[list[int]]:
    """``nodes`` split into at most ``groups`` random groups of at least :data:`MIN_DEVICES` each (sizes
    differ by at most one; fewer groups when there are too few nodes, none under :data:`MIN_DEVICES`)."""
    count = min(groups, len(nodes) // MIN_DEVICES)
    if count < 1:
        return []
    shuffled = sorted(nodes)
    random.Random(seed).shuffle(shuffled)
    return [sorted(shuffled[index::count]) for index in range(count)]


class SecureGroups(SyncDriver):
    """Synchronous rounds whose devices form ``groups`` random secure-aggregation groups; the strategy's
    rule runs over the groups' means (robust rules unweighted, linear rules weighted by each group's
    summed weight).

    Parameters
    ----------
    groups : int
        K, the groups a round's devices are split into (each of at least 3).
    secure : SecureAggregation
        The secure-aggregation driver whose protocol each group runs (its settings: threshold,
        neighbours, clip, precision, ring); bound here to a plain mean of its own.

    Raises
    ------
    ConfigError
        ``groups`` below 1.
    """

    def __init__(self, groups: int, secure: SecureAggregation) -> None:
        if groups < 1:
            raise ConfigError(f"secure-groups = {groups}: give 1 or more groups (0 turns secure groups off)")
        self.groups, self.secure = groups, secure
        self.rounds: Rounds | None = None
        self.group_norms: dict[int, dict[int, float]] = {}
        """Each group's update norm (its mean's L2 distance from the round's model), by round and group."""
        self.group_sizes: dict[int, dict[int, int]] = {}
        """Each group's devices in its sum (its survivors), by round and group."""

    def bind(self, rounds: Rounds) -> None:
        """Run ``rounds``: a robust rule over group means, or a linear rule's weighted mean of them.

        Raises
        ------
        ConfigError
            A rule that takes neither, DP, sub-models, or fewer groups (or devices) than the rule needs.
        """
        rule = rounds.rule
        linear = isinstance(rule, LinearRule) and rule.work_momentum is None
        if not (rule.takes_group_means or linear):
            raise ConfigError(f"secure-groups runs a robust rule over the groups' means, or a linear rule's weighted "
                              f"mean of them; {rounds.name}'s {type(rule).__name__} is neither (it needs each "
                              f"device's update or its local work); use "
                              f"{names_where(lambda each: each.takes_group_means or each.hierarchical)}")
        if rounds.privacy is not None:
            raise ConfigError("secure-groups cannot run with dp yet (each group's mean would be a release of its "
                              "own); turn dp off or set secure-groups = 0")
        if rounds.submodels is not None:
            raise ConfigError("secure-groups with width-scaled sub-models is not supported (sub-models already group "
                              "devices by width); set secure-groups = 0 or drop sub-models")
        if rounds.clients_per_round is not None:
            check_group_size(self.groups, rounds.clients_per_round)
        if rule.takes_group_means:
            check_groups(rule, rounds.name, self.groups, "secure groups a round (secure-groups)")
        # the groups' protocol instances run over rounds of their own: a plain mean, whose minimum is one group's,
        # under the strategy's selector (the neighbour graph's seed) and round policy (a deadline); stragglers FedAvg
        # leaves out are left out before the groups are formed (a group keeps its 3 devices)
        self.inner = Rounds(rounds.name, Mean(), selector=rounds.selector, policy=rounds.policy, min_train_replies=1,
                            keeps_partial_work=rounds.keeps_partial_work)
        self.secure.bind(self.inner)
        self.rounds = rounds

    def train_round(self, rounds: Rounds, grid: Grid, server_round: int, arrays: ArrayRecord,
                    config: ConfigRecord, timeout: float) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Split the round's devices into groups, one protocol instance per group, the rule over their means.

        A group whose instance fails is left out (logged); a round with fewer groups than the rule's bound
        needs keeps the model.
        """
        if rounds is not self.rounds:
            self.bind(rounds)
        rule = rounds.rule
        instructions = {m.metadata.dst_node_id: m.content
                        for m in rounds.train_messages(server_round, arrays, config, grid)}
        report = rounds.state.reports[-1]
        dropped = [node for node in instructions if rounds.drops(node)]  # FedAvg's stragglers: late, before grouping
        report.late += len(dropped)
        instructions = {node: content for node, content in instructions.items() if node not in dropped}
        groups = split_groups(list(instructions), self.groups, seed=rounds.selector.seed * 1_000_003 + server_round)
        grouped = {node for group in groups for node in group}
        for node in sorted(set(instructions) - grouped):  # fewer than 3 devices this round
            report.rejected.append(Rejection(node, f"too few devices this round for a secure group of {MIN_DEVICES}"))
        start = rounds.global_numpy()
        rule.begin(rounds.round_context())
        norms, sizes, clipping, accepted, weight_total = {}, {}, Clipping(), 0, 0.0
        for index, members in enumerate(groups):
            # a deadline's K (the round's target of its over-selected devices), this group's share of it
            self.inner.state.round_target = min(len(members), max(MIN_DEVICES, math.ceil(
                len(members) * rounds.state.round_target / max(1, len(instructions)))))
            try:
                mean, weight, survivors, clipped = self.secure.group_mean(
                    grid, server_round, {node: instructions[node] for node in members}, arrays, timeout, report)
            except SecureRoundFailed as exc:
                log.warning("round %d: secure group %d (%d devices) failed (%s); its devices are left out",
                            server_round, index, len(members), exc)
                continue
            update = Update(index, mean, weight)
            norms[index] = update_norms([update], start)[index]
            sizes[index] = len(survivors)
            accepted, weight_total, clipping = accepted + len(survivors), weight_total + weight, clipping + clipped
            rule.fold(update)
        self.group_norms[server_round], self.group_sizes[server_round] = norms, sizes
        report.group_norms = [float(value) for value in norms.values()]
        for name, value in clipping.report_fields().items():
            setattr(report, name, value)
        log.info("round %d: %d secure groups (devices %s), update norms %s", server_round, len(norms),
                 list(sizes.values()), [round(value, 4) for value in norms.values()])
        metrics = MetricRecord({"accepted": accepted, "failed": len(report.failed), "late": report.late,
                                "weight": weight_total, "groups": len(norms),
                                "group-norms": [float(value) for value in norms.values()], **clipping.metrics()})
        needed = rule.groups_needed()[0] if rule.takes_group_means else 1
        new = rule.result() if len(norms) >= needed and accepted >= rounds.min_train_replies else None
        if new is None or not all(np.all(np.isfinite(value)) for value in new.values()):
            log.warning("round %d: %d secure groups of %d devices aggregated (the rule needs %d groups, "
                        "min-train-replies %d devices); global model kept", server_round, len(norms), accepted,
                        needed, rounds.min_train_replies)
            return None, metrics
        report.accepted, report.aggregated = accepted, True
        return ArrayRecord({name: Array(c_contiguous(np.asarray(new[name]))) for name in arrays}), metrics
