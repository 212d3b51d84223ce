"""A rich progress bar over rounds (a no-op when disabled, e.g. in tests); a deployed run's round lines."""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedge import knobs


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


class RunFeed:
    """Follows a run directory from another process and prints one line per round, then a summary.

    What ``fedge coordinator start`` shows the operator while Flower runs the ServerApp: each
    round's participants against the expected count, the headline metric and the round's time,
    and why a round was not aggregated or which devices failed (by name, from ``names``);
    at the end one final line and the most frequent device failure reasons.
    """

    def __init__(self, run_dir: Path, names: Callable[[], dict[str, str]], out: IO[str] | None = None) -> None:
        self.run_dir, self.names, self.out = run_dir, names, out or sys.stdout
        self.offsets = {"metrics.jsonl": 0, "devices.jsonl": 0}
        self.events: dict[int, list[dict[str, Any]]] = {}  # failed or rejected device replies by round
        self.failures: Counter[str] = Counter()
        self.failed_devices: dict[str, set[str]] = {}
        self.last_wall: float | None = None
        self.rounds_seen = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RunFeed:  # noqa: D102
        self._thread = threading.Thread(target=self._follow, name="fedge-run-feed", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop following (after one last read)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.poll()

    def _follow(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.poll()
            except OSError:
                continue

    def _new_rows(self, name: str) -> list[dict[str, Any]]:
        path = self.run_dir / name
        if not path.exists():
            return []
        if path.stat().st_size < self.offsets[name]:  # rewritten (a resumed run starts its files again)
            self.offsets[name] = 0
        with path.open("rb") as stream:
            stream.seek(self.offsets[name])
            data = stream.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offsets[name] += len(complete)
        rows = []
        for line in complete.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def name_of(self, node: Any) -> str:
        """``phone-017`` for a registered device's node id (else the id itself)."""
        return self.names().get(str(node), str(node))

    def poll(self) -> None:
        """Print the rounds completed since the last call (device events first, so their reasons show)."""
        for event in self._new_rows("devices.jsonl"):
            if event.get("status") in ("error", "rejected"):
                self.events.setdefault(int(event.get("round", 0)), []).append(event)
                reason = str(event.get("reason", "?"))
                self.failures[reason] += 1
                self.failed_devices.setdefault(reason, set()).add(event.get("name") or self.name_of(event.get("node")))
        for row in self._new_rows("metrics.jsonl"):
            self.rounds_seen = max(self.rounds_seen, int(row.get("round", 0)))
            wall = float(row.get("wall_time_s") or 0.0)
            seconds, self.last_wall = (None if self.last_wall is None else wall - self.last_wall), wall
            if int(row.get("round", 0)) > 0:
                print(self.round_line(row, seconds), file=self.out, flush=True)

    def round_line(self, row: dict[str, Any], seconds: float | None) -> str:
        """``round 2/5: 3/3 participants, accuracy 0.8123, 4.1 s`` (+ why it was skipped or who failed)."""
        config = _read_json(self.run_dir / "config.json")
        total, expected = config.get(knobs.NUM_ROUNDS, "?"), config.get(knobs.CLIENTS_PER_ROUND, "?")
        value = row.get("headline")
        shown = "-" if value is None else f"{value:.4f}"
        line = f"round {row['round']}/{total}: {row.get('participants', 0)}/{expected} participants, " \
               f"{row.get('metric', 'accuracy')} {shown}" + ("" if seconds is None else f", {seconds:.1f} s")
        if not row.get("aggregated", True):
            line += f"; skipped: not aggregated ({row.get('participants', 0)} usable replies, " \
                    f"min-train-replies {config.get(knobs.MIN_TRAIN_REPLIES, '?')})"
        problems = [f"{e.get('name') or self.name_of(e.get('node'))} {e.get('status')}: "
                    f"{_short(str(e.get('reason', '?')))}" for e in self.events.pop(int(row["round"]), [])]
        if not problems:
            problems = [f"{self.name_of(r.get('node_id'))} rejected: {_short(str(r.get('reason', '?')))}"
                        for r in row.get("rejections", []) if isinstance(r, dict)]
        if problems:
            line += f"; {len(problems)} failed: " + "; ".join(problems[:3]) + \
                    (f"; +{len(problems) - 3} more" if len(problems) > 3 else "")
        return line

    def final_lines(self) -> list[str]:
        """The run's final line (from ``summary.json``), then the top device failure reasons."""
        summary = _read_json(self.run_dir / "summary.json")
        lines = []
        if summary:
            final, best_value = summary.get("final_headline"), summary.get("best_headline")
            metric = summary.get("headline", "accuracy")
            wall = float(summary.get("wall_time_s", 0))
            lines.append(f"run finished: {summary.get('rounds')} rounds in {wall:.1f} s; "
                         f"final {metric} {'-' if final is None else f'{final:.4f}'}"
                         f" (best {'-' if best_value is None else f'{best_value:.4f}'}); "
                         f"{summary.get('rejected', 0)} rejected, {summary.get('failed', 0)} failed replies; "
                         f"{summary.get('bytes_up', 0)} bytes up, {summary.get('bytes_down', 0)} down; "
                         f"run directory {self.run_dir}")
        if self.failures:
            top = [f"{count}x {_short(reason)} ({', '.join(sorted(self.failed_devices.get(reason, ()))[:5])})"
                   for reason, count in self.failures.most_common(3)]
            lines.append("device failures: " + "; ".join(top))
        return lines


def _short(reason: str, width: int = 120) -> str:
    reason = " ".join(reason.split())
    return reason if len(reason) <= width else reason[: width - 3] + "..."


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}
