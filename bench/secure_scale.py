"""Secure aggregation at fleet scale: 1,000 devices a round, a 1M-parameter model (issue 16, item 5).

One training round on the in-process grid, for plaintext FedAvg, fedge's SecAgg+ and
Flower 1.42's ``SecAggPlusWorkflow`` (as ``bench/secure.py``, which covers 10-100 devices
and a 100k model), at the size a fleet runs: ``--devices`` devices (1,000), an MLP of
999,985 parameters, SecAgg+ neighbourhoods of ``2 ceil(log2 n)`` devices (20 at 1,000:
O(log n)), a reconstruction threshold of half of them (devices raise it to a strict
majority), 0% and ``--dropout`` of the devices dropping out after the key exchange.

The fleet is fedge's default mix scaled to the size (60% phones, 30% laptops, 10% GPU
boxes); each device trains ``local-epochs = 5`` on 64 digits examples of its own. Every run
happens in its own subprocess (fresh memory; Flower's capped at ``--flower-timeout``).

Per run: the coordinator's time (the round less the grid's deliveries: the devices'
ClientApp calls, this script's metering and the in-process transport, i.e. the inline grid's
message and state copies, reported apart as ``transport_s``), in CPU seconds of this process
and in wall seconds; each device's protocol CPU (its ClientApp calls' CPU less local
training; mean and max) and bytes up/down (serialised protobuf of every message); and the
critical path of a fleet whose devices work in parallel: the coordinator's time plus, per
exchange, the slowest device, where a device's time is its measured ClientApp time with
local training replaced by what its profile charges for it (samples processed / compute
rate, :mod:`fedge.profiles`, as :func:`fedge.server.metering.reply_seconds` does):

* ``fleet_cpu``: on CPU time (the headline: other processes on the machine barely move it);
* ``fleet``: on wall time (moves ~2x with the machine's load);
* ``fleet+net``: wall, plus each message's transfer time over the device's link (bytes /
  bandwidth of its profile).

Ratios are against plaintext at the same size and dropout. Protocol work of the devices
is measured on this machine (one x86 core; a phone runs ChaCha20 a few times slower).

Usage: python bench/secure_scale.py [--devices 1000] [--dropout 0.1] [--systems ...]
Writes bench/results/secure_scale.json (and secure_scale.png). Target (issue 16): fedge's
fleet critical path <= 1.5x plaintext at 1,000 devices and 1M parameters.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import resource
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.serde import recorddict_to_proto
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_PARAMS_RECORD
from rich.console import Console
from rich.table import Table
from secure import flower_secagg_app  # bench/ is the script's folder, first on sys.path
from torch import nn

import fedge.clients.torch_client as torch_client
from fedge.clients.app import make_client_app
from fedge.config import RunConfig, resolve_run_config
from fedge.profiles import BUILTIN_PROFILES, parse_fleet
from fedge.server.app import TRAIN_KEYS
from fedge.simulation.grid import FIRST_NODE_ID, InlineGrid
from fedge.strategies import FedAvg
from fedge.strategies.drivers.secure import SecureAggregation
from fedge.task.api import TaskData
from fedge.task.builtin.digits import Digits
from fedge.task.models import model_arrays
from fedge.task.training import train_local

HERE = Path(__file__).resolve().parent
HIDDEN = 13_333  # 64 * 13333 + 13333 + 13333 * 10 + 10 = 999,985 parameters
PARAMETERS = 75 * HIDDEN + 10
EXAMPLES = 64  # examples on each device: 5 local epochs are 320 samples (1.6 s on a phone's profile)
SETTINGS = {"partitioner": "iid", "local-epochs": 5, "batch-size": 32, "learning-rate": 0.05, "momentum": 0.0,
            "model": "mlp"}
SYSTEMS = ("plaintext", "fedge-secagg", "flower-secagg+")
SECAGG = {"clip": 10.0, "precision": 1e-5, "bits": 32}
"""fedge's fixed point: |w * delta| <= 10 at steps of 1e-5 sums over 1,000 devices in 31 bits, so masked inputs
stay 4 bytes a parameter (the defaults, clip 1000 and 1e-4, need 35 bits: 8-byte words). Flower's SecAgg+
quantises to 2^22 levels over [-8, 8] (steps of 3.8e-6) modulo 2^32 and sends 8-byte integers."""


def wide_mlp() -> nn.Module:
    """The benchmark's 1M-parameter model (same initial weights everywhere)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))


