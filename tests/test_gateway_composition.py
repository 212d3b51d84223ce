"""Which strategies run over gateways (issue 27 item 2): refused at start in one line, or taken.

A gateway replies with the weighted mean of its devices' updates. A coordinator declares
gateways (``gateways = true``); strategies that need each device's update, steps, arrival or
own clipping are refused at start, naming why and what works; and a gateway's reply reaching a
coordinator that did not declare gateways is rejected instead of being folded as one device.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord

from fedge import wire
from fedge.config import resolve_run_config
from fedge.errors import ConfigError, UpdateRejected
from fedge.server.app import build_strategy
from fedge.strategies.validation import spec_of
from tests.replies import global_arrays, good_arrays, train_reply

COMPOSES = ["fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad"]
# robust rules (median, trimmed mean, krum, bulyan) run over the gateways' means when there are enough gateways
# for their bound (issue 42): tests/test_robust_groups.py; asynchronous rounds (fedbuff, asynchronous = true)
# compose, each gateway's round a partial flush (issue 43): tests/test_gateway_async.py
REFUSED = [
    ({"strategy": "fednova"}, "needs each device's update"),
    ({"strategy": "qfedavg"}, "needs each device's update"),
    ({"strategy": "fedbuff", "secure-aggregation": True}, "cannot join a later pool's sum"),
    ({"dp": "server-fixed"}, "clips each device's update"),
    ({"selector": "oort"}, "Oort ranks devices"),
]


@pytest.mark.parametrize("name", COMPOSES)
def test_linear_strategies_run_over_gateways(name: str) -> None:
    strategy = build_strategy(resolve_run_config({"strategy": name, "gateways": True, "clients-per-round": 4}), 10)
    assert strategy.rule.hierarchical and strategy.validator.accepts_aggregates


@pytest.mark.parametrize(("overrides", "reason"), REFUSED, ids=[str(o) for o, _ in REFUSED])
def test_what_needs_each_device_is_refused_at_start_in_one_line(overrides: dict[str, Any], reason: str) -> None:
    config = resolve_run_config({"gateways": True, "clients-per-round": 4, **overrides})
    with pytest.raises(ConfigError, match=re.escape(reason)) as refused:
        build_strategy(config, 20)
    assert "\n" not in str(refused.value) and "gateways-for-phones-and-browsers" in str(refused.value)


def test_asynchronous_secure_pools_are_refused_naming_the_pools() -> None:
    config = resolve_run_config({"gateways": True, "clients-per-round": 4, "asynchronous": True,
                                 "secure-aggregation": True})
    with pytest.raises(ConfigError, match="a device that answers late cannot join a later pool's sum"):
        build_strategy(config, 20)


def _gateway_reply(devices: int, secure_pool: int | None = None) -> Any:
    reply = train_reply(3, good_arrays(1.0), num_examples=300)
    meta = reply.content[wire.REPLY_META]
    assert isinstance(meta, ConfigRecord)
    meta[wire.AGGREGATE_OF] = devices
    if secure_pool is not None:
        meta[wire.SECURE_POOL] = secure_pool
    return reply


@pytest.mark.parametrize(("gateways", "devices", "taken"), [(False, 5, False), (True, 5, True), (False, 1, True)])
def test_a_gateways_reply_is_taken_only_when_the_run_declares_gateways(gateways: bool, devices: int,
                                                                        taken: bool) -> None:
    strategy = build_strategy(resolve_run_config({"gateways": gateways, "clients-per-round": 2}), 10)
    reference: ArrayRecord = global_arrays()
    content = _gateway_reply(devices).content
    if taken:
        arrays, weight = strategy.validator.check(content, server_round=1, spec=spec_of(reference))
        assert weight == 300.0 and np.all(arrays["w"] == 1.0)
    else:
        with pytest.raises(UpdateRejected, match="gateway's mean of 5 devices' updates; run the coordinator with "
                                                 "gateways = true"):
            strategy.validator.check(content, server_round=1, spec=spec_of(reference))


def test_secure_aggregation_over_gateways_runs_no_coordinator_protocol_and_takes_only_pool_sums() -> None:
    # Each gateway runs SecAgg+ over its pool (tests/test_gateway_secure.py); the coordinator sums gateways' replies
    strategy = build_strategy(resolve_run_config({"gateways": True, "secure-aggregation": True,
                                                  "clients-per-round": 2}), 10)
    assert type(strategy.driver).__name__ == "SyncDriver" and strategy.validator.secure_pool == 3


@pytest.mark.parametrize(("case", "devices", "secure_pool", "reason"), [
    ("one device's update in the clear", 1, None, "one device's update in the clear"),
    ("a gateway's plain mean", 5, 0, "a gateway's plain mean in the clear"),
    ("a pool of two", 2, 2, "at least 3 devices"),
])
def test_under_secure_aggregation_a_reply_that_is_not_a_secure_pool_sum_is_rejected(
        case: str, devices: int, secure_pool: int | None, reason: str) -> None:
    strategy = build_strategy(resolve_run_config({"gateways": True, "secure-aggregation": True,
                                                  "clients-per-round": 2}), 10)
    content = _gateway_reply(devices, secure_pool).content
    with pytest.raises(UpdateRejected, match=re.escape(reason)):
        strategy.validator.check(content, server_round=1, spec=spec_of(global_arrays()))


def test_under_secure_aggregation_a_secure_pool_sum_is_taken() -> None:
    strategy = build_strategy(resolve_run_config({"gateways": True, "secure-aggregation": True,
                                                  "clients-per-round": 2}), 10)
    arrays, weight = strategy.validator.check(_gateway_reply(4, 4).content, server_round=1,
                                              spec=spec_of(global_arrays()))
    assert weight == 300.0 and np.all(arrays["w"] == 1.0)
