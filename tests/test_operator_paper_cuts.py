"""Operator and device paper cuts (issue 26, items 7 and 8), each replayed without a coordinator.

The end-to-end halves (a device killed outright that rejoins at once, a device that stops
once its coordinator is gone, the status and resume lines of a real coordinator) are in
``tests/test_device_rejoin.py``, ``tests/test_operator_service.py`` and ``tests/test_lifecycle.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from fedge.cli.deploy import resume_command, start_parser, stopped_fleet
from fedge.clients import device
from fedge.clients.device_session import console_line, hold_state_dir, previous_session, remember_session
from fedge.server.coordinator import _previous_stop, allow_list, record_clean_stop
from fedge.server.pki import add_device, init_keys
from fedge.simulation.loopback import FEDGE


def test_a_key_file_removed_while_the_devices_sync_is_left_out_without_an_error(tmp_path: Path) -> None:
    # Prepare: two registered device keys; the operator revokes dev1 between the listing and the reading
    keys = init_keys(tmp_path / "keys")
    add_device(tmp_path / "keys", "dev0")
    add_device(tmp_path / "keys", "dev1")
    listed = keys.device_public_keys()
    (keys.devices / "dev1.pub").unlink()
    # Execute: Flower's loader raised ClickException ("Public key file ... does not exist") here
    allowed = allow_list(listed, warned=set())
    # Assert: dev0 alone, as a PEM public key
    assert list(allowed.values()) == ["dev0"]
    assert next(iter(allowed)).startswith("-----BEGIN PUBLIC KEY-----")


ED25519_PUB = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH)


@pytest.mark.parametrize("content", [b"", b"not a key", ED25519_PUB],
                         ids=["empty", "text", "ed25519 (not ECDSA)"])
def test_a_key_file_that_is_not_a_device_key_is_named_once_and_left_out(
        content: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare
    keys = init_keys(tmp_path / "keys")
    add_device(tmp_path / "keys", "dev0")
    (keys.devices / "odd.pub").write_bytes(content)
    warned: set[str] = set()
    # Execute: two syncs
    first = allow_list(keys.device_public_keys(), warned=warned)
    second = allow_list(keys.device_public_keys(), warned=warned)
    # Assert: dev0 is admitted; one warning names the file and the fix
    assert sorted(first.values()) == sorted(second.values()) == ["dev0"]
    err = capsys.readouterr().err
    assert err.count("odd.pub is not a device key") == 1, err
    assert "fedge keys add-device odd" in err


def test_a_stopped_coordinators_status_lists_revoked_devices_as_revoked() -> None:
    # Prepare: three registered devices, node 22 revoked before the stop
    names = {"11": "dev0", "22": "dev1", "33": "dev2"}
    # Execute
    fleet = stopped_fleet(names, {22})
    # Assert
    assert [node["status"].split(" ")[0] for node in fleet] == ["registered", "revoked", "registered"]


@pytest.mark.parametrize(("argv", "expected"), [
    ([], "fedge coordinator start --resume /runs/r1"),
    (["--keys", "/etc/fedge keys", "--port", "9200", "--host", "0.0.0.0"],
     "fedge coordinator start --resume /runs/r1 --keys '/etc/fedge keys' --host 0.0.0.0 --port 9200"),
    (["--insecure", "--state-dir", "st", "--bundle-port", "0"],
     "fedge coordinator start --resume /runs/r1 --state-dir st --bundle-port 0 --insecure"),
    (["--dashboard", "--dashboard-port", "9999", "--metrics-port", "0", "--run-config", "lr=0.1", "--rounds", "9"],
     "fedge coordinator start --resume /runs/r1 --dashboard-port 9999 --metrics-port 0 --dashboard"),
], ids=["defaults", "keys host port", "insecure state-dir bundle-port", "run settings come from the run"])
def test_the_resume_hint_repeats_the_operators_start_options(argv: list[str], expected: str) -> None:
    # Prepare
    args = start_parser().parse_args(argv)
    # Execute
    hint = resume_command(args, Path("/runs/r1"))
    # Assert
    assert hint == expected


def test_the_next_start_says_a_signalled_stop_not_a_crash_and_only_once(tmp_path: Path) -> None:
    # Prepare: a coordinator stopped by SIGTERM mid-run, recorded in its state and run directories
    state, run = tmp_path / "state", tmp_path / "run"
    state.mkdir()
    run.mkdir()
    record_clean_stop([state, run], "SIGTERM")
    (state / "last-stop.json").unlink()  # a restore from a backup has the run directory only
    # Execute: the next start reads it; the start after that finds nothing (say it crashed then)
    first, second = _previous_stop([state, run]), _previous_stop([state, run])
    # Assert
    assert first.startswith("it was stopped by SIGTERM at 20"), first
    assert second == "it crashed or was killed"


def test_a_second_device_on_one_state_directory_is_refused_with_the_holders_pid(tmp_path: Path) -> None:
    # Prepare: this process holds the state directory, as a running `fedge device` does
    state = tmp_path / "state"
    state.mkdir()
    data = tmp_path / "d.npz"
    np.savez(data, x=np.zeros((4, 64), np.float32), y=np.zeros(4, np.int64))
    with hold_state_dir(state):
        # Execute: a second device on the same directory (it would share Flower's home and bundles)
        done = subprocess.run([FEDGE, "device", "--insecure", "--coordinator", "127.0.0.1:1", "--data", str(data),
                               "--state-dir", str(state)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    # Assert: refused in one line naming the holder, before contacting anyone
    assert done.returncode == 2, done.stderr
    assert f"another `fedge device` (pid {os.getpid()}) is using --state-dir {state}" in done.stderr
    assert "unreachable" not in done.stderr + done.stdout
    with hold_state_dir(state):  # released: the next device may hold it
        pass


def test_a_session_is_remembered_per_key(tmp_path: Path) -> None:
    # Prepare: two device keys
    init_keys(tmp_path / "keys")
    one, other = (add_device(tmp_path / "keys", name)[0] for name in ("dev0", "dev1"))
    # Execute
    remember_session(tmp_path, one, 8888153329252361707)
    # Assert: the node id comes back for its own key only; an insecure device has no session to end
    assert previous_session(tmp_path, one) == 8888153329252361707
    assert previous_session(tmp_path, other) is None
    assert previous_session(tmp_path, None) is None


@pytest.mark.parametrize(("line", "shown"), [
    ("\x1b[92mINFO \x1b[0m:      Starting Flower SuperNode\n", None),
    ("\x1b[93mWARNING \x1b[0m:   Connection attempt failed, retrying in 3.10 seconds\n", None),
    ("INFO:     Uvicorn running on http://127.0.0.1:44021 (Press CTRL+C to quit)\n", None),
    ("Successfully installed fedge-run to /tmp/d/flwr-home/apps/fedge.fedge-run.1.0.0.f4c0e51b.\n", None),
    ("\x1b[92mINFO \x1b[0m:      \n", None),
    ("round 1: trained 719 samples in 45 steps (torch), loss 1.7906, 19,752 bytes to send\n",
     "round 1: trained 719 samples in 45 steps (torch), loss 1.7906, 19,752 bytes to send\n"),
    ("this device refused the round: ValueError: \x1b[1mbad\x1b[0m\n",
     "this device refused the round: ValueError: bad\n"),
], ids=["flower info", "flower warning", "uvicorn", "fab install", "blank record", "fedge round", "fedge refusal"])
def test_the_device_console_keeps_fedges_lines_and_drops_flowers(line: str, shown: str | None) -> None:
    # Execute / Assert: the console; --verbose shows every line, without colour codes
    assert console_line(line, verbose=False) == shown
    assert "\x1b" not in (console_line(line, verbose=True) or "")


# A stand-in SuperNode whose coordinator went away: Flower retries forever, one line per attempt
RETRYING_FOREVER = """
import time
print("\\x1b[92mINFO \\x1b[0m:      SuperNode ID: 42", flush=True)
while True:
    print("\\x1b[93mWARNING \\x1b[0m:   Connection attempt failed, retrying in 0.50 seconds", flush=True)
    time.sleep(0.5)
"""


def test_a_device_whose_coordinator_is_gone_stops_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: a joined device whose SuperNode retries a coordinator that no longer listens (port 1)
    monkeypatch.setattr(device, "supernode_command", lambda options, bundle: [sys.executable, "-c", RETRYING_FOREVER])
    monkeypatch.setattr(device, "wait_reachable", lambda host, port, wait: None)
    options = device.DeviceOptions(coordinator="127.0.0.1:1", profile="laptop", data=Path("."), key=None, ca=None,
                                   insecure=True, state_dir=tmp_path, offline_limit_s=2.0)
    # Execute: it used to retry "Connection attempt failed" forever
    code = device._run_device(options, tmp_path)
    # Assert: status 0, one line saying why and what to do; Flower's retries only in the log
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("the coordinator 127.0.0.1:1 has been unreachable for 2 s") == 1, out
    assert "joined the coordinator as node 42" in out
    assert "Connection attempt failed" not in out
    assert "Connection attempt failed" in (tmp_path / "supernode.log").read_text()