class WideDigits(Digits):
    """The digits task with the benchmark's 1M-parameter MLP and :data:`EXAMPLES` examples on every device.

    1,797 digits split 1,000 ways would leave each device 1 or 2 examples and no local work
    to speak of; here each device holds its own draw of 64 (drawn with its partition id as
    the seed, so devices overlap), whatever the fleet's size.
    """

    def build_model(self) -> nn.Module:
        return wide_mlp()

    def partition(self, partition_id: int, num_partitions: int, config: RunConfig) -> TaskData:
        pool = self.train_data()
        return pool.take(np.random.default_rng(partition_id).choice(len(pool), EXAMPLES, replace=False))


def fleet_spec(n: int) -> str:
    """fedge's default mix (phone=60,laptop=30,gpu-box=10) scaled to ``n`` devices."""
    gpu, laptop = n // 10, n * 3 // 10
    return f"phone={n - gpu - laptop},laptop={laptop},gpu-box={gpu}"


def neighbours_for(n: int) -> int:
    """SecAgg+'s O(log n): 2 ceil(log2 n) neighbours (all pairs up to 10 devices)."""
    return n - 1 if n <= 10 else min(n - 1, 2 * math.ceil(math.log2(n)))


class Metered:
    """Wraps a ClientApp: per device CPU, bytes, training time and profile; drops chosen devices at one step.

    Keeps, per exchange, the slowest device's time with local training replaced by its
    profile's compute time (with and without transfer time), and its own metering time
    (protobuf sizes), which is not the coordinator's.
    """

    def __init__(self, app: ClientApp, dropouts: set[int], drop_when: Any) -> None:
        self.app, self.dropouts, self.drop_when = app, dropouts, drop_when
        self.cpu: dict[int, float] = defaultdict(float)
        self.train_cpu: dict[int, float] = defaultdict(float)
        self.down: dict[int, int] = defaultdict(int)
        self.up: dict[int, int] = defaultdict(int)
        self.client_wall = 0.0  # all devices' ClientApp time, one after the other
        self.metering = 0.0  # this wrapper's own time (protobuf sizes)
        self.slowest = 0.0  # the current exchange's slowest device, training at its profile's speed
        self.slowest_net = 0.0  # the same with transfer times
        self.slowest_cpu = 0.0  # the same on CPU time (this process's: robust to the machine's load)
        self.node: int | None = None
        self.trained: tuple[float, float, int] = (0.0, 0.0, 0)  # wall, cpu, samples of this call's training

    def __call__(self, message: Message, context: Context) -> Message:
        node, started = context.node_id, time.perf_counter()
        profile = BUILTIN_PROFILES[str(context.node_config["profile"])]
        down = recorddict_to_proto(message.content).ByteSize()
        self.down[node] += down
        self.metering += time.perf_counter() - started
        if node in self.dropouts and self.drop_when(message):
            raise ConnectionError("device dropped out")
        self.node, self.trained = node, (0.0, 0.0, 0)
        cpu, wall = time.process_time(), time.perf_counter()
        reply = self.app(message=message, context=context)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        self.cpu[node] += cpu
        self.train_cpu[node] += self.trained[1]
        self.client_wall += wall
        started = time.perf_counter()
        up = recorddict_to_proto(reply.content).ByteSize() if not reply.has_error() else 0
        self.up[node] += up
        device = wall - self.trained[0] + profile.compute_seconds(self.trained[2])
        self.slowest = max(self.slowest, device)
        self.slowest_net = max(self.slowest_net, device + profile.download_seconds(down) + profile.upload_seconds(up))
        self.slowest_cpu = max(self.slowest_cpu, cpu - self.trained[1] + profile.compute_seconds(self.trained[2]))
        self.metering += time.perf_counter() - started
        return reply

    def timed_training(self, *args: Any, **kwargs: Any) -> Any:
        """``train_local``, timed (wall, CPU) and its samples counted for the current device."""
        cpu, wall = time.process_time(), time.perf_counter()
        stats = train_local(*args, **kwargs)
        self.trained = (time.perf_counter() - wall, time.process_time() - cpu, int(stats.samples_processed))
        return stats


