"""Fleet scale: the same round on fleets of 1,000 to 1,000,000 simulated devices.

Workload: the synthetic task (FedProx's Synthetic(0, 0)), logistic regression, 100 devices a
round (FedAvg, random selection), 5 rounds, a 60/30/10 mix of phones, laptops and GPU boxes,
fedge's inline engine. Each fleet size runs as a fresh process (``python bench/scale.py --one
N``), so start-up includes imports; peak memory is the process tree's resident memory,
sampled every 50 ms. A device's data, model and Context exist only while it is selected, so
the round should cost about the same whatever the fleet's size. Rounds differ by which devices
are selected (a synthetic device holds lognormal(4, 2) + 50 examples: a few hold tens of
thousands), so the table also splits each round into the time inside devices' ClientApp calls
and the rest (selection, availability, aggregation, the coordinator's evaluation).

Usage: python bench/scale.py [--sizes 1000,10000,100000,1000000] [--repeats N]
Writes bench/results/scale.json and scale.png and prints a table.
Targets (issue 16): 1,000,000 devices in <= 2 GB peak, a round within 1.5x of the 1,000-device one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

HERE = Path(__file__).resolve().parent
SIZES = (1_000, 10_000, 100_000, 1_000_000)
ROUNDS = 5
PER_ROUND = 100
WORKLOAD = {"dataset": "synthetic", "model": "logreg", "clients-per-round": PER_ROUND, "num-rounds": ROUNDS,
            "export-onnx": False, "seed": 0}


def fleet_of(size: int) -> str:
    """A 60/30/10 mix of phones, laptops and GPU boxes with ``size`` devices."""
    phones, laptops = size * 6 // 10, size * 3 // 10
    return f"phone={phones},laptop={laptops},gpu-box={size - phones - laptops}"


def one(size: int, run_dir: Path, started: float) -> None:
    """Run the workload on ``size`` devices in this process; print one JSON line of timings."""
    from fedge.server.recorder import RoundRecorder  # noqa: PLC0415 - imports are part of start-up
    from fedge.simulation.grid import InlineGrid  # noqa: PLC0415
    from fedge.simulation.runner import simulate  # noqa: PLC0415

    imported = time.perf_counter()
    cpu_marks: list[float] = []  # this process's CPU seconds at each round's end (round 0: the start)
    device_marks: list[float] = []  # wall seconds spent inside devices' ClientApp calls, at each round's end
    in_devices = [0.0]
    on_round_end, deliver = RoundRecorder.on_round_end, InlineGrid._deliver

    def marked(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = on_round_end(self, *args, **kwargs)
        cpu_marks.append(time.process_time())
        device_marks.append(in_devices[0])
        return result

    def timed(self: Any, message: Any) -> Any:
        begun = time.perf_counter()
        try:
            return deliver(self, message)
        finally:
            in_devices[0] += time.perf_counter() - begun

    RoundRecorder.on_round_end = marked  # type: ignore[method-assign]
    InlineGrid._deliver = timed  # type: ignore[method-assign]
    _, summary = simulate({**WORKLOAD, "fleet": fleet_of(size), "run-dir": str(run_dir)}, progress=False)
    finished = time.perf_counter()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    walls = [float(row["wall_time_s"]) for row in rows]  # cumulative from the coordinator's start
    rounds = [after - before for before, after in zip(walls, walls[1:], strict=False)]
    print(json.dumps({"size": size, "import_s": imported - started,
                      "startup_s": (finished - started) - walls[-1], "round_s": rounds,
                      "round_cpu_s": _steps(cpu_marks), "device_s": _steps(device_marks),
                      "process_s": finished - started, "accuracy": summary["final_accuracy"],
                      "participants": [row["participants"] for row in rows[1:]]}))


def _steps(marks: list[float]) -> list[float]:
    return [after - before for before, after in zip(marks, marks[1:], strict=False)]


def run_size(size: int, scratch: Path) -> dict[str, object]:
    """One fresh process for ``size`` devices: its timings and its peak memory."""
    from sim_vs_flower import run_watched  # noqa: PLC0415 - bench/ sibling, on sys.path when run as a script

    out = scratch / f"timings-{size}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--one", str(size),
               "--run-dir", str(scratch / f"run-{size}"), "--out", str(out)]
    wall, peak = run_watched(command)
    result: dict[str, object] = json.loads(out.read_text())
    result.update(wall_s=wall, peak_rss_mib=peak / 2**20)
    return result


def measure(sizes: list[int], repeats: int) -> list[dict[str, object]]:
    """Every size ``repeats`` times (sizes interleaved, so load on the machine hits all); medians."""
    rows = []
    results: dict[int, list[dict[str, object]]] = {size: [] for size in sizes}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(repeats):
            for size in sizes:
                place = Path(scratch) / f"{size}-{repeat}"
                place.mkdir()
                results[size].append(run_size(size, place))
                print(f"  {size:>9,} devices, run {repeat + 1}: {json.dumps(results[size][-1])}", flush=True)
        for size, runs in results.items():
            row: dict[str, object] = {
                "devices": size,
                "round_s": median(median(run["round_s"]) for run in runs),  # type: ignore[arg-type]
                "round_cpu_s": median(median(run["round_cpu_s"]) for run in runs),  # type: ignore[arg-type]
                "device_s": median(median(run["device_s"]) for run in runs),  # type: ignore[arg-type]
                "overhead_s": median(median(wall - device for wall, device in zip(  # type: ignore[call-overload]
                    run["round_s"], run["device_s"], strict=True)) for run in runs),  # type: ignore[call-overload]
                "rounds_s": [run["round_s"] for run in runs],
                "startup_s": median(float(run["startup_s"]) for run in runs),  # type: ignore[arg-type]
                "import_s": median(float(run["import_s"]) for run in runs),  # type: ignore[arg-type]
                "wall_s": median(float(run["wall_s"]) for run in runs),  # type: ignore[arg-type]
                "peak_rss_mib": max(float(run["peak_rss_mib"]) for run in runs),  # type: ignore[arg-type]
                "accuracy": runs[0]["accuracy"],
                "participants": runs[0]["participants"],
            }
            rows.append(row)
    return rows


def print_table(rows: list[dict[str, object]]) -> None:
    """The results as a fixed-width table, with the targets."""
    base = rows[0]
    print(f"\n{'devices':>10}{'round s':>9}{'x ' + format(base['devices'], ','):>9}{'round CPU s':>12}"
          f"{'in devices s':>13}{'rest s':>8}{'start-up s':>12}{'wall s':>8}{'peak MiB':>10}{'accuracy':>10}")
    for row in rows:
        ratio = float(row["round_s"]) / float(base["round_s"])  # type: ignore[arg-type]
        print(f"{row['devices']:>10,}{row['round_s']:>9.2f}{ratio:>9.2f}{row['round_cpu_s']:>12.2f}"
              f"{row['device_s']:>13.2f}{row['overhead_s']:>8.2f}{row['startup_s']:>12.1f}"
              f"{row['wall_s']:>8.1f}{row['peak_rss_mib']:>10.0f}{row['accuracy']:>10.4f}")
    print("targets: 1,000,000 devices <= 2048 MiB peak; round <= 1.5x the 1,000-device round")


def plot(rows: list[dict[str, object]], path: Path) -> None:
    """Round time, start-up and peak memory against fleet size (log x)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    sizes = [int(row["devices"]) for row in rows]  # type: ignore[call-overload]
    fig, (times, memory) = plt.subplots(1, 2, figsize=(10, 4))
    times.plot(sizes, [row["round_s"] for row in rows], "o-", label="round wall (median)")
    times.plot(sizes, [row["round_cpu_s"] for row in rows], "^-", label="round CPU (median)")
    times.plot(sizes, [row["overhead_s"] for row in rows], "v-", label="round outside devices (median)")
    times.plot(sizes, [row["startup_s"] for row in rows], "s--", label="start-up")
    times.set(xscale="log", xlabel="devices in the fleet", ylabel="wall seconds", ylim=(0, None),
              title=f"{PER_ROUND} devices a round, synthetic, logreg")
    times.legend()
    memory.plot(sizes, [row["peak_rss_mib"] for row in rows], "o-", color="tab:red")
    memory.axhline(2048, color="grey", linestyle=":", label="2 GiB target")
    memory.set(xscale="log", xlabel="devices in the fleet", ylabel="peak MiB (process tree)", ylim=(0, None),
               title="peak memory")
    memory.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        import contextlib  # noqa: PLC0415
        import io  # noqa: PLC0415

        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            one(args.one, Path(args.run_dir), started)
        Path(args.out).write_text(buffer.getvalue().strip().splitlines()[-1])
        return
    rows = measure([int(size) for size in args.sizes.split(",")], args.repeats)
    print_table(rows)
    out = HERE / "results" / "scale.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"repeats": args.repeats, "cores": os.cpu_count(), "workload": WORKLOAD,
                               "fleet_mix": "60% phone, 30% laptop, 10% gpu-box", "rows": rows}, indent=2) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
