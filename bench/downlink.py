"""What a gateway's compressed downlink costs in accuracy (issue 43 §1: goal <= 0.5 point for fp16).

Real parts, in one process: the digits task's signed training graph (onnxruntime, as the reference
protocol device and the web SDK train), the gateway's own round (:class:`fedge.clients.gateway.pool.GatewayRound`:
it encodes each round's task, hands it out, takes each device's update against what the device
read, and folds the results), and ``--devices`` devices, all of them every round, each training
``local-epochs`` from the task as the device reads it and answering ``--uplink``. The gateway's
mean is the next round's model (one gateway: the coordinator's FedAvg of one reply is that
reply). No network: this measures the learning, not the transport (bench/gateway_load.py does).

Each task encoding of ``--downlinks`` runs the same devices, seeds and rounds; fp32 is the
baseline of the same invocation. Printed: the final and best held-out accuracy of each, the
difference to fp32 in points, and the task's bytes a device. Written: bench/results/downlink.json
and downlink.png (accuracy per round).

Usage: python bench/downlink.py [--rounds 20] [--devices 10] [--downlinks fp32,fp16,int8]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results"


def setup(devices: int, root: Path) -> dict[str, Any]:
    """The digits run: its training graph (a trainer), the seeded global weights, the devices' shards, held-out data."""
    from fedge.config import resolve_run_config
    from fedge.edge.trainer import OnnxTrainer
    from fedge.edge.training_bundle import read_training_bundle
    from fedge.server.bundles import run_signing_key
    from fedge.server.training_bundle import (
        SIGNING_PUBLIC_KEY,
        TRAINING_BUNDLE,
        export_training_graph,
        write_run_training_bundle,
    )
    from fedge.task.api import seeded_model
    from fedge.task.loading import load_task
    from fedge.task.models import model_arrays

    config = resolve_run_config({"fleet": f"phone={devices}", "model": "mlp", "run-dir": str(root)})
    task = load_task(config)
    model = seeded_model(task, config.integer("seed"))
    graphs, metrics = export_training_graph(task, model, config)
    write_run_training_bundle(graphs, metrics, task, root, private_key=run_signing_key(config, root))
    bundle = read_training_bundle(root / TRAINING_BUNDLE, trusted_keys=[root / SIGNING_PUBLIC_KEY])
    central = task.central_data()
    assert central is not None, "the digits task holds out examples for the coordinator"
    return {"trainer": OnnxTrainer(bundle.train_onnx, bundle.eval_onnx, bundle.manifest),
            "weights": {name: array.numpy() for name, array in model_arrays(model).items()},
            "shards": [task.partition(index, devices, config) for index in range(devices)],
            "central": central, "seed": config.integer("seed")}


def run(setting: dict[str, Any], downlink: str, rounds: int, uplink: str, epochs: int) -> dict[str, Any]:
    """``rounds`` gateway rounds with ``downlink`` tasks; the held-out accuracy after each."""
    from fedge.clients.gateway.pool import GatewayRound, Session, device_seed
    from fedge.clients.gateway.protocol import (
        TASK_CAPABILITIES,
        assemble_frame,
        decode_frame,
        frame_tensors,
        int8_delta,
    )

    trainer, weights = setting["trainer"], dict(setting["weights"])
    central = setting["central"]
    accuracy, task_bytes = [], 0
    for server_round in range(1, rounds + 1):
        current = GatewayRound(kind="train", server_round=server_round, config={}, graph="", weights=weights,
                               target=len(setting["shards"]), max_num_examples=10**6, downlink=downlink)
        for index, shard in enumerate(setting["shards"]):
            session = Session(device=f"phone{index}", key=b"k" * 32, expires=1e18, tasks=frozenset(TASK_CAPABILITIES))
            task = current.task(session)
            task_bytes = len(task.data)
            trained, work = trainer.train(task.received, tuple(shard.inputs), shard.targets, epochs=epochs,
                                          batch_size=32, learning_rate=0.05, momentum=0.9,
                                          seed=device_seed(setting["seed"], server_round, session.device))
            header = {"task": current.task_id, "kind": "train", "num-examples": work.num_examples,
                      "samples-processed": work.num_examples * epochs, "steps": 0, "encoding": uplink}
            tensors, scales = int8_delta(trained, task.received) if uplink == "int8-delta" else (trained, None)
            current.accept(session, *decode_frame(assemble_frame(header, *frame_tensors(tensors, scales))))
        result = current.close()
        assert result is not None and result.rejected == 0
        weights = {name: np.asarray(value, np.float32) for name, value in result.arrays.items()}
        scores = trainer.evaluate(weights, tuple(central.inputs), central.targets)
        accuracy.append(float(scores["accuracy"]))
    return {"downlink": downlink, "accuracy": accuracy, "final": accuracy[-1], "best": max(accuracy),
            "task_bytes": task_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--uplink", default="int8-delta", choices=("fp32", "int8-delta"))
    parser.add_argument("--downlinks", default="fp32,fp16,int8")
    args = parser.parse_args()
    import tempfile

    setting = setup(args.devices, Path(tempfile.mkdtemp(prefix="downlink-")))
    records = []
    for downlink in args.downlinks.split(","):
        started = time.perf_counter()
        record = run(setting, downlink, args.rounds, args.uplink, args.local_epochs)
        record["seconds"] = time.perf_counter() - started
        records.append(record)
        print(f"{downlink}: final accuracy {record['final']:.4f} (best {record['best']:.4f}), "
              f"{record['task_bytes']:,} bytes of tensors in a task, {record['seconds']:.1f} s", flush=True)
    base = records[0]
    print(f"\n| downlink | task tensor bytes | final accuracy | vs {base['downlink']} (points) | best |")
    print("|---|---|---|---|---|")
    for record in records:
        print(f"| {record['downlink']} | {record['task_bytes']:,} | {record['final']:.4f} | "
              f"{100 * (record['final'] - base['final']):+.2f} | {record['best']:.4f} |")
    RESULTS.mkdir(exist_ok=True)
    out = {"rounds": args.rounds, "devices": args.devices, "local_epochs": args.local_epochs, "uplink": args.uplink,
           "runs": records}
    (RESULTS / "downlink.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(records, RESULTS / "downlink.png")
    print(f"\nwritten to {RESULTS / 'downlink.json'} and downlink.png")


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for record in records:
        axis.plot(range(1, len(record["accuracy"]) + 1), record["accuracy"], label=record["downlink"])
    axis.set_xlabel("round")
    axis.set_ylabel("held-out accuracy")
    axis.set_title("gateway rounds by task encoding (digits, mlp)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
