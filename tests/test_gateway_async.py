"""Asynchronous rounds through gateways (issue 43 §3): a gateway's round is one partial flush, a device's late
result for an earlier round is folded in staleness-weighted, and the coordinator's FedBuff counts a gateway's
partial as the devices behind it. (The deployment through two gateways: tests/test_gateway_deployment.py.)"""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge import wire
from fedge.aggregate import apply_buffer
from fedge.clients.gateway.pool import DeviceBounds, GatewayRound, Session
from fedge.clients.gateway.protocol import Frame, assemble_frame, decode_frame, frame_tensors
from fedge.clients.gateway.service import Gateway, GatewaySettings, _late
from fedge.config import resolve_run_config
from fedge.errors import DeviceProtocolError, UpdateRejected
from fedge.server.app import build_strategy
from fedge.simulation.grid import InlineGrid
from fedge.strategies.fedbuff import Buffered
from fedge.strategies.rule import RoundContext, Update
from tests.live_gateway import LiveGateway
from tests.replies import good_arrays, train_reply

W1 = {"w": np.zeros(3, np.float32)}  # round 1's model
W2 = {"w": np.ones(3, np.float32)}  # round 2's


def _round(server_round: int, weights: dict[str, np.ndarray], late: float | None = 0.5,
           target: int = 9) -> GatewayRound:
    return GatewayRound(kind="train", server_round=server_round, config={}, graph="", weights=weights, target=target,
                        max_num_examples=100, late_exponent=late)


def _session(name: str) -> Session:
    return Session(device=name, key=b"k" * 32, expires=1e18, tasks=frozenset())


def _result(task: GatewayRound, examples: int, value: np.ndarray) -> tuple[Frame, dict[str, float]]:
    header = {"task": task.task_id, "kind": "train", "num-examples": examples, "encoding": "fp32"}
    return decode_frame(assemble_frame(header, *frame_tensors({"w": value.astype(np.float32)}, None)))


def test_a_late_result_is_its_change_applied_to_the_round_now_weighted_by_its_staleness() -> None:
    # Prepare: round 1 closed with phone0 still training it; round 2 is open (one version later)
    first, second = _round(1, W1), _round(2, W2)
    phone0, phone1 = _session("phone0"), _session("phone1")
    first.task(phone0)
    first.close()
    second.task(phone1)

    # Execute: phone0 answers round 1 (+0.5 from W1, 10 examples), phone1 round 2 (+0.2 from W2, 10 examples)
    second.fold_late(first.late_result(phone0, *_result(first, 10, W1["w"] + 0.5)))
    second.accept(phone1, *_result(second, 10, W2["w"] + 0.2))
    result = second.close()

    # Assert: phone0 counts as W2 + 0.5 with weight 10 / sqrt(1 + 1); both are device results, one of them late
    late_weight = 10 / math.sqrt(2)
    expected = (late_weight * 1.5 + 10 * 1.2) / (late_weight + 10)
    assert result is not None and result.devices == 2 and result.late == 1 and result.num_examples == 20
    assert np.allclose(result.arrays["w"], expected, rtol=0, atol=1e-6)


def test_a_device_that_answered_late_may_train_the_round_now_but_not_answer_its_old_task_twice() -> None:
    # Prepare
    first, second = _round(1, W1), _round(2, W2)
    phone0 = _session("phone0")
    first.task(phone0)
    first.close()
    second.fold_late(first.late_result(phone0, *_result(first, 5, W1["w"] + 0.1)))

    # Execute / Assert: the same task again is refused; the round now takes its own answer
    with pytest.raises(DeviceProtocolError, match="already answered this task") as again:
        first.late_result(phone0, *_result(first, 5, W1["w"] + 0.1))
    assert again.value.status == 409
    assert not second.has_answered("phone0")
    second.accept(phone0, *_result(second, 5, W2["w"] + 0.1))
    result = second.close()
    assert result is not None and result.devices == 2 and result.late == 1


