"""Distributed DP (issue 41 §2): the devices clip and add discrete Gaussian noise inside secure
aggregation, so no party, the coordinator included, sees a noise-free sum."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge import wire
from fedge.clients import secagg_device
from fedge.clients.secagg_device import check_survivors
from fedge.clients.secure import add_secure_handlers
from fedge.config import resolve_run_config
from fedge.distributed_noise import DistributedNoise, discrete_gaussian
from fedge.errors import ConfigError
from fedge.secagg import ProtocolViolation, ring_accumulate, ring_dtype
from fedge.server.app import build_strategy, check_hierarchical
from fedge.server.privacy import DifferentialPrivacy, DistributedPrivacy, build_privacy
from fedge.server.report import read_jsonl
from fedge.simulation.grid import InlineGrid
from fedge.simulation.runner import simulate
from fedge.strategies.drivers.base import RoundReport
from fedge.strategies.drivers.secure import SecureAggregation
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.selection import RandomSelector


def _noise(stddev: float, *, clip: float = 1.0, scale: float = 1e3, bits: int = 32) -> DistributedNoise:
    return DistributedNoise(clip=clip, scale=scale, stddev=stddev, bits=bits, min_survivors=3)


# --------------------------------------------------------------------------- the mechanism


@pytest.mark.parametrize("sigma", [1.0, 7.5, 400.0])
def test_the_discrete_gaussian_has_the_variance_it_is_drawn_with(sigma: float) -> None:
    # Execute: 200,000 draws (the variance estimate's own error is sqrt(2 / 200,000) = 0.3 %)
    draws = discrete_gaussian(sigma, 200_000, np.random.default_rng(0))
    # Assert: N_Z(0, sigma^2) has variance within 1e-6 of sigma^2 for sigma >= 1 (Canonne et al., Fact 18)
    assert draws.dtype == np.int64
    assert abs(draws.var() / sigma ** 2 - 1) < 0.02 and abs(draws.mean()) < 4 * sigma / math.sqrt(200_000)


def test_the_sums_noise_variance_over_many_trials_is_the_calibrated_one() -> None:
    # Prepare: 5 devices with zero updates, noise calibrated so 5 shares make multiplier 1 over a
    # 2,000-entry model at clip 1 and scale 1,000: sigma_sum = 1 x (1,000 + sqrt(2,000) / 2) = 1,022.36
    noise = DistributedNoise.calibrated(multiplier=1.0, clip=1.0, scale=1e3, dimension=2000, min_survivors=5)
    rng = np.random.default_rng(1)
    sums = []
    # Execute: 20 secure sums (in the ring, as the coordinator unmasks them), decoded
    for _ in range(20):
        total = np.zeros(2000, ring_dtype(32))
        for _ in range(5):
            ring_accumulate(total, noise.encode(np.zeros(2000), rng=rng)[0], 32)
        sums.append(noise.decode_sum(total, 5)[0] * noise.scale)
    # Assert: the measured variance is the calibrated sigma^2 within 10 % (it lands within ~1 %)
    expected = (1e3 + math.sqrt(2000) / 2) ** 2
    assert abs(np.var(sums) / expected - 1) < 0.10


def test_a_device_clips_to_the_l2_norm_before_noising() -> None:
    # Prepare: an update of norm 5 (3, 4) at clip 1; noise so small it rounds to nothing (sigma 1e-3)
    noise = _noise(1e-3)
    # Execute
    vector, clipped = noise.encode(np.array([3.0, 4.0]), rng=np.random.default_rng(0))
    decoded, outside = noise.decode_sum(vector, 1)
    # Assert: (3, 4) / 5 = (0.6, 0.8), at scale 1,000 exactly
    assert clipped and outside == 0
    np.testing.assert_array_equal(decoded, [0.6, 0.8])


def test_a_device_that_does_not_clip_is_brought_back_into_range_and_counted() -> None:
    # Prepare: 3 devices' bound at clip 1, scale 1,000, sigma 10: 3 x 1,000.5 + 8 x 10 x sqrt(3) = 3,140.06
    noise = _noise(10.0)
    honest = noise.encode(np.array([0.1, 0.1, 0.1]), rng=np.random.default_rng(0))[0]
    hostile = np.array([2**30, 5, 2**31 - 10], np.uint32)  # an unclipped vector, one entry near the wrap
    total = np.zeros(3, np.uint32)
    for vector in (honest, honest, hostile):
        ring_accumulate(total, vector, 32)
    # Execute
    decoded, outside = noise.decode_sum(total, 3)
    # Assert: the two entries beyond the bound are counted and held at it; the other is untouched
    bound = noise.bound(3) / noise.scale
    assert outside == 2 and bound == pytest.approx(3.14006, abs=1e-4)
    assert decoded[0] == pytest.approx(bound) and decoded[2] == pytest.approx(-bound)
    assert abs(decoded[1]) < 0.5


def test_the_accounted_multiplier_follows_the_survivors_hand_computed() -> None:
    # Prepare: calibrated for 4 survivors to multiplier 2 over 10,000 entries at clip 1, scale 1e4:
    # Delta = 1e4 + 50 = 10,050; sigma = 2 x 10,050 / 2 = 10,050 per device
    noise = DistributedNoise.calibrated(multiplier=2.0, clip=1.0, scale=1e4, dimension=10_000, min_survivors=4)
    # Assert: tau is ~exp(-2 pi^2 1e8 / 2) = 0, so the multiplier is sqrt(n) sigma / Delta
    assert noise.stddev == pytest.approx(10_050.0)
    assert noise.multiplier(4, 10_000) == pytest.approx(2.0)
    assert noise.multiplier(16, 10_000) == pytest.approx(4.0)  # more survivors, more noise shares
    # ... and tiny shares pay the paper's tau: sigma 0.5 over 2 devices and 100 entries
    small = DistributedNoise(clip=1.0, scale=1.0, stddev=0.5, min_survivors=2)
    tau = 10 * math.exp(-2 * math.pi ** 2 * 0.25 / 2)
    assert small.multiplier(2, 100) == pytest.approx(1 / ((1 + 5) / math.sqrt(0.5) + 10 * tau))


def test_a_device_refuses_a_survivor_set_smaller_than_the_noise_was_calibrated_for() -> None:
    # Execute / Assert: 3 survivors, but the noise was calibrated for 4 shares
    with pytest.raises(ProtocolViolation, match="fewer than the 4 the distributed-DP noise was calibrated for"):
        check_survivors(survivors=[1, 2, 3], me=1, holding=[2, 3], neighbours=[2, 3], threshold=2, min_survivors=4)
    check_survivors(survivors=[1, 2, 3, 4], me=1, holding=[2, 3, 4], neighbours=[2, 3, 4], threshold=2,
                    min_survivors=4)


# --------------------------------------------------------------------------- the secure driver


class StubFleet:
    """Devices running fedge's own secure-aggregation handlers, each training to a known update (global model 0)."""

    def __init__(self, updates: list[list[float]]) -> None:
        self.updates = updates
        self.app = ClientApp()
        add_secure_handlers(self.app, self._train)

    def _train(self, msg: Message, context: Context) -> RecordDict:
        delta = self.updates[int(context.node_config["partition-id"])]
        return RecordDict({wire.ARRAYS: ArrayRecord({"w": Array(np.array(delta))}),
                           wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: 100 * (1 + len(delta))}),
                           wire.REPLY_META: ConfigRecord({wire.SERVER_ROUND: 1, wire.PROFILE: "laptop"})})

    def round(self, privacy: DistributedPrivacy) -> tuple[np.ndarray, MetricRecord, Any]:
        count = len(self.updates)
        nodes = [{"partition-id": i, "num-partitions": count, "profile": "laptop"} for i in range(count)]
        driver = SecureAggregation(precision=1e-4)
        strategy = FedAvg(driver=driver, privacy=privacy, clients_per_round=count, min_train_replies=3,
                          fraction_train=1.0, min_train_nodes=count, min_available_nodes=count, wait_for_nodes_s=0.0,
                          flower_lines=False, fraction_evaluate=0.0, selector=RandomSelector(0))
        strategy.rounds.state.reports.append(_report(count))
        new, metrics = driver.train_round(strategy.rounds, InlineGrid(self.app, nodes, {}), 1,
                                          ArrayRecord({"w": Array(np.zeros(2))}), ConfigRecord({}), 30.0)
        assert new is not None and metrics is not None
        return new["w"].numpy(), metrics, strategy.rounds.state.reports[-1]


