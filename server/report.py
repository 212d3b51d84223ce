"""The run directory: effective config, per-round metrics, summary and plots.

Every run writes ``<runs-root>/<run-name>/``: ``config.json``, ``metrics.jsonl``
(one JSON object per round, round 0 being the initial model), ``summary.json``,
``headline.png``, ``checkpoint.npz`` and ``model.onnx``.

Plots are drawn after the run. matplotlib takes about half a second to import, so a command
can open :func:`plotting_process` first: a helper process imports matplotlib while this one
imports torch and runs the rounds, and :func:`plot_headline` hands it the drawing and waits
for the PNG. Without one (or if it fails) the plot is drawn in this process, identically.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from fedge import knobs
from fedge.config import RunConfig
from fedge.files import write_bytes_atomic


def run_label(config: RunConfig) -> str:
    """What a run does, for names and titles: the strategy, with its round policy unless the
    default synchronous one, and secure aggregation when on (``fedavg-deadline-secure``)."""
    parts = [config.text(knobs.STRATEGY)]
    if config.text(knobs.ROUND_POLICY) != "sync":
        parts.append(config.text(knobs.ROUND_POLICY))
    if config[knobs.SECURE_AGGREGATION]:
        parts.append("secure")
    return "-".join(parts)


def run_title(config: RunConfig, task_name: str) -> str:
    """A plot's title: ``fedavg-deadline on houses``."""
    return f"{run_label(config)} on {task_name}"


def task_label(config: RunConfig) -> str:
    """The task a config names, without loading it: a registered name, the package of a
    ``package.module:object`` task (``houses`` for ``houses.task:HousesTask``), or the built-in
    ``dataset-model``."""
    named = config.text(knobs.TASK)
    if named:
        return named.split(":", 1)[0].split(".", 1)[0] if ":" in named else named
    return f"{config.text(knobs.DATASET)}-{config.text(knobs.MODEL)}"


def run_dir_for(config: RunConfig, task_name: str | None = None) -> Path:
    """The run directory a config names (``run-dir``, else ``runs-root/run-name``; without a
    name, ``<run label>-<task>-<time>``, e.g. ``fedavg-deadline-houses-20261204-203500``; the
    task is ``task_name`` or, not given, :func:`task_label`)."""
    if config[knobs.RUN_DIR]:
        return Path(config.text(knobs.RUN_DIR))
    task_name = task_name or task_label(config)
    safe_task = "".join(c if c.isalnum() or c in "-_." else "-" for c in task_name).strip("-.") or "task"
    name = config.text(knobs.RUN_NAME) or f"{run_label(config)}-{safe_task}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(config.text(knobs.RUNS_ROOT)) / name


def config_summary(config: RunConfig, run_dir: Path) -> str:
    """One short line for the console: the keys changed from the defaults (the whole effective
    config is ``run_dir/config.json``)."""
    from fedge.config import DEFAULTS

    changed = [f"{key}={config[key]!r}" for key in sorted(config)
               if key in DEFAULTS and config[key] != DEFAULTS[key] and key not in _LOCATION_KEYS]
    shown = ", ".join(changed) if changed else "all defaults"
    return f"run config: {shown} (every key: {run_dir / 'config.json'})"


