"""The synchronous driver: rounds of select, exchange, validate and fold (Flower's loop, resumable)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fedge.errors import RunFailed
from fedge.strategies.drivers.base import EvaluateFn
from fedge.strategies.policies import let_go
from fedge.strategies.screening import aggregate_replies
from fedge.strategies.systematic import stop_message, systematic_reason

if TYPE_CHECKING:
    from fedge.strategies.rounds import Rounds


class SyncDriver:
    """Synchronous rounds: train -> federated evaluation -> central evaluation, per round.

    Each round selects devices, exchanges messages under the strategy's round policy and
    folds each accepted reply into the strategy's rule as it arrives (O(model) memory).
    With differential privacy, Flower's DP wrapper drives configure/aggregate (it clips and
    adds noise around the strategy's own steps) and the release is accounted. Takes any rule.
    """

    federated_evaluation = True
    asynchronous = False

    def bind(self, rounds: Rounds) -> None:
        """Any rule runs synchronously."""

    def start(self, rounds: Rounds, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int, timeout: float,
              train_config: ConfigRecord, evaluate_config: ConfigRecord, evaluate_fn: EvaluateFn | None,
              start_round: int) -> Result:
        """Flower's ``Strategy.start`` loop, able to resume at ``start_round``.

        Flower's own loop always begins at round 1 and has no way to continue a run
        from a checkpoint, so the loop is restated here with the same semantics. Round 0
        (central evaluation of ``initial_arrays``) happens only on a fresh start.

        Raises
        ------
        RunFailed
            Every reply of two rounds in a row was left out for one and the same reason
            (:mod:`fedge.strategies.systematic`): the run stops instead of going on unchanged.
        """
        result, arrays, started = Result(), initial_arrays, time.time()
        result.arrays = arrays
        if evaluate_fn and start_round == 1 and (res := evaluate_fn(0, arrays)) is not None:
            result.evaluate_metrics_serverapp[0] = res
        reports = rounds.state.reports
        for server_round in range(start_round, num_rounds + 1):
            rounds.say("[ROUND %s/%s]", server_round, num_rounds)
            new_arrays, train_metrics = self.train_round(rounds, grid, server_round, arrays, train_config, timeout)
            if reports and reports[-1].server_round == server_round:
                rounds.log_round(reports[-1], train_metrics)
            if (reason := systematic_reason(reports)) is not None:
                raise RunFailed(stop_message(reports, reason))
            if new_arrays is not None:
                result.arrays = arrays = new_arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[server_round] = train_metrics
            evaluate_messages = [] if rounds.flower is None else list(
                rounds.flower.configure_evaluate(server_round, arrays, evaluate_config, grid))
            if evaluate_messages:
                evaluate_replies = grid.send_and_receive(evaluate_messages, timeout=timeout)
                if (metrics := rounds.evaluation_metrics(server_round, evaluate_replies)) is not None:
                    result.evaluate_metrics_clientapp[server_round] = rounds.state.evaluated[server_round] = metrics
            if evaluate_fn and (res := evaluate_fn(server_round, arrays)) is not None:
                result.evaluate_metrics_serverapp[server_round] = res
        rounds.say("Strategy execution finished in %.2fs", time.time() - started)
        rounds.say("Final results:\n%s", result)
        return result

    def train_round(self, rounds: Rounds, grid: Grid, server_round: int, arrays: ArrayRecord,
                    config: ConfigRecord, timeout: float) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """One training round: select, exchange under the round policy, validate, aggregate."""
        privacy = rounds.central_privacy
        if privacy is not None:  # Flower's DP wrapper drives configure/aggregate around the strategy's own
            messages = list(privacy.wrapper.configure_train(server_round, arrays, config, grid))
            exchange = rounds.policy.exchange(grid, messages, timeout, rounds.state.round_target)
            rounds.state.reports[-1].late = exchange.late
            rounds.learn(server_round, exchange.replies, grid)
            screened = _screened(rounds, server_round, exchange.replies)
            new_arrays, metrics = privacy.wrapper.aggregate_train(server_round, screened)
            if screened:  # conservative: adaptive clipping released a noised count even if no model came out
                rounds.state.reports[-1].epsilon = privacy.release()
            return new_arrays, metrics
        messages = rounds.train_messages(server_round, arrays, config, grid)
        stream = rounds.policy.stream(grid, messages, timeout, rounds.state.round_target)
        replies = _learning(rounds, server_round, stream, grid)
        result = (rounds.flower.aggregate_train(server_round, replies) if rounds.flower is not None
                  else aggregate_replies(rounds, server_round, replies, lambda _round, _records: None))
        report = rounds.report_for(server_round)
        report.late += stream.late  # on top of stragglers dropped in aggregation
        if rounds.noise_layer is not None and result[0] is not None:  # gateways' secure pools noised on devices
            report.epsilon = rounds.noise_layer.release_pools()
        return result


def _learning(rounds: Rounds, server_round: int, replies: Iterable[Message], grid: Grid) -> Iterator[Message]:
    """Pass each reply on as it arrives, after the selector and downlink learn from it.

    Nothing here keeps a reply: aggregation folds it in and it goes (O(model) memory).
    """
    for reply in replies:
        rounds.learn(server_round, [reply], grid)
        yield reply
        let_go(reply)  # aggregation asked for the next reply: this one is folded in


def _screened(rounds: Rounds, server_round: int, replies: Iterable[Message]) -> list[Message]:
    """The replies that pass validation (others recorded), before a DP wrapper clips them.

    Flower's wrappers skip a whole round on one error reply and clip before anything is
    validated; fedge keeps its rule: a bad reply is left out and the round goes on.
    """
    report, kept = rounds.report_for(server_round), []
    replies = list(replies)
    by_node = {reply.metadata.src_node_id: reply for reply in replies}
    for verdict in rounds.validator.screen(server_round, replies, rounds.state.global_arrays or ArrayRecord()):
        if (accepted := report.sort(verdict)) is not None:
            kept.append(by_node[accepted.node_id])
    return kept