def test_a_late_result_fills_the_partial_flush_and_is_bounded_as_its_own_round_bounds_it() -> None:
    # Prepare: a flush of 1 result; round 1's bound clips updates to norm 1
    first = GatewayRound(kind="train", server_round=1, config={}, graph="", weights=W1, target=1,
                         max_num_examples=100, late_exponent=0.0, bounds=DeviceBounds(max_update_norm=1.0))
    second = _round(2, W2, late=0.0, target=1)
    phone0 = _session("phone0")
    first.task(phone0)
    first.close()

    # Execute: a change of norm 6 (3 entries of +sqrt(12)), exponent 0: no staleness discount
    assert second.fold_late(first.late_result(phone0, *_result(first, 4, W1["w"] + np.sqrt(12.0))))

    # Assert: the flush is complete with it; its change was clipped to norm 1 (each entry 1/sqrt(3)) and counted
    result = second.close()
    assert second.complete.is_set() and result is not None and result.clipped == 1
    assert np.allclose(result.arrays["w"], 1.0 + 1 / np.sqrt(3.0), rtol=0, atol=1e-6)


def test_a_synchronous_round_refuses_a_late_result() -> None:
    # Prepare: a run without asynchrony (no late-exponent in the instruction)
    first, second = _round(1, W1, late=None), _round(2, W2, late=None)
    phone0 = _session("phone0")
    first.task(phone0)
    first.close()

    # Execute / Assert
    with pytest.raises(DeviceProtocolError, match="runs are not asynchronous") as refused:
        first.late_result(phone0, *_result(first, 5, W1["w"]))
    assert refused.value.status == 409 and second.answered == 0


def test_a_late_result_that_arrives_between_rounds_waits_for_the_next_one(tmp_path: Path) -> None:
    # Prepare: a gateway whose round 1 has closed (phone0 still training it) and whose next round has not opened
    gateway = Gateway(GatewaySettings(), tmp_path, None)
    first = _round(1, W1)
    gateway.open_round(first)
    phone0 = _session("phone0")
    first.task(phone0)
    first.close()

    # Execute: phone0's result (+0.5, 8 examples) arrives, then round 3 opens (two versions later)
    gateway.take_late(first.late_result(phone0, *_result(first, 8, W1["w"] + 0.5)))
    waiting = len(gateway.pending)
    third = _round(3, W2)
    gateway.open_round(third)
    result = third.close()

    # Assert: it waited, then was folded in as W2 + 0.5 (the only result: its staleness weight cancels out)
    assert waiting == 1 and not gateway.pending
    assert result is not None and result.late == 1 and result.devices == 1 and result.num_examples == 8
    assert np.allclose(result.arrays["w"], 1.5, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("value", "taken"), [(None, None), (0.5, 0.5), (0, 0.0), (-1, "error"), (True, "error"),
                                              ("0.5", "error"), (1e9, "error")])
def test_the_instructions_late_exponent_is_checked(value: Any, taken: Any) -> None:
    header = {} if value is None else {wire.LATE_EXPONENT: value}
    if taken == "error":
        with pytest.raises(DeviceProtocolError, match="late-exponent"):
            _late(header)
    else:
        assert _late(header) == taken


def test_fedbuff_counts_a_gateways_partial_as_its_devices() -> None:
    # Prepare: FedBuff's rule at x = 0; a gateway's partial of 3 devices (mean 0.3 below x, fresh) and one
    # device 1 version stale (0.6 below its base x = 0)
    rule = Buffered(server_learning_rate=1.0)
    rule.begin(RoundContext({"w": np.zeros(2)}, frozenset()))

    # Execute
    rule.fold(Update(1, {"w": np.full(2, 0.3)}, weight=3.0, devices=3))
    rule.fold(Update(2, {"w": np.full(2, 0.6)}, weight=1 / math.sqrt(2), base={"w": np.zeros(2)}))
    new = rule.result()

    # Assert: x - (1/K) sum w_i delta_i over K = 4 device results: deltas -0.3 (weight 3) and -0.6 (1/sqrt 2)
    assert new is not None
    assert np.allclose(new["w"], (3 * 0.3 + 0.6 / math.sqrt(2)) / 4)
    assert np.allclose(apply_buffer({"w": np.zeros(2)}, [{"w": np.ones(2)}], [2.0], 1.0, count=4)["w"], -0.5)


