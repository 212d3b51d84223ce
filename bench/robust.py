"""Robust aggregation vs Byzantine devices, in simulation.

50 laptops with IID digits shards, 10 per round, 30 rounds, MLP; 20% of the
devices Byzantine. Attacks on the update delta d: sign-flip x4 (send -4 d) and
x100 scaling (send 100 d). Final test accuracy per strategy and attack, and the
gap to the clean FedAvg run, for each seed; the table shows the mean over seeds.

Usage: python bench/robust.py [--seeds 42 1 2]
Writes bench/results/robust.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path
from typing import Any

from fedge.simulation.runner import simulate

HERE = Path(__file__).resolve().parent
BASE = {"fleet": "laptop=50", "clients-per-round": 10, "partitioner": "iid", "num-rounds": 30,
        "model": "mlp", "export-onnx": False}
STRATEGIES: dict[str, dict[str, Any]] = {
    "fedavg": {"strategy": "fedavg"},
    "trimmed-mean (0.3)": {"strategy": "trimmed-mean", "trim-fraction": 0.3},
    "median": {"strategy": "median"},
    "multi-krum (f=2, m=8)": {"strategy": "krum", "num-byzantine": 2, "krum-select": 8},
}
ATTACKS: dict[str, dict[str, Any]] = {
    "none": {"byzantine-fraction": 0.0},
    "sign-flip x4": {"byzantine-fraction": 0.2, "byzantine-attack": "sign-flip", "attack-scale": 4.0},
    "scale x100": {"byzantine-fraction": 0.2, "byzantine-attack": "scale", "attack-scale": 100.0},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, strategy in STRATEGIES.items():
            for attack, spec in ATTACKS.items():
                accuracies = []
                for seed in args.seeds:
                    run_dir = Path(tmp) / f"{len(results)}-{attack}-{seed}".replace(" ", "_")
                    config = {**BASE, **strategy, **spec, "seed": seed, "run-dir": str(run_dir)}
                    accuracies.append(simulate(config, progress=False)[1]["final_accuracy"])
                results.setdefault(name, {})[attack] = accuracies
                print(f"  {name:<24}{attack:<14}{accuracies}", flush=True)
    clean = results["fedavg"]["none"]
    print(f"\n{'strategy':<24}" + "".join(f"{attack:>22}" for attack in ATTACKS))
    for name, row in results.items():
        cells = []
        for attack in ATTACKS:
            gap = statistics.mean(a - c for a, c in zip(row[attack], clean, strict=True))
            cells.append(f"{statistics.mean(row[attack]):.4f} ({100 * gap:+.1f})")
        print(f"{name:<24}" + "".join(f"{cell:>22}" for cell in cells))
    print("cells: mean final accuracy over seeds (points vs clean FedAvg)")
    out = HERE / "results" / "robust.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"seeds": args.seeds, "base": BASE, "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
