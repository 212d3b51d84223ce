"""Secure aggregation's cost: fedge's protocol vs plaintext FedAvg vs Flower's own SecAgg+.

One training round of a 100k-parameter MLP on digits, at 10, 50 and 100 devices, with
0% and 20% of devices dropping out after the key exchange (before their masked input),
measured for three systems on the same in-process grid, the same data and the same
local training (fedge's SDK trainer, 1 epoch):

* ``plaintext``: fedge's FedAvg (a device that drops simply does not reply);
* ``fedge-secagg``: fedge's SecAgg+ over the Message API (``secure-aggregation = true``);
* ``fedge-secagg-dp``: the same with distributed DP (``dp = "distributed"``: each device clips and
  adds its discrete Gaussian share inside the masked vector; multiplier 1, clip 1);
* ``flower-secagg+``: Flower 1.42's ``SecAggPlusWorkflow`` (legacy workflow, NumPyClient
  with ``secaggplus_mod``), the anchor.

Both secure systems use the same neighbour count (all pairs at 10 devices, 2 ceil(log2 n)
otherwise) and a reconstruction threshold of half the neighbours. Reported per run: round
wall time, mean client CPU seconds per device (process time spent inside the ClientApp),
mean bytes up and down per device (serialised protobuf size of every message), and
whether the aggregate was produced. Two round times: ``1-machine`` is the wall time with
every device run one after the other in this process; ``fleet`` is the critical path of a
real fleet whose devices work in parallel: the coordinator's own time plus, for each
exchange, its slowest device (network time is left out of both). Ratios are against
plaintext at the same size. ``harness_s`` is the part of the coordinator's time that this
bench's own machinery spends, for both systems alike: serialising every message and reply to
count its bytes, and the in-process grid's deep copies of each message (standing in for the
device's deserialising) and of each device's state (kept to roll a crashed device back); it
stays in ``coordinator_s`` and the ratios, and is reported so that a reader can tell it apart.

Usage: python bench/secure.py [--sizes 10,50,100]
[--systems plaintext,fedge-secagg,fedge-secagg-dp,flower-secagg+] [--repeats 1] [--out secure.json].
With ``--repeats N`` each configuration runs N times, the systems interleaved;
each figure is the median of its N runs and each ratio the median of the N ratios to the
plaintext run beside it (on a shared machine single runs vary by 30%).
Writes bench/results/secure.json. Targets (issue #6): fedge-secagg <= 1.5x plaintext
round time at 50 devices, and faster than Flower's SecAgg+.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.client import NumPyClient
from flwr.client.mod import secaggplus_mod
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
from torch import nn

from fedge.clients.app import make_client_app
from fedge.config import RunConfig, resolve_run_config
from fedge.server.app import TRAIN_KEYS
from fedge.server.privacy import DistributedPrivacy
from fedge.simulation.grid import InlineGrid
from fedge.strategies import FedAvg
from fedge.strategies.drivers.secure import SecureAggregation
from fedge.task.api import TaskData
from fedge.task.builtin.digits import Digits
from fedge.task.models import model_arrays
from fedge.task.training import train_local

HERE = Path(__file__).resolve().parent
HIDDEN = 1320  # 64 * 1320 + 1320 + 1320 * 10 + 10 = 99,010 parameters
SETTINGS = {"partitioner": "iid", "local-epochs": 1, "batch-size": 32, "learning-rate": 0.05, "momentum": 0.0}


def wide_mlp() -> nn.Module:
    """The benchmark's 100k-parameter model (same initial weights everywhere)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))


class WideDigits(Digits):
    """The digits task with the benchmark's wide MLP."""

    def build_model(self) -> nn.Module:
        return wide_mlp()


class Metered:
    """Wraps a ClientApp: CPU seconds and serialised bytes per device; drops chosen devices at one step."""

    def __init__(self, app: ClientApp, dropouts: set[int], drop_when: Any) -> None:
        self.app, self.dropouts, self.drop_when = app, dropouts, drop_when
        self.cpu: dict[int, float] = defaultdict(float)
        self.down: dict[int, int] = defaultdict(int)
        self.up: dict[int, int] = defaultdict(int)
        self.client_wall = 0.0  # all devices' time, one after the other
        self.slowest = 0.0  # the slowest device of the current exchange
        self.metering = 0.0  # serialising messages and replies to count their bytes
        self.inside = 0.0  # all time in __call__ (devices and metering)

    def __call__(self, message: Message, context: Context) -> Message:
        entered = time.perf_counter()
        try:
            return self._call(message, context)
        finally:
            self.inside += time.perf_counter() - entered

    def _call(self, message: Message, context: Context) -> Message:
        node = context.node_id
        metering = time.perf_counter()
        self.down[node] += recorddict_to_proto(message.content).ByteSize()
        self.metering += time.perf_counter() - metering
        if node in self.dropouts and self.drop_when(message):
            raise ConnectionError("device dropped out")
        started, wall = time.process_time(), time.perf_counter()
        reply = self.app(message=message, context=context)
        self.cpu[node] += time.process_time() - started
        wall = time.perf_counter() - wall
        self.client_wall += wall
        self.slowest = max(self.slowest, wall)
        if not reply.has_error():
            metering = time.perf_counter()
            self.up[node] += recorddict_to_proto(reply.content).ByteSize()
            self.metering += time.perf_counter() - metering
        return reply


