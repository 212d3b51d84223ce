"""Only the operator controls the coordinator (issue 12, finding 1: the Control API).

Replays the attack: an outsider holding only ``ca.crt`` (every device has it) and a Flower
home of its own tries to register its own device key and to start its own ServerApp,
through the address devices use and through the operator's loopback port without the
operator token. Before the fix, both succeeded through the device address and the
outsider's ServerApp ran on the coordinator host.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from http_attacks import ATTACK_BYTES, idle_tls_connections, never_ending_headers, open_connections, wait_until
from tiny_bundles import tiny_bundle, write_dir

from fedge.edge.delivery import DeliveryError, pull
from fedge.process import flower_bin
from fedge.server.coordinator import Coordinator
from fedge.server.pki import CoordinatorKeys, add_device, init_keys
from fedge.server.publish import publish_bundle
from fedge.server.superlink import LIMITS
from fedge.simulation.loopback import free_port

pytestmark = pytest.mark.slow

EVIL_APP = '''
from pathlib import Path
from flwr.serverapp import ServerApp
app = ServerApp()
@app.main()
def main(grid, context):
    Path({marker!r}).write_text("the outsider's code ran on the coordinator host")
'''


@dataclass
class Setup:
    coordinator: Coordinator
    keys: CoordinatorKeys
    root: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("control")
    keys = init_keys(root / "keys")
    add_device(root / "keys", "phone-1")
    coordinator = Coordinator(root / "state", keys, port=free_port(), bundle_port=0)
    coordinator.start()
    try:
        yield Setup(coordinator, keys, root)
    finally:
        coordinator.stop()


def _outsider_home(root: Path, name: str, address: str, ca: Path, token: str | None = None) -> dict[str, str]:
    """A Flower home of the outsider's own: a connection to ``address`` trusting ``ca``."""
    home = root / name
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(f'[superlink]\ndefault = "target"\n\n[superlink.target]\n'
                                      f'address = "{address}"\nroot-certificates = "{ca}"\n')
    if token is not None:  # a guessed token, stored the way Flower's CLI sends one
        from flwr.cli.constant import ACCESS_TOKEN_STORE_KEY, AUTHN_TYPE_STORE_KEY, REFRESH_TOKEN_STORE_KEY
        from flwr.supercore.credential_store.file_credential_store import FileCredentialStore

        store = FileCredentialStore(home / "credentials.yaml")
        store.set(AUTHN_TYPE_STORE_KEY % address, b"oidc")
        store.set(ACCESS_TOKEN_STORE_KEY % address, token.encode())
        store.set(REFRESH_TOKEN_STORE_KEY % address, token.encode())
    return {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


def _flwr(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([flower_bin("flwr"), *args], env=env, capture_output=True, text=True, timeout=120,
                          check=False)


def _routes(setup: Setup) -> dict[str, tuple[str, str | None]]:
    coordinator = setup.coordinator
    return {"device address": (coordinator.address, None),
            "operator port, no token": (coordinator.control_address, None),
            "operator port, wrong token": (coordinator.control_address, "x" * 43)}


@pytest.mark.parametrize("route", ["device address", "operator port, no token", "operator port, wrong token"])
def test_an_outsider_cannot_register_its_own_device_key(setup: Setup, route: str) -> None:
    # Prepare: the outsider's own key and Flower home
    _, public = add_device(setup.root / f"outsider-keys-{route.replace(' ', '-')}", "outsider")
    address, token = _routes(setup)[route]
    env = _outsider_home(setup.root, f"outsider-{route.replace(' ', '-')}", address, setup.keys.ca_cert, token)
    before = len(setup.coordinator.devices())
    # Execute
    done = _flwr(env, "supernode", "register", str(public), "target")
    # Assert: refused, and the operator still sees only the device it registered
    assert done.returncode != 0, done.stdout + done.stderr
    assert len(setup.coordinator.devices()) == before


@pytest.mark.parametrize("route", ["device address", "operator port, no token", "operator port, wrong token"])
def test_an_outsider_cannot_start_a_run(setup: Setup, route: str) -> None:
    # Prepare: a Flower app whose ServerApp leaves a marker file if it ever runs
    app_dir = setup.root / f"evil-{route.replace(' ', '-').replace(',', '')}"
    app_dir.mkdir()
    marker = app_dir / "ran.txt"
    (app_dir / "evil.py").write_text(EVIL_APP.format(marker=str(marker)))
    (app_dir / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "evil"\nversion = "1.0.0"\ndependencies = []\n\n'
        '[tool.flwr.app]\npublisher = "evil"\n\n'
        '[tool.flwr.app.components]\nserverapp = "evil:app"\nclientapp = "evil:app"\n\n'
        '[tool.flwr.app.config]\nx = 1\n')
    address, token = _routes(setup)[route]
    env = _outsider_home(setup.root, f"runner-{route.replace(' ', '-')}", address, setup.keys.ca_cert, token)
    # Execute
    done = _flwr(env, "run", str(app_dir), "target")
    time.sleep(3)  # a started ServerApp would have written its marker by now
    # Assert: refused; nothing ran
    assert done.returncode != 0, done.stdout + done.stderr
    assert not marker.exists()


def _post(url: str, ca: Path) -> int:
    request = urllib.request.Request(url, data=b"", method="POST",
                                     headers={"Content-Type": "application/protobuf"})
    try:
        with urllib.request.urlopen(request, timeout=10, context=ssl.create_default_context(cafile=str(ca))) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


@pytest.mark.parametrize(("path", "refused"), [
    ("/v1/runtime/get-nodes", True),          # acting as the ServerApp
    ("/v1/runtime/acquire-task", True),
    ("/v1/control/list-runs", True),
    ("/v1/control/register-node", True),
    ("/docs", True),
    ("/v1/fleet/get-run", False),             # devices' own API: reaches Flower (which answers)
])
def test_the_device_address_serves_the_fleet_api_only(setup: Setup, path: str, refused: bool) -> None:
    # Execute
    status = _post(f"https://{setup.coordinator.address}{path}", setup.keys.ca_cert)
    # Assert
    assert (status == 403) is refused, status


def test_the_operator_keeps_control(setup: Setup) -> None:
    # Prepare: a second device registered by the operator (fedge's own path through the Control API)
    add_device(setup.root / "keys", "phone-2")
    # Execute
    registered = setup.coordinator.register_devices()
    # Assert
    assert registered == ["phone-1", "phone-2"]
    assert len(setup.coordinator.devices()) == 2  # only the operator's two: no outsider got in
    assert oct(os.stat(setup.root / "state" / "operator-token").st_mode & 0o777) == "0o600"


# --------------------------------------------------------------------------- issue 23: the device port's limits


def test_never_ending_headers_on_the_device_port_get_431(setup: Setup) -> None:
    # Execute: a Fleet API request whose headers never end, on the address devices use
    context = ssl.create_default_context(cafile=str(setup.keys.ca_cert))
    outcome = never_ending_headers(setup.coordinator.port, context, path="/v1/fleet/pull-messages")
    # Assert: stopped near the limit (Flower's SuperLink used to read it all: +663 MiB for 512 MB), 431
    assert outcome.closed, f"the SuperLink still read headers after {ATTACK_BYTES} bytes"
    assert outcome.sent <= LIMITS.max_header_bytes + 512 * 1024
    assert outcome.status in (431, None)


def test_an_idle_connection_on_the_device_port_is_dropped(setup: Setup) -> None:
    # Prepare: a TLS connection that never sends a request
    held = idle_tls_connections(setup.coordinator.port, ssl.create_default_context(cafile=str(setup.keys.ca_cert)),
                                1, source="127.0.0.1")
    # Execute / Assert: closed at the header deadline (an event; the bound is generous for a loaded machine)
    wait_until(lambda: open_connections(held) == 0, LIMITS.header_timeout_s + 50, "dropping the idle connection")


def test_the_bundle_service_follows_the_device_sync(setup: Setup) -> None:
    # Prepare: a published bundle; a device key the operator adds while the coordinator runs
    signer = Ed25519PrivateKey.generate()
    trusted = setup.root / "bundle-signing.pub"
    trusted.write_bytes(signer.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    bundle = write_dir(tiny_bundle(signer, version=1), setup.root / "bundle")
    publish_bundle("inference", bundle, setup.coordinator.published)
    key, public = add_device(setup.root / "keys", "puller")
    assert setup.coordinator.bundles_url is not None

    def pull_as_puller() -> int:
        result = pull(url_or_address=setup.coordinator.bundles_url or "", kind="inference",
                      directory=setup.root / "puller-device", device_key=key, ca=setup.keys.ca_cert,
                      trusted_keys=[trusted])
        return int(result.version or 0)

    # Execute: the coordinator's device sync (FleetWatch runs it every 10 s), then the key removed and synced again
    setup.coordinator.sync_devices()
    first = pull_as_puller()
    public.unlink()
    setup.coordinator.sync_devices()
    # Assert: served once its key was synced (before: only after a restart), refused once revoked (before: served)
    assert first == 1
    with pytest.raises(DeliveryError, match="not registered with this coordinator"):
        pull_as_puller()
