"""fedge's inline backend vs Flower's Ray simulation engine on the same workload.

Both backends run the *same* fedge ServerApp and ClientApp (same model, data,
selection and seed); only the engine that carries messages differs. Each run
is a fresh subprocess (``fedge simulate --backend ...``), so wall time includes
start-up and imports, and peak memory is the summed RSS of the whole process
tree (Ray's raylet, GCS and workers included), sampled every 50 ms.

Repeats alternate the backends (inline, ray, inline, ray, ...) so that a change in the
machine's load hits both alike. The same run also measures the floor no Python process that
trains with torch and talks Flower can go under: a fresh ``python -c "import torch, flwr..."``
that then exits at once, as ``fedge simulate`` does (its inline run does all its work in that
one process; a plotting helper imports matplotlib beside it, off the critical path).

Usage: python bench/sim_vs_flower.py [--repeats N]
Writes bench/results/sim_vs_flower.json and prints a table with ratios.
Target (issue #2): inline >= 10x faster and <= 1/4 the memory at the same accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import psutil

HERE = Path(__file__).resolve().parent
WORKLOADS = [
    {"name": "10 devices x 3 rounds", "fleet": "phone=6,laptop=3,gpu-box=1", "rounds": 3},
    {"name": "50 devices x 5 rounds", "fleet": "phone=30,laptop=15,gpu-box=5", "rounds": 5},
]
COMMON = "model='mlp' local-epochs=1 batch-size=32 learning-rate=0.05 momentum=0.0 export-onnx=false"


def tree_rss(process: psutil.Process) -> int:
    """Resident memory of ``process`` and all its descendants, in bytes."""
    total = 0
    for proc in [process, *process.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total


def run_watched(command: list[str]) -> tuple[float, int]:
    """Run ``command`` (Flower telemetry off), sampling its process tree's memory every 50 ms;
    return (wall seconds, peak resident bytes). Raises RuntimeError with stderr's tail on failure."""
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    watched, peak = psutil.Process(child.pid), 0
    while child.poll() is None:
        peak = max(peak, tree_rss(watched))
        time.sleep(0.05)
    wall = time.perf_counter() - started
    if child.returncode != 0:
        tail = child.stderr.read().decode(errors="replace")[-2000:] if child.stderr else ""
        raise RuntimeError(f"{' '.join(command)} exited {child.returncode}:\n{tail}")
    return wall, peak


def run_once(backend: str, workload: dict[str, object], run_dir: Path) -> dict[str, float]:
    """One ``fedge simulate`` in a subprocess: wall time, peak tree RSS, final accuracy."""
    fedge = Path(sys.executable).with_name("fedge")
    command = [str(fedge), "simulate", "--backend", backend, "--quiet",
               "--fleet", str(workload["fleet"]), "--rounds", str(workload["rounds"]),
               "--clients-per-round", "10", "--run-dir", str(run_dir), "--run-config", COMMON]
    wall, peak = run_watched(command)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"wall_s": wall, "run_wall_s": summary["wall_time_s"], "peak_rss_mib": peak / 2**20,
            "final_accuracy": summary["final_accuracy"]}


# What every fedge process that trains with torch and speaks Flower pays before any work:
# the interpreter and those imports, ended like `fedge simulate` ends (no interpreter teardown).
FLOOR = [sys.executable, "-c", "import os, torch, flwr.serverapp, flwr.clientapp; os._exit(0)"]


def measure(repeats: int) -> list[dict[str, object]]:
    """Run every workload on both backends ``repeats`` times, alternating them, and the floor
    (python + torch + Flower imports) once per repeat; keep medians."""
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for workload in WORKLOADS:
            row: dict[str, object] = {"workload": workload["name"]}
            runs: dict[str, list[dict[str, float]]] = {"inline": [], "ray": []}
            floors = []
            for i in range(repeats):
                for backend in ("inline", "ray"):
                    runs[backend].append(run_once(backend, workload, Path(scratch) / f"{backend}-{len(rows)}-{i}"))
                    print(f"  {workload['name']:<24} {backend:<6} {runs[backend][-1]}", flush=True)
                floors.append(run_watched(FLOOR)[0])
            for backend in ("inline", "ray"):
                row[backend] = {key: median(run[key] for run in runs[backend]) for key in runs[backend][0]}
            row["floor_wall_s"] = median(floors)
            inline, ray = row["inline"], row["ray"]
            row["speedup"] = ray["wall_s"] / inline["wall_s"]  # type: ignore[index]
            row["run_speedup"] = ray["run_wall_s"] / inline["run_wall_s"]  # type: ignore[index]
            row["memory_ratio"] = inline["peak_rss_mib"] / ray["peak_rss_mib"]  # type: ignore[index]
            row["floor_speedup"] = ray["wall_s"] / row["floor_wall_s"]  # type: ignore[index,operator]
            rows.append(row)
    return rows


def print_table(rows: list[dict[str, object]]) -> None:
    """The results as a fixed-width table."""
    print(f"\n{'workload':<24}{'backend':<8}{'wall s':>8}{'run s':>8}{'peak MiB':>10}{'accuracy':>10}")
    for row in rows:
        for backend in ("inline", "ray"):
            r = row[backend]
            print(f"{row['workload']:<24}{backend:<8}{r['wall_s']:>8.1f}{r['run_wall_s']:>8.2f}"  # type: ignore[index]
                  f"{r['peak_rss_mib']:>10.0f}{r['final_accuracy']:>10.4f}")  # type: ignore[index]
        print(f"{'':<24}{'floor':<8}{row['floor_wall_s']:>8.1f}   python + import torch, flwr")
        print(f"{'':<24}{'ratio':<8}{'ray/inline wall x' + format(row['speedup'], '.1f'):>26}"
              f"   run x{row['run_speedup']:.1f}   inline/ray memory {row['memory_ratio']:.2f}"
              f"   ray/floor x{row['floor_speedup']:.1f}")
    print("target: inline >= 10x faster (wall), <= 0.25 memory, same accuracy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = measure(args.repeats)
    print_table(rows)
    load = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']}")
    out = HERE / "results" / "sim_vs_flower.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"repeats": args.repeats, "cores": os.cpu_count(), "load_average": load,
                               "workload": COMMON, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
