"""Update compression: accuracy vs uplink bytes for each codec, against fp32, in one run.

Two workloads, both digits with Dirichlet(0.5) label skew, 100 devices (60 phones, 30
laptops, 10 GPU boxes), 10 per round, the demo's CNN (38.5k parameters), 5 local epochs:

* ``uniform``: every device uses the same codec, 30 synchronous rounds; final accuracy and
  total uplink bytes (serialised array payloads, as Flower sends them) per codec;
* ``heterogeneity``: the fleet's availability, dropouts and 20% jitter, deadline rounds
  (1.5 s, over-selection 1.3), 40 rounds: fp32 everywhere vs the per-profile policy
  ``phone = topk:0.05+int8, laptop = int8, gpu-box = fp32``; the virtual clock charges the
  encoded bytes, so simulated time to 0.90 accuracy shows what compression buys.

Each configuration runs over seeds 42, 1 and 2 (two processes at a time).

Usage: python bench/compression.py [--seeds 42 1 2] [--rounds 30] [--quick]
Writes bench/results/compression.json and compression.png (accuracy vs uplink bytes).
Targets (issue #7): int8 >= 4x fewer bytes within 0.5 points of fp32; top-k + error
feedback + int8 >= 25x fewer within 1 point.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CODECS = ["fp32", "fp16", "int8", "int8:channel", "topk:0.1+int8", "topk:0.05+int8", "topk:0.02+int8", "topk:0.05"]
POLICY = {"codec.phone": "topk:0.05+int8", "codec.laptop": "int8", "codec.gpu-box": "fp32"}
HETEROGENEITY: dict[str, Any] = {"device-behaviour": True, "jitter": 0.2, "round-timeout": 60.0,
                                 "round-policy": "deadline", "deadline-s": 1.5, "over-selection": 1.3}
TARGET = 0.90


def run(job: dict[str, Any]) -> dict[str, Any]:
    """One simulation (in a worker process); its accuracy, bytes and time to target."""
    from fedge.server.report import read_jsonl
    from fedge.simulation.runner import simulate

    logging.getLogger("flwr").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, summary = simulate({**job["config"], "export-onnx": False, "run-dir": f"{tmp}/run"}, progress=False)
        rows = read_jsonl(run_dir / "metrics.jsonl")
    reached = next((row for row in rows if row["accuracy"] >= TARGET), None)
    return {**{k: v for k, v in job.items() if k != "config"}, "final_accuracy": summary["final_accuracy"],
            "bytes_up": summary["bytes_up"], "bytes_down": summary["bytes_down"],
            "bytes_up_by_profile": summary["bytes_up_by_profile"], "sim_time_s": summary["sim_time_s"],
            "sim_s_to_target": reached["sim_time_s"] if reached else None,
            "curve": [(row["round"], row["accuracy"], row["sim_time_s"]) for row in rows]}


def jobs(seeds: list[int], rounds: int) -> list[dict[str, Any]]:
    """Every (workload, configuration, seed) to run."""
    out = [{"workload": "uniform", "name": codec, "seed": seed,
            "config": {"seed": seed, "num-rounds": rounds, "codec.default": codec}}
           for codec in CODECS for seed in seeds]
    for name, policy in (("fp32", {}), ("per-profile", POLICY)):
        out += [{"workload": "heterogeneity", "name": name, "seed": seed,
                 "config": {**HETEROGENEITY, **policy, "seed": seed, "num-rounds": rounds + 10}} for seed in seeds]
    return out


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean over seeds per (workload, name), with ratios against fp32 of the same workload."""
    table = []
    for workload in ("uniform", "heterogeneity"):
        names = dict.fromkeys(r["name"] for r in results if r["workload"] == workload)
        base = [r for r in results if r["workload"] == workload and r["name"] == "fp32"]
        for name in names:
            group = [r for r in results if r["workload"] == workload and r["name"] == name]
            accuracy = statistics.mean(r["final_accuracy"] for r in group)
            up = statistics.mean(r["bytes_up"] for r in group)
            times = [r["sim_s_to_target"] for r in group if r["sim_s_to_target"] is not None]
            base_times = [r["sim_s_to_target"] for r in base if r["sim_s_to_target"] is not None]
            table.append({
                "workload": workload, "name": name, "seeds": len(group), "final_accuracy": accuracy,
                "accuracy_stdev": statistics.stdev(r["final_accuracy"] for r in group) if len(group) > 1 else 0.0,
                "points_vs_fp32": 100 * (accuracy - statistics.mean(r["final_accuracy"] for r in base)),
                "bytes_up": up, "fewer_bytes_x": statistics.mean(r["bytes_up"] for r in base) / up,
                "sim_s_to_target": statistics.mean(times) if times else None,
                "reached": f"{len(times)}/{len(group)}",
                "faster_to_target_x": (statistics.mean(base_times) / statistics.mean(times))
                if times and base_times else None,
            })
    return table


def plot(table: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for row in (r for r in table if r["workload"] == "uniform"):
        axis.errorbar(row["bytes_up"] / 1e6, row["final_accuracy"], yerr=row["accuracy_stdev"], fmt="o", capsize=3)
        axis.annotate(row["name"], (row["bytes_up"] / 1e6, row["final_accuracy"]), textcoords="offset points",
                      xytext=(5, 4), fontsize=8)
    axis.set_xscale("log")
    axis.set_xlabel("total uplink MB (30 rounds, 10 devices a round)")
    axis.set_ylabel("final test accuracy (mean over seeds)")
    axis.set_title("digits CNN, 100 devices: accuracy vs uplink bytes per codec")
    axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="one seed, 5 rounds (a smoke test)")
    args = parser.parse_args()
    seeds, rounds = ([42], 5) if args.quick else (args.seeds, args.rounds)
    from rich.progress import Progress

    todo = jobs(seeds, rounds)
    results = []
    with ProcessPoolExecutor(max_workers=2) as pool, Progress() as progress:
        task = progress.add_task("simulations", total=len(todo))
        for result in pool.map(run, todo):
            results.append(result)
            progress.advance(task)
    table = summarise(results)
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "compression.json").write_text(json.dumps({"seeds": seeds, "rounds": rounds, "table": table,
                                                      "runs": results}, indent=2))
    plot(table, out / "compression.png")
    print(f"{'workload':<14}{'codec':<16}{'accuracy':>10}{'pts vs fp32':>12}{'uplink MB':>11}{'x fewer':>9}"
          f"{'sim s to 0.90':>15}{'reached':>9}")
    for row in table:
        to_target = f"{row['sim_s_to_target']:.1f}" if row["sim_s_to_target"] is not None else "-"
        print(f"{row['workload']:<14}{row['name']:<16}{row['final_accuracy']:>10.4f}{row['points_vs_fp32']:>+12.2f}"
              f"{row['bytes_up'] / 1e6:>11.2f}{row['fewer_bytes_x']:>9.1f}{to_target:>15}{row['reached']:>9}")


if __name__ == "__main__":
    main()