def test_a_gateways_reply_says_how_many_of_its_results_were_late() -> None:
    # Prepare: a gateway reply's meta
    reply = train_reply(3, good_arrays(1.0), num_examples=300)
    meta = reply.content[wire.REPLY_META]
    assert isinstance(meta, ConfigRecord)
    meta[wire.AGGREGATE_OF], meta[wire.GATEWAY], meta[wire.LATE] = 4, "gw0", 2

    # Execute
    read = wire.read_reply_meta(reply.content)

    # Assert
    assert read is not None and read.late == 2 and read.aggregate_of == 4
    assert isinstance(reply.content[wire.ARRAYS], ArrayRecord)


def _gateway_plus_one(message: Message, context: Context) -> Message:
    """A gateway whose three devices each sent the model plus 1: its partial mean is the model plus 1."""
    arrays = {name: Array(array.numpy() + 1) for name, array in message.content[wire.ARRAYS].items()}
    instruction = message.content[wire.CONFIG]
    seen.append(float(instruction[wire.LATE_EXPONENT]))  # type: ignore[arg-type]
    content = RecordDict({
        wire.ARRAYS: ArrayRecord(arrays),
        wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: 30, wire.TRAIN_LOSS: 0.5}),
        wire.REPLY_META: ConfigRecord({wire.SERVER_ROUND: instruction[wire.SERVER_ROUND], wire.SAMPLES_PROCESSED: 30,
                                       wire.AGGREGATE_OF: 3, wire.LATE: 1,
                                       wire.GATEWAY: f"gw{context.node_config['partition-id']}"}),
    })
    return Message(content, reply_to=message)


seen: list[float] = []


class RealTimeGrid(InlineGrid):
    """Two gateway nodes, in real time (no virtual clock: FedBuff's deployment path, as with a SuperLink)."""

    synchronous = False


def test_fedbuff_over_gateways_flushes_when_their_partials_hold_buffer_size_device_results() -> None:
    # Prepare: FedBuff through 2 gateways, a buffer of 6 device results: each gateway's partial stands for 3
    app = ClientApp()
    app.train()(_gateway_plus_one)
    grid = RealTimeGrid(app, [{"partition-id": i, "profile": "gateway"} for i in range(2)], {})
    config = resolve_run_config({"strategy": "fedbuff", "gateways": True, "clients-per-round": 2, "concurrency": 2,
                                 "buffer-size": 6, "staleness-exponent": 0.5})
    strategy = build_strategy(config)
    seen.clear()

    # Execute: one flush
    result = strategy.start(grid, ArrayRecord({"w": Array(np.zeros(3, np.float32))}), num_rounds=1, timeout=60.0)

    # Assert: two gateway replies made the buffer (not six); both fresh, so x - (1/6)(3 x -1 + 3 x -1) = x + 1;
    # each instruction told its gateway the run's staleness exponent; the gateways' late results are counted
    report = strategy.reports[0]
    assert (report.accepted, report.aggregated, report.stale_devices) == (2, True, 2)
    assert np.allclose(result.arrays["w"].numpy(), 1.0)
    assert seen and set(seen) == {0.5}


@pytest.mark.parametrize("overrides", [{"strategy": "fedbuff"}, {"asynchronous": True}])
def test_asynchronous_rounds_compose_with_gateways(overrides: dict[str, Any]) -> None:
    strategy = build_strategy(resolve_run_config({"gateways": True, "clients-per-round": 2, **overrides}))
    assert strategy.driver.asynchronous and strategy.validator.accepts_aggregates