def _report(count: int) -> RoundReport:
    return RoundReport(server_round=1, selected=count)


def test_a_secure_round_under_distributed_dp_is_the_clipped_uniform_mean_plus_the_devices_noise(
        caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: 4 devices (weights differ: DP ignores them); one update of norm 5 is clipped to 1;
    # multiplier 1e-4 so the noise (sigma_sum = 1e-4 x (1e4 + 0.71) ring units) is ~1e-4 of a unit
    fleet = StubFleet([[0.3, 0.4], [3.0, 4.0], [-0.2, 0.0], [0.1, 0.1]])
    privacy = DistributedPrivacy(noise_multiplier=1e-4, clipping_norm=1.0, num_sampled=4, population=4, delta=1e-5)
    # Execute
    with caplog.at_level(logging.INFO, logger="fedge"):
        mean, metrics, report = fleet.round(privacy)
    # Assert: (0.3 + 0.6 - 0.2 + 0.1, 0.4 + 0.8 + 0 + 0.1) / 4 = (0.2, 0.325), within the step and the noise
    np.testing.assert_allclose(mean, [0.2, 0.325], atol=1e-3)
    assert report.epsilon == privacy.epsilon > 0 and privacy.accountant.num_releases == 1
    # 4 shares, calibrated for 3 (each is 0.58 ring units: the paper's tau takes 0.01 % off)
    assert privacy.multipliers[0] == pytest.approx(1e-4 * math.sqrt(4 / 3), rel=1e-3)
    assert privacy.multipliers[0] < 1e-4 * math.sqrt(4 / 3)
    assert metrics["secagg-clipped-devices"] == 0  # a device's clipping stays on it under DP
    assert "distributed DP: 4 devices' noise shares" in caplog.text


def test_a_device_that_sends_an_unclipped_update_moves_the_dp_mean_by_at_most_the_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: device 0 skips clipping and noise and sends 1e6 in every entry of its share
    honest = secagg_device.encode_noised

    def unclipped(global_arrays: Any, trained: Any, params: Any) -> np.ndarray:
        vector = honest(global_arrays, trained, params)
        if float(np.asarray(trained.arrays["w"])[0]) == 9.0:
            vector[:2] = np.array([1e6 * float(params["dp-scale"])] * 2).astype(np.int64).view(np.uint64).astype(
                vector.dtype)
        return vector

    monkeypatch.setattr(secagg_device, "encode_noised", unclipped)
    fleet = StubFleet([[9.0, 0.0], [0.1, 0.1], [0.1, 0.1], [0.1, 0.1]])
    privacy = DistributedPrivacy(noise_multiplier=1e-4, clipping_norm=1.0, num_sampled=4, population=4, delta=1e-5)
    # Execute
    mean, _, report = fleet.round(privacy)
    # Assert: both entries beyond what 4 clipped devices reach are counted; the mean moved at most bound / 4
    assert report.dp_out_of_range == 2
    assert np.all(np.abs(mean) <= (4 * (1.0 + 0.5e-4) + 1e-3) / 4)


@pytest.mark.parametrize(("settings", "match"), [
    ({"dp": "distributed"}, "set secure-aggregation = true"),
    ({"dp": "server-fixed", "secure-aggregation": True}, "use dp = 'distributed'"),
    ({"dp": "client-adaptive", "secure-aggregation": True}, "use dp = 'distributed'"),
    ({"dp": "distributed", "secure-aggregation": True, "dp-noise-multiplier": 0.0}, "must be > 0"),
])
def test_dp_modes_that_cannot_hold_are_refused_naming_why(settings: dict[str, Any], match: str) -> None:
    config = resolve_run_config({"fleet": "laptop=6", "clients-per-round": 6, **settings})
    with pytest.raises(ConfigError, match=match):
        build_privacy(config, 6)


def test_central_dp_says_it_trusts_the_coordinator(caplog: pytest.LogCaptureFixture) -> None:
    config = resolve_run_config({"fleet": "laptop=6", "clients-per-round": 6, "dp": "server-fixed"})
    with caplog.at_level(logging.WARNING, logger="fedge"):
        build_privacy(config, 6)
    assert "central DP: the coordinator adds the noise and is trusted to" in caplog.text


def test_a_simulated_secure_run_under_distributed_dp_trains_and_reports_epsilon_each_round(tmp_path: Path) -> None:
    # Prepare: 6 laptops, all every round, secure aggregation with distributed DP
    config = {"fleet": "laptop=6", "clients-per-round": 6, "num-rounds": 3, "model": "logreg", "local-epochs": 1,
              "export-onnx": False, "secure-aggregation": True, "dp": "distributed", "dp-noise-multiplier": 0.5,
              "dp-clipping-norm": 1.0, "run-dir": str(tmp_path / "r")}
    # Execute
    run_dir, summary = simulate(config, progress=False)
    # Assert: ε grows every round, is in metrics.jsonl and summary.json with who added the noise
    rows = [row for row in read_jsonl(run_dir / "metrics.jsonl") if row["round"] > 0]
    epsilons = [row["dp_epsilon"] for row in rows]
    assert len(epsilons) == 3 and 0 < epsilons[0] < epsilons[1] < epsilons[2]
    assert all(row["aggregated"] and row["dp_out_of_range"] == 0 for row in rows)
    assert summary["dp"]["mode"] == "distributed" and summary["dp"]["releases"] == 3
    assert "the devices" in summary["dp"]["noise_added_by"]


# --------------------------------------------------------------------------- through gateways


@pytest.mark.parametrize(("dp", "refused"), [("server-fixed", True), ("client-adaptive", True), ("distributed", False)])
def test_gateways_take_distributed_dp_and_refuse_central_dp(dp: str, refused: bool) -> None:
    # Prepare: secure pools through gateways
    config = resolve_run_config({"gateways": True, "secure-aggregation": True, "dp": dp})
    strategy = build_strategy(resolve_run_config({"secure-aggregation": True}))
    # Execute / Assert: central DP would clip gateways' means; distributed DP is noised on the pools' devices
    if refused:
        with pytest.raises(ConfigError, match="dp = 'distributed' with secure-aggregation composes"):
            check_hierarchical(config, strategy)
    else:
        check_hierarchical(config, strategy)


def test_a_coordinator_over_gateways_accounts_each_round_of_pools_at_the_calibrated_multiplier() -> None:
    # Prepare
    privacy = DistributedPrivacy(noise_multiplier=1.5, clipping_norm=1.0, num_sampled=100, population=1000,
                                 delta=1e-5)
    # Execute: three rounds over gateways' pools
    epsilons = [privacy.release_pools() for _ in range(3)]
    # Assert: the same as three Gaussian releases at multiplier 1.5 (each pool carries at least that)
    central = DifferentialPrivacy(mode="server-fixed", noise_multiplier=1.5, clipping_norm=1.0, num_sampled=100,
                                  population=1000, delta=1e-5)
    assert epsilons == [central.release() for _ in range(3)] and privacy.multipliers == [1.5] * 3
