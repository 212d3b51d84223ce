"""FedBuff on the common round machinery (issue 13, item 6): the selector (and Oort's
fairness rule), straggler simulation and downlink codecs apply to it as to the
synchronous strategies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedge.errors import ConfigError
from fedge.server.checkpoint import load_checkpoint
from fedge.simulation.runner import simulate
from fedge.strategies.selection import OortSelector, RandomSelector

BASE = {"fleet": "phone=6,laptop=4,gpu-box=2", "model": "mlp", "local-epochs": 2, "export-onnx": False,
        "strategy": "fedbuff", "concurrency": 4, "buffer-size": 2, "num-rounds": 4, "clients-per-round": 4}


class Spy(OortSelector):
    """Oort, remembering the rounds it was asked about and what it observed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.select_rounds: list[int] = []
        self.observed: list[tuple[int, int, float]] = []

    def select(self, server_round: int, node_ids: Any, k: int) -> list[int]:  # noqa: D102
        self.select_rounds.append(server_round)
        return super().select(server_round, node_ids, k)

    def observe(self, server_round: int, replies: Any, durations: Any) -> None:  # noqa: D102
        self.observed += [(server_round, r.metadata.src_node_id, durations.get(r.metadata.src_node_id, -1.0))
                          for r in replies]
        super().observe(server_round, replies, durations)


def test_the_selector_sees_real_rounds_and_learns_from_every_arrival(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    # Prepare: capture the selector the coordinator builds for selector = oort
    spies: list[Spy] = []

    def build(config: Any) -> RandomSelector:
        spies.append(Spy(int(config["seed"]), preferred_s=10.0, epsilon=0.2, fairness_rounds=20))
        return spies[-1]

    monkeypatch.setattr("fedge.server.app.build_selector", build)
    # Execute
    simulate({**BASE, "selector": "oort", "run-dir": str(tmp_path / "r")}, progress=False)
    # Assert: rounds 1..4 (never version * 7919 + launches), and every arrival observed with its duration
    spy = spies[0]
    assert set(spy.select_rounds) <= set(range(1, 5)) and 1 in spy.select_rounds
    assert len(spy.observed) >= 8 and all(duration > 0 for _, _, duration in spy.observed)
    assert spy.records  # Oort learned utilities


def test_stragglers_do_partial_work_and_it_is_kept(tmp_path: Path) -> None:
    # Execute: every launch is a straggler (1 of the 2 local epochs)
    run_dir, _ = simulate({**BASE, "straggler-fraction": 1.0, "run-dir": str(tmp_path / "r")}, progress=False)
    events = [json.loads(line) for line in (Path(run_dir) / "devices.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    # Assert: all flushes aggregated (partial work kept) and devices were charged for half the work
    full, _ = simulate({**BASE, "run-dir": str(tmp_path / "f")}, progress=False)
    full_rows = [json.loads(line) for line in (Path(full) / "metrics.jsonl").read_text().splitlines()]
    assert all(row["aggregated"] for row in rows[1:]) and events
    assert rows[-1]["sim_time_s"] < full_rows[-1]["sim_time_s"]


def test_downlink_codecs_apply_to_fedbuff(tmp_path: Path) -> None:
    # Execute: int8 downlink to every device vs the fp32 default
    _, plain = simulate({**BASE, "run-dir": str(tmp_path / "p")}, progress=False)
    _, int8 = simulate({**BASE, "downlink.default": "int8", "run-dir": str(tmp_path / "q")}, progress=False)
    # Assert: about 4x fewer bytes down (int8 vs fp32), and the run still learns
    ratio = plain["bytes_down"] / int8["bytes_down"]
    assert 3.0 < ratio < 4.1, ratio
    assert int8["final_accuracy"] > 0.3


def test_fedbuff_is_its_rule_under_the_asynchronous_driver(tmp_path: Path) -> None:
    # Execute: fedbuff, and fedbuff with the asynchronous driver asked for by the run config
    plain, _ = simulate({**BASE, "run-dir": str(tmp_path / "p")}, progress=False)
    asked, _ = simulate({**BASE, "asynchronous": True, "run-dir": str(tmp_path / "a")}, progress=False)
    # Assert: the same model, array for array (one driver, built from the same keys)
    first, second = load_checkpoint(plain / "checkpoint.npz").arrays, load_checkpoint(asked / "checkpoint.npz").arrays
    assert first.keys() == second.keys() and all(np.array_equal(first[k], second[k]) for k in first)


def test_a_server_optimiser_runs_asynchronously(tmp_path: Path) -> None:
    # Execute: FedAdam's rule in FedBuff's buffered asynchronous rounds
    run_dir, summary = simulate({**BASE, "strategy": "fedadam", "asynchronous": True, "adaptive-learning-rate": 0.05,
                                 "num-rounds": 6, "run-dir": str(tmp_path / "r")}, progress=False)
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    state = load_checkpoint(Path(run_dir) / "checkpoint.npz").strategy_state
    # Assert: six flushes, each of a buffer's worth of arrivals; Adam's moments checkpointed; the model learned
    assert [row["round"] for row in rows] == list(range(7)) and all(row["aggregated"] for row in rows[1:])
    assert any(key.startswith("m/") for key in state) and any(key.startswith("v/") for key in state)
    assert summary["final_accuracy"] > rows[0]["accuracy"] + 0.2


@pytest.mark.parametrize(("overrides", "reason"), [
    ({"strategy": "fednova", "asynchronous": True}, "NormalisedMean cannot run asynchronously"),
    ({"strategy": "median", "asynchronous": True}, "CoordinateMedian cannot run asynchronously"),
    ({"strategy": "fedavg", "asynchronous": True, "secure-aggregation": True}, "secure-aggregation runs synchronous"),
])
def test_rules_the_asynchronous_driver_cannot_run_are_refused_at_start(overrides: dict[str, Any], reason: str,
                                                                       tmp_path: Path) -> None:
    # Execute / Assert: refused before anything runs, naming the rule
    with pytest.raises(ConfigError, match=reason):
        simulate({**BASE, **overrides, "run-dir": str(tmp_path / "r")}, progress=False)
    assert not (tmp_path / "r").exists()
