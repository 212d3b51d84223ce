"""The run directory: effective config, per-round metrics, summary and plots.

Every run writes ``<runs-root>/<run-name>/``: ``config.json``, ``metrics.jsonl``
(one JSON object per round, round 0 being the initial model), ``summary.json``,
``headline.png``, ``checkpoint.npz`` and ``model.onnx``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedge.config import RunConfig
from fedge.files import write_bytes_atomic


def run_dir_for(config: RunConfig) -> Path:
    """The run directory a config names (``run-dir``, else ``runs-root/run-name``)."""
    if config["run-dir"]:
        return Path(config.text("run-dir"))
    name = config.text("run-name") or (
        f"{config['strategy']}-{config['dataset']}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    return Path(config.text("runs-root")) / name


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


def plot_headline(rows: list[Mapping[str, Any]], path: Path, title: str, headline: str = "accuracy") -> None:
    """The headline metric vs round and vs simulated time, side by side, as a PNG (rounds
    without a value, e.g. round 0 under federated evaluation, are left out)."""
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
