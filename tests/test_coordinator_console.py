"""Issue 39 §3: what a coordinator's console says, once each; evaluation with one gateway; the profiler's noise.

A coordinator started with no device connected says at once that it waits for devices (the
ServerApp says it only after building the run: 50 s on a loaded machine); its console has no
warning with an empty reason, no line twice and no Flower warning about the app description
fedge writes itself. Evaluation rounds run with the nodes connected (one gateway included);
the refusal for one gateway names gateways and ``min-train-replies``; a sub-model run's memory
measurement prints no torch profiler lines.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge.config import resolve_run_config
from fedge.errors import ConfigError, FedgeError
from fedge.server.coordinator import Coordinator, FleetStatus, FleetWatch, RunOutput
from fedge.server.fleet_link import why_no_answer
from fedge.server.run_restarts import run_with_restarts, was_lost
from fedge.simulation.grid import InlineGrid
from fedge.simulation.loopback import LoopbackFederation

ROOT = Path(__file__).resolve().parents[1]
FAST = "model='mlp' export-onnx=false runtime='torch' round-timeout=900.0"


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[LoopbackFederation]:
    fed = LoopbackFederation(tmp_path, num_devices=2)
    yield fed
    fed.close()


def _syncing(federation: LoopbackFederation) -> bool:
    """Whether the coordinator's device look (a helper process of its own) is running now."""
    assert federation.coordinator is not None
    for child in psutil.Process(federation.coordinator.pid).children():
        try:
            if "init_http_client_from_connection" in " ".join(child.cmdline()):
                return True
        except psutil.Error:
            continue
    return False


@pytest.mark.slow
@pytest.mark.deployment
def test_a_coordinator_with_no_device_says_it_waits_at_once_and_each_line_once(
        federation: LoopbackFederation) -> None:
    # Prepare: a coordinator for 2 devices, none of them started
    federation.start_coordinator("--rounds", "1", "--clients-per-round", "2", "--run-config", FAST)
    # Execute: wait for the waiting line (that it comes before the ServerApp's own is asserted below), then for
    # the ServerApp's own, then stop the coordinator while its device look runs
    federation.wait_for(lambda: "waiting for devices: 0 connected of 2" in federation.log("coordinator"), 900,
                        "a 'waiting for devices' line")
    federation.wait_for(lambda: "round 1: waiting for devices" in federation.log("coordinator"), 900,
                        "the ServerApp's round")
    federation.wait_for(lambda: _syncing(federation), 900, "a device look in flight")
    assert federation.coordinator is not None
    code = federation.stop(federation.coordinator)
    # Assert: the coordinator said it before the ServerApp process started; nothing twice, nothing empty
    lines = federation.log("coordinator").splitlines()
    first_wait = next(i for i, line in enumerate(lines) if "waiting for devices" in line)
    serverapp = next(i for i, line in enumerate(lines) if "Start `flwr-serverapp` process" in line)
    assert code == 0
    assert first_wait < serverapp, "\n".join(lines)
    assert lines[first_wait] == "waiting for devices: 0 connected of 2 needed; rounds start once they have connected"
    assert not [line for line in lines if "device list unavailable" in line], "\n".join(lines)
    assert sum("fraction_evaluate" in line for line in lines) <= 1, "\n".join(lines)
    assert sum("registered devices:" in line or "devices registered:" in line for line in lines) == 1
    assert not [line for line in lines if "Recommended property" in line], "\n".join(lines)


def test_the_coordinators_wait_line_stops_when_the_serverapp_says_it() -> None:
    # Prepare: a coordinator whose last look saw 1 of 2 devices online; a run output on a console
    from fedge.server.coordinator import DeviceWait

    coordinator = Coordinator(Path("unused"), None)
    coordinator.fleet = FleetStatus(nodes=[{"node_id": "7", "status": "online", "name": ""},
                                           {"node_id": "8", "status": "offline", "name": ""}])
    console = io.StringIO()
    output = RunOutput(console, io.StringIO())
    config = resolve_run_config({"clients-per-round": 2, "deployment": True})
    # Execute: the wait starts, then the ServerApp logs its own line
    waiting = DeviceWait(coordinator, config, output).start()
    output.feed("INFO :      round 1: waiting for devices: 1 connected of 2 needed (600 s left)\n")
    said_after = waiting.say()
    waiting.stop()
    # Assert: one line of the coordinator's at once, none after the ServerApp's
    assert console.getvalue().splitlines() == [
        "waiting for devices: 1 connected of 2 needed; rounds start once they have connected",
        "INFO :      round 1: waiting for devices: 1 connected of 2 needed (600 s left)"]
    assert not said_after
    gateways = DeviceWait(coordinator, resolve_run_config({"clients-per-round": 1, "gateways": True}),
                          RunOutput(io.StringIO(), io.StringIO()))
    assert not gateways.say()  # one gateway needed, one online: nothing to wait for


