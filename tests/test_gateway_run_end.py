"""A gateway tells its devices when the coordinator's run is over (issue 39, §4), and a device says
what each round came to.

Real parts: a gateway's TLS device listener and control port in this process, fedge's ClientApp
handing it the coordinator's instruction (as its SuperNode would), reference protocol devices
(threads, and `fedge protocol-device` as a process), the run's signed training graph. The
coordinator's closing is a probe answering "closed": Flower tells a SuperNode nothing when a run
ends, and the deployment test (tests/test_gateway_deployment.py) runs the real one.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedge import wire
from fedge.clients.app import make_default_client_app
from fedge.clients.gateway.pool import GatewayRound
from fedge.clients.gateway.protocol import PREFIX
from fedge.clients.gateway.service import (
    Gateway,
    GatewayOptions,
    GatewaySettings,
    relay_inference_bundles,
    tell_devices,
    watch_run_end,
)
from fedge.config import resolve_run_config
from fedge.simulation.loopback import free_port
from fedge.task.api import seeded_model
from fedge.task.loading import load_task
from fedge.task.models import model_arrays
from tests.live_gateway import CONFIG, LiveGateway

FEDGE = str(Path(sys.executable).with_name("fedge"))
WAIT_S = 120.0  # a bound on waiting for an event, never a pause


@pytest.fixture
def one(tmp_path: Path, run: dict[str, Any]) -> Iterator[LiveGateway]:
    """A live gateway whose rounds take one device's result."""
    with LiveGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=1, round_deadline_s=300,
                                                   idle_poll_s=0.2)) as gateway:
        yield gateway


def _background(target: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(result=target()), daemon=True)
    thread.start()
    return thread, box


def _until(condition: Callable[[], bool]) -> None:
    """Until ``condition`` holds (an event), bounded by :data:`WAIT_S` so a broken gateway fails, not hangs."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "the awaited event never came"
        time.sleep(0.02)


class Looping(threading.Event):
    """A stop event that counts the waits of the loop it paces (how many times a watcher looked)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return super().wait(timeout)


def _instruction(run: dict[str, Any], server_round: int) -> Message:
    config = run["config"]
    arrays = model_arrays(seeded_model(load_task(resolve_run_config(config)), int(config["seed"])))
    return Message(RecordDict({wire.ARRAYS: arrays, wire.CONFIG: ConfigRecord({
        wire.SERVER_ROUND: server_round, wire.TRAINING_GRAPH: run["architecture"],
        **{k: CONFIG[k] for k in ("local-epochs", "batch-size", "learning-rate", "momentum")}})}),
        dst_node_id=9, message_type="train")


def _gateway_node(live: LiveGateway, run: dict[str, Any], rounds: int) -> Context:
    """The context fedge's ClientApp runs in on a gateway's SuperNode, for a run of ``rounds`` rounds."""
    (live.root / "token").write_text(live.token)
    return Context(run_id=1, node_id=9, state=RecordDict(), run_config={**run["config"], "num-rounds": rounds},
                   node_config={"profile": "gpu-box", "gateway-control": f"127.0.0.1:{live.control.port}",
                                "gateway-token": str(live.root / "token")})


def test_after_the_runs_last_round_a_closed_coordinator_ends_the_run_and_the_device_stops_with_one_line(
        one: LiveGateway, run: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: a device polling the gateway; a probe of the coordinator's port, open until the test closes it
    caplog.set_level(logging.INFO, logger="fedge")
    device = one.device("phone0", 0)
    polling, trained = _background(lambda: device.run(max_wait_s=0.5))
    probes: list[str] = []
    coordinator_open, stop = threading.Event(), Looping()
    coordinator_open.set()

    def reachable(address: str) -> bool:
        probes.append(address)
        return coordinator_open.is_set()

    watcher = threading.Thread(target=watch_run_end, args=(one.gateway, "127.0.0.1:9", stop, reachable, 0.05),
                               daemon=True)
    watcher.start()
    app, context = make_default_client_app(), _gateway_node(one, run, rounds=2)
    try:
        # Execute: round 1 of 2 through fedge's ClientApp, as the gateway's SuperNode runs it; the coordinator
        # closes for a while (as a restart would)
        first = app(_instruction(run, 1), context)
        coordinator_open.clear()
        looked = stop.waits
        _until(lambda: stop.waits >= looked + 3)  # the watcher looked three times since
        over_after_first, probed_after_first = one.gateway.over, list(probes)
        coordinator_open.set()
        # ... then the run's last round, after which the coordinator closes
        last = app(_instruction(run, 2), context)
        coordinator_open.clear()
        _until(lambda: not polling.is_alive())
    finally:
        stop.set()
        device.close()
    # Assert: a closed coordinator before the last round is not the run's end (it may be restarting); after it,
    # the gateway declares the run over and the device, told so at its next poll, stops on its own
    assert over_after_first is None and probed_after_first == []
    assert probes and set(probes) == {"127.0.0.1:9"}
    assert not first.has_error() and not last.has_error()
    assert one.gateway.over is not None and "round 2 of 2 was its last" in one.gateway.over
    assert trained["result"] == 2 and device.run_over == one.gateway.over
    lines = [r.getMessage() for r in caplog.records if r.name == "fedge.protocol_device"]
    assert [line for line in lines if "the run is over" in line] == \
        [f"device phone0: the run is over: {one.gateway.over}; 2 rounds trained, stopping"], lines
    per_round = [line for line in lines if line.startswith("device phone0: round ")]
    assert len(per_round) == 2 and all(line.startswith(f"device phone0: round {n}: trained on ")
                                       and ", loss " in line and line.endswith(", sent")
                                       for n, line in zip((1, 2), per_round, strict=True)), per_round
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("fedge")]
    assert one.gateway.heard() == (1, 1) and one.gateway.all_heard.is_set()