def test_a_gateways_asynchronous_rounds_take_a_late_result_whenever_it_arrives(tmp_path: Path) -> None:
    # Prepare: a gateway flushing each round at its first result; phone0 and phone1 both take round 1's task
    gateway = Gateway(GatewaySettings(devices_per_round=1), tmp_path, None)
    phone0, phone1 = _session("phone0"), _session("phone1")

    def header(server_round: int) -> dict[str, Any]:
        return {"kind": "train", "server-round": server_round, "config": {}, wire.LATE_EXPONENT: 0.5}

    async def rounds() -> tuple[Any, Any, int]:
        flush = asyncio.create_task(gateway.run_round(header(1), dict(W1)))
        while gateway.round is None:
            await asyncio.sleep(0.01)
        first = gateway.round
        first.task(phone0), first.task(phone1)
        first.accept(phone1, *_result(first, 10, W1["w"] + 0.2))
        one = await flush
        # Execute: phone0's result for round 1 arrives with no round open, then round 2 opens
        limit = gateway.result_limit()
        gateway.take_late(gateway.earlier[first.task_id].late_result(phone0, *_result(first, 10, W1["w"] + 0.5)))
        two = await gateway.run_round(header(2), dict(W2))
        return one, two, limit

    one, two, limit = asyncio.run(rounds())

    # Assert: the result was not refused for want of an open round; round 2's flush is it, rebased onto W2
    assert limit > 0
    assert (one.devices, one.late, two.devices, two.late) == (1, 0, 1, 1)
    assert np.allclose(two.arrays["w"], 1.5, rtol=0, atol=1e-6)


def test_a_device_trains_a_model_version_its_gateway_hands_out_again_with_a_seed_of_that_task(
        tmp_path: Path, run: dict[str, Any]) -> None:
    # Prepare: an asynchronous run's gateway flushing at 1 result; FedBuff's buffer was not full after the first
    # flush, so the coordinator sends the same version (server round 1) again; phone0 polls on a thread
    settings = GatewaySettings(name="gw-test", devices_per_round=1, round_deadline_s=60, idle_poll_s=0.2)
    with LiveGateway(tmp_path, run, settings) as gateway:
        device = gateway.device("phone0")
        stop = threading.Event()
        trained: list[int] = []
        thread = threading.Thread(target=lambda: trained.append(device.run(stop=stop, max_wait_s=0.05)), daemon=True)
        thread.start()
        try:
            # Execute: two flushes of version 0 (a device refusing the second would leave it to its deadline)
            first, first_arrays = gateway.round(server_round=1, late_exponent=0.5)
            second, second_arrays = gateway.round(server_round=1, late_exponent=0.5)
        finally:
            stop.set()
            thread.join()
    # Assert: it trained both; the two results differ (each task's own seed), though both start from version 0
    assert (first["devices"], second["devices"], trained) == (1, 1, [2])
    assert any(not np.array_equal(first_arrays[name], second_arrays[name]) for name in first_arrays)


@pytest.mark.parametrize(("aggregate_of", "late"), [(4, 5), (None, 1)])
def test_a_reply_claiming_more_late_results_than_it_holds_is_rejected(aggregate_of: int | None, late: int) -> None:
    # Prepare: a gateway's reply of 4 results claiming 5 late, and a device's own reply claiming one
    reply = train_reply(3, good_arrays(1.0), num_examples=300)
    meta = reply.content[wire.REPLY_META]
    assert isinstance(meta, ConfigRecord)
    if aggregate_of is not None:
        meta[wire.AGGREGATE_OF], meta[wire.GATEWAY] = aggregate_of, "gw0"
    meta[wire.LATE] = late
    # Execute / Assert
    with pytest.raises(UpdateRejected, match="'late' = .* must count some of a gateway's"):
        wire.read_reply_meta(reply.content)


def test_a_gateway_keeps_its_last_four_closed_rounds_for_late_results(tmp_path: Path) -> None:
    # Prepare
    gateway = Gateway(GatewaySettings(), tmp_path, None)
    rounds = [_round(server_round, W1) for server_round in range(1, 6)]
    # Execute: five asynchronous train rounds close, and one synchronous one
    for closed in rounds:
        closed.close()
        gateway.remember(closed)
    gateway.remember(_round(6, W1, late=None))
    # Assert: a result for the oldest is no longer taken (409 at the HTTP layer: it answers no task it knows)
    assert list(gateway.earlier) == [closed.task_id for closed in rounds[1:]]