REFUSED = "httpx.ConnectError: [Errno 111] Connection refused"


@pytest.mark.parametrize(("returncode", "log", "reason"), [
    (-15, "", "its helper process was stopped by SIGTERM before it answered"),
    (1, f"Traceback (most recent call last):\n  File \"x\", line 1\n{REFUSED}\n", REFUSED),
    (0, "", "its helper process exited with status 0 and printed nothing"),
])
def test_a_helper_that_gave_no_answer_says_why(returncode: int, log: str, reason: str) -> None:
    # Execute / Assert: the reason is the helper's last error line, else how it ended; never empty
    assert why_no_answer(returncode, log.splitlines()) == reason


def test_a_failed_device_look_says_why_and_the_next_look_asks_the_same_helper(tmp_path: Path) -> None:
    # Prepare: a coordinator whose SuperLink was never started (no Control API connection configured)
    coordinator = Coordinator(tmp_path / "state", None)
    try:
        # Execute: two looks
        with pytest.raises(FedgeError) as first:
            coordinator.sync_devices()
        assert coordinator.fleet_link is not None
        helper = coordinator.fleet_link._process
        with pytest.raises(FedgeError) as second:
            coordinator.sync_devices()
        # Assert: each names the reason in one line; one helper answered both (started once), then stops
        for raised in (first, second):
            assert str(raised.value).startswith("listing the coordinator's devices failed: ")
            assert "SuperLink connection 'fedge' not found" in str(raised.value), raised.value
        assert helper is not None and coordinator.fleet_link._process is helper and helper.poll() is None
    finally:
        if coordinator.fleet_link is not None:
            coordinator.fleet_link.close()
    assert helper.poll() is not None


class _Stopping:
    """A coordinator whose device look fails because it is being stopped meanwhile (or not)."""

    def __init__(self, *, stops: bool) -> None:
        self.stopped, self.stops = False, stops
        self.superlink = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.fleet = None

    def sync_devices(self) -> None:
        self.stopped = self.stops
        raise FedgeError("listing the coordinator's devices failed: its helper process was stopped by SIGTERM")


@pytest.mark.parametrize("stops", [True, False])
def test_the_fleet_watch_warns_only_when_a_running_coordinators_look_fails(stops: bool,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    # Prepare
    coordinator = _Stopping(stops=stops)
    watch = FleetWatch(coordinator)  # type: ignore[arg-type]
    # Execute
    try:
        with caplog.at_level(logging.WARNING, logger="fedge.server.coordinator"):
            watch.poll()
            watch.poll()
    finally:
        coordinator.superlink.kill()
        coordinator.superlink.wait()
    # Assert: a coordinator stopping says nothing; a running one says it once, with the reason
    warnings = [record.getMessage() for record in caplog.records if "device list unavailable" in record.getMessage()]
    assert warnings == ([] if stops else ["device list unavailable: listing the coordinator's devices failed: its "
                                          "helper process was stopped by SIGTERM"])


def test_the_app_description_fedge_writes_has_no_flower_warnings(tmp_path: Path) -> None:
    # Prepare
    import tomllib

    from flwr.common.config import validate_fields_in_config

    coordinator = Coordinator(tmp_path / "state", None)
    (tmp_path / "state").mkdir()
    # Execute
    app_dir = coordinator._app_description()
    valid, errors, warnings = validate_fields_in_config(tomllib.loads((app_dir / "pyproject.toml").read_text()))
    # Assert
    assert valid and errors == [] and warnings == []


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_building_the_strategy_does_not_repeat_flowers_fraction_evaluate_warning() -> None:
    # Prepare: Flower's logger, as the coordinator's console shows it
    from fedge.server.app import build_strategy

    records, flower = _Records(), logging.getLogger("flwr")
    level = flower.level  # the tests' conftest keeps Flower's logger at ERROR
    flower.addHandler(records)
    flower.setLevel(logging.INFO)
    try:
        # Execute: the check at start and the ServerApp each build it (central evaluation: fraction-evaluate 0)
        for _ in range(2):
            build_strategy(resolve_run_config({"deployment": True, "clients-per-round": 2}))
    finally:
        flower.removeHandler(records)
        flower.setLevel(level)
    # Assert
    assert not [message for message in records.messages if "fraction_evaluate" in message]


def _evaluating_app() -> ClientApp:
    app = ClientApp()

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 5, "eval-loss": 0.5})}), reply_to=msg)

    return app