def test_a_result_that_missed_its_closed_round_is_a_normal_outcome_not_an_error(
        one: LiveGateway, run: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: a round open at the gateway that closes right after handing phone0 its task (as a deadline would)
    caplog.set_level(logging.INFO, logger="fedge")
    current = GatewayRound(kind="train", server_round=4, config=CONFIG, graph=run["architecture"],
                           weights=run["weights"], target=1, max_num_examples=100_000)
    one.gateway.round, one.gateway.model_elements = current, sum(int(np.size(v)) for v in run["weights"].values())
    handed = one.gateway.task_for

    def close_after_handing(session: Any) -> bytes | None:
        frame = handed(session)
        current.close()
        return frame

    one.gateway.task_for = close_after_handing  # type: ignore[method-assign]
    device = one.device("phone0", 0)
    # Execute
    outcome = device.poll()
    # Assert: "late", one INFO line saying the round had closed, no warning; the device polls on
    assert outcome.kind == "late" and outcome.server_round == 4 and outcome.loss is not None
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "fedge.protocol_device"]
    assert len(lines) == 1 and lines[0][0] == logging.INFO, lines
    assert lines[0][1].startswith("device phone0: round 4: trained on ") and "the round closed before it arrived" \
        in lines[0][1], lines
    assert device.poll().kind == "wait"


def test_fedge_protocol_device_prints_each_round_and_exits_0_when_told_the_run_is_over(
        one: LiveGateway, run: dict[str, Any]) -> None:
    # Prepare: `fedge protocol-device` as a process (no --rounds: it runs until stopped or told)
    inputs, targets = run["shards"][0]
    np.savez(one.root / "phone0.npz", x=inputs[0], y=targets)
    log = one.root / "phone0.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [FEDGE, "protocol-device", "--gateway", one.url, "--name", "phone0", "--key", str(one.allow / "phone0.key"),
             "--data", str(one.root / "phone0.npz"), "--trust", str(run["trust"]), "--ca", str(run["keys"].ca_cert),
             "--state-dir", str(one.root / "phone0")], stdout=out, stderr=subprocess.STDOUT)
    try:
        # Execute: one round, which the process trains; then the run ends
        header, _ = one.round()
        one.gateway.finish("round 1 of 1 was its last and the coordinator has closed")
        code = process.wait(WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log.read_text()
    # Assert: one line for the round, one for the run's end, then the CLI's own; exit status 0
    assert code == 0 and header["devices"] == 1, output
    assert output.count("device phone0: round 1: trained on ") == 1 and "sent" in output, output
    assert output.count("the run is over: round 1 of 1 was its last and the coordinator has closed") == 1, output
    assert "stopped after 1 trained rounds" in output and "WARNING" not in output, output


def test_once_the_run_is_over_results_get_409_and_the_gateway_waits_until_its_devices_heard_it(
        live: LiveGateway) -> None:
    # Prepare: three devices seen lately
    devices = [live.device(f"phone{i}", i) for i in range(3)]
    for device in devices:
        assert device.poll().kind == "wait"
    live.gateway.finish("test: the run is over")
    # Execute: the gateway stops once all three heard it (each polls once, in a thread of its own)
    stopping, _ = _background(lambda: tell_devices(live.gateway, grace_s=WAIT_S))
    late_result = devices[0]._authenticated("POST", f"{PREFIX}/result", b"FDG1")
    outcomes = [device.poll() for device in devices]
    stopping.join(WAIT_S)
    # Assert: 409 naming the run's end; "done" for each; the gateway's wait ended because all heard it
    assert late_result[0] == 409 and b"the run is over (test: the run is over)" in late_result[2]
    assert [o.kind for o in outcomes] == ["done"] * 3 and {o.note for o in outcomes} == {"test: the run is over"}
    assert not stopping.is_alive() and live.gateway.heard() == (3, 3)


def test_a_round_after_the_run_was_declared_over_serves_rounds_again(live: LiveGateway) -> None:
    live.gateway.finish("test: the coordinator closed")
    live.gateway.note_round({"kind": "train", "server-round": 1, "num-rounds": 5})
    assert live.gateway.over is None and not live.gateway.run_over.is_set() and not live.gateway.final_round_seen
    assert live.device("phone0").poll().kind == "wait"


def test_the_inference_relay_is_quiet_after_the_last_round_and_stops_pulling_once_the_run_is_over(
        tmp_path: Path, run: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: a gateway that was handed the run's last round; the coordinator's bundle service is gone
    caplog.set_level(logging.DEBUG, logger="fedge")
    (tmp_path / "allow").mkdir()
    gateway = Gateway(GatewaySettings(name="gw-test"), tmp_path / "allow", None)
    gateway.note_round({"kind": "train", "server-round": 3, "num-rounds": 3})
    options = GatewayOptions(coordinator=f"127.0.0.1:{free_port()}", devices=tmp_path / "allow", key=None, ca=None,
                             trust=run["trust"], insecure=True, bundles=f"127.0.0.1:{free_port()}")
    stop = threading.Event()
    relay = threading.Thread(target=relay_inference_bundles, args=(options, tmp_path / "node", stop, gateway),
                             daemon=True)
    relay.start()
    try:
        _until(lambda: any("not pulled after the run's last round" in r.getMessage() for r in caplog.records))
        # Execute: the run is declared over
        gateway.finish("test: over")
        _until(lambda: any("pulls no further inference bundles" in r.getMessage() for r in caplog.records))
    finally:
        stop.set()
        relay.join(WAIT_S)
    # Assert: no warning about the bundle service at any point
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert not relay.is_alive()