class FleetGrid(InlineGrid):
    """The inline grid, adding each exchange's slowest device to the fleet's critical path."""

    def __init__(self, metered: Metered, n: int, config: dict[str, Any]) -> None:
        super().__init__(metered, _nodes(n), config)  # type: ignore[arg-type]
        self.metered, self.critical, self.critical_net, self.critical_cpu, self.exchanges = metered, 0.0, 0.0, 0.0, 0
        self.delivering = 0.0  # time in the grid's deliveries: the ClientApp calls and the in-process transport
        self.delivering_cpu = 0.0

    def _deliver(self, message: Message) -> Message:
        started, cpu = time.perf_counter(), time.process_time()
        try:
            return super()._deliver(message)
        finally:
            self.delivering += time.perf_counter() - started
            self.delivering_cpu += time.process_time() - cpu

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
        self.metered.slowest = self.metered.slowest_net = self.metered.slowest_cpu = 0.0
        replies = list(super().send_and_receive(messages, timeout=timeout))
        self.critical += self.metered.slowest
        self.critical_net += self.metered.slowest_net
        self.critical_cpu += self.metered.slowest_cpu
        self.exchanges += 1
        return replies


def _config(n: int) -> RunConfig:
    return resolve_run_config({**SETTINGS, "fleet": fleet_spec(n), "clients-per-round": n})


def run_fedge(n: int, dropout: float, secure: bool) -> dict[str, Any]:
    config = _config(n)
    step = "train.secagg_masked" if secure else "train"
    metered = Metered(make_client_app(WideDigits(config), config_defaults=config), _dropped(n, dropout),
                      lambda m: m.metadata.message_type == step)
    torch_client.train_local = metered.timed_training  # type: ignore[assignment]  # the device runtime's trainer
    grid = FleetGrid(metered, n, config)
    kwargs: dict[str, Any] = {"clients_per_round": n, "min_train_replies": 1}
    strategy = (FedAvg(driver=SecureAggregation(threshold=0.5, neighbours=neighbours_for(n), **SECAGG), **kwargs)
                if secure else FedAvg(**kwargs))
    arrays = model_arrays(wide_mlp())
    started, cpu = time.perf_counter(), time.process_time()
    new, _ = strategy.train_round(grid, 1, arrays, ConfigRecord({k: config[k] for k in TRAIN_KEYS}), 3600.0)
    return _row(grid, time.perf_counter() - started, time.process_time() - cpu, n, new is not None)


def run_flower(n: int, dropout: float) -> dict[str, Any]:
    config = _config(n)

    def at_masked_step(message: Message) -> bool:
        record = message.content.config_records.get(RECORD_KEY_CONFIGS)
        return record is not None and record.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS

    task = WideDigits(config)
    metered: Metered

    def train(task: WideDigits, model: nn.Module, dataset: TaskData, *, seed: int) -> Any:
        return metered.timed_training(task, model, dataset, epochs=config.integer("local-epochs"), batch_size=32,
                                      learning_rate=0.05, momentum=0.0, device=torch.device("cpu"), seed=seed)

    app = flower_secagg_app(task, n, config, train)
    metered = Metered(app, _dropped(n, dropout), at_masked_step)
    grid = FleetGrid(metered, n, config)
    initial = [v.detach().numpy() for v in wide_mlp().state_dict().values()]
    strategy = LegacyFedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n, min_available_clients=n,
                            min_evaluate_clients=0, initial_parameters=ndarrays_to_parameters(initial))
    context = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=1), strategy=strategy)
    workflow = DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares=neighbours_for(n) + 1,
                                                               reconstruction_threshold=0.5, timeout=3600.0))
    started, cpu = time.perf_counter(), time.process_time()
    workflow(grid, context)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    final = context.state.array_records[MAIN_PARAMS_RECORD].to_numpy_ndarrays()
    aggregated = any(not np.array_equal(a, b) for a, b in zip(final, initial, strict=True))
    return _row(grid, wall, cpu, n, aggregated)


