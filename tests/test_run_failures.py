"""Runs that go wrong end loudly and ship nothing (issue 25 items 1 and 5).

Before: a run whose every update was rejected or failed went on for every round, printed
``run finished`` and exited 0; it then signed the unchanged (or diverged) model and published it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fedge.cli.deploy import _summary_failure
from fedge.config import resolve_run_config
from fedge.errors import ExportError, RunFailed
from fedge.strategies.drivers.base import RoundReport
from fedge.strategies.systematic import systematic_reason
from fedge.strategies.validation import Failure, Rejection
from fedge.task.builtin.digits import Digits


def _report(server_round: int, accepted: int = 0, rejected: tuple[str, ...] = (),
            failed: tuple[tuple[str, bool], ...] = ()) -> RoundReport:
    return RoundReport(server_round=server_round, selected=len(rejected) + len(failed) + accepted, accepted=accepted,
                       rejected=[Rejection(10 + i, reason) for i, reason in enumerate(rejected)],
                       failed=[Failure(20 + i, reason, systematic=systematic)
                               for i, (reason, systematic) in enumerate(failed)])


SHAPE = "arrays do not match the model: wrong shape"
RAISED = "device error: TypeError: bad batch"
GONE = "device error: Node Unavailable"


@pytest.mark.parametrize(("reports", "expected"), [
    ([_report(1, rejected=(SHAPE, SHAPE)), _report(2, rejected=(SHAPE, SHAPE, SHAPE))], SHAPE),
    ([_report(1, failed=((RAISED, True),)), _report(2, failed=((RAISED, True), (GONE, False)))], RAISED),
    ([_report(1, rejected=(SHAPE,)), _report(2, accepted=1, rejected=(SHAPE,))], None),
    ([_report(1, rejected=(SHAPE,)), _report(2, rejected=(SHAPE, "not finite"))], None),
    ([_report(1, failed=((GONE, False),)), _report(2, failed=((GONE, False),))], None),
    ([_report(1, rejected=(SHAPE,))], None),
    ([_report(1, rejected=(SHAPE,)), _report(2), _report(3, rejected=(SHAPE,))], None),
], ids=["two rounds, one shape", "raised, one device away", "an update accepted", "two reasons",
        "devices away only", "one round", "a round with no reply between"])
def test_a_run_stops_when_every_update_of_two_rounds_is_left_out_for_one_reason(
        reports: list[RoundReport], expected: str | None) -> None:
    # Execute / Assert
    assert systematic_reason(reports) == expected


class LossFailsOnDevices(Digits):
    """Digits with a loss that raises on batches over 4 (the start-up check uses 2 examples)."""

    name = "fragile-digits"

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if len(targets) > 4:
            raise ValueError("this loss takes at most 4 examples")
        return super().loss(outputs, targets)


def _failed_run(fast_config: dict[str, Any], rounds: int) -> tuple[str, Path]:
    """Simulate ``rounds`` rounds of 2 of 4 devices that all fail; the RunFailed message and the run directory."""
    from fedge.simulation.runner import simulate

    overrides = {**fast_config, "fleet": "laptop=4", "clients-per-round": 2, "num-rounds": rounds, "export-onnx": True}
    task = LossFailsOnDevices(resolve_run_config(overrides))
    with pytest.raises(RunFailed) as failed:
        simulate(overrides, task=task, progress=False)
    return str(failed.value), Path(fast_config["run-dir"])


def test_a_simulated_run_whose_devices_all_fail_the_same_way_stops_after_two_rounds(
        fast_config: dict[str, Any]) -> None:
    # Execute: 5 rounds asked for
    message, run_dir = _failed_run(fast_config, rounds=5)
    # Assert: stopped after round 2 naming the reason (not after 5 rounds with exit 0); nothing signed
    assert "every update of rounds 1-2 (4 replies) was left out for the same reason" in message
    assert "ValueError: this loss takes at most 4 examples" in message
    assert not (run_dir / "summary.json").exists()
    assert not list(run_dir.glob("bundles/*"))


def test_a_run_with_no_accepted_update_exits_failed_and_publishes_nothing(fast_config: dict[str, Any]) -> None:
    # Execute: one round, every device fails (too short a run for the two-round stop)
    message, run_dir = _failed_run(fast_config, rounds=1)
    # Assert: one line naming why; summary.json says so; no bundle was signed
    assert "no device update was accepted in 1 round(s) (2 left out; most often: device error: ValueError" in message
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "no device update was accepted" in summary["failure"] and summary["failed"] == 2
    assert _summary_failure(run_dir) == summary["failure"]
    assert not list(run_dir.glob("bundles/*")) and not (run_dir / "model.onnx").exists()


def test_a_finished_run_with_a_failed_reply_is_not_taken_for_a_failed_run(tmp_path: Path) -> None:
    # Prepare: a finished run's summary: one device's reply failed in one round (a dead device)
    (tmp_path / "summary.json").write_text(json.dumps({"rounds": 3, "failed": 1, "rejected": 0}))
    # Execute / Assert: the coordinator reports it finished (it said "the run failed: 1" and exited 1)
    assert _summary_failure(tmp_path) is None


def test_a_model_that_is_not_finite_is_never_signed(tmp_path: Path, fast_config: dict[str, Any]) -> None:
    # Prepare: a global model with one NaN weight
    from fedge.edge.signing import generate_signing_key, load_private_key
    from fedge.server.bundles import export_global_model

    config = resolve_run_config({**fast_config, "model": "mlp"})
    task = Digits(config)
    model = task.build_model()
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    key = load_private_key(generate_signing_key(tmp_path / "keys")[0])
    # Execute / Assert
    with pytest.raises(ExportError, match=r"not finite \(net.0.weight holds NaN or inf\)"):
        export_global_model(model, tmp_path / "bundle", config=config, task=task, server_round=3,
                            source_run="r", private_key=key)
    assert not (tmp_path / "bundle").exists()


FRAGILE_TASK = '''
from fedge.task.builtin.digits import Digits


class Fragile(Digits):
    name = "fragile-digits"

    def loss(self, outputs, targets):
        if len(targets) > 4:
            raise ValueError("this loss takes at most 4 examples")
        return super().loss(outputs, targets)
'''


def test_fedge_simulate_exits_1_with_one_line_when_the_run_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: the task in a module of the working directory, as a user's would be
    from fedge.cli.main import main

    (tmp_path / "fragile_task.py").write_text(FRAGILE_TASK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    # Execute
    code = main(["simulate", "--task", "fragile_task:Fragile", "--fleet", "laptop=4", "--clients-per-round", "2",
                 "--rounds", "4", "--run-dir", str(tmp_path / "run"), "--quiet"])
    # Assert: status 1 (the run went and failed; 2 is for refused input) and one error line
    err = capsys.readouterr().err
    assert code == 1
    errors = [line for line in err.splitlines() if line.startswith("fedge: error:")]
    assert len(errors) == 1 and "fedge: error: the run failed: every update of rounds 1-2" in errors[0], err
