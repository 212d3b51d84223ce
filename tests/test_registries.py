"""Lists of names in messages come from the registries: a strategy or a server step registered later
is offered where it works, without editing the messages."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from fedge.aggregate import SECOND_MOMENTS, adaptive_step
from fedge.config import resolve_run_config
from fedge.errors import ConfigError
from fedge.server.app import build_strategy, check_hierarchical
from fedge.strategies import FedAvg, Median
from fedge.strategies.drivers.asynchronous import AsynchronousDriver
from fedge.strategies.drivers.secure import SecureAggregation
from fedge.strategies.fedavg import Mean
from fedge.strategies.registry import REGISTRY, names_where, register


class HalfStep(Mean):
    """A linear rule: half of FedAvg's step (a stand-in for a user's own)."""


@pytest.fixture
def user_strategy() -> Iterator[str]:
    """A strategy registered the way a user's file registers one; unregistered afterwards."""
    @register("half-step")
    class HalfStepAvg(FedAvg):
        def __init__(self, **kwargs: object) -> None:
            super().__init__(rule=HalfStep(), **kwargs)  # type: ignore[arg-type]

    yield "half-step"
    REGISTRY.pop("half-step")


def test_a_registered_linear_strategy_is_offered_where_linear_rules_work(user_strategy: str) -> None:
    # Execute
    with pytest.raises(ConfigError) as secure:
        Median(driver=SecureAggregation())
    with pytest.raises(ConfigError) as stale:
        Median(driver=AsynchronousDriver())
    with pytest.raises(ConfigError) as gateways:
        check_hierarchical(resolve_run_config({"gateways": True, "strategy": "fednova"}),
                           build_strategy(resolve_run_config({"strategy": "fednova"})))
    # Assert: the user's strategy is in each list; a rule that cannot is in none (over gateways the robust rules
    # are offered apart, as rules over the gateways' means: issue 42)
    for refused in (secure, stale, gateways):
        assert user_strategy in str(refused.value)
    for refused in (secure, stale):
        assert "krum" not in str(refused.value)
    assert "or a robust rule over the gateways' means: bulyan, krum, median or trimmed-mean" in str(gateways.value)


@pytest.mark.parametrize(("fits", "expected"), [
    (lambda rule: rule.linear, "fedadagrad, fedadam, fedavg, fedavgm, fednova, fedprox or fedyogi"),
    (lambda rule: rule.hierarchical, "fedadagrad, fedadam, fedavg, fedavgm, fedbuff, fedprox or fedyogi"),
    (lambda rule: rule.needs_each_update, "bulyan, krum, median or trimmed-mean"),
    (lambda rule: rule.takes_group_means, "bulyan, krum, median or trimmed-mean"),
])
def test_names_come_from_the_rules_flags(fits: object, expected: str) -> None:
    # Assert
    assert names_where(fits) == expected  # type: ignore[arg-type]


def test_a_registered_second_moment_is_a_server_step_and_is_named_in_the_refusal() -> None:
    # Prepare: AMSGrad-like: v never decreases
    SECOND_MOMENTS["max"] = lambda old, squared, beta2: np.maximum(old, squared)
    try:
        # Execute: one step from 0 towards a mean of 1 (m = 0.1, v = max(tau^2, 1) = 1)
        new, first, second = adaptive_step({"w": np.zeros(1)}, {"w": np.ones(1)}, {}, {}, server_lr=1.0, rule="max")
        with pytest.raises(ValueError) as unknown:
            adaptive_step({"w": np.zeros(1)}, {"w": np.ones(1)}, {}, {}, server_lr=1.0, rule="nadam")
    finally:
        SECOND_MOMENTS.pop("max")
    # Assert: x = 0 + 1 * 0.1 / (1 + 1e-3)
    np.testing.assert_allclose(new["w"], [0.1 / 1.001])
    assert "use one of adagrad, adam, yogi, max" in str(unknown.value)