_LOCATION_KEYS = frozenset({knobs.RUN_DIR, knobs.RUNS_ROOT, knobs.RUN_NAME})  # the line names the directory itself


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON to ``path`` atomically (a reader such as the dashboard never sees half of it)."""
    write_bytes_atomic(path, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode())


def append_jsonl(path: Path, row: Mapping[str, Any]) -> None:
    """Append one JSON line and flush it to disk (a reader may be following the file)."""
    with path.open("a") as handle:
        handle.write(json.dumps(row, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file; a partial last line (a writer mid-append) is skipped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


PLOTTED = "plotted"  # the helper's answer once a PNG is written
PLOT_KEYS = ("round", "headline", "sim_time_s")  # all of a metrics row that the plot draws
_helper: _PlotHelper | None = None
_helper_lock = threading.Lock()


def plot_headline(rows: list[Mapping[str, Any]], path: Path, title: str, headline: str = "accuracy") -> None:
    """The headline metric vs round and vs simulated time, side by side, as a PNG (rounds
    without a value, e.g. round 0 under federated evaluation, are left out).

    Drawn by the :func:`plotting_process` helper when one is open; the PNG exists on return.
    """
    with _helper_lock:
        if _helper is not None and _helper.plot(rows, path, title, headline):
            return
    draw_headline(rows, path, title, headline)


@contextmanager
def plotting_process() -> Iterator[None]:
    """Within this block, plots are drawn by a helper process that imports matplotlib now,
    in parallel with whatever this process does next (import torch, run the rounds).

    Start it first thing in a command that plots at the end; it ends with the block (and
    by itself when this process dies: its input closes).
    """
    global _helper
    with _helper_lock:
        started = _helper is None
        if started:
            _helper = _PlotHelper.start()
    try:
        yield
    finally:
        if started:
            with _helper_lock:
                helper, _helper = _helper, None
            if helper is not None:
                helper.close()


class _PlotHelper:
    """The helper process's end of the pipe: one JSON job a line in, one answer a line out."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process

    @classmethod
    def start(cls) -> _PlotHelper | None:
        try:  # -P: the current directory is not on its sys.path (a stray matplotlib.py there stays out)
            process = subprocess.Popen([sys.executable, "-P", "-m", "fedge.server.report"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        except OSError:
            return None
        return cls(process)

    def plot(self, rows: list[Mapping[str, Any]], path: Path, title: str, headline: str) -> bool:
        """Whether the helper drew the PNG (False: draw it here instead)."""
        stdin, stdout = self.process.stdin, self.process.stdout
        if stdin is None or stdout is None or self.process.poll() is not None:
            return False
        job = {"rows": [{key: row.get(key) for key in PLOT_KEYS} for row in rows],
               "path": os.path.abspath(path), "title": title, "headline": headline}
        try:
            stdin.write(json.dumps(job) + "\n")
            stdin.flush()
            return stdout.readline().strip() == PLOTTED
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        """End the helper: its input closes, it exits (killed if it does not within 10 s)."""
        if self.process.stdin is not None:
            with suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def _serve_plots(jobs: IO[str], answers: IO[str]) -> None:
    """The helper process: import matplotlib, then draw each job read from ``jobs`` until it closes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except Exception:  # noqa: BLE001 - the caller draws in its own process and reports the error there
        return
    for line in jobs:
        try:
            job = json.loads(line)
            draw_headline(job["rows"], Path(job["path"]), job["title"], job["headline"])
            answers.write(PLOTTED + "\n")
        except Exception as exc:  # noqa: BLE001 - likewise
            answers.write(f"failed: {type(exc).__name__}\n")
        answers.flush()


def draw_headline(rows: list[Mapping[str, Any]], path: Path, title: str, headline: str = "accuracy") -> None:
    """:func:`plot_headline`, drawn in this process."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [row for row in rows if row.get("headline") is not None]
    rounds = [row["round"] for row in shown]
    values = [row["headline"] for row in shown]
    sim_time = [row["sim_time_s"] for row in shown]
    fig, (by_round, by_time) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    by_round.plot(rounds, values, marker="o", markersize=3)
    by_round.set(xlabel="round", ylabel=headline, title=f"{headline} vs round")
    by_time.plot(sim_time, values, marker="o", markersize=3, color="tab:orange")
    by_time.set(xlabel="simulated wall-clock time (s)", title=f"{headline} vs simulated time")
    for axis in (by_round, by_time):
        axis.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # the plotting_process helper
    _serve_plots(sys.stdin, sys.stdout)
    sys.stdout.flush()
    os._exit(0)  # every PNG is written and closed: skip tearing matplotlib down (0.1-0.2 s of the caller's wait)
