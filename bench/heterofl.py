"""Devices too small for the model: leave them out, shrink the fleet's model, or give them sub-models.

A fleet of 20 devices: 12 phones that hold a quarter-width model (``model-width = 0.25``),
4 laptops that hold half (0.5) and 4 GPU boxes that hold the whole model. The phones hold
the data the others lack: 90 % of the examples of classes 0-4 (the rest of those go to the
laptops and GPU boxes, who hold all of classes 5-9). Every device trains every round (1 local
epoch). In one run, on ``digits`` (the demo's CNN) and on ``images`` (the GroupNorm ResNet):

(a) ``exclude``: the phones sit out (and their data with them);
(b) ``smallest``: the whole fleet trains the quarter-width model (what it delivers is that model);
(c) ``heterofl``: each class trains its width, leading channels (HeteroFL, ICLR 2021);
(d) ``fedrolex``: each class trains its width, a rolling window moving one unit a round (FedRolex,
    NeurIPS 2022, Algorithm 1);
(d') ``fedrolex`` with ``fedrolex-stride = 0``: the window moves by its own length each round
    (what fedge's ``fedrolex`` did before issue 39);
(c') ``heterofl`` with HeteroFL's scaler (``sub-model-scaler = true``), to measure what it does here.

Reports the central test accuracy of the whole model and of each width's model, bytes up and
down, and simulated time; and each width's training memory (estimate and a measured one-step
peak on this CPU). Goal (issue 29): (c) or (d) beats both (a) and (b) on the whole model by at
least 3 points (for (b): the model it delivers, the quarter-width one).

Usage: python bench/heterofl.py [--digits-rounds 30] [--images-rounds 30] [--seed 0] [--memory-only]
                                [--tasks digits images] [--runs "(d) fedrolex" ...]
Writes bench/results/heterofl.json and bench/results/heterofl.png; prints tables. With ``--runs``,
only those rows run and the task's other rows are kept from the results file, each row saying
when it ran (``ran_at``).
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

from fedge.config import RunConfig, resolve_run_config
from fedge.profiles import fleet_of
from fedge.server.report import read_jsonl
from fedge.simulation.runner import simulate
from fedge.task.api import Task, TaskData
from fedge.task.loading import load_task

HERE = Path(__file__).resolve().parent
FLEET = """
[profiles.phone]
compute-rate = 200
uplink-mbps = 2
downlink-mbps = 10
memory-mb = 512
model-width = 0.25

[profiles.laptop]
compute-rate = 2000
uplink-mbps = 20
downlink-mbps = 50
memory-mb = 2048
model-width = 0.5

[profiles.gpu-box]
compute-rate = 20000
uplink-mbps = 100
downlink-mbps = 500
memory-mb = 32768

