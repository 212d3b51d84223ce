"""Deployment keys: a local CA, the coordinator's TLS certificate, device auth keys.

Threat model: the CA key can mint certificates any device will accept as the
coordinator, and a device key lets its holder join the federation as that
device. Private keys are written with mode 0600 and never overwritten unless
asked (``force``). The CA and coordinator keys stay on the coordinator host;
each device gets ``ca.crt`` (to check the coordinator) and its own key.
Formats are the ones Flower's SuperLink/SuperNode accept: PEM for TLS, and EC
NIST P-384 keys in OpenSSH format for SuperNode authentication.

The key directory and ``devices/`` (the allow-list of devices the coordinator
registers) are created with mode 0700 whatever the umask, and an existing one
that group or others can write is tightened to 0700 (with a warning): whoever
can write ``devices/`` can add a device of their own. Public files are 0644.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedge.edge.signing import ensure_private_dir, write_public
from fedge.errors import ConfigError
from fedge.listeners import GATEWAY_CN_PREFIX

DEVICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class CoordinatorKeys:
    """Where ``fedge keys init`` put things."""

    directory: Path

    @property
    def ca_cert(self) -> Path:  # noqa: D102
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:  # noqa: D102
        return self.directory / "ca.key"

    @property
    def cert(self) -> Path:  # noqa: D102
        return self.directory / "coordinator.crt"

    @property
    def key(self) -> Path:  # noqa: D102
        return self.directory / "coordinator.key"

    @property
    def devices(self) -> Path:  # noqa: D102
        return self.directory / "devices"

    def device_public_keys(self) -> list[Path]:
        """Every registered device's OpenSSH public key."""
        return sorted(self.devices.glob("*.pub")) if self.devices.exists() else []


def write_private(path: Path, data: bytes, *, force: bool) -> None:
    """Create ``path`` with mode 0600 (refusing to replace it unless ``force``)."""
    if path.exists():
        if not force:
            raise ConfigError(f"{path} already exists; pass --force to replace it")
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _subject_alt_names(hosts: list[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in ["localhost", "127.0.0.1", *hosts]:
        try:
            entry: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            entry = x509.DNSName(host)
        if entry not in names:
            names.append(entry)
    return names


def init_keys(directory: str | Path, *, hosts: list[str] | None = None, days: int = 365,
              force: bool = False) -> CoordinatorKeys:
    """Create a CA and a CA-signed coordinator certificate for ``localhost``, ``127.0.0.1`` and ``hosts``."""
    keys = _private_dirs(directory)
    for path in (keys.ca_key, keys.key):
        if path.exists() and not force:
            raise ConfigError(f"{path} already exists; pass --force to replace it (devices will then "
                              "need the new ca.crt)")
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedge local CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, key_cert_sign=True, crl_sign=True,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA384()))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = _server_certificate(ca_key, ca_name, server_key, "fedge coordinator", hosts or [], days)
    write_private(keys.ca_key, _pem(ca_key), force=force)
    write_private(keys.key, _pem(server_key), force=force)
    write_public(keys.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM))
    write_public(keys.cert, server_cert.public_bytes(serialization.Encoding.PEM))
    return keys


def _server_certificate(ca_key: ec.EllipticCurvePrivateKey, ca_name: x509.Name, key: ec.EllipticCurvePrivateKey,
                        common_name: str, hosts: list[str], days: int) -> x509.Certificate:
    """A TLS server certificate the CA signs, for ``localhost``, ``127.0.0.1`` and ``hosts``."""
    now = dt.datetime.now(dt.UTC)
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(_subject_alt_names(hosts)), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA384()))


def add_gateway(directory: str | Path, name: str, *, hosts: list[str], days: int = 365,
                force: bool = False) -> tuple[Path, Path]:
    """A gateway's TLS certificate for its devices, signed by the CA of ``fedge keys init``: ``gateways/NAME.crt``
    and ``NAME.key`` (0600), for ``localhost``, ``127.0.0.1`` and ``hosts``.

    ECDSA P-256, not the coordinator's P-384: every device's poll may open a TLS connection, and
    the server's handshake signature is the gateway's per-connection cost (P-256 signs about 6x
    faster on the measured CPU, ``../shared/notes/device-gateway-probe.md``); phones and
    browsers all accept it. Devices check it against the same ``ca.crt``.

    Raises
    ------
    ConfigError
        A bad name, no CA in ``directory`` (run ``fedge keys init`` first), or existing files
        without ``force``.
    """
    if not DEVICE_NAME.match(name):
        raise ConfigError(f"gateway name '{name}' must be 1-64 letters, digits, '.', '_' or '-'")
    keys = CoordinatorKeys(Path(directory))
    if not keys.ca_key.is_file():
        raise ConfigError(f"{keys.ca_key} does not exist: create the CA first with `fedge keys init {directory}`")
    ca_key = serialization.load_pem_private_key(keys.ca_key.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{keys.ca_key} is not the EC key `fedge keys init` makes")
    ca_name = x509.load_pem_x509_certificate(keys.ca_cert.read_bytes()).subject
    folder = ensure_private_dir(keys.directory / "gateways")
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    key = ec.generate_private_key(ec.SECP256R1())
    write_private(key_path, _pem(key), force=force)
    write_public(cert_path, _server_certificate(ca_key, ca_name, key, f"{GATEWAY_CN_PREFIX}{name}", hosts, days)
                 .public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def add_device(directory: str | Path, name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Create device ``name``'s auth key pair (EC P-384, OpenSSH format) under ``devices/``."""
    if not DEVICE_NAME.match(name):
        raise ConfigError(f"device name '{name}' must be 1-64 letters, digits, '.', '_' or '-'")
    keys = _private_dirs(directory)
    private = ec.generate_private_key(ec.SECP384R1())
    private_path, public_path = keys.devices / f"{name}.key", keys.devices / f"{name}.pub"
    write_private(private_path, private.private_bytes(serialization.Encoding.PEM,
                                                      serialization.PrivateFormat.OpenSSH,
                                                      serialization.NoEncryption()), force=force)
    write_public(public_path, private.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + f" {name}\n".encode())
    return private_path, public_path


def _private_dirs(directory: str | Path) -> CoordinatorKeys:
    """The key directory and its ``devices/`` allow-list, both mode 0700 (see the module's threat model)."""
    keys = CoordinatorKeys(ensure_private_dir(directory))
    ensure_private_dir(keys.devices)
    return keys
