"""Server memory of one round: fedge folds replies as they arrive, Flower's FedAvg holds them all.

Workload: one training round with a ResNet-18-sized model (11.7M float32 parameters, 46.8 MB,
in ResNet-18's 62 tensors) and 100 replies. The devices are plain numpy ClientApps (the
update is the global model plus a small constant), so the memory measured is the
coordinator's: the round's instructions, each reply, validation and aggregation. They run
in the coordinator's process (fedge's inline engine), so one device's reply being made is
part of every peak. Each system runs in a fresh process (``--one NAME``):

* ``fedge``: fedge's FedAvg on the inline grid (each reply is made as it is pulled);
* ``fedge-realtime``: fedge's FedAvg on a grid whose replies arrive over time and are pulled
  every poll, the code path of a deployment and of Ray;
* ``flower-fedavg``: Flower 1.42's ``FedAvg`` on the same inline grid (``send_and_receive``
  returns the round's replies as a list and ``aggregate_train`` averages them), the baseline;
* ``fedge-median``: the coordinate-wise median, a robust rule that needs every update at once
  (O(replies x model) by nature), at 10 replies only.

Reported: the peak of Python-traced allocations above what the process held before the
round (``tracemalloc``: numpy's buffers and Flower's bytes), and the peak resident memory
above the resident memory before the round (``VmHWM`` after resetting it), each as a multiple
of the model's size. Target (issue 16): <= 4x the model with 100 replies.

Then the 1M-parameter model of issue 16's measurement (a 784-1000-200-10 MLP, 987,210
parameters) at 10 and 100 replies, fedge and Flower's FedAvg.

Usage: python bench/server_memory.py [--replies 100]
Writes bench/results/server_memory.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
SYSTEMS = ("fedge", "fedge-realtime", "flower-fedavg", "fedge-median")
MEDIAN_REPLIES = 10


def resnet18_shapes() -> dict[str, tuple[int, ...]]:
    """ResNet-18's parameter tensors (ImageNet head): 11,689,512 parameters in 62 tensors."""
    shapes: dict[str, tuple[int, ...]] = {"conv1.weight": (64, 3, 7, 7), "bn1.weight": (64,), "bn1.bias": (64,)}
    width_in = 64
    for stage, width in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            prefix = f"layer{stage}.{block}"
            first_in = width_in if block == 0 else width
            shapes[f"{prefix}.conv1.weight"] = (width, first_in, 3, 3)
            shapes[f"{prefix}.bn1.weight"] = shapes[f"{prefix}.bn1.bias"] = (width,)
            shapes[f"{prefix}.conv2.weight"] = (width, width, 3, 3)
            shapes[f"{prefix}.bn2.weight"] = shapes[f"{prefix}.bn2.bias"] = (width,)
            if block == 0 and first_in != width:
                shapes[f"{prefix}.downsample.0.weight"] = (width, first_in, 1, 1)
                shapes[f"{prefix}.downsample.1.weight"] = shapes[f"{prefix}.downsample.1.bias"] = (width,)
        width_in = width
    shapes["fc.weight"], shapes["fc.bias"] = (1000, 512), (1000,)
    return shapes


def mlp_shapes() -> dict[str, tuple[int, ...]]:
    """A 784-1000-200-10 MLP: 987,210 parameters (the "1M-parameter model" of issue 16)."""
    return {"fc1.weight": (1000, 784), "fc1.bias": (1000,), "fc2.weight": (200, 1000), "fc2.bias": (200,),
            "fc3.weight": (10, 200), "fc3.bias": (10,)}


MODELS = {"resnet18": resnet18_shapes, "mlp-1m": mlp_shapes}


