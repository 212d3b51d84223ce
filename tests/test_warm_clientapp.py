"""fedge's SuperNode launcher: a shorter idle pull, a faster heartbeat, ClientApps forked from a warm parent.

The deployment tests (tests/test_deployment.py and the rest) run every device through these; here
each piece is checked on its own, in process or with one small process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.supercore import heartbeat
from flwr.supernode import fleet_http_connection, start_client_internal

from fedge.clients import supernode, warm_clientapp
from fedge.clients.device import DeviceOptions, supernode_command
from fedge.clients.runtimes import HANDLERS


@pytest.fixture
def flower_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower's module attributes the launcher sets, put back after the test."""
    monkeypatch.setattr(start_client_internal, "time", time)
    monkeypatch.setattr(start_client_internal, "subprocess", subprocess)
    monkeypatch.setattr(fleet_http_connection, "HEARTBEAT_DEFAULT_INTERVAL", 30)
    monkeypatch.setattr(heartbeat, "HEARTBEAT_DEFAULT_INTERVAL", 30)


def test_pace_shortens_the_idle_pause_sets_the_heartbeat_and_starts_fedges_superexec(
        flower_restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: record the pauses the paced module takes and the SuperExec command it starts
    pauses: list[float] = []
    started: list[list[str]] = []
    monkeypatch.setattr(supernode.time, "sleep", pauses.append)
    monkeypatch.setattr(supernode.subprocess, "Popen", lambda args, *a, **k: started.append(args))
    # Execute
    said = supernode.pace(idle_pull_s=0.25, heartbeat_s=12, warm_runtime="onnx")
    start_client_internal.time.sleep(3)  # the loop's idle pause
    start_client_internal.time.sleep(0.5)  # its wait for a reply: left alone
    start_client_internal.subprocess.Popen(["flower-superexec", "--insecure"])
    # Assert
    assert said == []
    assert pauses == [0.25, 0.5]
    assert start_client_internal.time.monotonic() > 0  # the rest of `time` is time's
    assert fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL == 12 and heartbeat.HEARTBEAT_DEFAULT_INTERVAL == 12
    assert started == [[sys.executable, "-m", "fedge.clients.warm_clientapp", "--runtime", "onnx", "--insecure"]]


def test_pace_without_a_warm_runtime_leaves_flowers_superexec(flower_restored: None) -> None:
    supernode.pace(idle_pull_s=1.0, heartbeat_s=30, warm_runtime=None)
    assert start_client_internal.subprocess is subprocess


@pytest.mark.parametrize(("idle", "beat", "named"), [
    (1.0, 9, "10-1800"), (1.0, 1801, "10-1800"), (0.0, 15, "positive"), (-1.0, 15, "positive")])
def test_pace_refuses_what_flower_would_not_take(flower_restored: None, idle: float, beat: int, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        supernode.pace(idle_pull_s=idle, heartbeat_s=beat)


def test_a_flower_without_the_idle_pause_runs_at_its_own_pace_and_says_so(
        flower_restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supernode, "FLOWER_IDLE_PULL_S", 7)  # a pause this Flower's loop does not take
    said = supernode.pace(idle_pull_s=0.5, heartbeat_s=15)
    assert start_client_internal.time is time
    assert len(said) == 1 and "--idle-pull-s has no effect" in said[0]


@pytest.mark.parametrize(("options", "warm"), [
    ({}, ["--warm-runtime", "torch"]),
    ({"runtime": "onnx"}, ["--warm-runtime", "onnx"]),
    ({"gateway_control": "127.0.0.1:1", "gateway_token": Path("token")}, ["--warm-runtime", ""]),
    ({"warm_clientapps": False}, []),
])
def test_a_device_runs_fedges_supernode_with_its_pace_and_warm_runtime(
        tmp_path: Path, options: dict[str, Any], warm: list[str]) -> None:
    device = DeviceOptions(coordinator="127.0.0.1:9095", profile="laptop", data=tmp_path / "d.npz", key=None,
                           ca=None, insecure=True, idle_pull_s=0.5, heartbeat_s=20, **options)
    command = supernode_command(device)
    ours = command[3:command.index("--superlink")]
    assert command[:3] == [sys.executable, "-m", "fedge.clients.supernode"]
    assert ours == ["--idle-pull-s", "0.5", "--heartbeat-s", "20", *warm]


def test_each_runtime_names_modules_that_import() -> None:
    import importlib

    for handlers in HANDLERS.values():
        for name in handlers.warm:
            importlib.import_module(name)
    assert warm_clientapp.warm_modules("torch")[-1] == "fedge.clients.torch_client"
    assert warm_clientapp.warm_modules("") == ["flwr.supernode.cli.flwr_clientapp", "fedge.clients.app"]


def test_the_launcher_sends_clientapps_to_the_warm_parent_and_starts_anything_else(tmp_path: Path) -> None:
    # Prepare: a stand-in parent that writes what it is sent to a file
    sink = tmp_path / "launches"
    parent = subprocess.Popen([sys.executable, "-c", f"import sys; open({str(sink)!r}, 'w').write(sys.stdin.read())"],
                              stdin=subprocess.PIPE, text=True)
    launcher = warm_clientapp._WarmLauncher(parent)
    # Execute
    kept = launcher.popen(["flwr-clientapp", "--token", "t1"])
    quiet = launcher.popen(["flwr-clientapp", "--token", "t2"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    other = launcher.popen([sys.executable, "-c", "pass"])
    assert parent.stdin is not None
    parent.stdin.close()
    parent.wait(60)
    # Assert
    assert kept is None and quiet is None and other.wait(60) == 0
    lines = [json.loads(line) for line in sink.read_text().splitlines()]
    assert lines == [{"args": ["flwr-clientapp", "--token", "t1"], "quiet": False},
                     {"args": ["flwr-clientapp", "--token", "t2"], "quiet": True}]


def test_with_its_parent_gone_the_launcher_starts_flowers_own_process_and_says_so_once(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    parent = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE, text=True)
    parent.wait(60)
    started: list[list[str]] = []
    monkeypatch.setattr(warm_clientapp.subprocess, "Popen", lambda args, *a, **k: started.append(args))
    launcher = warm_clientapp._WarmLauncher(parent)
    for token in ("t1", "t2"):
        launcher.popen(["flwr-clientapp", "--token", token])
    assert started == [["flwr-clientapp", "--token", "t1"], ["flwr-clientapp", "--token", "t2"]]
    assert capsys.readouterr().err.count("warm ClientApp parent is gone") == 1


def test_the_warm_parent_forks_flowers_clientapp_per_line_and_exits_when_its_stdin_closes() -> None:
    # Prepare: a warm parent with nothing runtime-specific (a gateway node's)
    parent = subprocess.Popen([sys.executable, "-m", "fedge.clients.warm_clientapp", "--warm-parent",
                               "--runtime", ""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert parent.stdin is not None and parent.stdout is not None
    # Execute: Flower's own entry point asked for its help, once printed and once quiet, then the pipe closes
    for quiet in (True, False):
        parent.stdin.write(json.dumps({"args": ["flwr-clientapp", "--help"], "quiet": quiet}) + "\n")
        parent.stdin.flush()
    parent.stdin.close()
    out = parent.stdout.read()  # to EOF: the parent and every child closed it
    # Assert: one help text (the quiet child's went to /dev/null), and the parent is gone
    assert parent.wait(60) == 0
    assert out.count("usage: flwr-clientapp") == 1, out


def test_a_forked_child_draws_fresh_numbers_not_its_parents() -> None:
    import torch

    np.random.seed(0)
    torch.manual_seed(0)
    parent_draws = (np.random.random(), float(torch.rand(1)))
    np.random.seed(0)
    torch.manual_seed(0)
    warm_clientapp._reseed()
    assert (np.random.random(), float(torch.rand(1))) != parent_draws
