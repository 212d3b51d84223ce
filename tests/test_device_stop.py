"""A stopped device prints one line: its Flower helpers' shutdown noise goes to a file.

Replays what CI saw: Flower's ClientApp watches its parent and raises SIGINT in itself when
the parent is gone; one already exiting after fedge's SIGTERM then prints a KeyboardInterrupt
traceback into the SuperNode's output, which ``fedge device`` echoed to the console.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# A stand-in SuperNode whose shutdown prints the traceback Flower's helper printed in CI
NOISY_SUPERNODE = """
import signal, sys, time
def on_term(signum, frame):
    print("Traceback (most recent call last):", flush=True)
    print("KeyboardInterrupt:", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("supernode up", flush=True)
while True:
    time.sleep(0.1)
"""

DEVICE = """
import sys
from pathlib import Path
from fedge.clients import device

state = Path(sys.argv[1])
device.supernode_command = lambda options, bundle: [sys.executable, "-c", sys.argv[2]]
device.check_device = lambda options: None
device._run_device = lambda options, state: device._run_supernode(options, state, None).code
options = device.DeviceOptions(coordinator="127.0.0.1:1", profile="laptop", data=Path("."), key=None,
                               ca=None, insecure=True, state_dir=state)
sys.exit(device.run_device(options))
"""


def _wait_for_line(process: subprocess.Popen[str], text: str, timeout_s: float = 60) -> list[str]:
    assert process.stdout is not None
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        seen.append(line)
        if text in line:
            return seen
    raise AssertionError(f"{text!r} not printed: {seen}")


def test_a_stopped_device_prints_one_line_and_keeps_the_helpers_noise_in_a_file(tmp_path: Path) -> None:
    # Prepare: a device whose SuperNode prints a traceback when it is stopped
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    process = subprocess.Popen([sys.executable, "-c", DEVICE, str(tmp_path), NOISY_SUPERNODE], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_line(process, "supernode up")
    # Execute: Ctrl-C, as a terminal or a supervisor sends it
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=60)
    # Assert: exit 0 and one line on the console; the traceback is in the file it names
    assert process.returncode == 0, rest
    assert "Traceback" not in rest, rest
    assert rest.count("device stopped (SIGINT)") == 1, rest
    assert str(tmp_path / "last-stop.log") in rest
    assert "KeyboardInterrupt" in (tmp_path / "last-stop.log").read_text()


# Stand-in SuperNodes for the reconnect rule: Flower's SuperNode whose key is revoked right after
# activation raises SIGINT in itself and exits 0 ("terminated gracefully"); reconnecting is refused.
CUT_OFF_AFTER_ACTIVATION = 'print("INFO :      SuperNode ID: 8888153329252361707", flush=True)'
REFUSED_ON_RECONNECT = 'import sys; print("[code: 2004] Failed to activate SuperNode.", flush=True); sys.exit(1)'
NEVER_CONNECTED = 'import sys; print("TLS handshake failed", flush=True); sys.exit(7)'


@pytest.mark.parametrize(("runs", "outcome"), [
    ([CUT_OFF_AFTER_ACTIVATION, REFUSED_ON_RECONNECT], "refused"),
    ([NEVER_CONNECTED], 7),
], ids=["revoked within seconds of activation", "did not get going"])
def test_a_supernode_cut_off_right_after_activation_reconnects_and_is_refused(
        runs: list[str], outcome: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: each SuperNode start runs the next stand-in (the last one again if more are asked for);
    # no coordinator to reach or check
    from fedge.clients import device
    from fedge.errors import FedgeError

    started: list[str] = []

    def command(options: device.DeviceOptions, bundle: Path | None) -> list[str]:
        started.append(runs[min(len(started), len(runs) - 1)])
        return [sys.executable, "-c", started[-1]]

    monkeypatch.setattr(device, "supernode_command", command)
    monkeypatch.setattr(device, "check_device", lambda options: None)
    monkeypatch.setattr(device, "wait_reachable", lambda host, port, wait: None)
    options = device.DeviceOptions(coordinator="127.0.0.1:1", profile="laptop", data=Path("."), key=None,
                                   ca=None, insecure=True, state_dir=tmp_path, max_wait_s=2.0)
    # Execute / Assert: the cut-off device connects again and ends refused (the CLI's exit 2), where it used
    # to end 0 as if its SuperNode had stopped normally; one that never connected ends with its status
    if outcome == "refused":
        with pytest.raises(FedgeError, match="did not activate this device"):
            device._run_device(options, tmp_path)
        assert started[:2] == runs
    else:
        assert device._run_device(options, tmp_path) == outcome
        assert started == runs
