"""A coordinator's run goes on when its ServerApp is lost, not failed.

Flower's SuperLink ends a run whose ServerApp sent no heartbeat for 60 s (``HEARTBEAT_PATIENCE
x HEARTBEAT_DEFAULT_INTERVAL`` in flwr 1.42, not settable). A machine that stalls that long (a
virtual machine its host paused, swap, a laptop lid) or a ServerApp the kernel killed loses the
run though nothing in it was wrong; ``flwr run`` then ends without a word. The coordinator tells
that apart from a run that failed (the ServerApp reported an exception, or wrote its summary) or
was stopped (``flwr stop``): it goes on only when the SuperLink says the run failed for want of a
heartbeat, and then after its last checkpointed round, at most ``restarts`` times, saying so on
the console and in ``STATE_DIR/run.log``. A run lost before its first checkpoint (round 0's,
written once the initial model is evaluated) starts over.

Threat model: the ServerApp is the coordinator's own process; what it lost is its lease on the
SuperLink. The lost process is stopped before the run goes on, so it cannot write to the run
directory when it wakes (its task token is revoked: nothing it sends counts).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from fedge import knobs
from fedge.config import Scalar
from fedge.files import open_private_append

if TYPE_CHECKING:
    from fedge.server.coordinator import Coordinator, RunOutput

DEFAULT_RESTARTS = 3


def was_lost(output: RunOutput, run_dir: Path) -> bool:
    """Whether the run started, then ended without a summary and without its ServerApp reporting why."""
    return (output.run_id is not None and not (run_dir / "summary.json").exists() and output.error is None
            and output.exit_code is None)


def lost_for_want_of_a_heartbeat(status: str) -> bool:
    """Whether the SuperLink's word on a run (``finished:failed (No heartbeat received from the task)``) says it
    ended the run because its ServerApp went silent (not stopped by an operator, not still running)."""
    return status.startswith("finished:failed") and "heartbeat" in status.lower()


def run_with_restarts(coordinator: Coordinator, run_config: Mapping[str, Scalar], *, restarts: int) -> RunOutput:
    """Run ``run_config`` on ``coordinator``; go on after a lost ServerApp up to ``restarts`` times."""
    run_dir = Path(str(run_config[knobs.RUN_DIR]))
    output = coordinator.run(run_config)
    for restart in range(1, restarts + 1):
        superlink = coordinator.superlink
        if coordinator.stopped or not was_lost(output, run_dir) or superlink is None or superlink.poll() is not None:
            break  # stopped on purpose, finished or failed, or the SuperLink itself is gone
        why = coordinator.run_status(output.run_id)
        if not lost_for_want_of_a_heartbeat(why):
            break  # stopped by an operator, still running, or the SuperLink cannot say: reported as it ended
        stopped = coordinator.end_lost_server_app()
        resume = (run_dir / "checkpoint.npz").exists()
        _say(coordinator.state_dir / "run.log",
             f"WARNING: the run's ServerApp was lost, not failed: the SuperLink says {why} (it hears from a "
             "ServerApp every 30 s and ends its run after 60 s of silence: a stalled machine or a killed process)"
             + (f"; {stopped} ServerApp process stopped" if stopped else "")
             + (". The run goes on after its last checkpointed round" if resume else
                ". No round was checkpointed: the run starts over")
             + f" (restart {restart} of {restarts}; `--restarts` sets how many)")
        output = coordinator.run({**run_config, knobs.RESUME: True} if resume else run_config)
    return output


def _say(log: Path, line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    with open_private_append(log, text=True) as handle:
        handle.write(line + "\n")
