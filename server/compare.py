"""Comparing finished (or running) runs: a table, one plot and a JSON record.

``fedge compare RUN...`` reads each run directory's ``metrics.jsonl`` and ``summary.json``
(what :mod:`fedge.server.report` writes) and puts the runs side by side: the headline metric's
final and best values, when the best came, the simulated and wall time, bytes and rejected
updates; the plot draws the headline vs round and vs simulated time, one line per run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge.errors import ConfigError
from fedge.server.report import read_jsonl, write_json_atomic

MB = 1e6


@dataclass(frozen=True)
class RunRecord:
    """One run directory, as far as a comparison needs it."""

    name: str
    path: Path
    headline: str
    higher_is_better: bool
    rows: list[dict[str, Any]]
    summary: dict[str, Any]

    @property
    def scored(self) -> list[dict[str, Any]]:
        """Rounds that have a headline value (round 0 under federated evaluation may not)."""
        return [row for row in self.rows if isinstance(row.get("headline"), int | float)]


def load_run(path: Path) -> RunRecord:
    """Read a run directory; refuse anything else with what to pass instead."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"'{path}' is not a run directory (no metrics.jsonl): pass directories that "
                          "fedge simulate or fedge coordinator start wrote, e.g. runs/fedavg-digits-...")
    rows = read_jsonl(metrics)
    summary = _read_summary(path / "summary.json")
    first = rows[0] if rows else {}
    headline = str(summary.get("headline") or first.get("metric") or "accuracy")
    higher = bool(summary.get("higher_is_better", first.get("higher_is_better", True)))
    return RunRecord(path.name or str(path), path, headline, higher, rows, summary)


def _read_summary(path: Path) -> dict[str, Any]:
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):  # a run still going has none yet
        return {}
    return summary if isinstance(summary, dict) else {}


def load_runs(paths: Sequence[Path]) -> list[RunRecord]:
    """Read every run; they must measure the same headline metric to share a plot."""
    if len(paths) < 1:
        raise ConfigError("fedge compare needs at least one run directory")
    runs = [load_run(Path(p)) for p in paths]
    headlines = {run.headline for run in runs}
    if len(headlines) > 1:
        by = ", ".join(f"{run.name}: {run.headline}" for run in runs)
        raise ConfigError(f"the runs measure different headline metrics ({by}); compare runs of one task")
    return runs


def summary_row(run: RunRecord) -> dict[str, Any]:
    """The table's row for one run (None where the run has no value yet)."""
    scored = run.scored
    pick = max if run.higher_is_better else min
    best = pick(scored, key=lambda row: row["headline"]) if scored else None
    last = run.rows[-1] if run.rows else {}
    return {
        "run": run.name,
        "path": str(run.path),
        "headline": run.headline,
        "rounds": int(last.get("round", 0)),
        "final": scored[-1]["headline"] if scored else None,
        "best": best["headline"] if best else None,
        "best_round": best["round"] if best else None,
        "sim_time_s": float(last.get("sim_time_s", 0.0)),
        "wall_time_s": float(last.get("wall_time_s", 0.0)),
        "mb_up": sum(int(row.get("bytes_up", 0)) for row in run.rows) / MB,
        "mb_down": sum(int(row.get("bytes_down", 0)) for row in run.rows) / MB,
        "rejected": sum(int(row.get("rejected", 0)) for row in run.rows),
        "finished": bool(run.summary),
    }


COLUMNS = (("run", "{}"), ("rounds", "{}"), ("final", "{:.4f}"), ("best", "{:.4f}"), ("best_round", "{}"),
           ("sim_time_s", "{:.1f}"), ("wall_time_s", "{:.1f}"), ("mb_up", "{:.2f}"), ("mb_down", "{:.2f}"),
           ("rejected", "{}"))


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text table of :func:`summary_row` rows, columns aligned."""
    cells = [[name for name, _ in COLUMNS]]
    for row in rows:
        cells.append(["-" if row[name] is None else fmt.format(row[name]) for name, fmt in COLUMNS])
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in cells)


def draw_comparison(runs: Sequence[RunRecord], path: Path) -> None:
    """The headline vs round and vs simulated time, one line per run, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    headline = runs[0].headline
    fig, (by_round, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for run in runs:
        scored = run.scored
        values = [row["headline"] for row in scored]
        by_round.plot([row["round"] for row in scored], values, marker="o", markersize=2, label=run.name)
        by_time.plot([row.get("sim_time_s", 0.0) for row in scored], values, marker="o", markersize=2)
    by_round.set(xlabel="round", ylabel=headline, title=f"{headline} vs round")
    by_time.set(xlabel="simulated wall-clock time (s)", title=f"{headline} vs simulated time")
    for axis in (by_round, by_time):
        axis.grid(alpha=0.3)
    by_round.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(paths: Sequence[Path], out: Path) -> tuple[list[dict[str, Any]], Path, Path]:
    """Compare runs: returns the table rows and writes ``OUT.png`` and ``OUT.json``."""
    runs = load_runs(paths)
    rows = [summary_row(run) for run in runs]
    png, record = out.with_suffix(".png"), out.with_suffix(".json")
    png.parent.mkdir(parents=True, exist_ok=True)
    draw_comparison(runs, png)
    write_json_atomic(record, {"headline": runs[0].headline, "higher_is_better": runs[0].higher_is_better,
                               "runs": rows, "plot": png.name})
    return rows, png, record
