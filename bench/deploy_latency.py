"""Round latency in deployment: Flower's default polling vs the settings fedge uses.

A real coordinator (SuperLink, TLS + device authentication) and 2 devices on
127.0.0.1 run 4 rounds of a tiny model (logistic regression on digits, 1 local
epoch). Per-round wall time is read from the run's metrics (rounds 2-4, so
start-up is excluded).

Configurations, all in one run:
* ``flower-defaults``: the ServerApp uses Flower's ``send_and_receive`` (pulls every
  3 s) and SuperExec polls for tasks every 1 s (Flower's defaults);
* ``fedge-grid``: fedge's grid pulls every 0.1 s (``grid-poll-interval``) and
  ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1``; the devices' SuperNodes as Flower's own: a 3 s
  idle pull (hard-coded in Flower 1.42) and a cold ``flwr-clientapp`` process per message
  (``--idle-pull-s 3 --cold-clientapps``);
* ``fedge``: fedge's defaults: the same grid, Flower's 3 s idle pull, and ClientApps forked
  from a warm parent (:mod:`fedge.clients.warm_clientapp`);
* ``fedge-pull-1s``: the same with a 1 s idle pull (``fedge device --idle-pull-s 1``, what a
  gateway's node and the loopback test fleets use; :mod:`fedge.clients.supernode`).

Usage: python bench/deploy_latency.py   (about 4 minutes)
Writes bench/results/deploy_latency.json and prints a table.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from fedge.clients.supernode import FLOWER_IDLE_PULL_S, HEARTBEAT_S, IDLE_PULL_S
from fedge.simulation.loopback import LoopbackFederation

HERE = Path(__file__).resolve().parent
ROUNDS = 4
FEDGE_NODE = ("--idle-pull-s", str(IDLE_PULL_S), "--heartbeat-s", str(HEARTBEAT_S))  # fedge device's defaults
FLOWER_NODE = ("--idle-pull-s", str(FLOWER_IDLE_PULL_S), "--heartbeat-s", "30", "--cold-clientapps")
FEDGE_GRID = ({"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"}, "grid-poll-interval=0.1")
CONFIGS = {
    "flower-defaults": ({"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "1.0"}, "grid-poll-interval=0.0", FLOWER_NODE),
    "fedge-grid": (*FEDGE_GRID, FLOWER_NODE),
    "fedge": (*FEDGE_GRID, FEDGE_NODE),
    "fedge-pull-1s": (*FEDGE_GRID, ("--idle-pull-s", "1")),
}


def measure(name: str, env: dict[str, str], poll: str, device_args: tuple[str, ...],
            root: Path) -> dict[str, object]:
    """Round wall times of one configuration."""
    federation = LoopbackFederation(root / name, num_devices=2, env=env)
    try:
        federation.start_coordinator(
            "--rounds", str(ROUNDS), "--clients-per-round", "2", "--run-config",
            f"model='logreg' local-epochs=1 export-onnx=false round-timeout=60.0 {poll}")
        for index in range(2):
            federation.start_device(index, None, *device_args)
        federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 400, f"{name} run")
        walls = [row["wall_time_s"] for row in federation.rows()]
    finally:
        federation.close()
    per_round = [b - a for a, b in zip(walls[1:], walls[2:], strict=False)]
    return {"round_s": per_round, "median_round_s": statistics.median(per_round),
            "first_round_s": walls[1] - walls[0]}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: measure(name, env, poll, device_args, Path(tmp))
                   for name, (env, poll, device_args) in CONFIGS.items()}
    base = results["flower-defaults"]["median_round_s"]
    print(f"\n{'configuration':<18}{'median round s':>16}{'rounds 2-4 s':>28}{'speed-up':>10}")
    for name, result in results.items():
        rounds = ", ".join(f"{value:.2f}" for value in result["round_s"])  # type: ignore[attr-defined]
        ratio = base / result["median_round_s"]  # type: ignore[operator]
        print(f"{name:<18}{result['median_round_s']:>16.2f}{rounds:>28}{ratio:>9.2f}x")
    out = HERE / "results" / "deploy_latency.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"rounds": ROUNDS, "devices": 2, "model": "logreg", "results": results},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
