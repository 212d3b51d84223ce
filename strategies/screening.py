"""A synchronous round's replies screened into its report and folded into the rule (Flower's ``aggregate_train``).

Every reply is judged by the round's :class:`~fedge.strategies.validation.ReplyValidator`;
the verdict is filed in the round's report (:meth:`fedge.strategies.drivers.base.RoundReport.sort`),
what the device tier's bounds did is counted, and each accepted update is folded into the
rule as it comes (O(model) memory). What was clipped or left out is said on the console.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.exception import AggregationError
from numpy.typing import NDArray

from fedge import wire
from fedge.aggregate import c_contiguous, weighted_mean_metrics
from fedge.preprocessing import OUTSIDE, RAW_SCALED
from fedge.strategies.drivers.base import RoundReport
from fedge.strategies.rounds import GATEWAY_NODES, Rounds
from fedge.strategies.rule import EachUpdateRule, Update
from fedge.strategies.validation import AcceptedUpdate

log = logging.getLogger("fedge.strategies")

MetricsOf = Callable[[int, list[RecordDict]], MetricRecord | None]


def aggregate_replies(rounds: Rounds, server_round: int, replies: Iterable[Message],
                      metrics_of: MetricsOf) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """Validate each reply, then fold the accepted ones into the rule (streaming).

    ``metrics_of`` aggregates the accepted replies' metric records (Flower's
    ``train_metrics_aggr_fn``). Called without ``configure_train`` (Flower's tests, custom
    loops), replies are checked against the global arrays when the caller set them (and a
    server step starts from them), otherwise against the array names, shapes and dtypes most
    of them share.
    """
    replies, reference = _reference(rounds, replies)
    report = rounds.report_for(server_round)
    metric_rows: list[dict[str, float]] = []
    weights: list[float] = []
    records: list[RecordDict] = []

    def accepted() -> Iterator[Update]:
        reference_of = rounds.submodels.reference_of if rounds.submodels is not None else None
        for verdict in rounds.validator.screen(server_round, replies, reference, reference_of):
            if rounds.drops(verdict.node_id):
                report.late += 1  # FedAvg drops stragglers
            elif (kept := report.sort(verdict)) is not None:
                update = counted(rounds, report, kept)
                records.append(RecordDict({"metrics": next(iter(kept.content.metric_records.values()))}))
                metric_rows.append({k: float(v) for k, v in update.metrics.items() if k == wire.TRAIN_LOSS})
                weights.append(update.weight)
                yield update

    aggregate = rounds.fold(accepted())
    if rounds.node_word == GATEWAY_NODES and isinstance(rounds.rule, EachUpdateRule):  # each gateway is a group
        report.group_norms = list(rounds.rule.norms.values())
    _say_bounds(server_round, report)
    report.train_loss = weighted_mean_metrics(metric_rows, weights).get(wire.TRAIN_LOSS)
    metrics = metrics_of(server_round, records) if records else None
    if aggregate is not None and not all(np.all(np.isfinite(v)) for v in aggregate.values()):
        log.error("round %d: the aggregate is not finite (the update diverged); global model kept", server_round)
        aggregate = None
    if aggregate is None or report.accepted < rounds.min_train_replies:
        log.warning("round %d: %d accepted updates from %s (< min-train-replies %d); global model "
                    "kept as it was%s", server_round, report.accepted, rounds.node_word, rounds.min_train_replies,
                    rounds.replies_hint())
        return None, metrics
    report.aggregated = True
    if rounds.central_privacy is not None:
        aggregate = fixed_denominator(rounds, aggregate, report.accepted)
    return ArrayRecord({k: Array(c_contiguous(v)) for k, v in aggregate.items()}), metrics


def counted(rounds: Rounds, report: RoundReport, accepted: AcceptedUpdate) -> Update:
    """An accepted reply counted in the report (inputs, bounds) and made the rule's :class:`Update`."""
    report.accepted += 1
    said = accepted.meta.inputs if accepted.meta is not None else None
    report.inputs_raw += said == RAW_SCALED
    report.inputs_outside += said == OUTSIDE
    report.clipped_gateways += accepted.clipped
    for key, count in accepted.pool_clipping.items():  # a gateway's secure pool: its devices' encodings' clips
        name = key.replace("-", "_")
        setattr(report, name, getattr(report, name) + count)
    if accepted.norm is not None:
        report.gateway_norms.append(accepted.norm)
    if accepted.meta is not None:
        report.clipped_devices += accepted.meta.clipped
        report.capped_devices += accepted.meta.capped
        report.stale_devices += accepted.meta.late
        if accepted.meta.device_norm_median is not None:
            report.device_norm_medians.append(accepted.meta.device_norm_median)
    update = update_of(accepted, uniform=rounds.central_privacy is not None)  # central DP: the uniform mean
    if rounds.submodels is not None:
        update.window = rounds.submodels.windows.get(accepted.node_id)
    return update


def _say_bounds(server_round: int, report: RoundReport) -> None:
    """The console lines for what bounds clipped and for devices whose inputs look off."""
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


def update_of(accepted: AcceptedUpdate, *, uniform: bool) -> Update:
    """An accepted reply as the rule sees it: numpy arrays, a weight (1 when ``uniform``), local steps, metrics."""
    meta = accepted.meta
    metrics = next(iter(accepted.content.metric_records.values()))
    return Update(accepted.node_id, accepted.arrays, 1.0 if uniform else accepted.weight,
                  steps=meta.steps if meta is not None else None, metrics=dict(metrics))


def fixed_denominator(rounds: Rounds, mean: dict[str, NDArray[np.generic]],
                      count: int) -> dict[str, NDArray[np.generic]]:
    """DP-FedAvg's fixed denominator: ``global + sum(delta) / K`` instead of the mean of the
    ``count`` updates that arrived, so one device changes the result by at most ``clip / K``
    whoever else dropped out, which is what the noise ``z * clip / K`` is calibrated to."""
    assert rounds.central_privacy is not None
    scale = count / rounds.central_privacy.num_sampled
    base = rounds.global_numpy()
    out: dict[str, NDArray[np.generic]] = {}
    for name, value in mean.items():
        start = np.asarray(base[name], np.float64)
        out[name] = (start + scale * (np.asarray(value, np.float64) - start)).astype(value.dtype)
    return out


def _reference(rounds: Rounds, replies: Iterable[Message]) -> tuple[Iterable[Message], ArrayRecord]:
    """What replies are checked against: the arrays ``configure_train`` sent, or (called alone, as
    Flower's ``aggregate_train`` may be) the names, shapes and dtypes most replies share."""
    if rounds.state.global_arrays is not None:
        return replies, rounds.state.global_arrays
    if rounds.rule.needs_global_model:
        raise AggregationError(f"{rounds.name} steps from the global model configure_train sent: call "
                               "configure_train before aggregate_train (or set current_arrays, Flower's name for "
                               "the global model)")
    replies = list(replies)
    return replies, shared_arrays(replies)


def shared_arrays(replies: list[Message]) -> ArrayRecord:
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
