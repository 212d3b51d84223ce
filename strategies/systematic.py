"""When to stop a run whose every update is left out for one reason (a task or data mistake, not bad luck).

A device that is offline or slow says nothing about the run; a reply rejected because its
arrays have the wrong shape, or a ClientApp that raises the same ``TypeError`` on every device,
will do so again next round. Flower's loop would go on for every remaining round and end with
the initial model and exit status 0; fedge stops after ``ROUNDS`` such rounds with one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from fedge.strategies.validation import Failure, Rejection

ROUNDS = 2  # consecutive rounds with every reply left out for the same reason


class _Report(Protocol):
    server_round: int
    accepted: int
    rejected: list[Rejection]
    failed: list[Rejection]


def systematic_reason(reports: Sequence[_Report], rounds: int = ROUNDS) -> str | None:
    """The one reason every reply of the last ``rounds`` rounds was left out, if there is one.

    A round counts when no update was accepted, at least one reply was rejected (validation)
    or failed systematically (its ClientApp raised), and every such reply gives the same
    reason. Failures of devices that went away (unavailable, crashed) are not counted either
    way: they neither make a round systematic nor keep it from being so.

    Returns
    -------
    str | None
        The shared reason, or None while the run should go on.
    """
    if len(reports) < rounds:
        return None
    reasons: set[str] = set()
    for report in reports[-rounds:]:
        left_out = [r for r in [*report.rejected, *report.failed] if not isinstance(r, Failure) or r.systematic]
        if report.accepted or not left_out:
            return None
        reasons.update(r.reason for r in left_out)
    return reasons.pop() if len(reasons) == 1 else None


def stop_message(reports: Sequence[_Report], reason: str, rounds: int = ROUNDS) -> str:
    """The one line that ends such a run: which rounds, how many replies, the reason and the fix."""
    last = reports[-rounds:]
    replies = sum(len(r.rejected) + len(r.failed) for r in last)
    first = last[0].server_round
    return (f"every update of rounds {first}-{last[-1].server_round} ({replies} replies) was left out for the same "
            f"reason: {reason}; the global model is kept as it was after round {first - 1}. This repeats every "
            "round until the task, its data or the devices change: fix that, then resume the run")
