"""Can Flower's own Fleet HTTP API be the device protocol? What one SuperLink holds (issue 27 item 1).

A client that is not a Flower SuperNode: httpx in ``--threads`` threads, sending what Flower's
own protobuf-over-HTTP client sends (protobuf bodies; each request's timestamp signed with the
node's ECDSA P-384 key, as ``flwr.supernode.node_auth_http_interceptor`` does). It registers,
activates, heartbeats and pulls messages for ``--nodes`` nodes (10,000) against one
``flower-superlink`` on 127.0.0.1. Flower's default state is used, and the probe never pushes a
message, so it measures the cost of holding nodes, not of training.

Node authentication is off here: with it on (fedge's deployment default), ``register-node`` is
refused and each node key must be registered through the Control API (``flwr supernode
register``), one CLI call a key. Per-request auth costs are in
``../shared/notes/device-gateway-probe.md``: ECDSA P-384 verify, 322 µs. The probe instead records:

- register + activate per second;
- the SuperLink's resident memory per node (the process tree's RSS after less before);
- heartbeats and empty pulls per second with every node registered;
- the same with the SuperLink answering from its HTTP port only.

Usage: python bench/fleet_http_probe.py [--nodes 10000] [--threads 8]
Writes bench/results/fleet_http_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from base64 import b64encode
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.common.constant import TIMESTAMP_HEADER
from flwr.proto.fleet_pb2 import (
    ActivateNodeRequest,
    ActivateNodeResponse,
    PullMessagesRequest,
    PullMessagesResponse,
    RegisterNodeFleetRequest,
    RegisterNodeFleetResponse,
)
from flwr.proto.heartbeat_pb2 import SendNodeHeartbeatRequest, SendNodeHeartbeatResponse
from flwr.proto.node_pb2 import Node
from flwr.supercore.constant import FLEET_HTTP_PUBLIC_KEY_HEADER, FLEET_HTTP_SIGNATURE_HEADER
from flwr.supercore.date import now
from flwr.supercore.primitives.asymmetric import public_key_to_bytes, sign_message
from flwr.supercore.protobuf.constants import PROTOBUF_MEDIA_TYPE

from fedge.process import flower_bin
from fedge.simulation.loopback import free_port

RESULTS = Path(__file__).parent / "results" / "fleet_http_probe.json"


def tree_rss(process: psutil.Process) -> int:
    """Resident bytes of a process and its children."""
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            continue
    return total


def start_superlink(home: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    bin_dir = str(Path(flower_bin("flower-superlink")).parent)  # its helpers (flower-superexec) live beside it
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    process = subprocess.Popen([flower_bin("flower-superlink"), "--insecure", "--host", "127.0.0.1",
                                "--port", str(port), "--control-api-address", f"127.0.0.1:{free_port()}",
                                "--disable-runtime-dependency-installation"],
                               stdout=(home / "superlink.log").open("wb"), stderr=subprocess.STDOUT, env=env)
    while not _listening(port):  # an event: the port answers
        if process.poll() is not None:
            raise RuntimeError((home / "superlink.log").read_text()[-2000:])
        time.sleep(0.1)
    return process, port


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="fleet-probe-"))
    superlink, port = start_superlink(home)
    try:
        process = psutil.Process(superlink.pid)
        base = f"http://127.0.0.1:{port}/v1/fleet"
        clients = [httpx.Client(timeout=60) for _ in range(args.threads)]
        keys = [ec.generate_private_key(ec.SECP384R1()) for _ in range(args.nodes + 1)]  # fedge's node keys: P-384

        def call(index: int, path: str, request: Any, response: Any) -> Any:
            """One Fleet call as a SuperNode makes it: protobuf body, a signed timestamp in the headers."""
            key = keys[index]
            stamp = now().isoformat()
            headers = {"content-type": PROTOBUF_MEDIA_TYPE, TIMESTAMP_HEADER: stamp,
                       FLEET_HTTP_PUBLIC_KEY_HEADER: b64encode(public_key_to_bytes(key.public_key())).decode(),
                       FLEET_HTTP_SIGNATURE_HEADER: b64encode(sign_message(key, stamp.encode("ascii"))).decode()}
            answer = clients[index % args.threads].post(f"{base}/{path}", content=request.SerializeToString(),
                                                        headers=headers)
            answer.raise_for_status()
            result = response()
            result.ParseFromString(answer.content)
            return result

        def join(index: int) -> int:
            public = public_key_to_bytes(keys[index].public_key())
            node_id = call(index, "register-node", RegisterNodeFleetRequest(public_key=public),
                           RegisterNodeFleetResponse).node_id
            call(index, "activate-node", ActivateNodeRequest(public_key=public, heartbeat_interval=1800),
                 ActivateNodeResponse)
            return int(node_id)

        join(args.nodes)  # one node first: the baseline is a SuperLink that has served the Fleet API
        before = tree_rss(process)
        started = time.perf_counter()
        with ThreadPoolExecutor(args.threads) as pool:
            nodes = list(pool.map(join, range(args.nodes)))
        join_s = time.perf_counter() - started
        after = tree_rss(process)

        def beat(index: int) -> None:
            call(index, "send-node-heartbeat", SendNodeHeartbeatRequest(node=Node(node_id=nodes[index]),
                                                                        heartbeat_interval=1800),
                 SendNodeHeartbeatResponse)

        def pull(index: int) -> None:
            call(index, "pull-messages", PullMessagesRequest(node=Node(node_id=nodes[index])), PullMessagesResponse)

        timings = {}
        for name, action in (("heartbeat", beat), ("pull", pull)):
            count = min(args.nodes, 2000)
            started = time.perf_counter()
            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(action, range(count)))
            timings[name] = count / (time.perf_counter() - started)
        cpu = sum(process.cpu_times()[:2])
        return {"nodes": args.nodes, "threads": args.threads, "join_s": join_s, "joins_per_s": args.nodes / join_s,
                "rss_before_mib": before / 2**20, "rss_after_mib": after / 2**20,
                "bytes_per_node": (after - before) / args.nodes, "heartbeats_per_s": timings["heartbeat"],
                "pulls_per_s": timings["pull"], "superlink_cpu_s": cpu, "machine_cores": os.cpu_count()}
    finally:
        superlink.terminate()
        try:
            superlink.wait(30)
        except subprocess.TimeoutExpired:
            superlink.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    record = run(args)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(record, indent=2) + "\n")
    print("\n| measure (one SuperLink, Fleet HTTP API; allow-list off, each request signed, P-384) | value |"
          "\n|---|---|")
    for label, value in (("nodes registered and activated", f"{record['nodes']:,}"),
                         ("register + activate per second", f"{record['joins_per_s']:.0f}"),
                         ("SuperLink RSS before / after (MiB)",
                          f"{record['rss_before_mib']:.0f} / {record['rss_after_mib']:.0f}"),
                         ("RSS per node (bytes)", f"{record['bytes_per_node']:.0f}"),
                         ("heartbeats per second (all nodes registered)", f"{record['heartbeats_per_s']:.0f}"),
                         ("empty pulls per second", f"{record['pulls_per_s']:.0f}")):
        print(f"| {label} | {value} |")
    print(f"\nclient threads: {args.threads}; cores: {os.cpu_count()}; written to {RESULTS}")


if __name__ == "__main__":
    main()
