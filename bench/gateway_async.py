"""Asynchronous vs synchronous rounds through gateways on a virtual clock (issue 43 §3: goal >= 3x faster to 0.90).

Real parts, in one process: the digits task's signed training graph (onnxruntime, as protocol devices and the
web SDK train), each gateway's own rounds and late-result handling (:class:`fedge.clients.gateway.pool.GatewayRound`,
:meth:`fedge.clients.gateway.service.Gateway.take_late` / ``open_round`` / ``remember``), and the coordinator's
FedBuff step (:class:`fedge.strategies.fedbuff.Buffered`, folded as
:class:`fedge.strategies.drivers.asynchronous.AsynchronousDriver` folds a gateway's partial: ``D`` device results
weighing ``D`` times its staleness weight). Every device really trains; only time is simulated: a laptop's local
training takes 1 s, a phone's ``--slowdown`` (10) times that, each times a seeded 0.8-1.2 jitter, and each hop
between a gateway and the coordinator ``--hop-s`` (the Flower message and the gateway's ClientApp start).

Three schedules over the same fleet (``--gateways`` x ``--devices`` devices, half of them phones), seeds and data:
- **sync**: a round waits for every device of every gateway (FedAvg of the gateways' means);
- **sync-first-k**: each gateway closes its round at its first ``--flush`` results (the rest of its devices'
  work is refused: a synchronous round cannot take it), the coordinator still waits for every gateway;
- **async**: each gateway flushes its first ``--flush`` results and gets the newest model back at once; a device's
  result for a closed round is folded into the gateway's next flush, staleness-weighted; FedBuff publishes a
  version every ``--buffer`` device results.

Printed: the virtual time each reaches ``--target`` held-out accuracy, and async's speed-up over each.
Written: bench/results/gateway_async.json and gateway_async.png (accuracy over virtual time).

Usage: python bench/gateway_async.py [--gateways 4] [--devices 10] [--slowdown 10] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from downlink import setup

RESULTS = Path(__file__).parent / "results"
LEARNING_RATE, BATCH, EPOCHS = 0.05, 16, 5  # fedge's defaults (learning-rate, batch-size, local-epochs)


class Fleet:
    """The devices, their shards and speeds, and the training they do (real, through onnxruntime)."""

    def __init__(self, setting: dict[str, Any], gateways: int, per_gateway: int, slowdown: float, seed: int) -> None:
        self.setting, self.gateways, self.per_gateway = setting, gateways, per_gateway
        rng = random.Random(seed)
        self.speed = [(slowdown if index % 2 else 1.0) for index in range(gateways * per_gateway)]  # odd: phones
        self.jitter = rng
        self.seed = seed
        self.trainings = 0

    def duration(self, device: int) -> float:
        return self.speed[device] * self.jitter.uniform(0.8, 1.2)

    def train(self, device: int, current: Any, session: Any) -> tuple[Any, Any]:
        """``device`` takes ``current``'s task and trains it: its result frame."""
        from fedge.clients.gateway.pool import device_seed
        from fedge.clients.gateway.protocol import assemble_frame, decode_frame, frame_tensors

        shard = self.setting["shards"][device]
        task = current.task(session)
        trained, work = self.setting["trainer"].train(
            task.received, tuple(shard.inputs), shard.targets, epochs=EPOCHS, batch_size=BATCH,
            learning_rate=LEARNING_RATE, momentum=0.9,
            seed=device_seed(self.seed, current.server_round, session.device))
        self.trainings += 1
        header = {"task": current.task_id, "kind": "train", "num-examples": work.num_examples,
                  "samples-processed": work.num_examples * EPOCHS, "steps": 0, "encoding": "fp32"}
        return decode_frame(assemble_frame(header, *frame_tensors(trained, None)))

    def accuracy(self, weights: dict[str, np.ndarray]) -> float:
        central = self.setting["central"]
        return float(self.setting["trainer"].evaluate(weights, tuple(central.inputs), central.targets)["accuracy"])


def _session(device: int) -> Any:
    from fedge.clients.gateway.pool import Session
    from fedge.clients.gateway.protocol import TASK_CAPABILITIES

    return Session(device=f"device{device}", key=b"k" * 32, expires=1e18, tasks=frozenset(TASK_CAPABILITIES))


def _round(server_round: int, weights: dict[str, np.ndarray], target: int, late: float | None) -> Any:
    from fedge.clients.gateway.pool import GatewayRound

    return GatewayRound(kind="train", server_round=server_round, config={}, graph="", weights=weights, target=target,
                        max_num_examples=10**6, late_exponent=late)


