"""What strategies and round policies may know about time and traffic: a Protocol.

The metering Grid (:class:`fedge.server.metering.MeteredGrid`) satisfies it; strategies
never import it (it lies above them). A plain Flower ``Grid`` does not: strategies then
fall back to ``send_and_receive`` and learn nothing about arrival times.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from flwr.app import Message


@runtime_checkable
class TimedGrid(Protocol):
    """A Grid that tells when each reply arrived and counts what a round moved.

    Attributes
    ----------
    sim_time : float
        Seconds on the (virtual or real) clock since the run began.
    last_durations : dict[int, float]
        Each replying node's duration in the last exchange.
    """

    sim_time: float
    last_durations: dict[int, float]

    @property
    def virtual(self) -> bool:
        """Whether exchanges happen on a virtual clock (simulation), not in real time."""

    def exchange_timed(self, messages: list[Message], timeout: float | None) -> list[tuple[Message, float]]:
        """Send and collect replies with each one's arrival time (seconds after sending)."""

    def stream_timed(self, messages: list[Message], timeout: float | None) -> Iterator[tuple[Message, float]]:
        """:meth:`exchange_timed`, one reply at a time as each arrives (each can be let go before the next)."""

    def advance(self, seconds: float) -> None:
        """Move the clock on by ``seconds``."""

    def count_participants(self, replies: list[Message]) -> None:
        """Count the replies a round keeps."""

    def count_bytes(self, *, up: int = 0, down: int = 0) -> None:
        """Charge traffic the Grid did not see itself (pushes and pulls a strategy made)."""


def timed(grid: object) -> TimedGrid | None:
    """``grid`` as a :class:`TimedGrid`, or ``None`` when it is a plain Flower Grid."""
    return grid if isinstance(grid, TimedGrid) else None


def virtual(grid: object) -> TimedGrid | None:
    """``grid`` as a :class:`TimedGrid` on a virtual clock, or ``None``."""
    found = timed(grid)
    return found if found is not None and found.virtual else None


def durations(grid: object) -> dict[int, float]:
    """The last exchange's per-node durations, empty for a plain Grid."""
    found = timed(grid)
    return found.last_durations if found is not None else {}


__all__ = ["TimedGrid", "durations", "timed", "virtual"]
