"""Checkpoints written before strategies became rule + driver compositions still resume, exactly;
a checkpoint of another strategy, or state the rule does not keep, is refused by name.

``data/checkpoint-fedadam-before-rules.npz`` was written by commit 9aceb84 (FedAdam as a FedAvg
subclass), by ``bench/pin.py``'s ``fedadam`` case: 3 rounds of ``PIN`` below.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedge.errors import CheckpointMismatch
from fedge.server.checkpoint import load_checkpoint
from fedge.simulation.runner import simulate
from fedge.strategies.fedadam import Adaptive
from fedge.strategies.fedavg import Mean
from fedge.strategies.fedavgm import Momentum
from fedge.strategies.rule import Rule

FIXTURE = Path(__file__).parent / "data" / "checkpoint-fedadam-before-rules.npz"
PIN: dict[str, Any] = {"fleet": "laptop=12", "clients-per-round": 11, "export-onnx": False, "seed": 7, "model": "mlp",
                       "strategy": "fedadam"}


def _old_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    shutil.copy(FIXTURE, run_dir / "checkpoint.npz")
    return run_dir


def test_a_checkpoint_from_before_the_split_resumes_exactly(tmp_path: Path) -> None:
    # Prepare: the old checkpoint after round 3 (Adam's moments as m/<name>, v/<name>)
    old = _old_run(tmp_path)
    assert load_checkpoint(old / "checkpoint.npz").server_round == 3
    # Execute: resume it to round 5, and run rounds 1..5 from scratch with today's code
    simulate({**PIN, "num-rounds": 5, "run-dir": str(old), "resume": True}, progress=False)
    fresh, _ = simulate({**PIN, "num-rounds": 5, "run-dir": str(tmp_path / "fresh")}, progress=False)
    # Assert: the same model and the same moments (the rule restored the old state). Bit for bit on the CPU that
    # wrote the fixture; another CPU's float rounding puts rounds 1-3 up to ~3e-8 off (measured), so the model and
    # moments agree to 1e-6 there. A state not restored (moments from zero) is off by far more.
    resumed, straight = load_checkpoint(old / "checkpoint.npz"), load_checkpoint(fresh / "checkpoint.npz")
    assert resumed.server_round == straight.server_round == 5
    for mine, theirs in ((resumed.arrays, straight.arrays), (resumed.strategy_state, straight.strategy_state)):
        assert mine.keys() == theirs.keys()
        for key in mine:
            np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_a_checkpoint_of_another_strategy_is_refused_by_name(tmp_path: Path) -> None:
    # Prepare: FedAdam's checkpoint, resumed as FedAvgM with the same model settings
    old = _old_run(tmp_path)
    # Execute / Assert: refused before any round, naming the strategy it was made with
    with pytest.raises(CheckpointMismatch, match="'strategy': 'fedadam'"):
        simulate({**PIN, "strategy": "fedavgm", "num-rounds": 5, "run-dir": str(old), "resume": True}, progress=False)
    assert load_checkpoint(old / "checkpoint.npz").server_round == 3


def test_privacy_state_resumed_without_dp_is_refused_by_name(tmp_path: Path) -> None:
    # Prepare: one round of FedAvg under DP (its checkpoint holds the accountant's history)
    run_dir = tmp_path / "dp"
    simulate({**PIN, "strategy": "fedavg", "dp": "server-fixed", "num-rounds": 1, "run-dir": str(run_dir)},
             progress=False)
    # Execute / Assert: resumed with dp off, the privacy spent would be forgotten: refused, naming the state
    with pytest.raises(CheckpointMismatch, match=r"rule Mean does not keep: 'dp-accountant'"):
        simulate({**PIN, "strategy": "fedavg", "num-rounds": 2, "run-dir": str(run_dir), "resume": True},
                 progress=False)
    assert load_checkpoint(run_dir / "checkpoint.npz").server_round == 1


@pytest.mark.parametrize(("rule", "state", "refused"), [
    (Mean(), {"velocity/w": np.zeros(1)}, "'velocity/w'"),
    (Momentum(server_momentum=0.9), {"m/w": np.zeros(1), "velocity/w": np.zeros(1)}, "'m/w'"),
    (Adaptive(), {"m/w": np.zeros(1), "v/w": np.zeros(1), "dp-clipping-norm": np.ones(1)}, "'dp-clipping-norm'"),
])
def test_a_rule_refuses_state_it_does_not_keep(rule: Rule, state: dict[str, np.ndarray], refused: str) -> None:
    # Execute / Assert
    with pytest.raises(CheckpointMismatch, match=f"{type(rule).__name__} does not keep: {refused};"):
        rule.check_state(state)