class _ClosableGrid(InlineGrid):
    """A grid whose node listing fails once the test is over (ends a wait that would never end)."""

    closed = False

    def get_node_ids(self) -> Iterable[int]:
        if self.closed:
            raise RuntimeError("the test is over")
        return super().get_node_ids()


def test_evaluation_rounds_run_with_the_one_gateway_connected() -> None:
    # Prepare: the coordinator's strategy for one gateway, every node asked to evaluate; one node connected
    from fedge.server.app import build_strategy

    config = resolve_run_config({"gateways": True, "fraction-evaluate": 1.0, "clients-per-round": 1,
                                 "min-train-replies": 1, "deployment": True})
    strategy = build_strategy(config)
    grid = _ClosableGrid(_evaluating_app(), [{"partition-id": 0, "num-partitions": 1}], {})
    connected = list(grid.get_node_ids())
    arrays = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    configured: list[list[Message]] = []

    def configure() -> None:
        configured.append(list(strategy.configure_evaluate(1, arrays, ConfigRecord(), grid)))

    worker = threading.Thread(target=configure, daemon=True)
    # Execute
    worker.start()
    worker.join(timeout=30)
    grid.closed = True
    # Assert: configured at once, for the one node (Flower's default waits for a second node forever)
    assert not worker.is_alive(), "configure_evaluate waited for more nodes than are connected"
    assert [message.metadata.dst_node_id for message in configured[0]] == connected


def test_one_gateway_with_two_train_replies_is_refused_naming_gateways_and_the_fix() -> None:
    # Prepare: one registered gateway, the default min-train-replies (2)
    from fedge.server.app import check_deployment

    config = resolve_run_config({"gateways": True, "clients-per-round": 1, "deployment": True, "model": "mlp"})
    # Execute
    with pytest.raises(ConfigError) as refused:
        check_deployment(config, registered=1)
    # Assert: gateways, not devices; the knob and its value for one gateway; operator.md's gateway section says it
    message = str(refused.value)
    assert "1 gateway(s) are registered" in message and "device(s)" not in message
    assert "min-train-replies=1" in message
    section = (ROOT / "docs" / "operator.md").read_text().split("## Gateways for phones and browsers")[1]
    assert "min-train-replies=1" in section and "min-train-replies` (default 2" in section


def test_measuring_a_sub_models_memory_prints_no_profiler_lines(tmp_path: Path) -> None:
    # Prepare: a fresh process (the profiler reads its settings when it first starts), fedge's own line around it
    script = tmp_path / "measure.py"
    script.write_text(
        "import logging\n"
        "from fedge.config import resolve_run_config\n"
        "from fedge.task.api import seeded_model\n"
        "from fedge.task.submodels import measured_training_bytes\n"
        "from fedge.task.loading import load_task\n"
        "logging.basicConfig(format='%(levelname)s %(name)s: %(message)s')\n"
        "task = load_task(resolve_run_config({'model': 'mlp'}))\n"
        "measured = measured_training_bytes(task, seeded_model(task, 0), 32)\n"
        "logging.getLogger('fedge.server').warning('measured %d bytes', measured)\n")
    env = {key: value for key, value in os.environ.items() if key != "KINETO_LOG_LEVEL"}
    # Execute
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                          check=False)
    # Assert: fedge's line is there, torch's profiler lines are not
    assert done.returncode == 0, done.stderr
    assert "WARNING fedge.server: measured" in done.stderr
    assert "profiler_start" not in done.stderr + done.stdout and "USDT" not in done.stderr + done.stdout, done.stderr


