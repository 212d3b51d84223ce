"""What TLS session resumption saves a gateway (issue 43 §1): its CPU per device connection, full vs resumed.

A gateway's device listener runs in a process of its own (``bench/gateway_load.py --serve``: fedge's
TLS 1.3 acceptor, the P-256 certificate ``fedge keys add-gateway`` makes). This process opens
``--connections`` TLS connections to it one after another, each asking ``GET /v1/hello`` once and
closing, as a device polling between rounds does: first each with a full handshake, then each
offering the session of the one before (what :class:`fedge.clients.protocol_device.ResumingHTTPSConnection`
does). Measured: the gateway process's CPU-seconds per connection (psutil), and this client's wall
time per connection. Printed as a table with the resumed/full ratios; written to
bench/results/tls_resumption.json.

Usage: python bench/tls_resumption.py [--connections 1000]
"""

from __future__ import annotations

import argparse
import json
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

RESULTS = Path(__file__).parent / "results" / "tls_resumption.json"


def connections(port: int, ca: Path, count: int, *, resume: bool) -> tuple[float, int]:
    """``count`` connections asking /v1/hello; (wall seconds, how many the gateway resumed)."""
    from fedge.clients.gateway.protocol import PREFIX
    from fedge.clients.protocol_device import ResumingHTTPSConnection

    context = ssl.create_default_context(cafile=str(ca))
    sessions: dict[tuple[str, int], ssl.SSLSession] = {}
    resumed = 0
    started = time.perf_counter()
    for _ in range(count):
        connection = ResumingHTTPSConnection("127.0.0.1", port, timeout=30, context=context, sessions=sessions)
        connection.request("GET", f"{PREFIX}/hello")
        response = connection.getresponse()
        response.read()
        assert response.status == 200
        assert isinstance(connection.sock, ssl.SSLSocket)
        resumed += connection.sock.session_reused
        if resume:
            connection.keep_session()
        connection.close()
    return time.perf_counter() - started, resumed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=1000)
    args = parser.parse_args()
    from fedge.clients.gateway.service import add_protocol_device
    from fedge.server.pki import add_gateway, init_keys

    root = Path(tempfile.mkdtemp(prefix="tls-resumption-"))
    keys = init_keys(root / "keys")
    add_gateway(keys.directory, "bench", hosts=[])
    add_protocol_device(root / "allow", "d0")
    server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("gateway_load.py")), "--serve", str(root),
                               "--per-round", "1"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = json.loads(server.stdout.readline())["devices"]
        process = psutil.Process(server.pid)
        connections(port, keys.ca_cert, 20, resume=True)  # warm-up: imports, the listener's first connections
        records: dict[str, Any] = {}
        for name, resume in (("full", False), ("resumed", True), ("full again", False)):
            before = sum(process.cpu_times()[:2])
            wall, resumed = connections(port, keys.ca_cert, args.connections, resume=resume)
            cpu = sum(process.cpu_times()[:2]) - before
            records[name] = {"connections": args.connections, "resumed": resumed, "gateway_cpu_s": cpu,
                             "gateway_cpu_ms_per_connection": 1000 * cpu / args.connections,
                             "client_wall_ms_per_connection": 1000 * wall / args.connections}
            record = records[name]
            print(f"{name}: {resumed} of {args.connections} resumed, gateway "
                  f"{record['gateway_cpu_ms_per_connection']:.3f} CPU-ms a connection, client "
                  f"{record['client_wall_ms_per_connection']:.3f} ms a connection", flush=True)
    finally:
        server.terminate()
        server.wait(60)
    full = sum(records[n]["gateway_cpu_ms_per_connection"] for n in ("full", "full again")) / 2
    wall = sum(records[n]["client_wall_ms_per_connection"] for n in ("full", "full again")) / 2
    new = records["resumed"]
    print("\n| measure | full handshake (mean of the two runs) | resumed | resumed / full |\n|---|---|---|---|")
    print(f"| gateway CPU-ms a connection | {full:.3f} | {new['gateway_cpu_ms_per_connection']:.3f} | "
          f"{new['gateway_cpu_ms_per_connection'] / full:.2f}x |")
    print(f"| client wall ms a connection | {wall:.3f} | {new['client_wall_ms_per_connection']:.3f} | "
          f"{new['client_wall_ms_per_connection'] / wall:.2f}x |")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(records, indent=2) + "\n")
    print(f"\nwritten to {RESULTS}")


if __name__ == "__main__":
    main()