class FleetGrid(InlineGrid):
    """The inline grid, also timing each exchange's slowest device: the critical path of a fleet
    whose devices work in parallel is the coordinator's own time plus, per exchange, the slowest device."""

    def __init__(self, metered: Metered, n: int, config: dict[str, Any]) -> None:
        super().__init__(metered, _nodes(n), config)  # type: ignore[arg-type]
        self.metered, self.critical = metered, 0.0
        self.delivering = 0.0  # all time delivering messages: the grid's copies, then the Metered call

    def _deliver(self, message: Message) -> Message:
        started = time.perf_counter()
        try:
            return super()._deliver(message)
        finally:
            self.delivering += time.perf_counter() - started

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
        self.metered.slowest = 0.0
        replies = super().send_and_receive(messages, timeout=timeout)
        self.critical += self.metered.slowest
        return replies


def neighbours_for(n: int) -> int:
    """All pairs at small n, else 2 ceil(log2 n) (SecAgg+'s O(log n))."""
    return n - 1 if n <= 10 else min(n - 1, 2 * math.ceil(math.log2(n)))


def fedge_client(config: RunConfig, n: int) -> ClientApp:
    return make_client_app(WideDigits(config), config_defaults=config)


def flower_secagg_app(task: Digits, n: int, config: RunConfig, train: Callable[..., Any]) -> ClientApp:
    """Flower's SecAgg+ ClientApp (NumPyClient + ``secaggplus_mod``), shared with secure_scale.py: a
    device loads the parameters into ``task``'s model and trains its partition of ``n`` with
    ``train(task, model, dataset, seed=partition)``, which returns the training stats."""

    class Client(NumPyClient):  # type: ignore[misc]
        def __init__(self, partition: int) -> None:
            self.partition = partition

        def fit(self, parameters: list[np.ndarray], fit_config: dict[str, Any]) -> Any:
            model = task.build_model()
            model.load_state_dict({k: torch.from_numpy(v) for k, v in zip(model.state_dict(), parameters, strict=True)})
            stats = train(task, model, task.partition(self.partition, n, config), seed=self.partition)
            return [v.detach().numpy() for v in model.state_dict().values()], stats.num_examples, {}

    return ClientApp(client_fn=lambda context: Client(int(context.node_config["partition-id"])).to_client(),
                     mods=[secaggplus_mod])


def flower_client(config: RunConfig, n: int) -> ClientApp:
    def train(task: Digits, model: nn.Module, dataset: TaskData, *, seed: int) -> Any:
        return train_local(task, model, dataset, epochs=1, batch_size=32, learning_rate=0.05, momentum=0.0,
                           device=torch.device("cpu"), seed=seed)

    return flower_secagg_app(WideDigits(config), n, config, train)


def run_fedge(n: int, dropout: float, secure: bool, dp: bool = False) -> dict[str, Any]:
    config = resolve_run_config({**SETTINGS, "fleet": f"laptop={n}", "clients-per-round": n, "model": "mlp"})
    dropped = _dropped(n, dropout)
    step = "train.secagg_masked" if secure else "train"
    metered = Metered(fedge_client(config, n), dropped, lambda m: m.metadata.message_type == step)
    grid = FleetGrid(metered, n, config)
    kwargs: dict[str, Any] = {"clients_per_round": n, "min_train_replies": 1}
    if dp:
        kwargs["privacy"] = DistributedPrivacy(noise_multiplier=1.0, clipping_norm=1.0, num_sampled=n, population=n,
                                               delta=1e-5)
    strategy = (FedAvg(driver=SecureAggregation(threshold=0.5, neighbours=neighbours_for(n)), **kwargs) if secure
                else FedAvg(**kwargs))
    arrays = model_arrays(wide_mlp())
    started = time.perf_counter()
    new, _ = strategy.train_round(grid, 1, arrays, ConfigRecord({k: config[k] for k in TRAIN_KEYS}), 600.0)
    return _row(grid, time.perf_counter() - started, n, new is not None)


def run_flower(n: int, dropout: float) -> dict[str, Any]:
    config = resolve_run_config({**SETTINGS, "fleet": f"laptop={n}", "clients-per-round": n, "model": "mlp"})

    def at_masked_step(message: Message) -> bool:
        record = message.content.config_records.get(RECORD_KEY_CONFIGS)
        return record is not None and record.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS

    metered = Metered(flower_client(config, n), _dropped(n, dropout), at_masked_step)
    grid = FleetGrid(metered, n, config)
    initial = [v.detach().numpy() for v in wide_mlp().state_dict().values()]
    strategy = LegacyFedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n, min_available_clients=n,
                            min_evaluate_clients=0, initial_parameters=ndarrays_to_parameters(initial))
    context = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=1), strategy=strategy)
    workflow = DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares=neighbours_for(n) + 1,
                                                               reconstruction_threshold=0.5))
    started = time.perf_counter()
    workflow(grid, context)
    aggregated = _legacy_changed(context, initial)
    return _row(grid, time.perf_counter() - started, n, aggregated)


