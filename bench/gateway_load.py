"""How many protocol devices one fedge gateway holds, and how fast it takes their updates (issue 27).

Real parts on 127.0.0.1: a gateway's device listener (uvicorn, TLS 1.3 with a CA-signed
certificate from `fedge keys init`) and its control port, in a process of its own; simulated
protocol devices in ``--clients`` load-generator processes (asyncio, raw HTTP/1.1 over TLS,
real ECDSA P-256 check-in signatures and HMAC-SHA256 request MACs, as
``docs/device-protocol.md`` specifies and :class:`fedge.clients.protocol_device.ProtocolDevice`
does).

Phases:

1. **Check-in**: ``--devices`` devices (10,000) check in (a TLS connection each, hello once
   per process, the signed check-in, connection closed: devices do not hold connections
   between polls). Recorded: check-ins per second, and the gateway's resident memory per
   checked-in device (RSS after less RSS before, over the devices).
2. **Round**: the control port opens a train round of a ``--params`` (100,000) parameter
   model; ``--per-round`` (1,000) of the checked-in devices each fetch the task (the fp32
   weights) and post an int8-delta update (pre-computed: the bench measures the gateway, not
   training). Recorded: updates per second over the round, and the round's wall time from the
   control POST to its answer, which is the gateway's overhead beyond device compute.
3. **Baseline** (same run): the same 1,000 int8 updates decoded and folded in this process,
   as the inline simulation aggregates (no network, no TLS, no validation).

Each listener is measured with fp32 tasks; the gateway's own listener also with each other
task encoding of ``--downlinks`` (``fedge gateway start --downlink``: fp16, int8 tasks), so the
compressed downlink's gain is measured against fp32 in the same run (the ``fedge`` column).

Usage: python bench/gateway_load.py [--devices 10000] [--per-round 1000] [--params 100000]
                                   [--downlinks fp32,fp16,int8] [--listeners fedge,uvicorn] [--resumed-too]
       python bench/gateway_load.py --gateways 1,2,4 [--per-round 1000] [--rounds 6]
           (many gateways and one coordinator: bench/gateway_fleet.py)
Writes bench/results/gateway_load.json. Targets (issue 27): 10,000 connected devices within
1 GiB per gateway; >= 500 updates/s per gateway core; round overhead <= 2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import dataclasses
import functools
import json
import multiprocessing
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedge.aggregate import WeightedMeanAccumulator
from fedge.clients.gateway.protocol import (
    COUNTER_HEADER,
    MAC_HEADER,
    PREFIX,
    b64,
    check_in_message,
    decode_frame,
    encode_frame,
    from_int8_delta,
    int8_delta,
    request_mac,
    unb64,
)

RESULTS = Path(__file__).parent / "results" / "gateway_load.json"
CONCURRENCY = 64  # connections in flight per load-generator process


def model(params: int) -> dict[str, np.ndarray]:
    """A model of ``params`` float32 parameters in two tensors (a layer and its bias)."""
    rng = np.random.default_rng(0)
    return {"w": rng.normal(size=(params // 100, 99)).astype(np.float32),
            "b": rng.normal(size=params - (params // 100) * 99).astype(np.float32)}


# --------------------------------------------------------------------------- the gateway process
def serve(root: Path, per_round: int, listener: str = "fedge", downlink: str = "fp32") -> None:
    """Run a gateway's listeners until killed; print their ports.

    ``listener``: ``fedge`` is the gateway's own (fedge's TLS acceptor: connections counted per
    address when accepted, a 10 s handshake deadline, asyncio's event loop); ``uvicorn`` is the
    listener before security round 3 (uvicorn's own TLS on its default loop, uvloop here, with
    fedge's h11 limits), measured in the same run to show what the acceptor costs.

    With FEDGE_PROFILE=PATH the device listener runs on the main thread under cProfile,
    written to PATH when the bench stops it (SIGTERM).
    """
    from fedge.clients.gateway.service import DEVICE_LIMITS, Gateway, GatewaySettings, Served, control_app, device_app
    from fedge.listeners import ListenerLimits, bind, server_tls, uvicorn_options

    cert, cert_key = root / "keys" / "gateways" / "bench.crt", root / "keys" / "gateways" / "bench.key"
    gateway = Gateway(GatewaySettings(name="bench", devices_per_round=per_round, round_deadline_s=600,
                                      idle_poll_s=30, max_in_flight=4096, uplink="int8-delta",
                                      downlink=downlink),
                      root / "allow", None)
    control = Served(control_app(gateway, "bench-token"), "127.0.0.1", 0, limits=ListenerLimits())
    if not os.environ.get("FEDGE_PROFILE") and listener in ("fedge", "fedge-h11"):
        limits = DEVICE_LIMITS if listener == "fedge" else dataclasses.replace(DEVICE_LIMITS, parser="h11")
        devices = Served(device_app(gateway), "127.0.0.1", 0, limits=limits, cert=cert, cert_key=cert_key)
        print(json.dumps({"devices": devices.port, "control": control.port}), flush=True)
        while True:
            time.sleep(3600)
    import cProfile

    import uvicorn

    sock = bind("127.0.0.1", 0)
    print(json.dumps({"devices": sock.getsockname()[1], "control": control.port}), flush=True)
    tls = {"ssl_certfile": str(cert), "ssl_keyfile": str(cert_key)} if listener == "uvicorn" else {}
    options = uvicorn_options(DEVICE_LIMITS, tls=None if tls else server_tls(cert, cert_key))
    server = uvicorn.Server(uvicorn.Config(device_app(gateway), log_level="warning", access_log=False, **tls,
                                          **options))

    def stop(*_: Any) -> None:
        raise SystemExit(0)

    if not os.environ.get("FEDGE_PROFILE"):
        server.run(sockets=[sock])
        return
    signal.signal(signal.SIGTERM, stop)  # uvicorn re-raises SIGTERM after its shutdown: end here, then dump
    profiler = cProfile.Profile()
    try:
        profiler.runcall(server.run, sockets=[sock])
    finally:
        profiler.dump_stats(os.environ["FEDGE_PROFILE"])


# --------------------------------------------------------------------------- a minimal async HTTP/1.1 client
OFFERED: contextvars.ContextVar[ssl.SSLSession | None] = contextvars.ContextVar("offered", default=None)


class ResumingContext(ssl.SSLContext):
    """A client context that offers the TLS session in :data:`OFFERED` (a device's last one with this gateway, as
    :class:`fedge.clients.protocol_device.ResumingHTTPSConnection` does): asyncio's connections take no session."""

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:  # noqa: D102
        kwargs.setdefault("session", OFFERED.get())
        return super().wrap_bio(*args, **kwargs)


@functools.cache
def client_context(ca: str) -> ssl.SSLContext:
    """One per CA and process: a TLS session resumes only through the context that made it."""
    context = ResumingContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=ca)
    return context