[fleet]
phone = 12
laptop = 4
gpu-box = 4
"""
WIDTHS = {"phone": 0.25, "laptop": 0.5, "gpu-box": 1.0}
PHONE_CLASSES = range(5)  # the classes whose examples the phones hold most of
PHONE_SHARE = 0.9
CONFIGS: dict[str, dict[str, Any]] = {
    "(a) exclude": {"sub-models": "exclude"},
    "(b) smallest": {"sub-models": "smallest"},
    "(c) heterofl": {"sub-models": "heterofl"},
    "(d) fedrolex": {"sub-models": "fedrolex"},
    "(d') fedrolex, stride 0": {"sub-models": "fedrolex", "fedrolex-stride": 0},
    "(c') heterofl + scaler": {"sub-models": "heterofl", "sub-model-scaler": True},  # the paper's scaler, measured
}
TASKS = {  # digits: the demo's local work (5 epochs of batches of 16); images: as bench/tasks.py, 1 epoch
    "digits": {"dataset": "digits", "model": "cnn", "learning-rate": 0.05, "local-epochs": 5, "batch-size": 16},
    "images": {"task": "images", "learning-rate": 0.05, "local-epochs": 1, "batch-size": 32},
}


class PhonesHoldSomeClasses(Task):
    """A task's data and model, its training examples split by device profile: the phones hold
    ``PHONE_SHARE`` of every example of ``PHONE_CLASSES``; the rest (and every other class) is
    shared by the other devices. Everything else is the wrapped task's."""

    def __init__(self, inner: Task) -> None:
        self.inner = inner
        self._shards: list[np.ndarray] | None = None
        for name in ("name", "headline", "higher_is_better", "inputs", "labels", "preprocessing", "output",
                     "target_dtype"):
            setattr(self, name, getattr(inner, name))

    def build_model(self) -> Any:  # noqa: D102
        return self.inner.build_model()

    def train_data(self) -> TaskData:  # noqa: D102
        return self.inner.train_data()

    def central_data(self) -> TaskData | None:  # noqa: D102
        return self.inner.central_data()

    def forward(self, model: Any, inputs: Any) -> Any:  # noqa: D102
        return self.inner.forward(model, inputs)

    def loss(self, outputs: Any, targets: Any) -> Any:  # noqa: D102
        return self.inner.loss(outputs, targets)

    def metrics(self, outputs: Any, targets: Any) -> dict[str, float]:  # noqa: D102
        return self.inner.metrics(outputs, targets)

    def partition(self, partition_id: int, num_partitions: int, config: RunConfig) -> TaskData:  # noqa: D102
        return self.train_data().take(self.shards(config)[partition_id])

    def shards(self, config: RunConfig) -> list[np.ndarray]:
        """Each partition's example indices (computed once)."""
        if self._shards is not None:
            return self._shards
        fleet, seed = fleet_of(config), config.integer("seed")
        profiles = [fleet.profile_of(index, seed) for index in range(fleet.size)]
        phones = [index for index, name in enumerate(profiles) if name == "phone"]
        others = [index for index, name in enumerate(profiles) if name != "phone"]
        rng = np.random.default_rng(seed)
        shards: list[list[int]] = [[] for _ in profiles]
        targets = self.train_data().targets
        for label in np.unique(targets):
            examples = rng.permutation(np.flatnonzero(targets == label))
            to_phones = int(round(PHONE_SHARE * len(examples))) if label in PHONE_CLASSES else 0
            for group, part in ((phones, examples[:to_phones]), (others, examples[to_phones:])):
                for device, piece in zip(group, np.array_split(part, len(group)), strict=True):
                    shards[device].extend(piece.tolist())
        self._shards = [np.sort(np.array(shard, dtype=np.int64)) for shard in shards]
        return self._shards


def memory_table(task: Task, batch: int) -> list[dict[str, Any]]:
    """Each width's parameters and training memory (estimate, measured one-step peak)."""
    from fedge.task.api import seeded_model
    from fedge.task.submodels import memory_at, width_plan

    plan = width_plan(task, seeded_model(task, 0))
    rows = []
    for width in sorted(set(WIDTHS.values()), reverse=True):
        memory = memory_at(task, width, batch)
        rows.append({"width": width, "parameters": plan.parameters_at(width), "batch": batch,
                     "estimate_mib": memory.estimate / 2**20, "measured_mib": memory.measured / 2**20,
                     "measured_over_estimate": memory.measured / memory.estimate})
    return rows


