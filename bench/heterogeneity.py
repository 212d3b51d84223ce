"""Time-to-accuracy on a heterogeneous fleet: fedge's round policies vs FedAvg-sync.

digits, Dirichlet(0.5), 100 devices (60 phones, 30 laptops, 10 GPU boxes) with their
profiles' availability and mid-round dropout and 20% speed jitter, 10 devices per
round, the demo's CNN. For each configuration and seed: simulated seconds, rounds and
uplink bytes until test accuracy first reaches 0.90. A synchronous round waits for
every selected device, and for a device that dropped out until the 60 s round timeout.

Usage: python bench/heterogeneity.py [--seeds 42 1 2] [--rounds 60]
Writes bench/results/heterogeneity.json and heterogeneity.png (accuracy vs simulated time).
Target (issue #5): the best fedge policy >= 3x faster to target than FedAvg-sync.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path
from typing import Any

from fedge.server.report import read_jsonl
from fedge.simulation.runner import simulate

HERE = Path(__file__).resolve().parent
TARGET = 0.90
BASE: dict[str, Any] = {"device-behaviour": True, "jitter": 0.2, "round-timeout": 60.0, "export-onnx": False}
DEADLINE: dict[str, Any] = {"round-policy": "deadline", "deadline-s": 1.5, "over-selection": 1.3}
TIME_BUDGET: dict[str, Any] = {"local-budget": "time", "time-budget-s": 0.5}
CONFIGS: dict[str, dict[str, Any]] = {
    "fedavg-sync": {},
    "fedavg-deadline": {**DEADLINE},
    "fedprox-deadline-time": {"strategy": "fedprox", **DEADLINE, **TIME_BUDGET},
    "fednova-deadline-time": {"strategy": "fednova", **DEADLINE, **TIME_BUDGET},
    "fedbuff": {"strategy": "fedbuff", "concurrency": 20, "buffer-size": 10},
    "oort-deadline": {"selector": "oort", "preferred-round-s": 1.5, **DEADLINE},
}


def to_target(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Simulated seconds, rounds and uplink bytes when accuracy first reaches the target."""
    uplink = 0
    for row in rows:
        uplink += row["bytes_up"]
        if row["accuracy"] >= TARGET:
            return {"sim_s": row["sim_time_s"], "rounds": row["round"], "bytes_up": uplink}
    return {"sim_s": None, "rounds": None, "bytes_up": None}


def _spread(values: list[float | None]) -> dict[str, Any]:
    reached = [v for v in values if v is not None]
    return {"mean": statistics.mean(reached) if reached else None,
            "stdev": statistics.stdev(reached) if len(reached) > 1 else 0.0,
            "reached": f"{len(reached)}/{len(values)}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    runs: dict[str, list[dict[str, Any]]] = {}
    curves: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in CONFIGS.items():
            for seed in args.seeds:
                run_dir = Path(tmp) / f"{name}-{seed}"
                simulate({**BASE, **extra, "seed": seed, "num-rounds": args.rounds, "run-dir": str(run_dir)},
                         progress=False)
                rows = read_jsonl(run_dir / "metrics.jsonl")
                runs.setdefault(name, []).append({"seed": seed, **to_target(rows),
                                                  "final_accuracy": rows[-1]["accuracy"]})
                if seed == args.seeds[0]:
                    curves[name] = [(r["sim_time_s"], r["accuracy"]) for r in rows]
            print(f"  {name:<24}{runs[name]}", flush=True)
    summary = {name: {key: _spread([r[key] for r in rs]) for key in ("sim_s", "rounds", "bytes_up")}
               for name, rs in runs.items()}
    base = summary["fedavg-sync"]["sim_s"]["mean"]
    print(f"\n{'configuration':<24}{'sim s to 0.90':>20}{'rounds':>14}{'uplink MB':>12}{'reached':>9}{'speed-up':>10}")
    for name, s in summary.items():
        mean = s["sim_s"]["mean"]
        speed = f"{base / mean:.2f}x" if base and mean else "n/a"
        rounds = f"{s['rounds']['mean']:.1f}" if s["rounds"]["mean"] is not None else "-"
        up = f"{s['bytes_up']['mean'] / 1e6:.1f}" if s["bytes_up"]["mean"] is not None else "-"
        sim = f"{mean:.1f} ± {s['sim_s']['stdev']:.1f}" if mean is not None else "not reached"
        print(f"{name:<24}{sim:>20}{rounds:>14}{up:>12}{s['sim_s']['reached']:>9}{speed:>10}")
    _plot(curves, HERE / "results" / "heterogeneity.png")
    out = HERE / "results" / "heterogeneity.json"
    out.write_text(json.dumps({"target": TARGET, "seeds": args.seeds, "rounds": args.rounds, "base": BASE,
                               "configs": CONFIGS, "runs": runs, "summary": summary}, indent=2) + "\n")
    print(f"wrote {out} and heterogeneity.png")


def _plot(curves: dict[str, list[tuple[float, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(8, 5))
    for name, points in curves.items():
        axis.plot([max(t, 0.1) for t, _ in points], [a for _, a in points], label=name)
    axis.axhline(TARGET, color="grey", linestyle="--", linewidth=1)
    axis.set(xscale="log", xlabel="simulated wall-clock time (s, log)", ylabel="test accuracy",
             title="digits, 100 heterogeneous devices: accuracy vs simulated time (seed 42)")
    axis.grid(alpha=0.3)
    axis.legend()
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
