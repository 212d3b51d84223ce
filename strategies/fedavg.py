"""FedAvg with reply validation and streaming aggregation."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from numpy.typing import NDArray

from fedge.server.validation import AcceptedUpdate, Failure, Rejection, ReplyValidator
from fedge.strategies.aggregate import WeightedMeanAccumulator, weighted_mean_metrics

log = logging.getLogger("fedge.strategies")


@dataclass
class RoundReport:
    """What happened to the replies of one training round (explicit server state)."""

    server_round: int
    selected: int
    accepted: int = 0
    rejected: list[Rejection] = field(default_factory=list)
    failed: list[Rejection] = field(default_factory=list)
    aggregated: bool = False


class FedAvg(FlowerFedAvg):
    """Federated Averaging (McMahan et al., AISTATS 2017) that never trusts a reply.

    A subclass of Flower's message-based ``FedAvg``, usable in any Flower
    ``ServerApp``. Before aggregation every reply goes through a
    :class:`~fedge.server.validation.ReplyValidator`; rejected replies are logged,
    counted in the round's metrics and left out. Accepted updates are folded into
    a running weighted sum one at a time (memory O(model size)). If fewer than
    ``min_train_replies`` updates survive, the round returns no arrays and the
    global model stays as it was.

    Parameters
    ----------
    validator : ReplyValidator, optional
        Defaults to ``ReplyValidator()``.
    min_train_replies : int
        Accepted updates needed to change the global model.
    **kwargs
        Passed to Flower's ``FedAvg`` (``fraction_train``, ``min_train_nodes``, ...).
    """

    def __init__(
        self,
        *,
        validator: ReplyValidator | None = None,
        min_train_replies: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.validator = validator or ReplyValidator()
        self.min_train_replies = min_train_replies
        self.global_arrays: ArrayRecord | None = None
        self.reports: list[RoundReport] = []

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Remember the arrays replies must match, then sample as Flower's FedAvg does."""
        self.global_arrays = arrays
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.reports.append(RoundReport(server_round=server_round, selected=len(messages)))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate each reply, then aggregate the accepted ones (streaming)."""
        if self.global_arrays is None:
            raise RuntimeError("aggregate_train called before configure_train")
        report = self._report_for(server_round)
        metric_rows: list[dict[str, float]] = []
        weights: list[float] = []

        def accepted() -> Iterator[AcceptedUpdate]:
            for verdict in self.validator.screen(server_round, replies, self.global_arrays):
                if isinstance(verdict, Failure):
                    report.failed.append(verdict)
                elif isinstance(verdict, Rejection):
                    report.rejected.append(verdict)
                else:
                    report.accepted += 1
                    metrics = next(iter(verdict.content.metric_records.values()))
                    metric_rows.append({k: float(v) for k, v in metrics.items()  # type: ignore[arg-type]
                                        if not isinstance(v, list)})
                    weights.append(verdict.weight)
                    yield verdict

        aggregate = self.aggregate_updates(accepted())
        counts = {"accepted": report.accepted, "rejected": len(report.rejected),
                  "failed": len(report.failed)}
        metrics = MetricRecord({**weighted_mean_metrics(metric_rows, weights), **counts})
        if aggregate is None or report.accepted < self.min_train_replies:
            log.warning("round %d: %d accepted updates (< min-train-replies %d); global model "
                        "kept as it was", server_round, report.accepted, self.min_train_replies)
            return None, metrics
        report.aggregated = True
        return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in aggregate.items()}), metrics

    def aggregate_updates(
        self, updates: Iterator[AcceptedUpdate]
    ) -> dict[str, NDArray[np.generic]] | None:
        """Weighted mean of the accepted updates by ``num-examples``; ``None`` if none.

        Override this hook for another aggregation rule; consume ``updates`` lazily.
        """
        accumulator = WeightedMeanAccumulator()
        for update in updates:
            accumulator.add(update.arrays, update.weight)
        return accumulator.result() if accumulator.count else None

    def _report_for(self, server_round: int) -> RoundReport:
        if not self.reports or self.reports[-1].server_round != server_round:
            self.reports.append(RoundReport(server_round=server_round, selected=0))
        return self.reports[-1]