def rss_bytes(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def one(system: str, replies: int, model_name: str = "resnet18") -> dict[str, Any]:
    """Run one round of ``system`` in this process and measure it."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

    from fedge import wire
    from fedge.profiles import parse_fleet
    from fedge.server.metering import MeteredGrid
    from fedge.simulation.grid import InlineGrid
    from fedge.strategies.fedavg import FedAvg
    from fedge.strategies.median import Median

    count = MEDIAN_REPLIES if system == "fedge-median" else replies
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        step = np.float32(1e-3 * (message.metadata.dst_node_id % 7 + 1))
        arrays = ArrayRecord({name: Array(array.numpy() + step)
                              for name, array in message.content[wire.ARRAYS].items()})
        return Message(RecordDict({wire.ARRAYS: arrays, wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: 10})}),
                       reply_to=message)

    class Arriving(InlineGrid):
        """Replies that arrive over time, a few per pull (a deployment's code path)."""

        synchronous = False

        def pull_messages(self, message_ids: Any) -> Any:
            return list(super().pull_messages(list(message_ids)[:2]))

    nodes = [{"partition-id": i, "profile": "laptop"} for i in range(count)]
    inner = (Arriving if system == "fedge-realtime" else InlineGrid)(app, nodes, {})
    rng = np.random.default_rng(0)
    model = ArrayRecord({name: Array(rng.standard_normal(shape, dtype=np.float32))
                         for name, shape in MODELS[model_name]().items()})
    model_bytes = sum(len(array.data) for array in model.values())
    params = sum(int(np.prod(array.shape)) for array in model.values())

    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    rss_before = rss_bytes("VmRSS")
    tracemalloc.start()
    traced_before = tracemalloc.get_traced_memory()[0]
    started = time.perf_counter()
    if system == "flower-fedavg":
        strategy = FlowerFedAvg(fraction_train=1.0, min_train_nodes=count, min_available_nodes=count)
        messages = strategy.configure_train(1, model, ConfigRecord(), inner)
        result, _ = strategy.aggregate_train(1, inner.send_and_receive(messages, timeout=600))
    else:
        rule = Median if system == "fedge-median" else FedAvg
        grid = MeteredGrid(inner, parse_fleet(f"laptop={count}"), poll_interval=0.0 if system == "fedge-realtime"
                           else None)
        result, _ = rule(clients_per_round=count).train_round(grid, 1, model, ConfigRecord(), 600.0)
    seconds = time.perf_counter() - started
    traced_peak = tracemalloc.get_traced_memory()[1] - traced_before
    tracemalloc.stop()
    rss_peak = rss_bytes("VmHWM") - rss_before
    assert result is not None, f"{system}: no aggregate"
    first = next(iter(MODELS[model_name]()))
    assert np.allclose(result[first].numpy(), model[first].numpy(), atol=1e-2), f"{system}: wrong aggregate"
    return {"system": system, "model": model_name, "replies": count, "parameters": params,
            "model_mb": model_bytes / 1e6, "round_s": seconds, "traced_peak_mb": traced_peak / 1e6,
            "rss_peak_mb": rss_peak / 1e6,
            "traced_x_model": traced_peak / model_bytes, "rss_x_model": rss_peak / model_bytes}


def run_one(system: str, replies: int, model_name: str) -> dict[str, Any]:
    """``one`` in a fresh process."""
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    done = subprocess.run([sys.executable, __file__, "--one", system, "--replies", str(replies),
                           "--model", model_name], capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{system} failed:\n{done.stderr[-3000:]}")
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"  {system} ({model_name}, {replies} replies): {row}", flush=True)
    return row


def measure(replies: int) -> list[dict[str, Any]]:
    """Each system in a fresh process."""
    return [run_one(system, replies, "resnet18") for system in SYSTEMS]


def measure_small_model() -> list[dict[str, Any]]:
    """The 1M-parameter model at 10 and 100 replies: fedge's peak stays, Flower's grows with the replies."""
    return [run_one(system, count, "mlp-1m") for count in (10, 100) for system in ("fedge", "flower-fedavg")]


def print_table(rows: list[dict[str, Any]]) -> None:
    """Peaks as multiples of the model, and each against Flower's FedAvg at the same size."""
    print(f"\n{'system':<16}{'model':>9}{'replies':>8}{'round s':>9}{'traced MB':>11}{'x model':>9}"
          f"{'RSS MB':>9}{'x model':>9}{'RSS vs Flower':>15}")
    for row in rows:
        flower = next((other for other in rows if other["system"] == "flower-fedavg"
                       and other["model"] == row["model"] and other["replies"] == row["replies"]), None)
        versus = f"{row['rss_peak_mb'] / flower['rss_peak_mb']:.3f}" if flower else "-"
        print(f"{row['system']:<16}{row['model']:>9}{row['replies']:>8}{row['round_s']:>9.1f}"
              f"{row['traced_peak_mb']:>11.0f}{row['traced_x_model']:>9.2f}{row['rss_peak_mb']:>9.0f}"
              f"{row['rss_x_model']:>9.2f}{versus:>15}")
    print("target: <= 4x the model with 100 replies (fedge-median holds every update by design, at 10 replies)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replies", type=int, default=100)
    parser.add_argument("--one", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet18", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.replies, args.model)))
        return
    rows = measure(args.replies) + measure_small_model()
    print_table(rows)
    out = HERE / "results" / "server_memory.json"
    out.write_text(json.dumps({"replies": args.replies, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
