"""Connection limits of fedge's HTTP listeners (issue 23, items 4 and 5), replayed on real sockets.

The bundle service (TLS, real device keys) and the metrics endpoint run for real on
127.0.0.1. Attacks replayed: request headers that never end (before: the listener kept
reading, its memory growing with every byte; now 431 after 16 KiB); headers trickled too
slowly or never sent (now closed at the header deadline); 300 idle TLS connections from
one address (before: uvicorn's 256 connection slots were all theirs and every device's pull
was answered 503; now one address holds at most 16 and a device on another address pulls).
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from http_attacks import (
    ATTACK_BYTES,
    idle_tls_connections,
    never_ending_headers,
    open_connections,
    wait_until,
)
from tiny_bundles import tiny_bundle, write_dir

from fedge.edge.delivery import pull
from fedge.listeners import ListenerLimits
from fedge.server.dashboard import create_service_app, listen, serve_in_background
from fedge.server.pki import CoordinatorKeys, add_device, init_keys
from fedge.server.publish import LIMITS, BundleService, publish_bundle

ATTACKER = "127.0.0.2"  # another loopback address: the attacker's, the device pulls from 127.0.0.1


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> CoordinatorKeys:
    keys = init_keys(tmp_path_factory.mktemp("pki") / "keys")
    add_device(keys.directory, "dev0")
    return keys


@pytest.fixture
def service(pki: CoordinatorKeys, tmp_path: Path) -> Iterator[BundleService]:
    served = BundleService(tmp_path / "published", pki, host="127.0.0.1", port=0)
    served.start()
    yield served
    served.stop()


def _tls(pki: CoordinatorKeys) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(pki.ca_cert))


def _published_pull(service: BundleService, pki: CoordinatorKeys, tmp_path: Path) -> int:
    """Publish a signed bundle and pull it as dev0; returns its version."""
    signer = Ed25519PrivateKey.generate()
    trusted = tmp_path / "signing.pub"
    trusted.write_bytes(signer.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    publish_bundle("inference", write_dir(tiny_bundle(signer, version=1), tmp_path / "bundle"), service.published)
    result = pull(url_or_address=f"127.0.0.1:{service.port}", kind="inference", directory=tmp_path / "device",
                  device_key=pki.devices / "dev0.key", ca=pki.ca_cert, trusted_keys=[trusted])
    return int(result.version or 0)


def test_never_ending_headers_get_431_from_the_bundle_service(service: BundleService, pki: CoordinatorKeys) -> None:
    # Execute: a request whose headers never end
    outcome = never_ending_headers(service.port, _tls(pki), path="/v1/bundles/inference")
    # Assert: stopped near the limit (memory bounded), answered 431
    assert outcome.closed, f"the bundle service still read headers after {ATTACK_BYTES} bytes"
    assert outcome.sent <= LIMITS.max_header_bytes + 512 * 1024
    assert outcome.status in (431, None)


def test_never_ending_headers_get_431_from_the_metrics_endpoint(tmp_path: Path) -> None:
    # Prepare: the coordinator's metrics endpoint, served as `fedge coordinator start` serves it
    sock = listen("127.0.0.1", 0, "the metrics endpoint", "--metrics-port")
    server = serve_in_background(create_service_app(tmp_path), sock, "test-metrics")
    wait_until(lambda: bool(server.started), 30, "the metrics endpoint starting")
    try:
        # Execute
        outcome = never_ending_headers(sock.getsockname()[1], None, path="/metrics")
    finally:
        server.should_exit = True
    # Assert
    assert outcome.closed, f"the metrics endpoint still read headers after {ATTACK_BYTES} bytes"
    assert outcome.status == 431


def test_headers_never_sent_are_dropped_at_the_deadline(pki: CoordinatorKeys, tmp_path: Path) -> None:
    # Prepare: a service with a 1 s header deadline; two TLS connections, one silent, one trickling half a request
    service = BundleService(tmp_path / "published", pki, limits=ListenerLimits(header_timeout_s=1.0))
    service.start()
    try:
        held = idle_tls_connections(service.port, _tls(pki), 2, source="127.0.0.1")
        held[1].sendall(b"GET /v1/bundles/inference HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        # Execute / Assert: the listener closes both (an event; the bound is generous for a loaded machine)
        wait_until(lambda: open_connections(held) == 0, 60, "closing connections that sent no complete headers")
    finally:
        service.stop()


def test_idle_tls_connections_from_one_address_do_not_lock_out_devices(service: BundleService,
                                                                       pki: CoordinatorKeys, tmp_path: Path) -> None:
    # Prepare: 300 idle TLS connections from the attacker's address (no device key needed for TLS)
    held = idle_tls_connections(service.port, _tls(pki), 300, source=ATTACKER)
    try:
        # Execute: a real device pull from another address, while they are held
        version = _published_pull(service, pki, tmp_path)
        # Assert: served (before: 503 'Exceeded concurrency limit'); the attacker holds at most its share
        assert version == 1
        wait_until(lambda: open_connections(held) <= LIMITS.per_address, 60,
                   f"closing the attacker's connections beyond {LIMITS.per_address}")
    finally:
        for sock in held:
            sock.close()