def source_of(name: str) -> str:
    """Device ``dN``'s own loopback address (127.0.x.y): a fleet's devices come from many addresses,
    and the gateway caps what one address may hold."""
    index = int(name[1:]) if name[1:].isdigit() else 0
    return f"127.0.{1 + index // 250}.{2 + index % 250}"


async def call(host: str, port: int, context: ssl.SSLContext, method: str, path: str, body: bytes = b"",
               headers: dict[str, str] | None = None, writer_pair: Any = None,
               source: str | None = None) -> tuple[int, bytes, Any]:
    """One request on a (new or given) TLS connection from ``source``; (status, body, the connection to reuse)."""
    reader, writer = writer_pair or await asyncio.open_connection(
        host, port, ssl=context, local_addr=None if source is None else (source, 0))
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    await writer.drain()
    status_line = await reader.readline()
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    data = await reader.readexactly(length)
    return int(status_line.split()[1]), data, (reader, writer)


async def check_in_all(host: str, port: int, ca: str, names: list[str], keys: list[bytes]
                       ) -> list[tuple[str, bytes, str, ssl.SSLSession | None]]:
    """Check every device in; their (token, session key, name, TLS session)."""
    context = client_context(ca)
    status, body, pair = await call(host, port, context, "GET", f"{PREFIX}/hello")
    gateway = json.loads(body)["gateway"]
    pair[1].close()
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(name: str, pem: bytes) -> tuple[str, bytes, str, ssl.SSLSession | None]:
        key = serialization.load_pem_private_key(pem, None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        nonce, issued = b64(os.urandom(16)), int(time.time())
        signature = key.sign(check_in_message(device=name, gateway=gateway, issued_at=issued, nonce=nonce),
                             ec.ECDSA(hashes.SHA256()))
        request = json.dumps({"device": name, "time": issued, "nonce": nonce, "signature": b64(signature)}).encode()
        async with limit:
            status, body, pair = await call(host, port, context, "POST", f"{PREFIX}/check-in", request,
                                            {"Content-Type": "application/json"}, source=source_of(name))
            tls = pair[1].get_extra_info("ssl_object").session  # TLS 1.3: the ticket came before the answer
            pair[1].close()
        answer = json.loads(body)
        assert status == 200, answer
        return answer["session"], unb64(answer["key"], "key", size=32), name, tls

    return list(await asyncio.gather(*(one(n, k) for n, k in zip(names, keys, strict=True))))


async def round_all(host: str, port: int, ca: str, sessions: list[tuple[str, bytes, str, ssl.SSLSession | None]],
                    base: dict[str, np.ndarray], update: tuple[dict[str, np.ndarray], dict[str, float]],
                    resume: bool = False) -> tuple[list[float], int, int]:
    """Each session fetches the task and posts its update (``resume``: on a connection that resumes its check-in's
    TLS session); the time each result was accepted, a task's bytes, connections resumed."""
    context = client_context(ca)
    resumed: list[bool] = []
    limit = asyncio.Semaphore(CONCURRENCY)
    done: list[float] = []
    task_bytes: list[int] = []

    async def one(token: str, key: bytes, name: str, tls: ssl.SSLSession | None) -> None:
        source = source_of(name)
        OFFERED.set(tls if resume else None)  # this task's own context
        async with limit:
            counter, pair = 1, None
            while True:
                mac = request_mac(key, method="GET", path=f"{PREFIX}/task", counter=counter, body=b"")
                status, body, pair = await call(host, port, context, "GET", f"{PREFIX}/task", b"", {
                    "Authorization": f"Fedge-Session {token}", COUNTER_HEADER: str(counter), MAC_HEADER: mac},
                    pair, source)
                counter += 1
                if body[:4] == b"FDG1":
                    break
                await asyncio.sleep(0.05)  # the round is not open yet
            task = decode_frame(body)[0].header
            task_bytes.append(len(body))
            frame = encode_frame({"task": task["task"], "kind": "train", "num-examples": 32, "steps": 1,
                                  "encoding": "int8-delta", "metrics": {"train-loss": 1.0}}, *update)
            mac = request_mac(key, method="POST", path=f"{PREFIX}/result", counter=counter, body=frame)
            status, body, pair = await call(host, port, context, "POST", f"{PREFIX}/result", frame, {
                "Authorization": f"Fedge-Session {token}", COUNTER_HEADER: str(counter), MAC_HEADER: mac,
                "Content-Type": "application/vnd.fedge.frame"}, pair)
            resumed.append(pair[1].get_extra_info("ssl_object").session_reused)
            pair[1].close()
            assert status == 200, body[:200]
            done.append(time.time())

    await asyncio.gather(*(one(*session) for session in sessions))
    return done, max(task_bytes), sum(resumed)


def worker(job: dict[str, Any], queue: Any) -> None:
    """A load-generator process: check its devices in, then (when told) run its share of the round."""
    names, keys = job["names"], [Path(p).read_bytes() for p in job["keys"]]
    started = time.time()
    sessions = asyncio.run(check_in_all("127.0.0.1", job["port"], job["ca"], names, keys))
    queue.put(("checked-in", time.time() - started))
    base = model(job["params"])
    rng = np.random.default_rng(1)
    trained = {k: v + rng.normal(scale=0.01, size=v.shape).astype(np.float32) for k, v in base.items()}
    update = int8_delta(trained, base)
    job["go"].wait()
    accepted = asyncio.run(round_all("127.0.0.1", job["port"], job["ca"], sessions[:job["per_round"]], base, update,
                                     job["resume"]))
    queue.put(("round", accepted))


# --------------------------------------------------------------------------- the bench
def control_round(port: int, base: dict[str, np.ndarray]) -> tuple[float, dict[str, Any]]:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    started = time.time()
    connection.request("POST", "/control/round", body=encode_frame(
        {"kind": "train", "server-round": 1, "graph": "", "config": {"seed": 0}}, base),
        headers={"Authorization": "Bearer bench-token"})
    response = connection.getresponse()
    body = response.read()
    assert response.status == 200, body[:300]
    return started, decode_frame(body)[0].header


def round_open(port: int) -> bool:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("GET", "/control/status", headers={"Authorization": "Bearer bench-token"})
    return bool(json.loads(connection.getresponse().read())["round-open"])


def inline_fold(base: dict[str, np.ndarray], count: int) -> float:
    """Seconds to decode and fold ``count`` int8 updates in-process (what the inline simulation does)."""
    rng = np.random.default_rng(1)
    trained = {k: v + rng.normal(scale=0.01, size=v.shape).astype(np.float32) for k, v in base.items()}
    frame = encode_frame({}, *int8_delta(trained, base))
    started = time.perf_counter()
    total = WeightedMeanAccumulator()
    for _ in range(count):
        decoded, scales = decode_frame(frame)
        total.add(from_int8_delta(decoded.tensors, scales, base), 32.0)
    total.result()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--per-round", type=int, default=1_000)
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=2, help="load-generator processes")
    parser.add_argument("--listeners", default="fedge,uvicorn",
                        help="device listeners measured in turn: fedge (the gateway's), fedge-h11 (the same with "
                             "the h11 parser, before issue 43's httptools) and uvicorn (before round 3)")
    parser.add_argument("--downlinks", default="fp32,fp16,int8",
                        help="task encodings measured on the first listener (fp32 is measured on each)")
    parser.add_argument("--resumed-too", action="store_true",
                        help="also the first listener with fp32 tasks where each device's round connection resumes "
                             "its check-in's TLS session (as fedge's reference device and browsers do)")
    parser.add_argument("--gateways", default="",
                        help="N[,N...]: instead, N gateway processes and one coordinator (bench/gateway_fleet.py), "
                             "--per-round devices a round over them, --rounds rounds")
    parser.add_argument("--rounds", type=int, default=6, help="with --gateways: the run's rounds")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--listener", default="fedge", help=argparse.SUPPRESS)
    parser.add_argument("--downlink", default="fp32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.per_round, args.listener, args.downlink)
        return
    if args.gateways:
        from gateway_fleet import fleet_bench
        fleet_bench([int(n) for n in args.gateways.split(",")], args.per_round, args.rounds, args.clients)
        return
    from fedge.clients.gateway.service import add_protocol_device
    from fedge.server.pki import add_gateway, init_keys

    root = Path(tempfile.mkdtemp(prefix="gateway-load-"))
    keys = init_keys(root / "keys")
    add_gateway(keys.directory, "bench", hosts=[])  # the P-256 certificate `fedge keys add-gateway` makes
    print(f"making {args.devices} device keys ...", flush=True)
    for index in range(args.devices):
        add_protocol_device(root / "allow", f"d{index}")
    records = {}
    listeners = args.listeners.split(",")
    runs = [(listeners[0], d, False) for d in args.downlinks.split(",")] + \
        [(name, "fp32", False) for name in listeners[1:]]
    runs = runs + [(listeners[0], "fp32", True)] if args.resumed_too else runs
    for listener, downlink, resume in runs:
        name = (listener if downlink == "fp32" else f"{listener}+{downlink}") + ("/resumed" if resume else "")
        print(f"listener '{listener}', {downlink} tasks{', TLS sessions resumed' if resume else ''}:", flush=True)
        server = subprocess.Popen([sys.executable, __file__, "--serve", str(root), "--per-round", str(args.per_round),
                                   "--listener", listener, "--downlink", downlink], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            ports = json.loads(server.stdout.readline())
            process = psutil.Process(server.pid)
            rss_before = process.memory_info().rss
            records[name] = run_load(args, root, keys.ca_cert, ports, process, rss_before, resume)
        finally:
            server.terminate()
            server.wait(60)
        records[name]["inline_fold_s"] = inline_fold(model(args.params), args.per_round)
        records[name]["downlink"] = downlink
    report(records, args)


def run_load(args: argparse.Namespace, root: Path, ca: Path, ports: dict[str, int], process: psutil.Process,
             rss_before: int, resume: bool = False) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    queue, go = context.Queue(), context.Manager().Event()
    share = args.devices // args.clients
    jobs = [{"names": [f"d{i}" for i in range(c * share, (c + 1) * share)],
             "keys": [str(root / "allow" / f"d{i}.key") for i in range(c * share, (c + 1) * share)],
             "port": ports["devices"], "ca": str(ca), "params": args.params,
             "per_round": args.per_round // args.clients, "resume": resume,
             "go": go} for c in range(args.clients)]
    started = time.time()
    workers = [context.Process(target=worker, args=(job, queue)) for job in jobs]
    for w in workers:
        w.start()
    check_in_times = [queue.get()[1] for _ in workers]
    check_in_s = time.time() - started
    rss_after = process.memory_info().rss
    print(f"{args.devices} devices checked in in {check_in_s:.1f} s; gateway RSS "
          f"{rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB", flush=True)
    cpu_before = sum(process.cpu_times()[:2])
    box: dict[str, Any] = {}
    weights = model(args.params)
    opener = threading.Thread(target=lambda: box.update(
        zip(("opened", "header"), control_round(ports["control"], weights), strict=True)))
    opener.start()
    while not round_open(ports["control"]):  # devices are sent once the round is open (as pace steering would)
        time.sleep(0.01)
    go.set()
    opener.join()
    answered = time.time()
    opened, header = box["opened"], box["header"]
    answers = [queue.get()[1] for _ in workers]
    accepted = [t for times, _, _ in answers for t in times]
    cpu_round = sum(process.cpu_times()[:2]) - cpu_before
    for w in workers:
        w.join()
    accepted.sort()
    span = accepted[-1] - accepted[0] if len(accepted) > 1 else float("nan")
    return {"devices": args.devices, "per_round": args.per_round, "params": args.params, "clients": args.clients,
            "check_in_s": check_in_s, "check_in_worker_s": check_in_times,
            "check_ins_per_s": args.devices / max(check_in_times), "rss_before_mib": rss_before / 2**20,
            "rss_after_check_in_mib": rss_after / 2**20, "rss_peak_round_mib": process.memory_info().rss / 2**20,
            "bytes_per_session": (rss_after - rss_before) / args.devices, "round_wall_s": answered - opened,
            "updates_per_s": len(accepted) / span if span == span and span > 0 else float("nan"),
            "gateway_cpu_round_s": cpu_round, "updates_per_cpu_s": len(accepted) / cpu_round,
            "task_bytes": answers[0][1], "round_connections_resumed": sum(a[2] for a in answers),
            "round_devices": header["devices"], "round_examples": header["num-examples"],
            "machine_cores": os.cpu_count()}


def report(records: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(records, indent=2) + "\n")
    rows = [
        ("checked-in devices", lambda r: f"{r['devices']:,}", "10,000"),
        ("gateway RSS after check-in (MiB)", lambda r: f"{r['rss_after_check_in_mib']:.0f}", "<= 1024"),
        ("RSS per checked-in device (bytes)", lambda r: f"{r['bytes_per_session']:.0f}", ""),
        ("check-ins/s (TLS handshake + P-256 verify)", lambda r: f"{r['check_ins_per_s']:.0f}", ""),
        ("updates/s over the round (wall)", lambda r: f"{r['updates_per_s']:.0f}", ">= 500 per core"),
        ("updates per gateway CPU-second", lambda r: f"{r['updates_per_cpu_s']:.0f}", ">= 500"),
        (f"round wall, {args.per_round:,} devices (s)", lambda r: f"{r['round_wall_s']:.2f}", "<= 2"),
        ("inline fold of the same updates (s)", lambda r: f"{r['inline_fold_s']:.2f}", ""),
        ("round / inline fold", lambda r: f"{r['round_wall_s'] / r['inline_fold_s']:.1f}x", ""),
        ("task frame (bytes)", lambda r: f"{r['task_bytes']:,}", ""),
    ]
    names = list(records)
    print(f"\n| measure | {' | '.join(names)} | target |\n|---|{'---|' * len(names)}---|")
    for label, value, target in rows:
        print(f"| {label} | {' | '.join(value(records[n]) for n in names)} | {target} |")
    for name in (n for n in records if n.startswith("fedge+")):
        new, old = records[name], records["fedge"]
        ratios = (new["updates_per_cpu_s"] / old["updates_per_cpu_s"], new["round_wall_s"] / old["round_wall_s"],
                  new["task_bytes"] / old["task_bytes"])
        print(f"{name} / fedge (fp32 tasks): updates per CPU-second {ratios[0]:.2f}x, round wall {ratios[1]:.2f}x, "
              f"task bytes {ratios[2]:.2f}x")
    for name in (n for n in records if n.endswith("/resumed")):
        new, old = records[name], records[name.removesuffix("/resumed")]
        print(f"\n{name} / full handshakes: updates per CPU-second "
              f"{new['updates_per_cpu_s'] / old['updates_per_cpu_s']:.2f}x, round wall "
              f"{new['round_wall_s'] / old['round_wall_s']:.2f}x ({new['round_connections_resumed']} of "
              f"{new['per_round']} round connections resumed)")
    if {"fedge", "fedge-h11"} <= set(records):
        new, old = records["fedge"], records["fedge-h11"]
        print(f"\nhttptools / h11 (fp32 tasks): updates per CPU-second "
              f"{new['updates_per_cpu_s'] / old['updates_per_cpu_s']:.2f}x, round wall "
              f"{new['round_wall_s'] / old['round_wall_s']:.2f}x")
    if {"fedge", "uvicorn"} <= set(records):
        new, old = records["fedge"], records["uvicorn"]
        print(f"\nfedge / uvicorn: check-ins/s {new['check_ins_per_s'] / old['check_ins_per_s']:.2f}x, updates per "
              f"CPU-second {new['updates_per_cpu_s'] / old['updates_per_cpu_s']:.2f}x, round wall "
              f"{new['round_wall_s'] / old['round_wall_s']:.2f}x")
    print(f"\n{args.clients} load-generator processes and the gateway share {os.cpu_count()} cores; "
          f"written to {RESULTS}")


if __name__ == "__main__":
    main()
