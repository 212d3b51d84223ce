"""Many gateways, one coordinator (issue 43 §2): `python bench/gateway_load.py --gateways 1,2,4`.

Real parts on 127.0.0.1, as an operator runs them: `fedge coordinator start` (SuperLink, TLS,
node auth, the signed training graph) and N `fedge gateway start` processes (each a SuperNode
node of the coordinator plus its HTTPS device listener, int8-delta uplink), and ``--per-round``
simulated protocol devices split evenly over the gateways, in ``--clients`` load-generator
processes (bench/gateway_load.py's raw HTTP/1.1-over-TLS client: real P-256 check-ins and
request MACs). A device polls its gateway, takes each train task and posts an int8 delta of the
task's weights (a fixed small perturbation: the bench measures the tier, not training), until its
gateway says the run is over.

Recorded per N, for the run's ``--rounds`` rounds (the first one excluded from the medians: its
ClientApps start cold):
- the round's wall time at the coordinator: from one round's row in metrics.jsonl to the next
  (the instruction through the SuperLink to every gateway's ClientApp, each gateway's devices,
  the replies, the aggregate and the coordinator's own evaluation);
- the part of it the devices took (from the first device's task to the last result accepted,
  over all gateways: the round's device phase); the rest is the Flower hop and the coordinator;
- what the coordinator's processes (its SuperLink, the ServerApp) hold in memory, before the
  gateways connect and after the run, per gateway;
- the CPU-seconds each side used over the rounds (coordinator tree, gateway trees, load generators).

The model is the digits task's MLP (4,810 parameters): this bench measures the coordinator's side
and the Flower hop per gateway, which do not grow with the model; what a gateway's listener pays per
byte is bench/gateway_load.py's own measurement at 100k parameters.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import shutil
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

RESULTS = Path(__file__).parent / "results" / "gateway_fleet.json"
RUN = ("model='mlp' local-epochs=1 export-onnx=false runtime='onnx' round-timeout=900.0 gateways=true "
       "fraction-evaluate=0.0")


def fleet_device_loop(job: dict[str, Any], queue: Any) -> None:
    """A load-generator process: check its devices in at their gateways, then serve rounds until told it is over."""
    from gateway_load import check_in_all

    sessions: list[tuple[str, bytes, str, int]] = []
    for port, names in job["by_port"].items():
        keys = [Path(job["allow"], f"{name}.key").read_bytes() for name in names]
        checked = asyncio.run(check_in_all("127.0.0.1", int(port), job["ca"], names, keys))
        sessions += [(token, key, name, int(port)) for token, key, name in checked]
    queue.put(("checked-in", len(sessions)))
    accepted = asyncio.run(_serve_rounds(sessions, job["ca"]))
    queue.put(("done", accepted))


async def _serve_rounds(sessions: list[tuple[str, bytes, str, int]], ca: str) -> list[tuple[int, float, float]]:
    """Every session polls its gateway until told the run is over; (round, time) of each accepted result."""
    context = ssl.create_default_context(cafile=ca)
    limit = asyncio.Semaphore(64)
    accepted: list[tuple[int, float, float]] = []
    await asyncio.gather(*(_device(session, context, limit, accepted) for session in sessions))
    return accepted


async def _device(session: tuple[str, bytes, str, int], context: ssl.SSLContext, limit: asyncio.Semaphore,
                  accepted: list[tuple[int, float, float]]) -> None:
    from gateway_load import call, source_of

    from fedge.clients.gateway.protocol import COUNTER_HEADER, MAC_HEADER, PREFIX, request_mac

    token, key, name, port = session
    counter, trained = 1, 0

    async def request(method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        nonlocal counter
        mac = request_mac(key, method=method, path=path, counter=counter, body=body)
        headers = {"Authorization": f"Fedge-Session {token}", COUNTER_HEADER: str(counter), MAC_HEADER: mac}
        if body:
            headers["Content-Type"] = "application/vnd.fedge.frame"
        counter += 1
        async with limit:
            status, answer, pair = await call("127.0.0.1", port, context, method, path, body, headers,
                                              source=source_of(name))
            pair[1].close()
        return status, answer

    while True:
        status, body = await request("GET", f"{PREFIX}/task")
        if body[:4] == b"FDG1":
            tasked = time.time()
            server_round, frame = _update_for(body)
            status, answer = await request("POST", f"{PREFIX}/result", frame)
            if status == 200:
                trained += 1
                accepted.append((server_round, tasked, time.time()))
            continue
        answer = json.loads(body or b"{}")
        if answer.get("kind") == "done":
            return
        await asyncio.sleep(min(float(answer.get("next-in-s", 1.0)), 1.0))


def _update_for(task_frame: bytes) -> tuple[int, bytes]:
    """The round and an int8-delta result for a train task: its weights moved by a fixed small perturbation."""
    from fedge.clients.gateway.protocol import decode_frame, encode_frame, int8_delta, task_weights

    frame, scales = decode_frame(task_frame)
    weights = task_weights(frame, scales)
    rng = np.random.default_rng(1)
    trained = {k: v + rng.normal(scale=0.01, size=v.shape).astype(np.float32) for k, v in weights.items()}
    header = {"task": frame.header["task"], "kind": "train", "num-examples": 32, "samples-processed": 32, "steps": 1,
              "encoding": "int8-delta", "metrics": {"train-loss": 1.0}}
    return int(frame.header["server-round"]), encode_frame(header, *int8_delta(trained, weights))


def _tree_cpu(process: psutil.Process) -> float:
    """CPU-seconds of a process and its live children (what exited is in the parent's children times)."""
    total = 0.0
    for member in [process, *process.children(recursive=True)]:
        try:
            times = member.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
        except psutil.Error:
            continue
    return total


def _tree_rss(process: psutil.Process) -> dict[str, float]:
    """Resident MiB of a process tree by command (the SuperLink, the ServerApp, the coordinator's CLI)."""
    rss: dict[str, float] = {}
    for member in [process, *process.children(recursive=True)]:
        try:
            command = " ".join(member.cmdline()[:3])
            label = "superlink" if "superlink" in command else "serverapp" if "serverapp" in command else \
                "coordinator" if member.pid == process.pid else Path(member.cmdline()[0]).name
            rss[label] = rss.get(label, 0.0) + member.memory_info().rss / 2**20
        except (psutil.Error, IndexError):
            continue
    return rss


def _device_phases(accepted: list[tuple[int, float, float]]) -> dict[int, float]:
    """Per round, seconds from the first device's task to the last device's accepted result (the devices' part)."""
    by_round: dict[int, list[tuple[float, float]]] = {}
    for server_round, tasked, done in accepted:
        by_round.setdefault(server_round, []).append((tasked, done))
    return {r: max(d for _, d in times) - min(t for t, _ in times) for r, times in by_round.items()}


def start_gateway(federation: Any, index: int, port: int, options: list[str]) -> None:
    """Start `fedge gateway start` number ``index`` of ``federation`` on ``port`` (its certificate made first; its
    allow-list ``ROOT/allow``, its node key ``devINDEX``), with ``options`` and a 900 s round deadline."""
    from fedge.cli.main import main as fedge

    directory, root = federation.keys.directory, federation.root
    assert fedge(["keys", "add-gateway", f"gw{index}", "--dir", str(directory)]) == 0
    cert = directory / "gateways" / f"gw{index}"
    federation.devices[100 + index] = federation.spawn(
        ["gateway", "start", "--coordinator", f"127.0.0.1:{federation.port}", "--name", f"gw{index}",
         "--devices", str(root / "allow"), "--key", str(federation.keys.devices / f"dev{index}.key"),
         "--ca", str(federation.keys.ca_cert), "--trust", str(federation.bundle_signing_key),
         "--cert", str(cert.with_suffix(".crt")), "--cert-key", str(cert.with_suffix(".key")),
         "--port", str(port), "--state-dir", str(root / f"gw{index}"), "--round-deadline", "900", *options],
        f"gateway{index}.log")


def run_fleet(gateways: int, per_round: int, rounds: int, clients: int) -> dict[str, Any]:
    """One deployment with ``gateways`` gateways and ``per_round`` devices; its measures."""
    from fedge.clients.gateway.service import add_protocol_device
    from fedge.simulation.loopback import LoopbackFederation, free_port

    root = Path(tempfile.mkdtemp(prefix=f"gateway-fleet-{gateways}-"))
    federation = LoopbackFederation(root, num_devices=gateways)  # devN: gateway N's node key
    try:
        names = [f"d{index}" for index in range(per_round)]
        for name in names:
            add_protocol_device(root / "allow", name)
        federation.start_coordinator("--rounds", str(rounds), "--clients-per-round", str(gateways),
                                     "--run-config", RUN)
        federation.wait_for(federation.bundle_signing_key.exists, 900, "the bundle signing key")
        assert federation.coordinator is not None
        coordinator = psutil.Process(federation.coordinator.pid)
        federation.wait_for(lambda: "superlink" in _tree_rss(coordinator), 900, "the SuperLink")
        time.sleep(2.0)  # the SuperLink's own start-up settles
        memory_before = _tree_rss(coordinator)
        ports = [free_port() for _ in range(gateways)]
        for index, port in enumerate(ports):
            start_gateway(federation, index, port, ["--uplink", "int8-delta", "--devices-per-round",
                                                    str(per_round // gateways), "--poll-interval", "1.0",
                                                    "--max-in-flight", "4096", "--max-per-address", "64"])
        for index in range(gateways):
            federation.wait_for(lambda i=index: "serves devices on https://" in federation.log(f"gateway{i}"), 900,
                                f"gateway {index}'s device listener")
        cpu_before = _tree_cpu(coordinator)
        gateway_processes = [psutil.Process(federation.devices[100 + index].pid) for index in range(gateways)]
        gateway_cpu_before = sum(_tree_cpu(process) for process in gateway_processes)
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        jobs = [{"by_port": {str(ports[index % gateways]): [n for i, n in enumerate(names) if i % clients == c
                                                            and i % gateways == index] for index in range(gateways)},
                 "allow": str(root / "allow"), "ca": str(federation.keys.ca_cert)} for c in range(clients)]
        workers = [context.Process(target=fleet_device_loop, args=(job, queue)) for job in jobs]
        for worker in workers:
            worker.start()
        checked = sum(queue.get()[1] for _ in workers)
        print(f"  {gateways} gateway(s): {checked} devices checked in; running {rounds} rounds", flush=True)
        federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 3600, "the run's summary")
        cpu_coordinator = _tree_cpu(coordinator) - cpu_before
        cpu_gateways = sum(_tree_cpu(process) for process in gateway_processes) - gateway_cpu_before
        memory_after = _tree_rss(coordinator)
        accepted = [row for _ in workers for row in queue.get()[1]]
        for worker in workers:
            worker.join(600)
        rows = federation.rows()
        walls = [float(b["wall_time_s"]) - float(a["wall_time_s"]) for a, b in zip(rows[1:], rows[2:], strict=False)]
        phases = _device_phases(accepted)
        device_phase = [phases.get(r, float("nan")) for r in range(2, rounds + 1)]
        return {
            "gateways": gateways, "per_round": per_round, "rounds": rounds, "clients": clients,
            "round_wall_s": walls, "median_round_wall_s": statistics.median(walls[1:] or walls),
            "device_phase_s": device_phase, "median_device_phase_s": statistics.median(device_phase),
            "participants": [row.get("participants") for row in rows[1:]],
            "accepted_results": len(accepted), "coordinator_cpu_s": cpu_coordinator, "gateways_cpu_s": cpu_gateways,
            "coordinator_mib_before": memory_before, "coordinator_mib_after": memory_after,
            "superlink_mib_per_gateway": (memory_after.get("superlink", 0.0) - memory_before.get("superlink", 0.0))
            / gateways,
            "params": 4810, "machine_cores": psutil.cpu_count(),
        }
    finally:
        federation.close()
        shutil.rmtree(root, ignore_errors=True)


def fleet_bench(counts: list[int], per_round: int, rounds: int, clients: int) -> None:
    """Run the fleet at each gateway count; print the table and write bench/results/gateway_fleet.json."""
    records = {}
    for gateways in counts:
        print(f"{gateways} gateway(s), {per_round} devices a round, {rounds} rounds:", flush=True)
        records[str(gateways)] = run_fleet(gateways, per_round, rounds, clients)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(records, indent=2) + "\n")
    names = list(records)
    table = [
        ("devices a round", lambda r: f"{r['per_round']:,}"),
        ("round wall at the coordinator, median (s)", lambda r: f"{r['median_round_wall_s']:.2f}"),
        ("... of which the gateways' device phase (s)", lambda r: f"{r['median_device_phase_s']:.2f}"),
        ("results accepted / expected", lambda r: f"{r['accepted_results']} / {r['per_round'] * r['rounds']}"),
        ("coordinator CPU over the run (s)", lambda r: f"{r['coordinator_cpu_s']:.1f}"),
        ("gateways' CPU over the run (s)", lambda r: f"{r['gateways_cpu_s']:.1f}"),
        ("SuperLink RSS before -> after (MiB)", lambda r: f"{r['coordinator_mib_before'].get('superlink', 0):.0f} -> "
                                                        f"{r['coordinator_mib_after'].get('superlink', 0):.0f}"),
        ("SuperLink MiB per gateway", lambda r: f"{r['superlink_mib_per_gateway']:.1f}"),
    ]
    print(f"\n| measure | {' | '.join(f'{n} gateway(s)' for n in names)} |\n|---|{'---|' * len(names)}")
    for label, value in table:
        print(f"| {label} | {' | '.join(value(records[n]) for n in names)} |")
    print(f"\nwritten to {RESULTS}; {psutil.cpu_count()} cores shared by every process", file=sys.stderr)
