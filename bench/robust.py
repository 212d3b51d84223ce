"""Robust aggregation vs Byzantine devices, in simulation.

Flat (the default): 50 laptops with IID digits shards, 10 per round, 30 rounds, MLP; 20% of the
devices Byzantine. Attacks on the update delta d: sign-flip x4 (send -4 d) and
x100 scaling (send 100 d). Final test accuracy per strategy and attack, and the
gap to the clean FedAvg run, for each seed; the table shows the mean over seeds.

Over secure groups (``--groups``, issue 42): 200 laptops with IID digits shards, all of them each round,
under secure aggregation in ``secure-groups = 20`` random groups of 10; the rule (median, trimmed mean, or
FedAvg's weighted mean: the same groups, the flat mean) runs over the 20 group means. 5 % and 20 % of the
devices attack: model replacement (Bagdasaryan et al. 2020: train on labels shifted by one, send
G + gamma (L - G) with gamma = devices a round / attackers, so that together they replace the model),
sign flipping x4 (G - 4 d) and "a little is enough" (Baruch et al. 2019: the attackers collude, each sends
G + mu - z sigma of the attackers' honest updates, z from the paper's n and f). Also the clean run's cost of
grouping against one secure-aggregation instance over every device (accuracy, wall time a round, bytes).

The goal (``--goal``, issue 42: 5 % model replacement within 2 points of the clean run): FedAvg, the median
and Multi-Krum over 50 secure groups of 4, clean, under 5 % model replacement and under 5 % sign flipping,
for each seed. Multi-Krum's f is 10, the number of attackers: one attacker poisons at most its own group,
so however the groups fall no more than 10 of the 50 hold one (Krum's bound: n >= 2 f + 3 groups).

Usage: python bench/robust.py [--seeds 42 1 2]          (flat)
       python bench/robust.py --groups [--rounds 10] [--flat-rounds 2]     (over secure groups)
       python bench/robust.py --goal [--seeds 42 1 2] [--rounds 10] [--rules bulyan ...]  (the goal, over seeds)
       python bench/robust.py --cost [--sizes 100 1000]       (grouping's cost: round time and bytes)
Writes bench/results/robust.json (each mode its own key; the other mode's results are kept).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp

from fedge import knobs, wire
from fedge.clients.app import make_client_app
from fedge.clients.secure import add_secure_handlers
from fedge.config import resolve_run_config
from fedge.profiles import fleet_of
from fedge.server.app import behaviour_of, run_coordinator
from fedge.server.report import run_dir_for
from fedge.simulation.byzantine import byzantine_partitions
from fedge.simulation.grid import FleetNodes, InlineGrid
from fedge.simulation.runner import simulate
from fedge.task.api import Task, TaskData
from fedge.task.loading import load_task

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
    parser.add_argument("--groups", action="store_true", help="robust rules over secure groups (issue 42)")
    parser.add_argument("--rounds", type=int, default=10, help="--groups: rounds per run")
    parser.add_argument("--flat-rounds", type=int, default=2,
                        help="--groups: rounds of the one-instance baseline (~100 s each on 2 loaded cores)")
    parser.add_argument("--goal", action="store_true",
                        help="issue 42's goal over seeds: 5 %% model replacement through 50 secure groups of 4")
    parser.add_argument("--rules", nargs="*", default=[],
                        help="--goal: only the rules whose name holds one of these words (the others' earlier "
                             "results are kept)")
    parser.add_argument("--cost", action="store_true",
                        help="the cost of grouping: one secure instance vs secure-groups, 2 clean rounds each")
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000], help="--cost: devices a round")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    if args.cost:
        cost_main(args.sizes, args.seeds[0])
        return
    if args.goal:
        goal_main(args.rounds, args.seeds, args.rules)
        return
    if args.groups:
        groups_main(args.rounds, args.seeds[0], args.flat_rounds)
        return
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
    kept = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps({**kept, "seeds": args.seeds, "base": BASE, "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


# --------------------------------------------------------------------------- over secure groups (issue 42)
GROUPS_BASE = {"fleet": "laptop=200", "clients-per-round": 200, "partitioner": "iid", "model": "mlp",
               "dataset": "digits", "export-onnx": False, "secure-aggregation": True, "min-train-replies": 3}
GROUP_RULES: dict[str, dict[str, Any]] = {
    "fedavg over groups": {"strategy": "fedavg", "secure-groups": 20},
    "median over groups": {"strategy": "median", "secure-groups": 20},
    "trimmed-mean (0.2) over groups": {"strategy": "trimmed-mean", "trim-fraction": 0.2, "secure-groups": 20},
    "median over 50 groups of 4": {"strategy": "median", "secure-groups": 50},
}
GROUP_ATTACKS: dict[str, tuple[str, float]] = {  # name: (attack, share of the devices)
    "none": ("none", 0.0),
    "model replacement 5%": ("replace", 0.05), "model replacement 20%": ("replace", 0.20),
    "sign flip x4 5%": ("sign-flip", 0.05), "sign flip x4 20%": ("sign-flip", 0.20),
    "a little is enough 5%": ("alie", 0.05), "a little is enough 20%": ("alie", 0.20),
}


def shifted(task: Task) -> Task:
    """``task`` whose simulated partitions' labels are shifted by one class (the model replacement's target)."""
    honest_partition = task.partition

    def partition(partition_id: int, num_partitions: int, config: Any) -> TaskData:
        data = honest_partition(partition_id, num_partitions, config)
        return TaskData(data.inputs, (data.targets + 1) % 10)

    poisoned = copy.copy(task)
    poisoned.partition = partition  # type: ignore[method-assign]
    return poisoned


def alie_z(devices: int, attackers: int) -> float:
    """Baruch et al.'s z_max: the most standard deviations the attackers may shift while enough honest
    devices still lie farther from the mean (s = floor(n / 2 + 1) - f supporters needed)."""
    supporters = int(devices / 2 + 1) - attackers
    return NormalDist().inv_cdf((devices - supporters) / devices)


def hostile_secure_app(task: Task, config: Mapping[str, Any], bad: set[int], attack: str, boost: float,
                       z: float) -> ClientApp:
    """fedge's device app under secure aggregation, except that partitions in ``bad`` attack what they mask."""
    honest = make_client_app(task, config_defaults=config)
    poisoned = make_client_app(shifted(task), config_defaults=config)
    colluded: dict[int, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = {}  # round: (mu, sigma)

    def content(app: ClientApp, msg: Message, context: Context) -> RecordDict:
        train = Message(RecordDict({wire.ARRAYS: msg.content[wire.ARRAYS], wire.CONFIG: msg.content[wire.CONFIG]}),
                        dst_node_id=msg.metadata.dst_node_id, message_type=MessageType.TRAIN)
        train.metadata.__dict__["_message_id"] = f"train-{msg.metadata.message_id}"
        return app(train, context).content

    def deltas_of(content_: RecordDict, start: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: array.numpy() - start[name] for name, array in content_[wire.ARRAYS].items()}

    def train_content(msg: Message, context: Context) -> RecordDict:
        start = {name: array.numpy() for name, array in msg.content[wire.ARRAYS].items()}
        if int(context.node_config["partition-id"]) not in bad:
            return content(honest, msg, context)
        if attack == "replace":
            reply = content(poisoned, msg, context)
            change = {name: boost * value for name, value in deltas_of(reply, start).items()}
        elif attack == "sign-flip":
            reply = content(honest, msg, context)
            change = {name: -4.0 * value for name, value in deltas_of(reply, start).items()}
        else:  # a little is enough: the colluders' honest updates' mean - z sigma, computed once a round
            reply = content(honest, msg, context)
            server_round = int(msg.content[wire.CONFIG][wire.SERVER_ROUND])  # type: ignore[arg-type]
            if server_round not in colluded:
                others = [deltas_of(content(honest, msg, Context(
                    run_id=context.run_id, node_id=context.node_id, state=RecordDict(),
                    node_config={**context.node_config, "partition-id": partition}, run_config=context.run_config)),
                    start) for partition in sorted(bad)]
                colluded.clear()
                colluded[server_round] = ({name: np.mean([d[name] for d in others], axis=0) for name in start},
                                          {name: np.std([d[name] for d in others], axis=0) for name in start})
            mu, sigma = colluded[server_round]
            change = {name: mu[name] - z * sigma[name] for name in start}
        reply[wire.ARRAYS] = ArrayRecord({name: Array((start[name] + change[name]).astype(start[name].dtype))
                                          for name in start})
        return reply

    app = ClientApp()
    add_secure_handlers(app, train_content)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return honest(msg, context)

    return app


def grouped_run(overrides: Mapping[str, Any], attack: str, share: float) -> dict[str, Any]:
    """One simulated run under secure aggregation with ``share`` of the devices attacking; its record."""
    torch.set_num_threads(1)  # as simulate() does: on a few shared cores more threads only contend
    config = resolve_run_config(overrides)
    fleet = fleet_of(config)
    config[knobs.RUN_DIR] = str(run_dir_for(config))
    task = load_task(config)
    devices, per_round = fleet.size, config.integer(knobs.CLIENTS_PER_ROUND)
    bad = byzantine_partitions(devices, share, config.integer(knobs.SEED)) if share else set()
    z = alie_z(per_round, max(1, round(share * per_round)))
    boost = per_round / max(1, round(share * per_round))
    app = hostile_secure_app(task, config, bad, attack, boost, z)
    grid = InlineGrid(app, FleetNodes(fleet, config.integer(knobs.SEED)), config, behaviour=behaviour_of(config, fleet))
    started = time.perf_counter()
    run_dir = run_coordinator(grid, config, progress=False, task=task)
    wall = time.perf_counter() - started
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [later["wall_time_s"] - earlier["wall_time_s"] for earlier, later in zip(rows, rows[1:], strict=False)]
    return {"final_accuracy": summary["final_accuracy"], "attackers": len(bad), "wall_s": round(wall, 1),
            "accuracy_by_round": [round(row["headline"], 4) for row in rows[1:]],
            "round_wall_s": round(statistics.median(times), 3) if times else None,
            "bytes_up_per_round": summary["bytes_up"] // max(1, summary["rounds"]),
            "bytes_down_per_round": summary["bytes_down"] // max(1, summary["rounds"]),
            **({"z": round(z, 3)} if attack == "alie" else {}), **({"boost": boost} if attack == "replace" else {})}


TRIMMED_ATTACKS = ("none", "model replacement 5%", "model replacement 20%", "a little is enough 5%")
"""The trimmed mean runs these (the machine is shared: FedAvg and the median run every attack)."""
SMALL_GROUP_ATTACKS = ("none", "model replacement 5%", "sign flip x4 5%")
"""The median over 50 groups of 4 runs these: smaller groups, fewer of them hold an attacker."""


def runs_of(name: str) -> tuple[str, ...]:
    """The attacks the rule ``name`` runs against."""
    if name.startswith("trimmed"):
        return TRIMMED_ATTACKS
    if "50 groups" in name:
        return SMALL_GROUP_ATTACKS
    return tuple(GROUP_ATTACKS)


def groups_main(rounds: int, seed: int, flat_rounds: int) -> None:
    """The attacks x rules table over 20 secure groups of 200 devices, and the clean run without groups
    (``flat_rounds`` rounds of one secure-aggregation instance over all 200: its round time and bytes; its
    model equals FedAvg's over the groups, the weighted mean of the group means, so accuracy is compared by
    round)."""
    results: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        def run(name: str, attack_name: str, rule: Mapping[str, Any]) -> None:
            attack, share = GROUP_ATTACKS[attack_name]
            run_dir = Path(tmp) / f"{len(results)}-{name}-{attack_name}".replace(" ", "_")
            record = grouped_run({**GROUPS_BASE, "num-rounds": rounds, **rule, "seed": seed,
                                  "run-dir": str(run_dir)}, attack, share)
            results.setdefault(name, {})[attack_name] = record
            print(f"  {name:<32}{attack_name:<26}{record}", flush=True)

        for name, rule in GROUP_RULES.items():
            for attack_name in runs_of(name):
                run(name, attack_name, rule)
        run("flat secure fedavg (one instance)", "none", {"strategy": "fedavg", "secure-groups": 0,
                                                          "num-rounds": flat_rounds})
    print(f"\n{'rule':<32}" + "".join(f"{attack:>24}" for attack in GROUP_ATTACKS))
    for name, row in results.items():
        print(f"{name:<32}" + "".join(f"{row[a]['final_accuracy']:>24.4f}" if a in row else f"{'':>24}"
                                      for a in GROUP_ATTACKS))
    out = HERE / "results" / "robust.json"
    kept = json.loads(out.read_text()) if out.exists() else {}
    kept["groups"] = {"seed": seed, "rounds": rounds, "flat_rounds": flat_rounds, "base": GROUPS_BASE,
                      "results": results,
                      "total_wall_s": round(time.perf_counter() - started, 1),
                      "machine": "2 shared CPU cores, loaded by other work (wall times are indicative)"}
    out.write_text(json.dumps(kept, indent=2) + "\n")
    print(f"wrote {out}")



GOAL_RULES: dict[str, dict[str, Any]] = {
    "fedavg over 50 groups of 4": {"strategy": "fedavg", "secure-groups": 50},
    "median over 50 groups of 4": {"strategy": "median", "secure-groups": 50},
    "trimmed-mean (0.2) over 50 groups of 4": {"strategy": "trimmed-mean", "trim-fraction": 0.2, "secure-groups": 50},
    "bulyan (f=10) over 50 groups of 4": {"strategy": "bulyan", "num-byzantine": 10, "secure-groups": 50},
    "multi-krum (f=10, m=40) over 50 groups of 4": {"strategy": "krum", "num-byzantine": 10, "krum-select": 40,
                                                    "secure-groups": 50},
}
GOAL_ATTACKS = ("none", "model replacement 5%", "sign flip x4 5%")


def goal_main(rounds: int, seeds: list[int], only: list[str]) -> None:
    """Each goal rule x attack x seed; the table of means over seeds, each attack's gap to the rule's clean run
    and to clean FedAvg's. ``only``: run the rules whose name holds one of these words, keeping the others'
    results from an earlier run with the same seeds and rounds."""
    out = HERE / "results" / "robust.json"
    kept = json.loads(out.read_text()) if out.exists() else {}
    earlier = kept.get("goal", {})
    same = earlier.get("seeds") == seeds and earlier.get("rounds") == rounds
    results: dict[str, dict[str, list[float]]] = dict(earlier.get("final_accuracy", {})) if same and only else {}
    chosen = {name: rule for name, rule in GOAL_RULES.items() if not only or any(word in name for word in only)}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            results[name] = {}
        for seed in seeds:
            for name, rule in chosen.items():
                for attack_name in GOAL_ATTACKS:
                    attack, share = GROUP_ATTACKS[attack_name]
                    run_dir = Path(tmp) / f"{seed}-{name}-{attack_name}".replace(" ", "_")
                    record = grouped_run({**GROUPS_BASE, "num-rounds": rounds, **rule, "seed": seed,
                                          "run-dir": str(run_dir)}, attack, share)
                    results.setdefault(name, {}).setdefault(attack_name, []).append(record["final_accuracy"])
                    print(f"  seed {seed:<4}{name:<46}{attack_name:<24}{record['final_accuracy']:.4f}", flush=True)
    clean_fedavg = statistics.mean(results["fedavg over 50 groups of 4"]["none"])
    print(f"\n{'rule':<46}" + "".join(f"{attack:>24}" for attack in GOAL_ATTACKS))
    for name, row in results.items():
        clean = statistics.mean(row["none"])
        print(f"{name:<46}" + "".join(
            f"{statistics.mean(row[a]):>10.4f} ({100 * (statistics.mean(row[a]) - clean):+5.1f}/"
            f"{100 * (statistics.mean(row[a]) - clean_fedavg):+5.1f})" for a in GOAL_ATTACKS))
    print("cells: mean final accuracy over seeds (points vs the rule's clean run / vs clean FedAvg over the groups)")
    kept["goal"] = {"seeds": seeds, "rounds": rounds, "base": GROUPS_BASE, "rules": GOAL_RULES,
                    "final_accuracy": results, "last_invocation_wall_s": round(time.perf_counter() - started, 1),
                    "rules_last_invocation": list(chosen),
                    "machine": "2 shared CPU cores, loaded by other work"}
    out.write_text(json.dumps(kept, indent=2) + "\n")
    print(f"wrote {out}")


def neighbours_for(n: int) -> int:
    """SecAgg+'s O(log n) neighbourhood for one instance over ``n`` devices: 2 ceil(log2 n) (bench/secure_scale.py)."""
    return min(n - 1, 2 * math.ceil(math.log2(n)))


def cost_main(sizes: list[int], seed: int) -> None:
    """For each fleet size, 2 clean rounds of FedAvg under one SecAgg+ instance over every device and under
    ``secure-groups`` of about 10 and of 4: the median round's wall time and the bytes a round."""
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for devices in sizes:
            bits = {"secagg-bits": 40} if devices > 400 else {}  # one instance's sum must fit: refused at 32 bits
            setups = {f"one instance (SecAgg+, {neighbours_for(devices)} neighbours)":
                      {"secure-groups": 0, "secagg-neighbours": neighbours_for(devices), **bits},
                      f"{devices // 10} groups of 10": {"secure-groups": devices // 10, **bits},
                      f"{devices // 4} groups of 4": {"secure-groups": devices // 4, **bits}}
            for name, setup in setups.items():
                run_dir = Path(tmp) / f"{devices}-{name}".replace(" ", "_")
                record = grouped_run({**GROUPS_BASE, "fleet": f"laptop={devices}", "clients-per-round": devices,
                                      "strategy": "fedavg", "num-rounds": 2, "seed": seed, **setup,
                                      "run-dir": str(run_dir)}, "none", 0.0)
                results.setdefault(str(devices), {})[name] = record
                print(f"  {devices:>5} devices  {name:<36} round {record['round_wall_s']:>7.2f} s  "
                      f"{record['bytes_up_per_round'] / 1e6:8.2f} MB up  {record['bytes_down_per_round'] / 1e6:8.2f} "
                      f"MB down  accuracy {record['final_accuracy']:.4f}", flush=True)
    out = HERE / "results" / "robust.json"
    kept = json.loads(out.read_text()) if out.exists() else {}
    kept["cost"] = {"seed": seed, "base": GROUPS_BASE, "rounds": 2, "results": results,
                    "machine": "2 shared CPU cores, loaded by other work (wall times are indicative)"}
    out.write_text(json.dumps(kept, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
