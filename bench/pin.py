"""Pin every strategy's numbers across a refactor: same seeds, same results before and after.

Runs each registered strategy (and each secure-aggregation, DP and round-policy combination
fedge supports) for a few rounds on the digits task with a fixed seed, and records each
round's accuracy, loss, train loss and reply counts plus a SHA-256 of the final global
model. Run it before a change (``--out before.json``), then after it with
``--compare before.json``: the table says, per case, whether the numbers are identical.

Usage: python bench/pin.py [--out bench/results/pin.json] [--compare OLD.json] [--keep DIR]
(``--keep`` keeps each case's run directory, checkpoint included, to resume it later.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from fedge.server.checkpoint import load_checkpoint
from fedge.server.report import read_jsonl
from fedge.simulation.runner import simulate

HERE = Path(__file__).resolve().parent
BASE: dict[str, Any] = {"fleet": "laptop=12", "clients-per-round": 11, "num-rounds": 3, "export-onnx": False,
                        "seed": 7, "model": "mlp"}
STRATEGIES = ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedprox", "fednova", "qfedavg",
              "median", "trimmed-mean", "krum", "bulyan", "fedbuff")
CASES: dict[str, dict[str, Any]] = {
    **{name: {"strategy": name} for name in STRATEGIES},
    "fedavgm-lr": {"strategy": "fedavgm", "server-momentum": 0.5, "server-learning-rate": 0.5},
    "fedavg-deadline": {"round-policy": "deadline", "deadline-s": 0.5, "over-selection": 1.3,
                        "clients-per-round": 8, "device-behaviour": True, "jitter": 0.2},
    "fedprox-stragglers": {"strategy": "fedprox", "straggler-fraction": 0.5, "local-epochs": 2},
    "fedavg-secure": {"strategy": "fedavg", "secure-aggregation": True},
    "fedprox-secure": {"strategy": "fedprox", "secure-aggregation": True},
    "fednova-secure": {"strategy": "fednova", "secure-aggregation": True},
    "fedavg-dp-server": {"strategy": "fedavg", "dp": "server-fixed", "dp-noise-multiplier": 0.5},
    "fedprox-dp-client-adaptive": {"strategy": "fedprox", "dp": "client-adaptive", "dp-noise-multiplier": 0.5},
    "fedavg-int8-both-ways": {"strategy": "fedavg", "downlink.default": "int8", "codec.default": "int8"},
    "krum-byzantine": {"strategy": "krum", "byzantine-fraction": 0.2, "byzantine-attack": "sign-flip",
                       "num-byzantine": 2, "krum-select": 5},
}
ROW_KEYS = ("accuracy", "loss", "train_loss", "aggregated", "rejected", "failed", "late", "participants")
COUNT_KEYS = ("aggregated", "rejected", "failed", "late", "participants")


def same(case: str, old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Identical numbers; under DP only the counts (Flower's DP wrappers draw their noise from numpy's
    global generator, which no seed of fedge's fixes, so the models differ from run to run)."""
    if "dp" not in CASES[case]:
        return old == new
    def counts(result: dict[str, Any]) -> list[list[Any]]:
        return [[row[key] for key in COUNT_KEYS] for row in result["rounds"]]
    return counts(old) == counts(new)


def model_digest(run_dir: Path) -> str:
    """SHA-256 over the final checkpoint's arrays (names, dtypes, shapes, bytes) and strategy state."""
    checkpoint = load_checkpoint(run_dir / "checkpoint.npz")
    digest = hashlib.sha256()
    for source in (checkpoint.arrays, checkpoint.strategy_state):
        for name in sorted(source):
            value = np.ascontiguousarray(source[name])
            digest.update(f"{name}|{value.dtype}|{value.shape}".encode())
            digest.update(value.tobytes())
    return digest.hexdigest()


def run_case(overrides: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """One case's per-round numbers and final model digest."""
    simulate({**BASE, **overrides, "run-dir": str(run_dir)}, progress=False)
    rows = [{key: row.get(key) for key in ROW_KEYS} for row in read_jsonl(run_dir / "metrics.jsonl")]
    return {"rounds": rows, "model_sha256": model_digest(run_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "pin.json")
    parser.add_argument("--compare", type=Path, help="a pin.json written before the change")
    parser.add_argument("--keep", type=Path, help="copy each case's run directory here")
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    before = json.loads(args.compare.read_text())["cases"] if args.compare else {}
    results: dict[str, Any] = {}
    print(f"{'case':<30}{'final accuracy':>16}  {'model sha256':<18}{'vs before':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases:
            run_dir = Path(tmp) / name
            results[name] = run_case(CASES[name], run_dir)
            if args.keep:
                shutil.copytree(run_dir, args.keep / name, dirs_exist_ok=True)
            verdict = "-" if name not in before else (
                "identical" if same(name, before[name], results[name]) else "DIFFERENT")
            print(f"{name:<30}{results[name]['rounds'][-1]['accuracy']:>16.4f}  "
                  f"{results[name]['model_sha256'][:16]:<18}{verdict:>12}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"base": BASE, "cases": results}, indent=2) + "\n")
    different = [name for name in results if name in before and not same(name, before[name], results[name])]
    print(f"wrote {args.out}; {len(different)} of {len(before)} compared cases differ{': ' if different else ''}"
          f"{', '.join(different)}")


if __name__ == "__main__":
    main()