def run_sync(fleet: Fleet, target: float, hop_s: float, first_k: int | None, max_time: float) -> list[tuple]:
    """Synchronous rounds: (virtual time, round, accuracy) after each; ``first_k``: each gateway closes at its first
    k results (a device still training an earlier round's task is busy until it finishes, its result refused)."""
    from fedge.aggregate import WeightedMeanAccumulator

    weights = {k: np.asarray(v, np.float32) for k, v in fleet.setting["weights"].items()}
    now, server_round, busy_until = 0.0, 0, [0.0] * len(fleet.speed)
    curve = [(0.0, 0, fleet.accuracy(weights))]
    while curve[-1][2] < target and now < max_time:
        server_round += 1
        mean, closes = WeightedMeanAccumulator(), []
        for gateway in range(fleet.gateways):
            devices = range(gateway * fleet.per_gateway, (gateway + 1) * fleet.per_gateway)
            current = _round(server_round, weights, first_k or fleet.per_gateway, None)
            opened = now + hop_s
            finishes = []
            for device in devices:  # each device takes the task once it is free
                start = max(opened, busy_until[device])
                finishes.append((start + fleet.duration(device), device))
            finishes.sort()
            taken = finishes[:first_k or len(finishes)]
            for end, device in finishes:
                busy_until[device] = end
            for _end, device in taken:
                current.accept(_session(device), *fleet.train(device, current, _session(device)))
            result = current.close()
            closes.append(taken[-1][0] + hop_s)
            mean.add(result.arrays, float(result.num_examples))
        now = max(closes)
        weights = {k: np.asarray(v, np.float32) for k, v in mean.result().items()}
        curve.append((now, server_round, fleet.accuracy(weights)))
    return curve


