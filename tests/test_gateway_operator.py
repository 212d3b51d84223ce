"""What a gateway's operator sees in the first hour (issue 39): it waits for a coordinator started
after it, and says how many devices a waiting round has.

Real parts: a gateway's TLS device listener and control port in this process, fedge's ClientApp side
handing it the coordinator's instruction, reference protocol devices. The training graph's pull is a
stand-in answering "not published" (with a stand-in clock), so the test proves minutes of waiting in
milliseconds.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedge import wire
from fedge.cli.main import main
from fedge.clients.app import make_default_client_app
from fedge.clients.gateway.service import GatewayOptions, GatewaySettings, wait_for_training_graph
from fedge.clients.protocol_device import ProtocolDevice
from fedge.config import resolve_run_config
from fedge.edge.delivery import NotPublished
from fedge.errors import FedgeError
from fedge.server.app import build_strategy
from tests.live_gateway import LiveGateway

WAIT_S = 60.0  # a bound on waiting for an event, never a pause
FEDGE = str(Path(sys.executable).with_name("fedge"))


def _until(condition: Callable[[], bool]) -> None:
    """Until ``condition`` holds (an event), bounded so a broken gateway fails, not hangs."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "the awaited event never came"
        time.sleep(0.02)


class NotYetPublished:
    """A coordinator that publishes its training graph only after ``misses`` pulls, each taking 10 s of
    a stand-in clock."""

    def __init__(self, misses: int, graph: Path) -> None:
        self.misses, self.graph, self.pulls, self.now = misses, graph, 0, 0.0

    def clock(self) -> float:
        return self.now

    def fetch(self) -> Path:
        self.pulls += 1
        self.now += 10.0
        if self.pulls <= self.misses:
            raise NotPublished("no training bundle is published at 127.0.0.1:9096 yet")
        return self.graph


def _options(tmp_path: Path, max_wait_s: float | None = None) -> GatewayOptions:
    return GatewayOptions(coordinator="127.0.0.1:9095", devices=tmp_path, key=None, ca=None,
                          trust=tmp_path / "signing.pub", insecure=True, max_wait_s=max_wait_s)


def test_a_gateway_started_before_its_coordinator_waits_for_the_training_graph_saying_so_rarely(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: the graph comes after 30 pulls, 300 s of (stand-in) time: far past the old 60 s limit
    coordinator = NotYetPublished(misses=30, graph=tmp_path / "training.zip")
    # Execute
    graph = wait_for_training_graph(_options(tmp_path), tmp_path, fetch=coordinator.fetch, clock=coordinator.clock,
                                    say_every_s=120.0, retry_s=(0.0, 0.0))
    # Assert: it waited for the graph, not gave up; one line at the start, then one every 120 s
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("waiting for")]
    assert graph == coordinator.graph and coordinator.pulls == 31
    assert len(lines) == 3
    assert lines[0].startswith("waiting for the coordinator's training graph at 127.0.0.1:9096 (start the "
                               "coordinator first, or it is still exporting)")


