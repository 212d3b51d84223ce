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
device._run_device = lambda options, state: device._run_supernode(options, state, None)[0]
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
