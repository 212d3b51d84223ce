"""Accuracy against ε: central DP (the coordinator adds the noise) beside distributed DP (the devices
add it inside secure aggregation), on the digits task with 1,000 simulated devices (issue 41 §2).

Each ε in {1, 4, 8} at δ = 1e-5 after ``--rounds`` rounds of ``--per-round`` devices: the noise
multiplier ``z`` is found by bisection on Flower's RDP accountant (no amplification by sampling,
add-or-remove-one: the accounting both modes use), then both modes run with that ``z`` and the
same seed. ε = ∞ is the run without DP (secure aggregation on, as for distributed DP). Central DP
is ``client-fixed`` (Flower's clipping mod on each device, Gaussian noise on the coordinator);
distributed DP calibrates each device's share for ``min-train-replies`` = all of the round's
devices (no dropouts in this simulation), so both carry the same noise multiplier, distributed DP
plus its rounding (``sqrt(d) / 2`` ring units of sensitivity). Also measured: the bytes and the
time distributed DP adds to one device's masked step (the encoding alone, same process).

Usage: python bench/dp.py [--rounds 30] [--per-round 100] [--seed 0]
Writes bench/results/dp.json and dp.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedge.clients.secagg_device import Trained, encode_update
from fedge.distributed_noise import DistributedNoise
from fedge.server.privacy import DifferentialPrivacy
from fedge.server.report import read_jsonl
from fedge.simulation.runner import simulate

HERE = Path(__file__).resolve().parent
EPSILONS = (1.0, 4.0, 8.0)
DELTA = 1e-5
CLIP = 1.0
BASE: dict[str, Any] = {"dataset": "digits", "model": "logreg", "fleet": "laptop=1000", "partitioner": "iid",
                        "local-epochs": 5, "export-onnx": False, "dp-clipping-norm": CLIP, "dp-delta": DELTA}
MODES: dict[str, dict[str, Any]] = {
    "central (client-fixed)": {"dp": "client-fixed"},
    "distributed (secure)": {"dp": "distributed", "secure-aggregation": True, "secagg-neighbours": 16},
}


def multiplier_for(epsilon: float, rounds: int, per_round: int, population: int) -> float:
    """The smallest noise multiplier whose ``rounds`` releases spend at most ``epsilon`` at δ (bisection)."""
    def spent(z: float) -> float:
        privacy = DifferentialPrivacy(mode="server-fixed", noise_multiplier=z, clipping_norm=CLIP,
                                      num_sampled=per_round, population=population, delta=DELTA)
        for _ in range(rounds):
            privacy.release()
        return privacy.epsilon
    low, high = 0.05, 200.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if spent(middle) > epsilon else (low, middle)
    return high


def run(config: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """One simulated run: its final accuracy, ε and wall time."""
    started = time.perf_counter()
    _, summary = simulate({**config, "run-dir": str(run_dir)}, progress=False)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return {"accuracy": rows[-1]["accuracy"], "epsilon": rows[-1].get("dp_epsilon"),
            "wall_s": round(time.perf_counter() - started, 1), "dp": summary.get("dp")}


def device_cost(dimension: int = 100_000, repeats: int = 5) -> dict[str, float]:
    """The masked step's encoding of a ``dimension``-entry update, with and without distributed DP."""
    rng = np.random.default_rng(0)
    arrays = {"w": rng.normal(size=dimension).astype(np.float32) * 0.01}
    trained = Trained({"w": arrays["w"] + 0.001}, 100, 10)
    base = {"bits": 32, "clip": 1e7, "scale": 1e4, "update-clip": 1000.0, "count-clip": dimension,
            "weight-clip": 1e5, "weight-scale": 1e4, "work-clip": 1e5, "work-scale": 1e4, "work-cap": 1.0,
            "work-momentum": -1.0}
    noise = DistributedNoise.calibrated(multiplier=1.0, clip=CLIP, scale=1e4, dimension=dimension, min_survivors=100)
    noised = {**base, "dp-clip": noise.clip, "dp-scale": noise.scale, "dp-stddev": noise.stddev,
              "dp-min-survivors": noise.min_survivors}
    times: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for name, params in (("plain secure", base), ("distributed DP", noised)):
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            vector = encode_update({"w": arrays["w"].astype(np.float64)}, trained, params)
            samples.append(time.perf_counter() - started)
        times[name], sizes[name] = float(np.median(samples)), int(vector.nbytes)
    return {"dimension": dimension, "encode_s": times, "bytes": sizes,
            "extra_ms": round(1000 * (times["distributed DP"] - times["plain secure"]), 2),
            "extra_bytes": sizes["distributed DP"] - sizes["plain secure"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    base = {**BASE, "num-rounds": args.rounds, "clients-per-round": args.per_round,
            "min-train-replies": args.per_round, "seed": args.seed}
    table: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        result = run({**base, "secure-aggregation": True, "secagg-neighbours": 16}, Path(tmp) / "off")
        table.append({"epsilon_target": None, "mode": "no DP (secure)", "z": 0.0, **result})
        print(f"  eps=inf  no DP (secure)              accuracy {result['accuracy']:.4f}  ({result['wall_s']} s)",
              flush=True)
        for epsilon in EPSILONS:
            z = multiplier_for(epsilon, args.rounds, args.per_round, 1000)
            for mode, extra in MODES.items():
                result = run({**base, **extra, "dp-noise-multiplier": z}, Path(tmp) / f"{epsilon}-{extra['dp']}")
                table.append({"epsilon_target": epsilon, "mode": mode, "z": z, **result})
                print(f"  eps={epsilon:<4} {mode:<28} z={z:.3f} accuracy {result['accuracy']:.4f} "
                      f"epsilon {result['epsilon']:.3f} ({result['wall_s']} s)", flush=True)
    cost = device_cost()
    print(f"\n{'ε target':>9}" + "".join(f"{mode:>28}" for mode in MODES))
    for epsilon in EPSILONS:
        cells = {row["mode"]: row for row in table if row["epsilon_target"] == epsilon}
        print(f"{epsilon:>9}" + "".join(f"{cells[m]['accuracy']:>20.4f} ε={cells[m]['epsilon']:.2f}" for m in MODES))
    print(f"{'∞':>9}{table[0]['accuracy']:>28.4f} (no DP, secure aggregation)")
    print(f"distributed DP on one device ({cost['dimension']:,} entries): +{cost['extra_ms']} ms to encode "
          f"(median of 5), +{cost['extra_bytes']} bytes sent")
    (HERE / "results").mkdir(exist_ok=True)
    _plot(table, HERE / "results" / "dp.png")
    (HERE / "results" / "dp.json").write_text(json.dumps(
        {"rounds": args.rounds, "per_round": args.per_round, "population": 1000, "delta": DELTA, "clip": CLIP,
         "seed": args.seed, "base": base, "table": table, "device_cost": cost}, indent=1, default=str) + "\n")


def _plot(table: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(6, 4))
    for mode in MODES:
        rows = [row for row in table if row["mode"] == mode]
        axes.plot([row["epsilon_target"] for row in rows], [row["accuracy"] for row in rows], marker="o", label=mode)
    axes.axhline(table[0]["accuracy"], color="grey", linestyle="--", label="no DP (ε = ∞)")
    axes.set_xlabel("ε (δ = 1e-5)")
    axes.set_ylabel("test accuracy after the last round")
    axes.set_title("digits, 1,000 devices: central vs distributed DP")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
