"""Issue 42 §2: the device tier's norm bound is a strategy-level setting with an adaptive option.

``update-norm-bound = median`` moves ``max-update-norm`` after every round to the median of that
round's norms before clipping: the devices' (each plain gateway reports its devices' median) and
the gateways' (measured at the coordinator). Expected values are computed by hand.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord

from fedge import wire
from fedge.aggregate import NORM_BOUND_RULES
from fedge.clients.gateway.bridge import _config_of
from fedge.config import resolve_run_config
from fedge.errors import ConfigError, UpdateRejected
from fedge.server.app import build_strategy
from fedge.strategies.drivers.base import RoundReport
from fedge.strategies.norm_bound import NormBounds
from fedge.strategies.screening import aggregate_replies
from fedge.strategies.validation import spec_of
from tests.replies import global_arrays, good_arrays, instruction, train_reply
from tests.test_gateway_operator import OneNodeGrid


@pytest.mark.parametrize(("rule", "norms", "expected"), [
    ("fixed", [1.0, 2.0, 3.0], 10.0),  # kept
    ("median", [1.0, 4.0, 2.0], 2.0),
    ("median", [1.0, 4.0], 2.5),  # an even count: the mean of the middle two
    ("median", [], 10.0),  # no norms (no plain gateway answered): kept
    ("median", [0.0, 0.0, 0.0], 10.0),  # a median of 0 would turn the bound off: kept
    ("median", [math.nan, 3.0, math.inf], 3.0),  # only finite norms count
])
def test_the_bound_rules_move_the_bound_as_computed_by_hand(rule: str, norms: list[float], expected: float) -> None:
    assert NORM_BOUND_RULES[rule](10.0, norms) == expected


def test_the_bounds_move_once_a_round_and_come_back_from_a_checkpoint() -> None:
    # Prepare: both bounds start at max-update-norm 10; round 1's norms
    bounds = NormBounds(rule="median", device=10.0, gateway=10.0)
    report = RoundReport(server_round=1, selected=3, gateway_norms=[2.0, 4.0, 9.0], device_norm_medians=[0.5, 0.9])
    # Execute: observed twice (the next round's start and the checkpoint both ask), then saved and restored
    bounds.observe(report)
    bounds.observe(RoundReport(server_round=1, selected=3, gateway_norms=[100.0], device_norm_medians=[100.0]))
    restored = NormBounds(rule="median", device=10.0, gateway=10.0)
    restored.load_state_dict(bounds.state_dict())
    # Assert: the medians of round 1, once; the same after the checkpoint
    assert (bounds.device, bounds.gateway, bounds.observed) == (0.7, 4.0, 1)
    assert (restored.device, restored.gateway, restored.observed) == (0.7, 4.0, 1)


def test_an_unknown_rule_is_refused_naming_the_registered_ones() -> None:
    with pytest.raises(ConfigError, match="update-norm-bound 'mean': use one of fixed, median"):
        NormBounds(rule="mean", device=1.0, gateway=1.0)
    with pytest.raises(ConfigError, match="fixed, median"):
        resolve_run_config({"update-norm-bound": "mean"})


def test_a_moving_bound_without_gateways_is_refused_naming_why() -> None:
    with pytest.raises(ConfigError, match="it needs gateways = true"):
        build_strategy(resolve_run_config({"update-norm-bound": "median", "clients-per-round": 2}), 10)


def _gateway_reply(node: int, value: float, device_median: float | None, server_round: int) -> Any:
    reply = train_reply(node, good_arrays(value), num_examples=100, server_round=server_round)
    meta = reply.content[wire.REPLY_META]
    assert isinstance(meta, ConfigRecord)
    meta[wire.AGGREGATE_OF], meta[wire.GATEWAY] = 5, f"gw{node}"
    if device_median is not None:
        meta[wire.DEVICE_NORM_MEDIAN] = device_median
    return reply


def test_the_coordinator_sends_each_round_the_bounds_the_last_rounds_norms_set() -> None:
    # Prepare: gateways with update-norm-bound = median, from max-update-norm 10
    config = resolve_run_config({"gateways": True, "clients-per-round": 1, "min-train-replies": 1,
                                 "update-norm-bound": "median", "max-update-norm": 10.0})
    strategy = build_strategy(config)
    rounds, grid = strategy.rounds, OneNodeGrid()
    first = ConfigRecord({})
    rounds.configure_train(1, global_arrays(), first, grid)  # type: ignore[arg-type]
    # Execute: round 1's three gateway replies (all entries 1, 2 and 5 from the zero model: norms 3, 6 and 15 over
    # 9 entries; the last clipped to 10), two plain ones reporting their devices' median norm, one a secure pool's
    replies = [_gateway_reply(1, 1.0, 0.4, 1), _gateway_reply(2, 2.0, 0.8, 1), _gateway_reply(3, 5.0, None, 1)]
    aggregate_replies(rounds, 1, replies, lambda _round, _records: None)
    second = ConfigRecord({})
    rounds.configure_train(2, global_arrays(), second, grid)  # type: ignore[arg-type]
    # Assert: round 1 ran under 10 at both levels; round 2's device bound is the median of 0.4 and 0.8, sent to the
    # gateways, and its gateway bound the median of 3, 6 and 15 (before clipping), applied here; both recorded
    assert first[wire.DEVICE_NORM_BOUND] == 10.0 and rounds.state.reports[0].norm_bounds == (10.0, 10.0)
    assert rounds.state.reports[0].gateway_norms == pytest.approx([3.0, 6.0, 15.0])
    assert rounds.state.reports[0].clipped_gateways == 1
    assert second[wire.DEVICE_NORM_BOUND] == pytest.approx(0.6)
    assert rounds.validator.gateway_norm_bound == pytest.approx(6.0)
    assert rounds.state.reports[1].norm_bounds == pytest.approx((0.6, 6.0))
    assert strategy.checkpoint_state()["norm-bound/gateway-level"] == pytest.approx(6.0)


def test_a_gateway_is_told_the_rounds_device_bound_in_place_of_the_run_configs() -> None:
    # Prepare: the coordinator's instruction for round 2 under update-norm-bound = median
    config = resolve_run_config({"gateways": True, "max-update-norm": 10.0})
    message = instruction(1, 2)
    record = message.content[wire.CONFIG]
    assert isinstance(record, ConfigRecord)
    record[wire.DEVICE_NORM_BOUND] = 0.6
    # Execute: what the gateway's ClientApp hands the gateway (evaluation: the bounds alone)
    sent = _config_of(message, None, config, "evaluate")  # type: ignore[arg-type]
    # Assert
    assert sent["max-update-norm"] == 0.6


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, "0.5", True])
def test_a_gateway_reporting_a_bad_device_norm_median_is_rejected_naming_it(value: Any) -> None:
    reply = _gateway_reply(1, 1.0, None, 1)
    reply.content[wire.REPLY_META][wire.DEVICE_NORM_MEDIAN] = value
    with pytest.raises(UpdateRejected, match="reply meta 'device-norm-median' must be a finite number >= 0"):
        wire.read_reply_meta(reply.content)


def test_each_reply_is_judged_against_the_round_bound_not_the_run_config() -> None:
    # Prepare: the validator's bound for this round, lowered from the run's 10 to 2
    strategy = build_strategy(resolve_run_config({"gateways": True, "clients-per-round": 1}))
    strategy.rounds.validator.gateway_norm_bound = 2.0
    # Execute: a gateway's update of norm 3 (all entries 1 over 9 entries)
    checked = strategy.validator.read(_gateway_reply(1, 1.0, None, 1).content, server_round=1,
                                      spec=spec_of(global_arrays()),
                                      reference={k: a.numpy() for k, a in global_arrays().items()}, node_id=1)
    # Assert: clipped to 2 (the update scaled by 2/3), its norm before clipping kept
    assert checked.clipped and checked.norm == pytest.approx(3.0)
    assert np.allclose(checked.arrays["w"], 2.0 / 3.0)


def test_a_moved_bound_never_exceeds_max_update_norm() -> None:
    # Prepare: max-update-norm 10 (the ceiling); a round whose norms' median is 40 (hostile reports, or a wild round)
    bounds = NormBounds(rule="median", device=10.0, gateway=10.0)
    # Execute
    bounds.observe(RoundReport(server_round=1, selected=3, gateway_norms=[30.0, 40.0, 50.0],
                               device_norm_medians=[5.0, 90.0]))
    # Assert: the gateways' bound stays at 10; the devices' is the mean of the two reports, 47.5, capped at 10
    assert (bounds.device, bounds.gateway) == (10.0, 10.0)


@pytest.mark.parametrize(("secure_pool", "gateway"), [(5, "gw1"), (0, None)], ids=["secure-pool", "not-a-gateway"])
def test_a_device_norm_median_from_anything_but_a_plain_gateway_is_rejected(secure_pool: int,
                                                                         gateway: str | None) -> None:
    reply = train_reply(1, good_arrays(1.0), num_examples=100)
    meta = reply.content[wire.REPLY_META]
    assert isinstance(meta, ConfigRecord)
    meta[wire.AGGREGATE_OF], meta[wire.SECURE_POOL], meta[wire.DEVICE_NORM_MEDIAN] = 5, secure_pool, 0.5
    if gateway is not None:
        meta[wire.GATEWAY] = gateway
    with pytest.raises(UpdateRejected, match="comes only with a plain gateway's reply"):
        wire.read_reply_meta(reply.content)


def test_a_resumed_run_goes_on_with_the_bounds_its_checkpoint_holds() -> None:
    # Prepare: a run whose bounds round 1 moved to 0.7 and 4.0, checkpointed
    config = resolve_run_config({"gateways": True, "clients-per-round": 1, "min-train-replies": 1,
                                 "update-norm-bound": "median"})
    before = build_strategy(config)
    assert before.rounds.norm_bounds is not None
    before.rounds.norm_bounds.observe(RoundReport(server_round=1, selected=2, gateway_norms=[4.0],
                                                  device_norm_medians=[0.7]))
    # Execute: a new coordinator's strategy restores the checkpoint's state and configures round 2
    after = build_strategy(config)
    after.restore_state(before.checkpoint_state())
    sent = ConfigRecord({})
    after.rounds.configure_train(2, global_arrays(), sent, OneNodeGrid())  # type: ignore[arg-type]
    # Assert: round 2 runs under the restored bounds
    assert sent[wire.DEVICE_NORM_BOUND] == 0.7 and after.rounds.validator.gateway_norm_bound == 4.0