class BundleService:
    """A coordinator's bundle service on 127.0.0.1 that answers 404 (nothing published) until :meth:`publish`."""

    def __init__(self, bundle: Path) -> None:
        self.bundle, self.published, self.asked = bundle, threading.Event(), 0
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                service.asked += 1
                if service.published.is_set() and self.path.endswith("/training"):
                    body, status, kind = service.bundle.read_bytes(), 200, "application/zip"
                else:
                    body, status, kind = b'{"error": "no training bundle is published yet"}', 404, "application/json"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def publish(self) -> None:
        self.published.set()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_fedge_gateway_started_before_its_coordinator_publishes_waits_then_takes_the_graph(
        tmp_path: Path, run: dict[str, Any]) -> None:
    # Prepare: a coordinator port that accepts connections, a bundle service with nothing published yet
    coordinator, bundles = socket.socket(), BundleService(run["bundle"])
    coordinator.bind(("127.0.0.1", 0))
    coordinator.listen(16)
    (tmp_path / "allow").mkdir()
    output: list[str] = []
    gateway = subprocess.Popen(
        [FEDGE, "gateway", "start", "--coordinator", f"127.0.0.1:{coordinator.getsockname()[1]}",
         "--bundles", f"127.0.0.1:{bundles.port}", "--insecure", "--devices", str(tmp_path / "allow"),
         "--trust", str(run["trust"]), "--port", "0", "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert gateway.stdout is not None
    reader = threading.Thread(target=lambda: output.extend(iter(gateway.stdout.readline, "")),  # type: ignore[union-attr]
                              daemon=True)
    reader.start()
    try:
        # Execute: the gateway finds nothing published; then the coordinator publishes its graph
        _until(lambda: any("waiting for the coordinator's training graph" in line for line in output)
               or gateway.poll() is not None)
        asked = bundles.asked
        _until(lambda: bundles.asked >= asked + 2 or gateway.poll() is not None)  # it keeps asking
        bundles.publish()
        _until(lambda: any("training graph for this gateway's devices" in line for line in output)
               or gateway.poll() is not None)
    finally:
        gateway.terminate()
        gateway.wait(timeout=WAIT_S)
        reader.join(timeout=WAIT_S)
        bundles.close()
        coordinator.close()
    # Assert: one line saying what it waits for and how to fix it, no give-up, then the graph
    waiting = [line for line in output if line.startswith("waiting for the coordinator's training graph")]
    assert len(waiting) == 1, output
    assert waiting[0].startswith(f"waiting for the coordinator's training graph at 127.0.0.1:{bundles.port} (start "
                                 "the coordinator first, or it is still exporting); waited 0 s so far: ")
    assert any("training graph for this gateway's devices: task digits" in line for line in output), output


def test_a_gateway_with_max_wait_gives_up_naming_the_fix(tmp_path: Path) -> None:
    coordinator = NotYetPublished(misses=30, graph=tmp_path / "training.zip")
    with pytest.raises(FedgeError, match="within --max-wait 100 s .*start the coordinator"):
        wait_for_training_graph(_options(tmp_path, max_wait_s=100.0), tmp_path, fetch=coordinator.fetch,
                                clock=coordinator.clock, retry_s=(0.0, 0.0))


def _waiting_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "waiting for devices" in r.getMessage()]


def test_a_round_without_devices_says_so_when_it_opens_and_while_it_waits(
        tmp_path: Path, run: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: a gateway none of whose devices has checked in, saying where a round stands every 0.25 s
    caplog.set_level(logging.INFO, logger="fedge.gateway")
    with LiveGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=2, round_deadline_s=1.0,
                                                    idle_poll_s=0.2)) as live:
        live.gateway.progress_every_s = 0.25
        # Execute: the coordinator's round reaches it; it times out with nobody there
        with pytest.raises(FedgeError, match="none of this gateway's devices answered"):
            live.round()
    # Assert: a line when the round opened, and a few more (not one per poll) while it waited
    lines = _waiting_lines(caplog)
    assert lines[0].startswith("round 1: waiting for devices: 0 checked in (0 polled in the last 1 s) of 2 wanted, "
                               "0 took the task, 0 answered, deadline in 1 s; devices check in at")
    assert 2 <= len(lines) <= 6


def test_a_waiting_round_counts_the_devices_that_took_its_task(
        tmp_path: Path, run: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: one device checked in, a round that wants two
    caplog.set_level(logging.INFO, logger="fedge.gateway")
    with LiveGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=2, round_deadline_s=30.0,
                                                    idle_poll_s=0.2)) as live:
        live.gateway.progress_every_s = 0.1
        device = live.device("phone0")
        device.check_in()
        box: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: box.update(result=live.round()), daemon=True)
        thread.start()
        _until(lambda: live.gateway.round is not None)
        # Execute: the device takes the task and answers; the round goes on waiting for a second
        device.poll()
        _until(lambda: any("1 took the task, 1 answered" in line for line in _waiting_lines(caplog)))
        live.device("phone1", 1).poll()  # the second result completes the round
        thread.join(WAIT_S)
    # Assert
    assert any(line.startswith("round 1: waiting for devices: 1 checked in (1 polled in the last 1 s) of 2 wanted")
               for line in _waiting_lines(caplog))
    assert box["result"][0]["devices"] == 2


class OneNodeGrid:
    """A grid with one node connected (one gateway)."""

    def get_node_ids(self) -> list[int]:
        return [1]


