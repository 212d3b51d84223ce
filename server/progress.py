"""A rich progress bar over rounds (a no-op when disabled, e.g. in tests)."""

from __future__ import annotations

from types import TracebackType

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RoundProgress:
    """Shows ``round k/N``, the latest headline metric and the simulated clock."""

    def __init__(self, num_rounds: int, headline: str = "accuracy", *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._bar = Progress(
            TextColumn("[bold]rounds"), BarColumn(), MofNCompleteColumn(),
            TextColumn(f"{headline} " + "{task.fields[value]}  sim {task.fields[sim]:.0f}s"),
            TimeElapsedColumn(), disable=not enabled,
        )
        self._task = self._bar.add_task("rounds", total=num_rounds, value="-", sim=0.0)

    def __enter__(self) -> RoundProgress:
        self._bar.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._bar.stop()

    def advance(self, server_round: int, headline: float | None, sim_time: float) -> None:
        """Show the state after ``server_round`` (round 0 is the initial model)."""
        shown = "-" if headline is None else f"{headline:.4f}"
        self._bar.update(self._task, completed=server_round, value=shown, sim=sim_time)
