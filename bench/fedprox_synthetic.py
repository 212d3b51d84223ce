"""FedProx's heterogeneity experiment on Synthetic(1, 1) (Li et al., MLSys 2020, Figure 1).

30 devices, 10 per round, 20 local epochs, batch 10, SGD lr 0.01, multinomial logistic
regression. Stragglers (0%, 50%, 90% of each round's devices) do a random 1..19 of the 20
epochs: FedAvg drops their replies, FedProx keeps their partial work (mu = 0 and mu = 1), as
in the paper's code. Test accuracy and training loss per round.

Usage: python bench/fedprox_synthetic.py [--rounds 60] [--seed 42]
Writes bench/results/fedprox_synthetic.json and fedprox_synthetic.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from fedge.server.report import read_jsonl
from fedge.simulation.runner import simulate

HERE = Path(__file__).resolve().parent
BASE: dict[str, Any] = {"dataset": "synthetic", "synthetic-alpha": 1.0, "synthetic-beta": 1.0, "fleet": "laptop=30",
                        "clients-per-round": 10, "local-epochs": 20, "batch-size": 10, "learning-rate": 0.01,
                        "momentum": 0.0, "model": "logreg", "export-onnx": False, "min-train-replies": 1}
METHODS: dict[str, dict[str, Any]] = {
    "FedAvg (drops stragglers)": {"strategy": "fedavg"},
    "FedProx mu=0": {"strategy": "fedprox", "proximal-mu": 0.0},
    "FedProx mu=1": {"strategy": "fedprox", "proximal-mu": 1.0},
}
STRAGGLERS = (0.0, 0.5, 0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    curves: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fraction in STRAGGLERS:
            for name, extra in METHODS.items():
                run_dir = Path(tmp) / f"{fraction}-{len(curves)}-{extra['strategy']}-{extra.get('proximal-mu', 0)}"
                simulate({**BASE, **extra, "straggler-fraction": fraction, "seed": args.seed,
                          "num-rounds": args.rounds, "run-dir": str(run_dir)}, progress=False)
                rows = [{"round": r["round"], "accuracy": r["accuracy"], "train_loss": r["train_loss"]}
                        for r in read_jsonl(run_dir / "metrics.jsonl")]
                curves.setdefault(f"{int(fraction * 100)}% stragglers", {})[name] = rows
                print(f"  {int(fraction * 100):>3}% {name:<28} final accuracy {rows[-1]['accuracy']:.4f}", flush=True)
    print(f"\n{'stragglers':<18}" + "".join(f"{m:>30}" for m in METHODS))
    for setting, methods in curves.items():
        print(f"{setting:<18}" + "".join(
            f"{methods[m][-1]['accuracy']:>22.4f} / {_last_loss(methods[m]):>5}" for m in METHODS))
    print("cells: final test accuracy / last training loss")
    _plot(curves, HERE / "results" / "fedprox_synthetic.png")
    out = HERE / "results" / "fedprox_synthetic.json"
    out.write_text(json.dumps({"rounds": args.rounds, "seed": args.seed, "base": BASE, "curves": curves},
                              indent=2) + "\n")
    print(f"wrote {out} and fedprox_synthetic.png")


def _last_loss(rows: list[dict[str, Any]]) -> str:
    losses = [r["train_loss"] for r in rows if r["train_loss"] is not None]
    return f"{losses[-1]:.3f}" if losses else "-"


def _plot(curves: dict[str, dict[str, list[dict[str, Any]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(curves), figsize=(4 * len(curves), 6), sharex=True)
    for column, (setting, methods) in enumerate(curves.items()):
        for name, rows in methods.items():
            axes[0][column].plot([r["round"] for r in rows], [r["accuracy"] for r in rows], label=name)
            trained = [r for r in rows if r["train_loss"] is not None]
            axes[1][column].plot([r["round"] for r in trained], [r["train_loss"] for r in trained], label=name)
        axes[0][column].set(title=setting, ylabel="test accuracy")
        axes[1][column].set(xlabel="round", ylabel="training loss")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Synthetic(1,1): FedAvg vs FedProx under stragglers")
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