def _legacy_changed(context: LegacyContext, initial: list[np.ndarray]) -> bool:
    """Whether Flower's workflow replaced the global parameters (its aggregation happened)."""
    final = context.state.array_records[MAIN_PARAMS_RECORD].to_numpy_ndarrays()
    return any(not np.array_equal(a, b) for a, b in zip(final, initial, strict=True))


def _dropped(n: int, fraction: float) -> set[int]:
    from fedge.simulation.grid import FIRST_NODE_ID

    return {FIRST_NODE_ID + i for i in random.Random(n).sample(range(n), int(round(fraction * n)))}


def _nodes(n: int) -> list[dict[str, Any]]:
    return [{"partition-id": i, "num-partitions": n, "profile": "laptop"} for i in range(n)]


def _row(grid: FleetGrid, wall: float, n: int, aggregated: bool) -> dict[str, Any]:
    metered = grid.metered
    harness = metered.metering + grid.delivering - metered.inside  # metering + the grid's copies around each call
    return {"round_s": wall, "fleet_round_s": wall - metered.client_wall + grid.critical,
            "coordinator_s": wall - metered.client_wall, "harness_s": harness,
            "client_cpu_s": sum(metered.cpu.values()) / n,
            "bytes_up": sum(metered.up.values()) / n, "bytes_down": sum(metered.down.values()) / n,
            "aggregated": aggregated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10,50,100")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="which of them (plaintext is always run)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration, interleaved; medians")
    parser.add_argument("--out", default="secure.json", help="results file name under bench/results")
    args = parser.parse_args()
    systems = [s for s in SYSTEMS if s == "plaintext" or s in args.systems.split(",")]
    logging.getLogger("flwr").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    run_fedge(10, 0.0, secure=True, dp="fedge-secagg-dp" in systems)  # warm-up: imports (scipy too), kernels
    results = []
    for n in [int(size) for size in args.sizes.split(",")]:
        for dropout in (0.0, 0.2):
            runs: dict[str, list[dict[str, Any]]] = {system: [] for system in systems}
            for _ in range(args.repeats):
                for system in systems:
                    runs[system].append(run_flower(n, dropout) if system == "flower-secagg+"
                                        else run_fedge(n, dropout, secure=system.startswith("fedge-secagg"),
                                                       dp=system == "fedge-secagg-dp"))
            for system in systems:
                results.append({"devices": n, "dropout": dropout, "system": system, "repeats": args.repeats,
                                **_median(runs[system]), **_vs_plaintext(runs[system], runs["plaintext"])})
                print(json.dumps(results[-1]), flush=True)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / args.out).write_text(json.dumps({"model_parameters": 99_010, "results": results},
                                                              indent=2))
    _print(results)


SYSTEMS = ("plaintext", "fedge-secagg", "fedge-secagg-dp", "flower-secagg+")


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over repeated runs (aggregated: only if every run aggregated)."""
    return {key: (all(row[key] for row in rows) if key == "aggregated" else statistics.median(row[key] for row in rows))
            for key in rows[0]}


def _vs_plaintext(rows: list[dict[str, Any]], plain: list[dict[str, Any]]) -> dict[str, float]:
    """Ratios to plaintext, each the median over the repeats of the ratio to the plaintext run beside it
    (paired: a load that slows one repeat slows both)."""
    def ratio(key: str) -> float:
        return statistics.median(row[key] / base[key] for row, base in zip(rows, plain, strict=True))
    return {"round_vs_plaintext": ratio("round_s"), "fleet_round_vs_plaintext": ratio("fleet_round_s"),
            "bytes_up_vs_plaintext": ratio("bytes_up")}


def _print(results: list[dict[str, Any]]) -> None:
    table = Table(title="secure aggregation: one round, 100k-parameter MLP, 1 local epoch")
    for column in ("devices", "dropout", "system", "1-machine s", "x plain", "fleet s", "x plain", "coordinator s",
                   "of which harness s", "client CPU s", "KB up", "KB down", "ok"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(str(r["devices"]), f"{r['dropout']:.0%}", r["system"], f"{r['round_s']:.2f}",
                      f"{r['round_vs_plaintext']:.2f}", f"{r['fleet_round_s']:.3f}",
                      f"{r['fleet_round_vs_plaintext']:.2f}",
                      f"{r['coordinator_s']:.3f}", f"{r['harness_s']:.3f}", f"{r['client_cpu_s']:.3f}",
                      f"{r['bytes_up'] / 1e3:.0f}",
                      f"{r['bytes_down'] / 1e3:.0f}", "yes" if r["aggregated"] else "NO")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
