"""``fedge keys``: the deployment's keys (a local CA, the coordinator's and gateways' TLS
certificates, devices' authentication keys) and the Ed25519 key that signs bundles."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parsers(sub: Any) -> None:
    """Register ``fedge keys`` and its subcommands on ``sub``."""
    keys = sub.add_parser("keys", help="key management").add_subparsers(dest="keys_command", required=True)
    _add_deployment_key_parsers(keys)
    signing = keys.add_parser("signing", help="Ed25519 keys that sign edge bundles")
    signing_sub = signing.add_subparsers(dest="signing_command", required=True)
    init = signing_sub.add_parser("init", help="create signing.key (0600) and signing.pub in DIR")
    init.add_argument("directory", type=Path)
    init.add_argument("--force", action="store_true", help="replace existing keys")
    init.set_defaults(handler=_keys_signing_init)


def _add_deployment_key_parsers(keys: Any) -> None:
    init = keys.add_parser("init", help="create a local CA and the coordinator's TLS certificate in DIR")
    init.add_argument("directory", type=Path)
    init.add_argument("--host", action="append", default=[],
                      help="extra DNS name or IP the coordinator is reached at (repeatable)")
    init.add_argument("--days", type=int, default=365, help="certificate validity")
    init.add_argument("--force", action="store_true", help="replace existing keys")
    init.set_defaults(handler=_keys_init)
    device = keys.add_parser("add-device", help="create a device's authentication key pair")
    device.add_argument("name")
    device.add_argument("--dir", type=Path, default=Path("keys"), help="the `fedge keys init` directory")
    device.add_argument("--force", action="store_true")
    device.set_defaults(handler=_keys_add_device)
    gateway = keys.add_parser("add-gateway", help="create a gateway's TLS certificate for its devices (CA-signed)")
    gateway.add_argument("name")
    gateway.add_argument("--host", action="append", default=[],
                         help="DNS name or IP devices reach the gateway at (repeatable)")
    gateway.add_argument("--dir", type=Path, default=Path("keys"), help="the `fedge keys init` directory")
    gateway.add_argument("--days", type=int, default=365, help="certificate validity")
    gateway.add_argument("--force", action="store_true", help="replace an existing certificate and key")
    gateway.set_defaults(handler=_keys_add_gateway)


def _keys_init(args: argparse.Namespace) -> int:
    from fedge.server.pki import init_keys

    keys = init_keys(args.directory, hosts=args.host, days=args.days, force=args.force)
    print(f"CA certificate:          {keys.ca_cert} (give to devices)")
    print(f"CA key:                  {keys.ca_key} (mode 0600; keep offline if you can)")
    sans = ", ".join(["localhost", "127.0.0.1", *args.host])
    print(f"coordinator certificate: {keys.cert} (SANs: {sans})")
    print(f"coordinator key:         {keys.key} (mode 0600)")
    print(f"next: fedge keys add-device NAME --dir {args.directory}")
    return 0


def _keys_add_device(args: argparse.Namespace) -> int:
    from fedge.server.pki import add_device

    private, public = add_device(args.dir, args.name, force=args.force)
    print(f"device key: {private} (mode 0600; copy to the device with {args.dir}/ca.crt)")
    print(f"public key: {public} (registered by `fedge coordinator start`)")
    return 0


def _keys_add_gateway(args: argparse.Namespace) -> int:
    from fedge.server.pki import add_gateway

    cert, key = add_gateway(args.dir, args.name, hosts=args.host, days=args.days, force=args.force)
    sans = ", ".join(["localhost", "127.0.0.1", *args.host])
    print(f"gateway certificate: {cert} (SANs: {sans}; devices check it with {args.dir}/ca.crt)")
    print(f"gateway TLS key:     {key} (mode 0600; copy both to the gateway host)")
    print(f"next: fedge keys add-device {args.name} --dir {args.dir}  (the gateway's node key at the coordinator)")
    return 0


def _keys_signing_init(args: argparse.Namespace) -> int:
    from fedge.edge.signing import fingerprint, generate_signing_key, load_private_key

    private, public = generate_signing_key(args.directory, force=args.force)
    print(f"private key: {private} (mode 0600; keep it on the coordinator)")
    print(f"public key:  {public} (give this to devices)")
    print(f"fingerprint: {fingerprint(load_private_key(private).public_key())}")
    return 0