def _dropped(n: int, fraction: float) -> set[int]:
    return {FIRST_NODE_ID + i for i in random.Random(n).sample(range(n), int(round(fraction * n)))}


def _nodes(n: int) -> list[dict[str, Any]]:
    profiles = parse_fleet(fleet_spec(n)).assignment(seed=0)
    return [{"partition-id": i, "num-partitions": n, "profile": profiles[i]} for i in range(n)]


def _row(grid: FleetGrid, wall: float, cpu: float, n: int, aggregated: bool) -> dict[str, Any]:
    metered = grid.metered
    coordinator, coordinator_cpu = wall - grid.delivering, cpu - grid.delivering_cpu
    transport = grid.delivering - metered.client_wall - metered.metering
    protocol = np.array([metered.cpu[node] - metered.train_cpu[node] for node in metered.cpu])
    return {"round_s": wall - metered.metering, "coordinator_s": coordinator, "transport_s": transport,
            "fleet_transport_round_s": coordinator + transport + grid.critical,
            "coordinator_cpu_s": coordinator_cpu, "fleet_cpu_round_s": coordinator_cpu + grid.critical_cpu,
            "fleet_round_s": coordinator + grid.critical, "fleet_net_round_s": coordinator + grid.critical_net,
            "device_protocol_cpu_mean_s": float(protocol.mean()), "device_protocol_cpu_max_s": float(protocol.max()),
            "device_cpu_mean_s": sum(metered.cpu.values()) / n, "device_train_cpu_mean_s":
            sum(metered.train_cpu.values()) / n, "bytes_up": sum(metered.up.values()) / n,
            "bytes_down": sum(metered.down.values()) / n, "exchanges": grid.exchanges,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "aggregated": aggregated}


def one(system: str, n: int, dropout: float) -> dict[str, Any]:
    """One run in this process (what each subprocess does)."""
    logging.getLogger("flwr").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    if system == "flower-secagg+":
        return run_flower(n, dropout)
    return run_fedge(n, dropout, secure=system == "fedge-secagg")


