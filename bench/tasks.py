"""Realistic tasks through the Task API: the image task on fedge's inline engine vs Flower's Ray
simulation engine, and the sequence task's learning curve.

1. ``images`` (3x32x32, a ResNet-style model of >= 1M parameters) on 100 devices, 10 a round:
   the same fedge ServerApp and ClientApp on both engines (``fedge simulate --backend
   inline|ray``, each a fresh subprocess): wall time per round, whole-run wall time, peak
   memory of the process tree (Ray's raylet, GCS and workers included, sampled every 50 ms),
   bytes up/down per round and the headline metric per round.
2. ``chars`` (next-character prediction on Python's standard-library sources): the headline
   (and loss) per round on the inline engine.

Usage: python bench/tasks.py [--rounds N] [--char-rounds M]
Writes bench/results/tasks.json and bench/results/tasks.png; prints tables with ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from sim_vs_flower import run_watched  # bench/ is the script's folder, first on sys.path

HERE = Path(__file__).resolve().parent
IMAGES = {"task": "images", "fleet": "phone=60,laptop=30,gpu-box=10", "clients": 10,
          "config": "local-epochs=2 batch-size=32 learning-rate=0.05 momentum=0.9 export-onnx=false"}
CHARS = {"task": "chars", "fleet": "phone=12,laptop=6,gpu-box=2", "clients": 5,
         "config": "local-epochs=1 batch-size=32 learning-rate=0.5 momentum=0.9 export-onnx=false "
                   "partitioner='iid'"}


def run(workload: dict[str, Any], backend: str, rounds: int, run_dir: Path) -> dict[str, Any]:
    """One ``fedge simulate`` subprocess: per-round rows, wall time and peak tree memory."""
    fedge = Path(sys.executable).with_name("fedge")
    command = [str(fedge), "simulate", "--backend", backend, "--quiet", "--task", workload["task"],
               "--fleet", workload["fleet"], "--rounds", str(rounds), "--clients-per-round",
               str(workload["clients"]), "--run-dir", str(run_dir), "--run-config", workload["config"]]
    wall, peak = run_watched(command)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    per_round = [b["wall_time_s"] - a["wall_time_s"] for a, b in zip(rows, rows[1:], strict=False)]
    return {"backend": backend, "wall_s": wall, "run_wall_s": summary["wall_time_s"],
            "round_wall_s": per_round, "median_round_s": sorted(per_round)[len(per_round) // 2],
            "peak_rss_mib": peak / 2**20, "metric": summary["headline"],
            "headline": [row["headline"] for row in rows], "loss": [row.get("loss") for row in rows],
            "bytes_up": [row["bytes_up"] for row in rows], "bytes_down": [row["bytes_down"] for row in rows]}


def parameters(task: str) -> int:
    """The task model's parameter count."""
    from fedge.config import resolve_run_config
    from fedge.task.api import seeded_model
    from fedge.task.loading import load_task

    model = seeded_model(load_task(resolve_run_config({"task": task})), 0)
    return sum(p.numel() for p in model.parameters())


def plot(images: list[dict[str, Any]], chars: dict[str, Any], path: Path) -> None:
    """Headline vs round for both engines on ``images``, and the ``chars`` curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for result in images:
        left.plot(range(len(result["headline"])), result["headline"], marker="o", label=result["backend"])
    left.set(xlabel="round", ylabel=images[0]["metric"], title="images: 100 devices, 10 a round")
    right.plot(range(len(chars["headline"])), chars["headline"], marker="o", color="tab:green")
    right.set(xlabel="round", ylabel=chars["metric"], title="chars: next-character prediction")
    for axis in (left, right):
        axis.grid(alpha=0.3)
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_tables(images: list[dict[str, Any]], chars: dict[str, Any], params: int) -> None:
    """The results as fixed-width tables, with fedge/Flower ratios."""
    print(f"\nimages ({params / 1e6:.2f} M parameters), 100 devices, 10 a round")
    print(f"{'engine':<8}{'wall s':>9}{'run s':>9}{'s/round':>9}{'peak MiB':>10}{'MB up/rnd':>11}"
          f"{'final ' + images[0]['metric']:>16}")
    for r in images:
        up = sum(r["bytes_up"]) / max(len(r["bytes_up"]) - 1, 1) / 1e6
        print(f"{r['backend']:<8}{r['wall_s']:>9.1f}{r['run_wall_s']:>9.1f}{r['median_round_s']:>9.2f}"
              f"{r['peak_rss_mib']:>10.0f}{up:>11.1f}{r['headline'][-1]:>16.4f}")
    inline, ray = images
    print(f"ratios ray/inline: wall x{ray['wall_s'] / inline['wall_s']:.2f}, per round "
          f"x{ray['median_round_s'] / inline['median_round_s']:.2f}, memory inline/ray "
          f"{inline['peak_rss_mib'] / ray['peak_rss_mib']:.2f}")
    print(f"\nchars: {chars['metric']} by round: " + ", ".join(f"{v:.3g}" for v in chars["headline"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds of the image task")
    parser.add_argument("--char-rounds", type=int, default=10, help="rounds of the sequence task")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        images = [run(IMAGES, backend, args.rounds, Path(scratch) / backend) for backend in ("inline", "ray")]
        for result in images:
            print(f"  images {result['backend']}: {result['wall_s']:.1f} s", flush=True)
        chars = run(CHARS, "inline", args.char_rounds, Path(scratch) / "chars")
    params = parameters("images")
    print_tables(images, chars, params)
    out = HERE / "results" / "tasks.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"cores": os.cpu_count(), "images": {"parameters": params, "workload": IMAGES,
                                                                   "runs": images},
                               "chars": {"workload": CHARS, "run": chars}}, indent=2) + "\n")
    plot(images, chars, HERE / "results" / "tasks.png")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
