"""Asynchronous vs synchronous rounds through real gateways (issue 43 §3's deployment bench).

Real parts: `fedge coordinator start` (SuperLink, TLS, node auth, the signed training graph), ``--gateways``
`fedge gateway start` processes, and ``--gateways`` x ``--devices`` reference protocol devices (threads of this
process, TLS, check-ins, onnxruntime training on the digits task, label-skewed shards). Half of each gateway's
devices are laptops and half phones; each device's training is followed by a sleep of ``--laptop-s`` (phones:
``--slowdown`` times that), so a phone answers 10x later than a laptop, as on the virtual clock of
bench/gateway_async.py. Two runs over the same fleet and data:

- **sync**: FedAvg, each gateway's round waits for all its devices (``--devices-per-round`` = its devices);
- **async**: FedBuff, each gateway flushes its first ``--flush`` results, ``buffer-size`` = gateways x flush.

Printed: the wall seconds from the coordinator's first round to ``--target`` held-out accuracy (a run is stopped
once it is reached), and the ratio. Each gateway hop is one Flower message and one ``flwr-clientapp`` process
(seconds of CPU on this 2-core machine), which the virtual-clock bench leaves out. Written:
bench/results/gateway_async_deploy.json.

Usage: python bench/gateway_async_deploy.py [--gateways 4] [--devices 4] [--laptop-s 3] [--slowdown 10]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gateway_fleet import start_gateway

from fedge.clients.protocol_device import ProtocolDevice

RESULTS = Path(__file__).parent / "results"
BASE = "model='mlp' export-onnx=false runtime='onnx' round-timeout=900.0 gateways=true"


def run(schedule: str, args: argparse.Namespace) -> dict[str, Any]:
    """One deployment: the wall time to the target accuracy, and the accuracy curve."""
    from fedge.clients.gateway.service import add_protocol_device
    from fedge.config import resolve_run_config
    from fedge.simulation.loopback import LoopbackFederation, free_port
    from fedge.task.loading import load_task

    total = args.gateways * args.devices
    asynchronous = schedule == "async"
    run_config = f"{BASE} strategy='fedbuff' buffer-size={args.gateways * args.flush}" if asynchronous else BASE
    root = Path(tempfile.mkdtemp(prefix=f"gateway-async-{schedule}-"))
    federation = LoopbackFederation(root, num_devices=args.gateways)
    stop = threading.Event()
    try:
        for index in range(total):
            add_protocol_device(root / "allow", f"phone{index}")
        federation.start_coordinator("--rounds", str(args.max_versions if asynchronous else args.max_rounds),
                                     "--clients-per-round", str(args.gateways), "--run-config", run_config)
        federation.wait_for(federation.bundle_signing_key.exists, 900, "the bundle signing key")
        ports = [free_port() for _ in range(args.gateways)]
        for index, port in enumerate(ports):
            start_gateway(federation, index, port, ["--poll-interval", "0.5", "--devices-per-round",
                                                    str(args.flush if asynchronous else args.devices)])
        config = resolve_run_config({})
        task = load_task(config)
        threads = []
        for index in range(total):
            shard = task.partition(index, total, config)
            delay = args.laptop_s * (args.slowdown if index % 2 else 1.0)
            device = SlowDevice(delay, gateway=f"https://127.0.0.1:{ports[index % args.gateways]}",
                                name=f"phone{index}", key=root / "allow" / f"phone{index}.key",
                                data=(tuple(shard.inputs), shard.targets), trust=federation.bundle_signing_key,
                                ca=federation.keys.ca_cert, state_dir=root / f"phone{index}")
            threads.append(threading.Thread(target=device.run, kwargs={"stop": stop, "max_wait_s": 1.0}, daemon=True))
        for thread in threads:
            thread.start()

        def reached() -> bool:
            rows = federation.rows()
            over = (federation.run_dir / "summary.json").exists()
            return bool(rows) and (rows[-1]["accuracy"] >= args.target or over)

        federation.wait_for(reached, 3600, f"{args.target} accuracy")
        rows = federation.rows()
        started = float(rows[0]["wall_time_s"])
        hit = next((row for row in rows if row["accuracy"] >= args.target), None)
        return {"schedule": schedule, "run_config": run_config,
                "seconds_to_target": None if hit is None else float(hit["wall_time_s"]) - started,
                "rounds_to_target": None if hit is None else int(hit["round"]),
                "curve": [(float(row["wall_time_s"]) - started, int(row["round"]), float(row["accuracy"]))
                          for row in rows]}
    finally:
        stop.set()
        federation.close()
        shutil.rmtree(root, ignore_errors=True)


class SlowDevice(ProtocolDevice):
    """A reference protocol device whose every training takes ``delay`` seconds longer (a slower device)."""

    def __init__(self, delay: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.delay = delay

    def train(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        result = super().train(*args, **kwargs)
        time.sleep(self.delay)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateways", type=int, default=4)
    parser.add_argument("--devices", type=int, default=4, help="devices per gateway (half of them phones)")
    parser.add_argument("--flush", type=int, default=2, help="async: a gateway's partial flush")
    parser.add_argument("--laptop-s", type=float, default=3.0)
    parser.add_argument("--slowdown", type=float, default=10.0)
    parser.add_argument("--target", type=float, default=0.90)
    parser.add_argument("--max-rounds", type=int, default=12)
    parser.add_argument("--max-versions", type=int, default=60)
    args = parser.parse_args()
    records = []
    for schedule in ("sync", "async"):
        record = run(schedule, args)
        records.append(record)
        reached = record["seconds_to_target"]
        print(f"{schedule}: {'not reached' if reached is None else f'{reached:.0f} s'} to {args.target:.2f} "
              f"(round/version {record['rounds_to_target']}; {record['run_config']})", flush=True)
    sync, asynchronous = (record["seconds_to_target"] for record in records)
    if sync and asynchronous:
        print(f"async is {sync / asynchronous:.1f}x faster to {args.target:.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway_async_deploy.json").write_text(json.dumps({"settings": vars(args), "runs": records},
                                                                  indent=1) + "\n")


if __name__ == "__main__":
    main()