def run_one(task: Task, overrides: dict[str, Any], chosen: dict[str, Any], rounds: int,
            run_dir: Path) -> dict[str, Any]:
    """One simulated run; its rows and summary."""
    mode = chosen["sub-models"]
    run_dir, summary = simulate({**overrides, **chosen, "num-rounds": rounds, "run-dir": str(run_dir)},
                                progress=True, task=task)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    last = rows[-1]
    by_width = {key: value for key, value in last.get("headline_by_width", {}).items()}
    whole = last["headline"]
    delivered = by_width.get("0.25", whole) if mode == "smallest" else whole
    return {"mode": mode, "whole": whole, "by_width": by_width, "delivered": delivered,
            "bytes_up": summary["bytes_up"], "bytes_down": summary["bytes_down"], "sim_time_s": summary["sim_time_s"],
            "wall_time_s": summary["wall_time_s"], "ran_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "curve": [(row["round"], row["sim_time_s"], row["headline"], row.get("headline_by_width", {}))
                      for row in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--digits-rounds", type=int, default=30)
    parser.add_argument("--images-rounds", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--memory-only", action="store_true", help="only the training-memory table")
    parser.add_argument("--runs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                        help="rows to run; the others are kept from bench/results/heterofl.json")
    args = parser.parse_args()
    if args.memory_only:
        print_memory({name: memory_table(PhonesHoldSomeClasses(load_task(resolve_run_config(TASKS[name]))),
                                         int(TASKS[name]["batch-size"])) for name in args.tasks})
        return
    logging.getLogger("fedge").setLevel(logging.WARNING)
    out = HERE / "results"
    previous = json.loads((out / "heterofl.json").read_text()) if (out / "heterofl.json").exists() else {}
    results: dict[str, Any] = {"fleet": FLEET, "phone_share": PHONE_SHARE, "seed": args.seed,
                               "tasks": previous.get("tasks", {})}
    with tempfile.TemporaryDirectory() as scratch:
        where = Path(scratch)
        (where / "fleet.toml").write_text(FLEET)
        for name in args.tasks:
            rounds = args.digits_rounds if name == "digits" else args.images_rounds
            overrides = {**TASKS[name], "fleet-file": str(where / "fleet.toml"), "clients-per-round": 20,
                         "momentum": 0.9, "seed": args.seed}
            config = resolve_run_config(overrides)
            task = PhonesHoldSomeClasses(load_task(config))
            kept = results["tasks"].get(name, {}).get("runs", {}) if results["tasks"].get(name, {}).get(
                "rounds") == rounds else {}
            runs = {label: run_one(task, overrides, chosen, rounds, where / name / str(index))
                    if label in args.runs or label not in kept else kept[label]
                    for index, (label, chosen) in enumerate(CONFIGS.items())}
            memory = memory_table(task, int(overrides["batch-size"]))
            results["tasks"][name] = {"rounds": rounds, "memory": memory, "runs": runs}
            print_task(name, results["tasks"][name])
    out.mkdir(exist_ok=True)
    (out / "heterofl.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "heterofl.png")
    print(f"wrote {out / 'heterofl.json'} and {out / 'heterofl.png'}")


def print_task(name: str, result: dict[str, Any]) -> None:
    """The comparison table, the goal's verdict and the memory table of one task."""
    runs = result["runs"]
    print(f"\n{name}: {result['rounds']} rounds, every device every round")
    print("| run | whole model | w0.5 model | w0.25 model | delivered | MB down | MB up | sim s | ran |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, run in runs.items():
        widths = run["by_width"]
        print(f"| {label} | {run['whole']:.4f} | {_shown(widths.get('0.5'))} | {_shown(widths.get('0.25'))} | "
              f"{run['delivered']:.4f} | {run['bytes_down'] / 1e6:.1f} | {run['bytes_up'] / 1e6:.1f} | "
              f"{run['sim_time_s']:.0f} | {run.get('ran_at', 'before issue 39')} |")
    best = max(run["whole"] for label, run in runs.items() if label[:3] in ("(c)", "(d)", "(d'"))
    baseline = max(runs["(a) exclude"]["delivered"], runs["(b) smallest"]["delivered"])
    verdict = "met" if best - baseline >= 0.03 else "not met"
    print(f"goal (best of c/d beats best of a/b by >= 3 points): {best:.4f} vs {baseline:.4f}: "
          f"{(best - baseline) * 100:+.1f} points, {verdict}")
    print_memory({name: result["memory"]})


def print_memory(tables: dict[str, list[dict[str, Any]]]) -> None:
    """Each task's training memory per width: estimate, measured one-step peak, their ratio."""
    print("| task | width | batch | parameters | memory estimate MiB | measured MiB | measured / estimate |")
    print("|---|---|---|---|---|---|---|")
    for name, rows in tables.items():
        for row in rows:
            print(f"| {name} | {row['width']:g} | {row['batch']} | {row['parameters']:,} | {row['estimate_mib']:.1f} | "
                  f"{row['measured_mib']:.1f} | {row['measured_over_estimate']:.2f} |")


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def plot(results: dict[str, Any], path: Path) -> None:
    """Whole-model accuracy vs rounds and vs simulated time, one row of plots per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = results["tasks"]
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 4 * len(tasks)), squeeze=False)
    for row, (name, result) in enumerate(tasks.items()):
        for label, run in result["runs"].items():
            curve = run["curve"]
            key = "0.25" if run["mode"] == "smallest" else None
            accuracy = [(point[3].get(key, point[2]) if key else point[2]) for point in curve]
            axes[row][0].plot([point[0] for point in curve], accuracy, label=label)
            axes[row][1].plot([point[1] for point in curve], accuracy, label=label)
        for column, xlabel in enumerate(("round", "simulated seconds")):
            axes[row][column].set_xlabel(xlabel)
            axes[row][column].set_ylabel("test accuracy of the delivered model")
            axes[row][column].set_title(name)
            axes[row][column].grid(alpha=0.3)
        axes[row][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
