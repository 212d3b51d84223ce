"""``fedge gateway start|add-device|revoke`` and ``fedge protocol-device`` (the reference client)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any


def add_parsers(sub: Any) -> None:
    """Register ``gateway`` and ``protocol-device`` on ``sub``."""
    gateway = sub.add_parser("gateway", help="a gateway tier for phones and browsers (fedge's device protocol)")
    actions = gateway.add_subparsers(dest="gateway_command", required=True)
    _start_options(actions.add_parser("start", help="serve protocol devices and join the coordinator as a node"))
    add = actions.add_parser("add-device", help="admit a protocol device: a P-256 key pair in the allow-list")
    add.add_argument("name", help="the device's name (letters, digits, '.', '_', '-')")
    add.add_argument("--devices", type=Path, required=True, help="the gateway's allow-list directory")
    add.add_argument("--force", action="store_true", help="replace an existing key pair")
    add.set_defaults(handler=_add_device)
    revoke = actions.add_parser("revoke", help="refuse a device from now on (its live session included)")
    revoke.add_argument("name")
    revoke.add_argument("--devices", type=Path, required=True, help="the gateway's allow-list directory")
    revoke.set_defaults(handler=_revoke)
    demo = actions.add_parser("demo-data", help="write a task's examples for the web demo page's devices (--demo-data)")
    demo.add_argument("--task", default="digits", help="the task whose simulated partitions to write (default digits)")
    demo.add_argument("--devices", type=int, required=True, help="how many demo devices (files PREFIX0.json ...)")
    demo.add_argument("--out", type=Path, required=True, help="the folder to write (the gateway's --demo-data)")
    demo.add_argument("--prefix", default="browser", help="device names: PREFIX0, PREFIX1, ... (default browser)")
    demo.add_argument("--raw", action="store_true",
                      help="write raw inputs (before the task's preprocessing), as a sensor gives them")
    demo.set_defaults(handler=_demo_data)
    _device_options(sub.add_parser("protocol-device", help="the reference protocol device: no Flower, no torch"))


def _start_options(start: argparse.ArgumentParser) -> None:
    start.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    start.add_argument("--devices", type=Path, required=True, help="allow-list directory (NAME.pub, revoked)")
    start.add_argument("--key", type=Path, help="this gateway's node key at the coordinator (`fedge keys add-device`)")
    start.add_argument("--ca", type=Path, help="the coordinator's ca.crt")
    start.add_argument("--trust", type=Path, required=True, help="the coordinator's bundle signing public key")
    start.add_argument("--cert", type=Path, help="TLS certificate devices see (signed by a CA they hold)")
    start.add_argument("--cert-key", type=Path, help="the certificate's private key")
    start.add_argument("--host", default="127.0.0.1", help="address devices connect to (default 127.0.0.1)")
    start.add_argument("--port", type=int, default=9443, help="port devices connect to (default 9443)")
    start.add_argument("--name", default="gateway", help="this gateway's name (devices sign it at check-in)")
    start.add_argument("--devices-per-round", type=int, default=0,
                       help="results that complete a round (default 0: every device seen in the last two poll "
                            "intervals, at least --min-devices)")
    start.add_argument("--min-devices", type=int, default=1, help="fewest results a round waits for")
    start.add_argument("--round-deadline", type=float, default=120.0, help="seconds a round waits for its devices")
    start.add_argument("--poll-interval", type=float, default=10.0, help="seconds idle devices are told to wait")
    start.add_argument("--max-in-flight", type=int, default=512, help="requests in progress before 503 + Retry-After")
    start.add_argument("--max-per-address", type=int, default=32,
                       help="requests in progress one client address may hold (default 32)")
    start.add_argument("--max-num-examples", type=int, default=100_000, help="largest example count one device claims")
    from fedge.codec import ENCODINGS, TASK_ENCODINGS  # noqa: PLC0415 - numpy only: --help stays light

    start.add_argument("--uplink", default="fp32", choices=tuple(ENCODINGS),
                       help="what devices send (the codec registry's device-protocol encodings)")
    start.add_argument("--downlink", default="fp32", choices=tuple(TASK_ENCODINGS),
                       help="how a plain round's task carries the model to devices that read it (fp16: half the "
                            "bytes, int8: a quarter; devices' updates are taken against what they received); "
                            "secure rounds send fp32")
    from fedge.aggregate import DEVICE_RULES  # noqa: PLC0415 - numpy only

    start.add_argument("--device-rule", default="mean", choices=DEVICE_RULES,
                       help="a plain round's reply over its devices' updates: mean (hierarchical FedAvg, default) or "
                            "a robust rule (unweighted), so one hostile device moves the reply only within the "
                            "others' spread (median: from 3 devices; trimmed-mean: once the fraction cuts one at each "
                            "end; a secure pool reveals only its mean)")
    start.add_argument("--device-trim-fraction", type=float, default=0.2,
                       help="--device-rule trimmed-mean: the share cut at each end of each coordinate (default 0.2)")
    start.add_argument("--bundles", default="",
                       help="HOST:PORT of the coordinator's bundle service (default: the coordinator's port + 1)")
    start.add_argument("--state-dir", type=Path, help="this gateway's working files (default ~/.fedge-gateway)")
    start.add_argument("--max-wait", type=float,
                       help="give up if the coordinator is unreachable, or its training graph unpublished, this long "
                            "(default: wait)")
    start.add_argument("--insecure", action="store_true", help="NO TLS to devices or coordinator (throwaway tests)")
    start.add_argument("--demo-page", action="store_true",
                       help="serve the web device SDK's demo page at /web/demo.html?name=NAME (needs --ort-web)")
    start.add_argument("--ort-web", type=Path, help="onnxruntime-web's dist folder (npm onnxruntime-web@1.31.1)")
    start.add_argument("--demo-data", type=Path, help="NAME.json examples for demo devices (docs/devices.md)")
    start.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                       help="a web app's origin (https://app.example.org) whose pages may call this gateway (CORS); "
                            "repeatable; default none: same-origin pages only")
    start.set_defaults(handler=_start)


def _start(args: argparse.Namespace) -> int:
    from fedge.clients.gateway.service import GatewayOptions, GatewaySettings, run_gateway  # noqa: PLC0415
    from fedge.clients.gateway.web import WebSite  # noqa: PLC0415
    from fedge.errors import ConfigError  # noqa: PLC0415

    if args.demo_page and args.ort_web is None:
        raise ConfigError("--demo-page needs --ort-web DIR: onnxruntime-web's dist folder (npm install "
                          "onnxruntime-web@1.31.1), which the page's worker loads")
    web = WebSite(ort=args.ort_web, bundle_key=args.trust, data=args.demo_data) if args.demo_page else None

    settings = GatewaySettings(name=args.name, devices_per_round=args.devices_per_round, min_devices=args.min_devices,
                               round_deadline_s=args.round_deadline, idle_poll_s=args.poll_interval,
                               max_in_flight=args.max_in_flight, max_per_address=args.max_per_address,
                               max_num_examples=args.max_num_examples,
                               uplink=args.uplink, downlink=args.downlink, device_rule=args.device_rule,
                               device_trim_fraction=args.device_trim_fraction)
    return run_gateway(GatewayOptions(coordinator=args.coordinator, devices=args.devices, key=args.key, ca=args.ca,
                                      trust=args.trust, cert=args.cert, cert_key=args.cert_key, host=args.host,
                                      port=args.port, insecure=args.insecure, state_dir=args.state_dir,
                                      bundles=args.bundles, max_wait_s=args.max_wait, settings=settings, web=web,
                                      allow_origins=tuple(args.allow_origin)))


def _demo_data(args: argparse.Namespace) -> int:
    from fedge.clients.gateway.web import write_demo_data  # noqa: PLC0415

    written = write_demo_data(args.task, args.out, args.devices, prefix=args.prefix, raw=args.raw)
    print(f"wrote {len(written)} demo devices' examples ({written[0].name} .. {written[-1].name}) to {args.out}: "
          f"start the gateway with --demo-page --demo-data {args.out}, admit each device's key, and open "
          f"/web/demo.html?name={written[0].stem}", flush=True)
    return 0


def _add_device(args: argparse.Namespace) -> int:
    from fedge.clients.gateway.service import add_protocol_device  # noqa: PLC0415

    private, public = add_protocol_device(args.devices, args.name, force=args.force)
    print(f"device '{args.name}': give {private} to the device (then delete it here); {public} stays in the "
          "allow-list (a running gateway admits it within a second)")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    from fedge.clients.gateway.service import revoke_protocol_device  # noqa: PLC0415

    revoke_protocol_device(args.devices, args.name)
    print(f"device '{args.name}' is revoked: gateways reading {args.devices} refuse it within a second")
    return 0


def _device_options(device: argparse.ArgumentParser) -> None:
    device.add_argument("--gateway", required=True, action="append",
                        help="the gateway's URL, https://HOST:PORT; repeat it to name more: when the one in use "
                             "cannot be reached the device checks in at the next, and it trains each round once")
    device.add_argument("--name", required=True, help="this device's name in the gateway's allow-list")
    device.add_argument("--key", type=Path, required=True, help="this device's private key (PEM, P-256 or Ed25519)")
    device.add_argument("--data", type=Path, required=True, help="this device's examples (.npz or .csv)")
    device.add_argument("--trust", type=Path, required=True, help="the coordinator's bundle signing public key")
    device.add_argument("--ca", type=Path, help="the CA that signed the gateway's certificate")
    device.add_argument("--state-dir", type=Path,
                        help="this device's own state, created 0700: the verified training graph, its freshness "
                             "records and lineage pin (default ~/.fedge-protocol-device/NAME)")
    device.add_argument("--model-id", metavar="NAME",
                        help="train only graphs of this lineage (signed model_id), and follow it from now on "
                             "(default: the lineage of the first graph accepted)")
    device.add_argument("--rounds", type=int, help="stop after this many trained rounds (default: run until stopped)")
    device.add_argument("--insecure", action="store_true", help="plain HTTP to the gateway (throwaway tests)")
    device.add_argument("--secure-aggregation", action="store_true",
                        help="train only under secure aggregation: refuse plain train tasks (the gateway would see "
                             "this device's update); the gateway then learns only its pool's sum")
    device.set_defaults(handler=_protocol_device)


def _protocol_device(args: argparse.Namespace) -> int:
    from fedge.clients.protocol_device import ProtocolDevice  # noqa: PLC0415

    if args.insecure:
        print("WARNING: INSECURE MODE. This device talks plain HTTP: its session and updates are readable on the "
              "network.", file=sys.stderr, flush=True)
    device = ProtocolDevice(gateway=args.gateway, name=args.name, key=args.key, data=args.data, trust=args.trust,
                            ca=args.ca, state_dir=args.state_dir, insecure=args.insecure,
                            secure=args.secure_aggregation, model_id=args.model_id)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    trained = device.run(stop=stop, rounds=args.rounds)
    print(f"device '{args.name}' stopped after {trained} trained rounds", flush=True)
    return 0