def in_subprocess(system: str, n: int, dropout: float, timeout: float) -> dict[str, Any]:
    """:func:`one` in a fresh process, killed after ``timeout`` seconds (then a row saying so)."""
    command = [sys.executable, __file__, "--one", system, "--devices", str(n), "--dropout", str(dropout)]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}, check=False)
    except subprocess.TimeoutExpired:
        return {"devices": n, "dropout": dropout, "system": system, "finished": False,
                "killed_after_s": round(time.perf_counter() - started, 1)}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"devices": n, "dropout": dropout, "system": system, "finished": False,
                "error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return {"devices": n, "dropout": dropout, "system": system, "finished": True, **json.loads(lines[-1])}


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Each finished row's ratios to plaintext at the same size and dropout."""
    for row in results:
        base = next((r for r in results if r["system"] == "plaintext" and r["devices"] == row["devices"]
                     and r["dropout"] == row["dropout"] and r["finished"]), None)
        if base is None or not row["finished"]:
            continue
        for key in ("round_s", "coordinator_s", "fleet_round_s", "fleet_transport_round_s", "fleet_net_round_s",
                    "coordinator_cpu_s", "fleet_cpu_round_s", "bytes_up", "bytes_down"):
            if key in row and key in base:
                row[f"{key}_vs_plaintext"] = row[key] / base[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--dropout", default="0,0.1", help="fractions of devices dropping after the key exchange")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--flower-devices", type=int, default=0, help="Flower's size (0: --devices)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds a fedge run may take")
    parser.add_argument("--flower-timeout", type=float, default=600.0, help="seconds a Flower run may take")
    parser.add_argument("--out", default=str(HERE / "results" / "secure_scale.json"))
    parser.add_argument("--one", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.devices, float(args.dropout))), flush=True)
        return
    out = Path(args.out)
    previous = json.loads(out.read_text())["results"] if out.exists() else []
    results = []
    for dropout in (float(d) for d in args.dropout.split(",")):
        for system in args.systems.split(","):
            flower = system == "flower-secagg+"
            n = (args.flower_devices or args.devices) if flower else args.devices
            row = in_subprocess(system, n, dropout, args.flower_timeout if flower else args.timeout)
            results.append(row)
            print(json.dumps(row), flush=True)
    # keep earlier rows of other sizes/systems/dropouts (one invocation per point on a shared machine)
    key = ("devices", "dropout", "system")
    merged = [r for r in previous if not any(all(r[k] == s[k] for k in key) for s in results)] + results
    merged.sort(key=lambda r: (r["devices"], r["dropout"], SYSTEMS.index(r["system"])))
    add_ratios(merged)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model_parameters": PARAMETERS, "neighbours": {str(r["devices"]): neighbours_for(
        r["devices"]) for r in merged}, "local_epochs": SETTINGS["local-epochs"], "results": merged}, indent=2))
    show(merged)
    plot(merged, out.with_suffix(".png"))


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Stacked bars at the largest size: the coordinator's time and the devices' share of the critical path."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [r for r in results if r["finished"] and "fleet_cpu_round_s" in r
            and r["devices"] == max(x["devices"] for x in results)]
    if not rows:
        return
    labels = [f"{r['system']}\n{r['dropout']:.0%} drop" for r in rows]
    coordinator = [r["coordinator_cpu_s"] for r in rows]
    devices = [r["fleet_cpu_round_s"] - r["coordinator_cpu_s"] for r in rows]
    figure, axis = plt.subplots(figsize=(1.6 * len(rows) + 2, 4))
    axis.bar(labels, coordinator, label="coordinator (CPU, measured)")
    axis.bar(labels, devices, bottom=coordinator, label="slowest device per exchange (profile compute + protocol)")
    for index, r in enumerate(rows):
        ratio = r.get("fleet_cpu_round_s_vs_plaintext")
        if ratio is not None:
            axis.text(index, r["fleet_cpu_round_s"], f"{ratio:.2f}x", ha="center", va="bottom")
    axis.set_ylabel("fleet critical path of one round (CPU s)")
    axis.set_title(f"{rows[0]['devices']:,} devices, {PARAMETERS:,} parameters (x: vs plaintext)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def show(results: list[dict[str, Any]]) -> None:
    table = Table(title=f"secure aggregation at scale: one round, {PARAMETERS:,}-parameter MLP, fleet 60/30/10 "
                        "phone/laptop/gpu-box (a shared 2-core machine under load: wall times vary ~2x)")
    for column in ("devices", "drop", "system", "coord. CPU s", "coord. wall s", "dev. proto CPU mean/max s",
                   "MB up", "MB down", "fleet CPU s", "x plain", "fleet wall s", "x plain", "fleet+net s", "x plain",
                   "ok"):
        table.add_column(column, justify="right")

    def ratio(row: dict[str, Any], key: str) -> str:
        return f"{row[key + '_vs_plaintext']:.2f}" if key + "_vs_plaintext" in row else "-"

    for r in results:
        if not r["finished"]:
            table.add_row(str(r["devices"]), f"{r['dropout']:.0%}", r["system"],
                          f"killed after {r.get('killed_after_s', '?')} s", *[""] * 11)
            continue
        table.add_row(str(r["devices"]), f"{r['dropout']:.0%}", r["system"], f"{r.get('coordinator_cpu_s', 0):.2f}",
                      f"{r['coordinator_s']:.2f}",
                      f"{r['device_protocol_cpu_mean_s']:.3f}/{r['device_protocol_cpu_max_s']:.3f}",
                      f"{r['bytes_up'] / 1e6:.2f}", f"{r['bytes_down'] / 1e6:.2f}",
                      f"{r.get('fleet_cpu_round_s', 0):.2f}", ratio(r, "fleet_cpu_round_s"),
                      f"{r['fleet_round_s']:.2f}", ratio(r, "fleet_round_s"), f"{r['fleet_net_round_s']:.2f}",
                      ratio(r, "fleet_net_round_s"), "yes" if r["aggregated"] else "NO")
    Console(width=220).print(table)


if __name__ == "__main__":
    main()