def run_async(fleet: Fleet, target: float, hop_s: float, flush: int, buffer: int, exponent: float,
              max_time: float) -> tuple[list[tuple], int]:
    """FedBuff through gateways: (virtual time, version, accuracy) after each version; late results folded."""
    from fedge.aggregate import staleness_weight
    from fedge.clients.gateway.service import Gateway, GatewaySettings
    from fedge.strategies.fedbuff import Buffered
    from fedge.strategies.rule import RoundContext, Update

    weights = {k: np.asarray(v, np.float32) for k, v in fleet.setting["weights"].items()}
    rule, version, snapshots, buffered, late_total = Buffered(), 0, {0: weights}, 0, 0
    rule.begin(RoundContext(weights, frozenset()))
    with tempfile.TemporaryDirectory() as allow:
        gateways = [Gateway(GatewaySettings(devices_per_round=flush), Path(allow), None) for _ in range(fleet.gateways)]
        holds: list[tuple[Any, int] | None] = [None] * len(fleet.speed)  # each device's task: (round, version)
        events: list[tuple[float, int, str, int, Any]] = []
        sequence = 0

        def push(at: float, kind: str, who: int, payload: Any = None) -> None:
            nonlocal sequence
            sequence += 1
            heapq.heappush(events, (at, sequence, kind, who, payload))

        def hand_out(gateway: int, now: float) -> None:
            current = gateways[gateway].round
            for device in range(gateway * fleet.per_gateway, (gateway + 1) * fleet.per_gateway):
                if holds[device] is None and current is not None and not current.closed \
                        and not current.has_answered(f"device{device}") and not current.complete.is_set():
                    holds[device] = (current, fleet.train(device, current, _session(device)))
                    push(now + fleet.duration(device), "result", device)

        curve = [(0.0, 0, fleet.accuracy(weights))]
        for gateway in range(fleet.gateways):
            push(hop_s, "open", gateway, (0, weights))
        while events and curve[-1][2] < target:
            now, _, kind, who, payload = heapq.heappop(events)
            if now > max_time:
                break
            if kind == "open":  # the coordinator's instruction reaches a gateway: a new round, late results folded
                sent_version, sent = payload
                gateways[who].open_round(_round(sent_version + 1, sent, flush, exponent))
                hand_out(who, now)
            elif kind == "result":
                current, frame = holds[who]
                holds[who] = None
                gateway = gateways[who // fleet.per_gateway]
                if current.closed:
                    if current.task_id in gateway.earlier:
                        gateway.take_late(current.late_result(_session(who), *frame))
                else:
                    current.accept(_session(who), *frame)
                open_now = gateway.round
                if open_now is not None and not open_now.closed and open_now.complete.is_set():
                    result = open_now.close()
                    gateway.remember(open_now)
                    late_total += result.late
                    push(now + hop_s, "partial", who // fleet.per_gateway, (open_now.server_round - 1, result))
                hand_out(who // fleet.per_gateway, now)
            else:  # "partial": a gateway's flush reaches the coordinator; it sends that gateway the newest model
                trained_from, result = payload
                stale = version - trained_from
                rule.fold(Update(who, dict(result.arrays), result.devices * staleness_weight(stale, exponent),
                                 base=snapshots[trained_from] if stale else None, devices=result.devices))
                buffered += result.devices
                if buffered >= buffer:
                    new = rule.result()
                    version, buffered = version + 1, 0
                    weights = {k: np.asarray(v, np.float32) for k, v in new.items()}
                    snapshots[version] = weights
                    rule.begin(RoundContext(weights, frozenset()))
                    curve.append((now, version, fleet.accuracy(weights)))
                push(now + hop_s, "open", who, (version, weights))
    return curve, late_total


def time_to(curve: list[tuple], target: float) -> float | None:
    return next((t for t, _, accuracy in curve if accuracy >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateways", type=int, default=4)
    parser.add_argument("--devices", type=int, default=10, help="devices per gateway (half of them phones)")
    parser.add_argument("--slowdown", type=float, default=10.0, help="a phone's training time over a laptop's")
    parser.add_argument("--flush", type=int, default=5, help="a gateway's partial flush (devices-per-round)")
    parser.add_argument("--buffer", type=int, default=10, help="FedBuff's buffer-size, in device results")
    parser.add_argument("--exponent", type=float, default=0.5, help="staleness-exponent")
    parser.add_argument("--hop-s", type=float, default=0.5)
    parser.add_argument("--target", type=float, default=0.90)
    parser.add_argument("--max-time", type=float, default=2000.0)
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gateway-async-"))
    setting = setup(args.gateways * args.devices, root)
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        record: dict[str, Any] = {"seed": seed}
        for name in ("sync", "sync-first-k", "async"):
            fleet = Fleet(setting, args.gateways, args.devices, args.slowdown, seed)
            if name == "async":
                curve, late = run_async(fleet, args.target, args.hop_s, args.flush, args.buffer, args.exponent,
                                        args.max_time)
                record["async_late_results"] = late
            else:
                curve = run_sync(fleet, args.target, args.hop_s, args.flush if name == "sync-first-k" else None,
                                 args.max_time)
            record[name] = {"curve": curve, "time_to_target": time_to(curve, args.target),
                            "trainings": fleet.trainings}
            reached = record[name]["time_to_target"]
            print(f"seed {seed} {name}: {'not reached' if reached is None else f'{reached:.1f} s'} to "
                  f"{args.target:.2f} ({fleet.trainings} device trainings, final {curve[-1][2]:.4f})", flush=True)
        runs.append(record)
    print("\n| seed | sync s | sync-first-k s | async s | async vs sync | async vs sync-first-k | late results |")
    print("|---|---|---|---|---|---|---|")
    for record in runs:
        times = [record[name]["time_to_target"] for name in ("sync", "sync-first-k", "async")]
        ratio = [f"{t / times[2]:.1f}x" if t and times[2] else "-" for t in times[:2]]
        shown = [f"{t:.1f}" if t else "not reached" for t in times]
        print(f"| {record['seed']} | {' | '.join(shown)} | {' | '.join(ratio)} | {record['async_late_results']} |")
    RESULTS.mkdir(exist_ok=True)
    out = {"settings": vars(args), "runs": runs}
    (RESULTS / "gateway_async.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(runs, args.target, RESULTS / "gateway_async.png")
    print(f"\nwritten to {RESULTS / 'gateway_async.json'} and gateway_async.png")


def plot(runs: list[dict[str, Any]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for name, colour in (("sync", "tab:blue"), ("sync-first-k", "tab:orange"), ("async", "tab:green")):
        for index, record in enumerate(runs):
            curve = record[name]["curve"]
            axis.plot([c[0] for c in curve], [c[2] for c in curve], color=colour, alpha=0.7,
                      label=name if index == 0 else None)
    axis.axhline(target, color="grey", linestyle=":")
    axis.set_xlabel("virtual time (s; a laptop's local training = 1 s)")
    axis.set_ylabel("held-out accuracy")
    axis.set_title("through 4 gateways, phones 10x slower (digits, mlp)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