def test_the_coordinators_superexec_polls_once_a_second_and_a_devices_ten_times(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: no poll interval set by the operator
    from fedge.process import flower_env

    monkeypatch.delenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", raising=False)
    # Execute
    coordinator = Coordinator(tmp_path / "state", None).env()
    device = flower_env(tmp_path / "flwr-home")
    # Assert: the coordinator's SuperExec launches one ServerApp a run (a 1 s poll costs its start at most 1 s and
    # its SuperLink a tenth of a core less while idle); a device's launches a ClientApp for every message
    assert coordinator["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "1.0"
    assert device["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "0.1"


@pytest.mark.parametrize(("lines", "summary", "lost"), [
    (["Successfully started run 42\n", "round 1/3: 1/1 participants\n"], False, True),  # ended without a word
    (["Traceback (most recent call last):\n", "ConfigError: no device\n"], False, False),  # it said why it failed
    (["Exit Code: 201\n"], False, False),  # Flower said the ServerApp failed
    (["Successfully started run 42\n"], True, False),  # the run finished (its summary says how)
    (["Connection refused\n"], False, False),  # the run never started
])
def test_a_run_is_lost_only_when_its_server_app_ended_without_a_summary_or_a_reason(
        tmp_path: Path, lines: list[str], summary: bool, lost: bool) -> None:
    # Prepare: a run's streamed log, and its summary where it wrote one
    output = RunOutput(io.StringIO(), io.StringIO())
    if summary:
        (tmp_path / "summary.json").write_text("{}")
    # Execute
    for line in lines:
        output.feed(line)
    # Assert: only a run that ended silently is restarted; the SuperLink's id for it is kept
    assert was_lost(output, tmp_path) is lost
    assert output.run_id == ("42" if "Successfully started run 42\n" in lines else None)


def test_flowers_start_line_with_a_federation_still_names_the_run() -> None:
    output = RunOutput(io.StringIO(), io.StringIO())
    output.feed("Successfully started run 42 in federation fleet-a\n")
    assert output.run_id == "42"


class _LosingCoordinator:
    """The coordinator's part :func:`run_with_restarts` drives: every run ends silently; the SuperLink says
    ``statuses`` in turn; it counts runs and lost ServerApps stopped."""

    def __init__(self, state_dir: Path, statuses: list[str], superlink_alive: bool = True) -> None:
        self.state_dir, self.statuses, self.stopped = state_dir, statuses, False
        self.superlink = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) if superlink_alive \
            else None
        self.configs: list[dict[str, Any]] = []
        self.ended = 0

    def run(self, run_config: dict[str, Any]) -> RunOutput:
        self.configs.append(dict(run_config))
        output = RunOutput(io.StringIO(), io.StringIO())
        output.feed(f"Successfully started run {len(self.configs)}\n")
        return output

    def run_status(self, run_id: str | None) -> str:
        return self.statuses[int(run_id or 0) - 1]

    def end_lost_server_app(self) -> int:
        self.ended += 1
        return 1

    def close(self) -> None:
        if self.superlink is not None:
            self.superlink.kill()
            self.superlink.wait()


HEARTBEAT = "finished:failed (No heartbeat received from the task)"


@pytest.mark.parametrize(("statuses", "checkpoint", "runs", "resumed"), [
    ([HEARTBEAT, HEARTBEAT, HEARTBEAT, HEARTBEAT], True, 4, [False, True, True, True]),  # 3 restarts, then it stops
    ([HEARTBEAT, "finished:stopped"], True, 2, [False, True]),  # an operator's flwr stop: not restarted
    (["running"], True, 1, [False]),  # the run goes on without this flwr run: not a second one beside it
    ([""], True, 1, [False]),  # the SuperLink could not say: not restarted
    ([HEARTBEAT, HEARTBEAT, HEARTBEAT, HEARTBEAT], False, 4, [False, False, False, False]),  # no checkpoint: over
])
def test_only_a_run_the_superlink_ended_for_want_of_a_heartbeat_goes_on(
        tmp_path: Path, statuses: list[str], checkpoint: bool, runs: int, resumed: list[bool]) -> None:
    # Prepare: a coordinator whose runs all end without a summary
    if checkpoint:
        (tmp_path / "checkpoint.npz").write_bytes(b"")
    coordinator = _LosingCoordinator(tmp_path, statuses)
    try:
        # Execute
        run_with_restarts(coordinator, {"run-dir": str(tmp_path)}, restarts=3)  # type: ignore[arg-type]
    finally:
        coordinator.close()
    # Assert: how many runs, which resumed, one lost ServerApp stopped before each restart, each said in run.log
    assert len(coordinator.configs) == runs
    assert [bool(config.get("resume")) for config in coordinator.configs] == resumed
    assert coordinator.ended == runs - 1
    assert (tmp_path / "run.log").read_text().count("was lost, not failed") == runs - 1 if runs > 1 else \
        not (tmp_path / "run.log").exists()


def test_no_run_goes_on_when_the_superlink_itself_is_gone(tmp_path: Path) -> None:
    coordinator = _LosingCoordinator(tmp_path, [HEARTBEAT], superlink_alive=False)
    run_with_restarts(coordinator, {"run-dir": str(tmp_path)}, restarts=3)  # type: ignore[arg-type]
    assert len(coordinator.configs) == 1 and coordinator.ended == 0
