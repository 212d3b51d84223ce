"""Differential privacy: Flower's DP wrappers and mods driven by run config, ε accounted per round."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedge.cli.main import main
from fedge.config import resolve_run_config
from fedge.server.app import run_coordinator
from fedge.server.checkpoint import load_checkpoint
from fedge.server.report import read_jsonl
from fedge.simulation.grid import InlineGrid
from fedge.simulation.runner import simulate
from replies import drop_out, tampered_app

BASE = {"fleet": "laptop=12", "clients-per-round": 6, "num-rounds": 3, "model": "logreg", "local-epochs": 1,
        "export-onnx": False, "dp-noise-multiplier": 1.0}


def _classic_rdp_epsilon(z: float, releases: int, delta: float) -> float:
    """Mironov's RDP bound for ``releases`` Gaussian releases: min over orders of
    ``releases * a / (2 z^2) + log(1/delta) / (a - 1)``."""
    return min(releases * a / (2 * z * z) + math.log(1 / delta) / (a - 1) for a in np.linspace(1.01, 200, 20_000))


@pytest.mark.parametrize("mode", ["server-fixed", "client-fixed", "server-adaptive", "client-adaptive"])
def test_a_dp_run_reports_epsilon_growing_with_rounds(mode: str, tmp_path: Path) -> None:
    # Execute: federated evaluation on too, so the per-handler mods must leave evaluate replies alone
    run_dir, summary = simulate({**BASE, "dp": mode, "fraction-evaluate": 0.5, "run-dir": str(tmp_path / "r")},
                                progress=False)
    # Assert: ε after each round, increasing, and no larger than the classic RDP bound
    rows = read_jsonl(run_dir / "metrics.jsonl")[1:]
    epsilons = [row["dp_epsilon"] for row in rows]
    assert all(row["aggregated"] for row in rows)
    assert epsilons == sorted(epsilons) and epsilons[0] < epsilons[-1]
    for releases, epsilon in enumerate(epsilons, start=1):
        assert 0.5 * _classic_rdp_epsilon(1.0, releases, 1e-5) < epsilon <= _classic_rdp_epsilon(1.0, releases, 1e-5)
    assert summary["dp"]["epsilon"] == epsilons[-1] and summary["dp"]["delta"] == 1e-5
    assert summary["dp"]["mode"] == mode and summary["dp"]["releases"] == 3


def _moved(run_dir: Path) -> float:
    """L2 distance the global model moved in round 1."""
    first = load_checkpoint(run_dir / "checkpoints" / "round-0000.npz").arrays
    second = load_checkpoint(run_dir / "checkpoints" / "round-0001.npz").arrays
    return float(np.sqrt(sum(np.sum((second[k] - first[k]) ** 2) for k in first)))


@pytest.mark.parametrize("mode", ["server-fixed", "client-fixed"])
def test_clipping_bounds_how_far_one_round_moves_the_model(mode: str, tmp_path: Path) -> None:
    # Prepare: clip each update to norm 0.01, almost no noise
    clipped = {**BASE, "num-rounds": 1, "dp": mode, "dp-clipping-norm": 0.01, "dp-noise-multiplier": 1e-4}
    # Execute
    plain, _ = simulate({**BASE, "num-rounds": 1, "run-dir": str(tmp_path / "plain")}, progress=False)
    private, _ = simulate({**clipped, "run-dir": str(tmp_path / "dp")}, progress=False)
    # Assert: the mean of updates of norm <= 0.01 moves at most 0.01 (+ noise std 1e-6 per weight)
    assert _moved(plain) > 0.1
    assert _moved(private) <= 0.01 + 1e-3


def test_a_failing_device_is_left_out_and_the_dp_round_goes_on(tmp_path: Path) -> None:
    # Prepare: partition 2 fails every time it trains
    app = tampered_app(2, "train", drop_out)
    config = resolve_run_config({**BASE, "fleet": "laptop=6", "num-rounds": 2, "dp": "server-fixed",
                                 "run-dir": str(tmp_path / "r")})
    nodes = [{"partition-id": i, "num-partitions": 6, "profile": "laptop"} for i in range(6)]
    # Execute
    run_dir = run_coordinator(InlineGrid(app, nodes, config), config, progress=False)
    # Assert: Flower's wrapper alone would skip a round with an error reply; fedge leaves the device out
    rows = read_jsonl(run_dir / "metrics.jsonl")[1:]
    assert [(row["aggregated"], row["failed"]) for row in rows] == [(True, 1), (True, 1)]
    assert rows[-1]["dp_epsilon"] > rows[0]["dp_epsilon"] > 0


def test_a_resumed_run_goes_on_spending_privacy(tmp_path: Path) -> None:
    # Execute: 3 rounds straight, and 2 rounds then a resume to 3
    straight, _ = simulate({**BASE, "dp": "server-adaptive", "run-dir": str(tmp_path / "a")}, progress=False)
    simulate({**BASE, "dp": "server-adaptive", "num-rounds": 2, "run-dir": str(tmp_path / "b")}, progress=False)
    resumed, summary = simulate({**BASE, "dp": "server-adaptive", "resume": True, "run-dir": str(tmp_path / "b")},
                                progress=False)
    # Assert: the same ε after round 3 (the accountant's history came back from the checkpoint)
    assert summary["dp"]["releases"] == 3
    assert read_jsonl(resumed / "metrics.jsonl")[-1]["dp_epsilon"] == pytest.approx(
        read_jsonl(straight / "metrics.jsonl")[-1]["dp_epsilon"])


@pytest.mark.parametrize(("overrides", "reason"), [
    ({"dp": "server-fixed", "strategy": "median"}, "works with strategy fedavg, fedprox"),
    ({"dp": "client-fixed", "secure-aggregation": "true"}, "use dp = 'distributed'"),
    ({"dp": "server-fixed", "dp-noise-multiplier": 0.0}, "ε is infinite"),
    ({"dp": "central"}, "use one of: off, server-fixed"),
    ({"dp-delta": 1.5}, "must be in (0, 1)"),
])
def test_impossible_dp_settings_are_refused_at_start(
    overrides: dict[str, Any], reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Execute
    args = " ".join(f"{k}={v!r}" if isinstance(v, str) and k == "dp" else f"{k}={v}" for k, v in overrides.items())
    code = main(["simulate", "--quiet", "--fleet", "laptop=10", "--run-config", args,
                 "--run-dir", str(tmp_path / "r")])
    # Assert
    assert code == 2 and reason in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_the_mean_has_a_fixed_denominator_whoever_dropped_out() -> None:
    # Prepare: K = 6 sampled, only 2 updates arrived; the global model is 0, their mean is 3
    from flwr.app import Array, ArrayRecord

    from fedge.server.privacy import DifferentialPrivacy
    from fedge.strategies import FedAvg
    from fedge.strategies.screening import fixed_denominator

    strategy = FedAvg(clients_per_round=6, privacy=DifferentialPrivacy(
        mode="server-fixed", noise_multiplier=1.0, clipping_norm=1.0, num_sampled=6, population=10, delta=1e-5))
    strategy.global_arrays = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    # Execute
    result = fixed_denominator(strategy.rounds, {"w": np.full(3, 3.0, np.float32)}, count=2)
    # Assert: global + (3 + 3) / 6 = 1, the step DP-FedAvg's sensitivity clip / K is computed for
    np.testing.assert_allclose(result["w"], np.ones(3))