def test_under_gateways_a_round_short_of_min_train_replies_says_gateways_and_how_to_run_one(
        caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: gateways = true, min-train-replies 2, one gateway connected
    config = resolve_run_config({"gateways": True, "clients-per-round": 2, "min-train-replies": 2,
                                 "round-timeout": 0.1})
    strategy = build_strategy(config)
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedge"):
        selected = strategy.rounds.select_nodes(1, OneNodeGrid())  # type: ignore[arg-type]
    # Assert: the line counts gateways, and names min-train-replies=1 for one gateway
    assert selected == []
    assert "round 1: only 1 gateways connected (< min-train-replies 2); round skipped (each gateway is one reply " \
           "a round" in caplog.text
    assert "'min-train-replies=1' for one gateway" in caplog.text


class Polling:
    """Devices polling their gateway on threads until stopped (what phones do between rounds)."""

    def __init__(self, devices: list[ProtocolDevice]) -> None:
        self.stop, self.devices = threading.Event(), devices
        self.threads = [threading.Thread(target=device.run, kwargs={"stop": self.stop, "max_wait_s": 0.05},
                                         daemon=True) for device in devices]
        for device in devices:
            device.check_in()
        for thread in self.threads:
            thread.start()

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def test_a_secure_pools_clipping_counts_reach_the_coordinators_round_report_and_console(
        tmp_path: Path, run: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: a gateway whose secure rounds take its four phones; a run whose secagg-clip (0.001) clips most
    # entries of every update, and whose max-device-examples (100) caps each phone's weight (~450 examples)
    caplog.set_level(logging.WARNING, logger="fedge")
    secure_run = {**run["config"], "gateways": True, "secure-aggregation": True, "secagg-clip": 0.001,
                  "max-device-examples": 100, "clients-per-round": 1, "min-train-replies": 1, "num-rounds": 1}
    instruction = Message(RecordDict({wire.ARRAYS: ArrayRecord({name: Array(value) for name, value in
                                                                run["weights"].items()}),
                                      wire.CONFIG: ConfigRecord({wire.SERVER_ROUND: 1,
                                                                 wire.TRAINING_GRAPH: run["architecture"],
                                                                 "local-epochs": 1, "batch-size": 32,
                                                                 "learning-rate": 0.05, "momentum": 0.9})}),
                          dst_node_id=9, message_type="train")
    with LiveGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=4, round_deadline_s=600,
                                                    idle_poll_s=1200)) as live:
        (live.root / "token").write_text(live.token)
        node = Context(run_id=1, node_id=9, state=RecordDict(), run_config=secure_run,
                       node_config={"profile": "gpu-box", "gateway-control": f"127.0.0.1:{live.control.port}",
                                    "gateway-token": str(live.root / "token")})
        polling = Polling([live.device(f"phone{index}", index, secure=True) for index in range(4)])
        # Execute: the round through fedge's ClientApp on the gateway's node, then the coordinator's strategy
        try:
            reply = make_default_client_app()(instruction, node)
        finally:
            polling.close()
    coordinator = build_strategy(resolve_run_config(secure_run))
    coordinator.current_arrays = instruction.content.array_records[wire.ARRAYS]
    reply.metadata.__dict__["_src_node_id"] = 9
    coordinator.aggregate_train(1, [reply])
    # Assert: the pool's counts are the round report's (metrics.jsonl's secagg_* columns), and the console says so
    report = coordinator.reports[-1]
    assert report.accepted == 1
    assert report.secagg_clipped_devices == 4 and report.secagg_capped_weights == 4
    assert report.secagg_clipped_entries > 4
    assert (f"round 1: the gateways' secure pools clipped {report.secagg_clipped_entries} update entries on 4 "
            "device(s)") in caplog.text and "capped 4 device weight(s) at max-device-examples" in caplog.text


def test_a_secure_round_waiting_for_its_pool_says_how_many_devices_can_join_it(
        tmp_path: Path, run: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: a gateway with one device checked in; a secure round needs at least three
    caplog.set_level(logging.INFO, logger="fedge.gateway")
    secure = {"threshold": 0.5, "neighbours": 0, "clip": 1000.0, "precision": 1e-4, "bits": 32, "weight-clip": 1000}
    with LiveGateway(tmp_path, run, GatewaySettings(name="gw-test", round_deadline_s=0.6, idle_poll_s=10)) as live:
        live.gateway.progress_every_s = 0.2
        live.device("phone0", secure=True).check_in()
        # Execute
        with pytest.raises(FedgeError, match="at least 3 devices"):
            live.round(secure=secure)
    # Assert
    lines = _waiting_lines(caplog)
    assert lines[0].startswith("round 1: waiting for devices: 1 checked in (1 polled in the last 30 s, able to run "
                               "secure aggregation) of 3 wanted, deadline in 1 s")
    assert 2 <= len(lines) <= 5


@pytest.mark.parametrize(("extra", "message"), [
    (["--device-rule", "mode"], "argument --device-rule: invalid choice: 'mode' (choose from mean, median, "
                                "trimmed-mean)"),  # some Pythons quote the choices: unquoted below
    (["--device-rule", "trimmed-mean", "--device-trim-fraction", "0.5"],
     "gateway device trim fraction 0.5: give a fraction in [0, 0.5)"),
])
def test_a_gateway_refuses_an_unknown_device_rule_or_trim_fraction_at_start_naming_the_choices(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    # Prepare: a start line that would otherwise go on to contact the coordinator
    argv = ["gateway", "start", "--coordinator", "127.0.0.1:1", "--devices", str(tmp_path / "allow"),
            "--trust", str(tmp_path / "signing.pub"), *extra]
    # Execute
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own refusal
        code = int(exit_.code or 0)
    # Assert: exit 2, the message names the choices from the registry, nothing was made
    assert code == 2 and message in capsys.readouterr().err.replace("'mean'", "mean").replace(
        "'median'", "median").replace("'trimmed-mean'", "trimmed-mean")
    assert not (tmp_path / "allow").exists()
