"""Private state is its user's only, whatever the umask (issue 23, item 13).

Replayed under umask 000 (every bit a call asks for is kept) and 022 (the usual one): the
coordinator's state directory, ``published/``, the SuperLink's database with its WAL and
shared-memory files, its log and the run log; a device's state directory, bundles, lineage
pin and freshness records. These used to follow the umask: ``superlink.db`` (messages in
flight), its WAL and ``superlink.log`` were 0644 under umask 022, and under umask 000
``state/``, ``published/`` and the device's ``bundles/`` were 0777.

Real parts: a SuperLink started by :class:`fedge.server.coordinator.Coordinator`, the bundle
service on 127.0.0.1 with TLS, ``fedge device`` up to its first connection attempt.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from test_delivery import _publish, _pull, pki, service, signer  # noqa: F401 - pytest fixtures

from fedge.clients.device import DeviceOptions, run_device
from fedge.edge.delivery import LINEAGE_PIN
from fedge.errors import FedgeError
from fedge.server.coordinator import Coordinator
from fedge.server.pki import CoordinatorKeys
from fedge.server.publish import BundleService
from fedge.simulation.loopback import free_port


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(params=[0o000, 0o022], ids=["umask-000", "umask-022"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


@pytest.mark.slow
def test_the_coordinators_state_is_private(umask: int, tmp_path: Path) -> None:
    # Prepare: an insecure coordinator (TLS files are not what is checked here); under umask 022 its state
    # directory is one an older fedge left (0755, readable by all), under 000 it is made now
    if umask == 0o022:
        (tmp_path / "state").mkdir()
    coordinator = Coordinator(tmp_path / "state", None, port=free_port(), bundle_port=0)
    # Execute: the SuperLink starts, opens its database (WAL mode) and logs
    coordinator.start()
    try:
        state = coordinator.state_dir
        database = [state / name for name in ("superlink.db", "superlink.db-wal", "superlink.db-shm")]
        assert all(path.exists() for path in database)  # what is checked is there
        # Assert
        assert {path.name: _mode(path) for path in [state, coordinator.published]} == \
            {"state": 0o700, "published": 0o700}
        assert {path.name: _mode(path) for path in [*database, state / "superlink.log"]} == \
            {path.name: 0o600 for path in [*database, state / "superlink.log"]}
    finally:
        coordinator.stop()


def test_a_devices_bundles_pin_and_freshness_records_are_private(
        umask: int, service: BundleService, pki: CoordinatorKeys,  # noqa: F811
        signer: tuple[Ed25519PrivateKey, Path], tmp_path: Path) -> None:  # noqa: F811
    # Prepare
    _publish(service, signer, tmp_path, 4)
    device = tmp_path / "device" / "bundles"
    # Execute
    result = _pull(service, pki, signer, device)
    # Assert
    freshness = device / ".freshness"
    assert {path.name: _mode(path) for path in [device, freshness]} == {"bundles": 0o700, ".freshness": 0o700}
    files = [result.path, *freshness.iterdir()]
    assert freshness / LINEAGE_PIN in files and list(freshness.glob("*.json"))  # the pin and the version record
    assert {path.name: _mode(path) for path in files} == {path.name: 0o600 for path in files}


def test_a_devices_state_directory_is_private(umask: int, tmp_path: Path) -> None:
    # Prepare: a device with its own data, whose coordinator is not there
    data = tmp_path / "mine.npz"
    np.savez(data, x=np.zeros((4, 64), np.float32), y=np.zeros(4, np.int64))
    state = tmp_path / "device-state"
    options = DeviceOptions(coordinator=f"127.0.0.1:{free_port()}", profile="laptop", data=data, key=None,
                            ca=None, insecure=True, max_wait_s=0, state_dir=state)
    # Execute: it gives up at once, after setting up its state
    with pytest.raises(FedgeError, match="unreachable"):
        run_device(options)
    # Assert
    assert _mode(state) == 0o700
