"""A coordinator with two gateways on 127.0.0.1 trains with protocol devices (issue 27, end to end).

Real parts: `fedge coordinator start` (SuperLink, TLS, node auth, the signed training graph),
two `fedge gateway start` processes (each a SuperNode node plus an HTTPS device listener),
six reference protocol devices (no Flower, no torch in what they run: their modules are
checked in tests/test_gateway.py) on the digits task, and the inline simulation of the same
six devices for the flat baseline. Under distributed DP, two of the six are headless-Chromium
tabs on a gateway's demo page (the web SDK), in the same secure pool as a Python device.

The devices run until their gateway tells them the run is over (``done``, once the coordinator
closed after the run's last round): a test ends because they were told, whatever the machine's
load, never because a wait ran out.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from chromium import start_chromium, trust_certificate_flag

from fedge.cli.main import main
from fedge.clients.gateway.service import add_protocol_device
from fedge.clients.gateway.web import demo_examples
from fedge.clients.protocol_device import ProtocolDevice
from fedge.config import resolve_run_config
from fedge.server.report import read_jsonl
from fedge.simulation.loopback import LoopbackFederation, free_port
from fedge.simulation.runner import simulate
from fedge.task.loading import load_task
from fedge.web import ORT_FILES
from tests.test_web_device import ORT_DIST

pytestmark = pytest.mark.slow
DEVICES, ROUNDS = 6, 3
RUN = "model='mlp' local-epochs=2 export-onnx=false runtime='onnx' round-timeout=900.0 gateways=true"


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[LoopbackFederation]:
    fed = LoopbackFederation(tmp_path, num_devices=2)  # dev0 / dev1: the gateways' node keys
    yield fed
    fed.close()


def _start_gateway(federation: LoopbackFederation, index: int, port: int, deadline_s: float = 900.0,
                   extra: tuple[str, ...] = (), per_round: int = DEVICES // 2) -> None:
    keys, cert = federation.keys, federation.keys.directory / "gateways" / f"gw{index}"
    if not cert.with_suffix(".crt").exists():  # its TLS certificate for devices, as an operator makes it
        assert main(["keys", "add-gateway", f"gw{index}", "--dir", str(keys.directory)]) == 0
    federation.devices[100 + index] = federation.spawn(
        ["gateway", "start", "--coordinator", f"127.0.0.1:{federation.port}", "--name", f"gw{index}",
         "--devices", str(federation.root / "allow"), "--key", str(keys.devices / f"dev{index}.key"),
         "--ca", str(keys.ca_cert), "--trust", str(federation.bundle_signing_key),
         "--cert", str(cert.with_suffix(".crt")), "--cert-key", str(cert.with_suffix(".key")), "--port", str(port),
         "--state-dir", str(federation.root / f"gw{index}"),
         "--devices-per-round", str(per_round), "--poll-interval", "0.5", "--round-deadline", str(deadline_s),
         *extra], f"gateway{index}.log")


def _kill_gateway(federation: LoopbackFederation, index: int) -> None:
    """Kill gateway ``index`` outright: its process group and the Flower helpers under its state directory."""
    gateway = federation.devices[100 + index]
    os.killpg(gateway.pid, signal.SIGKILL)
    gateway.wait()
    federation._kill_marked(str(federation.root / f"gw{index}"))


# `fedge protocol-device` in a process where importing Flower or torch fails, as on a device without them
WITHOUT_FLOWER_OR_TORCH = (
    "import sys\n"
    "class Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('flwr', 'torch'):\n"
    "            raise ImportError('this device has no ' + name)\n"
    "sys.meta_path.insert(0, Block())\n"
    "from fedge.cli.main import main\n"
    "sys.exit(main(sys.argv[1:]))\n")


class ProtocolFleet:
    """Six protocol devices (or those of ``indices``), device ``i`` on gateway ``i % 2``: threads of this process,
    and the last ``processes`` of them as `fedge protocol-device` processes that cannot import Flower or torch.
    Each runs until its gateway says the run is over."""

    def __init__(self, federation: LoopbackFederation, ports: list[int], *, processes: int = 0,
                 secure: bool = False, indices: tuple[int, ...] = tuple(range(DEVICES)),
                 failover: bool = False) -> None:
        config = resolve_run_config({"partitioner": "iid"})
        task = load_task(config)
        shards = [task.partition(index, DEVICES, config) for index in range(DEVICES)]
        self.federation, self.stop, self.trained = federation, threading.Event(), [0] * DEVICES
        # device i's gateway, then (failover) the other one: it checks in there when its own cannot be reached
        urls = {index: [f"https://127.0.0.1:{port}" for port in (ports[index % 2], ports[1 - index % 2])]
                [:2 if failover else 1] for index in indices}
        self.devices = {index: ProtocolDevice(gateway=urls[index], name=f"phone{index}",
                                              key=federation.root / "allow" / f"phone{index}.key",
                                              data=(tuple(shards[index].inputs), shards[index].targets),
                                              trust=federation.bundle_signing_key, ca=federation.keys.ca_cert,
                                              state_dir=federation.root / f"phone{index}", secure=secure)
                        for index in indices}
        in_threads = indices[:len(indices) - processes]
        self.threads = {index: threading.Thread(target=self._run, args=(index,), daemon=True) for index in in_threads}
        for thread in self.threads.values():
            thread.start()
        self.processes = {}
        for index in indices[len(indices) - processes:]:
            np.savez(federation.root / f"phone{index}.npz", x=shards[index].inputs[0], y=shards[index].targets)
            argv = ["protocol-device", *(arg for url in urls[index] for arg in ("--gateway", url)), "--name",
                    f"phone{index}", "--key", str(federation.root / "allow" / f"phone{index}.key"), "--data",
                    str(federation.root / f"phone{index}.npz"), "--trust", str(federation.bundle_signing_key),
                    "--ca", str(federation.keys.ca_cert), "--state-dir", str(federation.root / f"phone{index}"),
                    *(["--secure-aggregation"] if secure else [])]
            with (federation.root / f"phone{index}.log").open("wb") as out:
                self.processes[index] = subprocess.Popen([sys.executable, "-c", WITHOUT_FLOWER_OR_TORCH, *argv],
                                                         stdout=out, stderr=subprocess.STDOUT)
        self.codes: dict[int, int | None] = {}

    def _run(self, index: int) -> None:
        self.trained[index] = self.devices[index].run(stop=self.stop, max_wait_s=1.0)

    def told(self) -> bool:
        """Whether every device has stopped on its own (its gateway said the run is over)."""
        return not any(thread.is_alive() for thread in self.threads.values()) and \
            all(process.poll() is not None for process in self.processes.values())

    def close(self) -> None:
        """Stop whatever still runs (a device that was not told: the test then fails on it) and collect counts."""
        self.stop.set()
        for thread in self.threads.values():
            thread.join(60)
        for index, process in self.processes.items():
            if process.poll() is None:
                process.kill()
            self.codes[index] = process.wait()
            log = self.federation.log(f"phone{index}")
            if self.codes[index] == 0 and "stopped after " in log:
                self.trained[index] = int(log.rsplit("stopped after ", 1)[1].split()[0])

    def check_told(self, rounds: int, gateways: tuple[int, ...] = (0, 1)) -> None:
        """Every device stopped because its gateway told it the run was over after round ``rounds``, with one
        line; the processes exit 0 having logged one line per round they trained; each gateway said so."""
        over = f"round {rounds} of {rounds} was its last and the coordinator has closed"
        for index in self.threads:
            assert self.devices[index].run_over == over, (self.devices[index].name, self.devices[index].run_over)
        for index in self.processes:
            log = self.federation.log(f"phone{index}")
            assert self.codes[index] == 0 and log.count("the run is over: ") == 1 and over in log, log
            # a result lost on the way (a loaded machine) is sent again when the task comes again: one line either way
            sent = re.findall(rf"device phone{index}: round \d+: (?:trained on \d+ examples, loss [0-9.]+|its result, "
                              r"trained before, sent again), sent", log)
            assert len(sent) >= self.trained[index] > 0, log
        for index in gateways:
            assert f"the run is over ({over})" in self.federation.log(f"gateway{index}")


def _summary_then_devices_told(federation: LoopbackFederation, fleet: ProtocolFleet) -> None:
    """Wait for the run's summary, then for every device to stop on its own: events, with bounds that only
    catch a broken run (a device never told would otherwise hang the test)."""
    federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 900, "the summary")
    federation.wait_for(fleet.told, 900, "the devices to hear from their gateways that the run is over")


def _start(federation: LoopbackFederation, rounds: int, run_config: str = RUN,
           gateway_deadline_s: float = 900.0, extra: dict[int, tuple[str, ...]] | None = None,
           per_round: int = DEVICES // 2) -> list[int]:
    """Allow-list, coordinator (2 nodes a round: the gateways) and both gateways; their device ports."""
    for index in range(DEVICES):
        add_protocol_device(federation.root / "allow", f"phone{index}")
    federation.start_coordinator("--rounds", str(rounds), "--clients-per-round", "2", "--run-config", run_config)
    federation.wait_for(federation.bundle_signing_key.exists, 900, "the bundle signing key")
    ports = [free_port(), free_port()]
    for index, port in enumerate(ports):
        _start_gateway(federation, index, port, gateway_deadline_s, (extra or {}).get(index, ()), per_round)
    return ports


@pytest.mark.deployment
def test_two_gateways_train_protocol_devices_to_the_accuracy_of_a_flat_federation(
        federation: LoopbackFederation) -> None:
    # Prepare: six devices' keys; the coordinator and two gateways
    ports = _start(federation, ROUNDS)
    # Execute: six protocol devices, three per gateway (one a `fedge protocol-device` without Flower or torch)
    fleet = ProtocolFleet(federation, ports, processes=1)
    try:
        _summary_then_devices_told(federation, fleet)
    finally:
        fleet.close()
    fleet.check_told(ROUNDS)
    trained = fleet.trained
    rows = federation.rows()
    # the flat baseline: the same six devices, the same settings, in the inline simulation
    flat_dir, _ = simulate({"partitioner": "iid", "fleet": f"laptop={DEVICES}", "runtime": "onnx",
                            "num-rounds": ROUNDS, "clients-per-round": DEVICES, "model": "mlp", "local-epochs": 2,
                            "export-onnx": False, "run-dir": str(federation.root / "flat")}, progress=False)
    flat_rows = read_jsonl(flat_dir / "metrics.jsonl")
    # Assert: every round aggregated both gateways (all six devices' examples) and learned like the flat run
    assert [row["round"] for row in rows] == list(range(ROUNDS + 1)), federation.log("coordinator")
    assert all(row["aggregated"] and row["participants"] == 2 and row["rejected"] == 0 for row in rows[1:])
    assert sum(trained) == DEVICES * ROUNDS
    flat_accuracy = float(flat_rows[-1]["accuracy"])
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.3
    assert abs(rows[-1]["accuracy"] - flat_accuracy) <= 0.05, (rows[-1]["accuracy"], flat_accuracy)
    for index in range(2):
        log = federation.log(f"gateway{index}")
        assert "serves devices on https://127.0.0.1" in log and f"{DEVICES // 2} device results" in log, log
        assert "(gateway, 3 devices)" in log, log
    assert np.isfinite(rows[-1]["loss"])


@pytest.mark.deployment
def test_a_gateway_restart_loses_at_most_its_round_in_flight(federation: LoopbackFederation) -> None:
    # Prepare: a 4-round run through two gateways
    rounds = 4
    # (a round that asked the killed gateway ends at the round timeout: 300 s, not the 900 s of the others)
    ports = _start(federation, rounds, RUN.replace("round-timeout=900.0", "round-timeout=300.0"))
    fleet = ProtocolFleet(federation, ports)
    try:
        federation.wait_for(lambda: len(federation.rows()) >= 2, 900, "round 1")
        # Execute: gateway 0 dies outright, then starts again on the same state
        _kill_gateway(federation, 0)
        _start_gateway(federation, 0, ports[0])
        _summary_then_devices_told(federation, fleet)
    finally:
        fleet.close()
    fleet.check_told(rounds)
    rows = federation.rows()
    # Assert: every round ran and aggregated; at most one round lacked gateway 0; the model still learned
    assert [row["round"] for row in rows] == list(range(rounds + 1)), federation.log("coordinator")
    assert all(row["aggregated"] and row["rejected"] == 0 for row in rows[1:]), rows
    assert sum(row["participants"] < 2 for row in rows[1:]) <= 1, [row["participants"] for row in rows]
    assert rows[-1]["participants"] == 2
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.3
    assert federation.log("gateway0").count("serves devices on https://") == 2


@pytest.mark.deployment
def test_asynchronous_rounds_through_two_gateways_go_on_when_one_dies_and_its_devices_fail_over(
        federation: LoopbackFederation) -> None:
    # Prepare: FedBuff through two gateways, each flushing its first 2 device results (a third still training
    # answers late, into its gateway's next flush); a model version every 4 device results (the gateways' flushes:
    # a gateway may be handed the same version again, and its devices train it again). Every device names
    # both gateways, its own first; gateway 0's three are `fedge protocol-device` processes (their logs are read)
    flushes = 8
    ports = _start(federation, flushes, RUN.replace("gateways=true", "gateways=true strategy='fedbuff' buffer-size=4"),
                   per_round=2)
    fleet = ProtocolFleet(federation, ports, processes=3, indices=(1, 3, 5, 0, 2, 4), failover=True)
    try:
        federation.wait_for(lambda: len(federation.rows()) >= 3, 900, "model version 2")
        # Execute: gateway 0 dies outright and stays down
        _kill_gateway(federation, 0)
        killed_at = len(federation.rows()) - 1
        _summary_then_devices_told(federation, fleet)
    finally:
        fleet.close()
    fleet.check_told(flushes, gateways=(1,))
    assert federation.coordinator is not None and federation.coordinator.wait(600) == 0, federation.log("coordinator")
    rows = federation.rows()
    # Assert: every version was published, the ones after the kill without waiting for gateway 0 (its instruction
    # in flight would time out only after the 900 s round timeout), and the model learned
    assert [row["round"] for row in rows] == list(range(flushes + 1)), federation.log("coordinator")
    assert all(row["aggregated"] and row["rejected"] == 0 for row in rows[1:]), rows
    assert killed_at <= flushes - 3
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.3
    # ... gateway 0's devices checked in at gateway 1 and their results were taken there (an asynchronous run has
    # no round to count a device once in: each training is a result; a synchronous run's device trains a round
    # once whichever gateway offers it, tests/test_gateway.py)
    moved = f"gateway 127.0.0.1:{ports[0]} cannot be reached; checking in at 127.0.0.1:{ports[1]}"
    sent_there = 0
    for index in (0, 2, 4):
        log = federation.log(f"phone{index}")
        assert moved in log and "not training round" not in log, log
        sent_there += len(re.findall(r"round \d+: [^\n]*, sent", log.split(moved, 1)[1]))
    assert sent_there > 0, "none of gateway 0's devices sent a result through gateway 1"
    assert re.search(r"round \d+ \(train\): 2 device results", federation.log("gateway1"))


# Each tab records what it sends (the frame's tensor names and dtypes) and its page's state
RECORD_SENT = """
const [done] = arguments;
window.__sent = [];
import('./fedge-device.js').then(({FedgeDevice}) => {
  const result = FedgeDevice.prototype.result;
  FedgeDevice.prototype.result = async function (frame) {
    const bytes = frame instanceof Uint8Array ? frame : new Uint8Array(frame);
    const length = new DataView(bytes.buffer, bytes.byteOffset).getUint32(4, true);
    const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + length)));
    window.__sent.push((header.tensors || []).map((t) => [t.name, t.dtype]));
    return result.call(this, frame);
  };
  done(true);
});
"""
PAGE_STATE = ("const s = window.__fedge || {}; return {key: s.publicKeyPem || null, done: !!s.done,"
              " error: s.error || null,"
              " trained: (s.progress || []).filter((e) => e.kind === 'train').length,"
              " refused: (s.progress || []).filter((e) => e.kind === 'refused').map((e) => e.reason || e.error),"
              " sent: window.__sent || []};")


def _join(driver: Any) -> None:
    """Join the page's device to the run once its check-in is accepted: a key written to the allow-list is read
    within a second (at the next check-in), so a check-in just before it was read is refused; then join again."""
    for _ in range(10):
        driver.execute_script("window.fedgeJoin()")
        error = driver.execute_async_script(
            "const done = arguments[0];"
            "(function wait() { const s = window.__fedge;"
            " if (s.error || (s.device && s.device.session)) done(s.error || null); else setTimeout(wait, 100); })();")
        if error is None:
            return
        assert "allow-list" in error, error
    raise AssertionError(f"the gateway never admitted the page's key: {error}")


def _wait_page(driver: Any, condition: Any) -> dict[str, Any]:
    """The page's state once ``condition`` holds: an event in the page, polled every 0.1 s, no fixed sleep."""
    while not condition(state := dict(driver.execute_script(PAGE_STATE))):
        if state["error"]:
            raise AssertionError(f"the page failed: {state['error']}")
        driver.execute_async_script("setTimeout(arguments[0], 100)")
    return state


@pytest.mark.deployment
def test_distributed_dp_through_two_gateways_trains_protocol_devices_and_browser_tabs(
        federation: LoopbackFederation) -> None:
    # Prepare: secure aggregation with distributed DP (the devices add the noise). gateway0's pool: phone0, phone2,
    # phone4 (a `fedge protocol-device` without Flower or torch); gateway1's: phone1 and two Chromium tabs, browser3 and
    # browser5, on its demo page (their files hold raw digits, 0..16: the SDK preprocesses as the devices do). Each
    # pool's noise is calibrated for 3 survivors (its floor: the pool's devices refuse fewer). With six devices no
    # small ε can learn anything; z = 0.3 at clip 1.0 keeps the noise on the mean (z c sqrt(2) / 6 per entry) well
    # below the update. Every round must take both pools, so no deadline may end one on a loaded machine (rounds end
    # on their devices' answers; the deadlines only bound a round that lost its devices, which this test has none of)
    if any(not (ORT_DIST / name).is_file() for name in ORT_FILES):
        pytest.skip(f"onnxruntime-web is not installed under {ORT_DIST.parent}; `make test` installs it with npm")
    tabs_at, tabs = ["browser3", "browser5"], {}
    root = federation.root
    config = resolve_run_config({"partitioner": "iid"})
    task = load_task(config)
    (root / "demo-data").mkdir()
    for name in tabs_at:
        shard = task.partition(int(name[-1]), DEVICES, config)
        raw = tuple(x * np.float32(16) for x in shard.inputs)
        (root / "demo-data" / f"{name}.json").write_text(json.dumps(demo_examples(raw, shard.targets)))
    run = (RUN + " secure-aggregation=true dp='distributed'"
           " dp-noise-multiplier=0.3 dp-clipping-norm=1.0")
    web = ("--demo-page", "--ort-web", str(ORT_DIST), "--demo-data", str(root / "demo-data"))
    ports = _start(federation, ROUNDS, run, gateway_deadline_s=900.0, extra={1: web})
    federation.wait_for(lambda: "web device demo page" in federation.log("gateway1"), 900, "gateway1's demo page")
    driver = start_chromium(trust_certificate_flag((root / "keys" / "gateways" / "gw1.crt").read_bytes()))
    driver.set_script_timeout(60)
    fleet = None
    try:
        # Execute: the tabs become devices (the operator admits each page's key) and follow the run; then the phones
        for index, name in enumerate(tabs_at):
            if index:
                driver.switch_to.new_window("window")  # a window each: neither is a hidden background tab
            driver.get(f"https://127.0.0.1:{ports[1]}/web/demo.html?name={name}")
            pem = _wait_page(driver, lambda s: s["key"])["key"]
            (root / "allow" / f"{name}.pub").write_text(pem)
            assert driver.execute_async_script(RECORD_SENT)
            _join(driver)
            tabs[name] = driver.current_window_handle
        fleet = ProtocolFleet(federation, ports, processes=1, secure=True, indices=(0, 1, 2, 4))
        _summary_then_devices_told(federation, fleet)
        pages = {}
        for name, handle in tabs.items():
            driver.switch_to.window(handle)
            pages[name] = _wait_page(driver, lambda s: s["done"])
    finally:
        if fleet is not None:
            fleet.close()
        driver.quit()
    fleet.check_told(ROUNDS)
    rows = federation.rows()
    summary = json.loads((federation.run_dir / "summary.json").read_text())
    epsilons = [row.get("dp_epsilon") for row in rows[1:]]
    learned = (f"accuracy by round {[round(row['accuracy'], 3) for row in rows]} at ε {[round(e, 1) for e in epsilons]}"
               " (δ 1e-5)")
    print(f"distributed DP through two gateways: {learned}")
    # Assert: every round took both gateways' secure pool sums (three devices each, two of gateway1's tabs)
    assert [row["round"] for row in rows] == list(range(ROUNDS + 1)), federation.log("coordinator")
    assert all(row["aggregated"] and row["participants"] == 2 and row["rejected"] == 0 for row in rows[1:]), rows
    assert sum(fleet.trained) == 4 * ROUNDS
    for index in range(2):
        log = federation.log(f"gateway{index}")
        assert log.count("3 devices' masked inputs summed") == ROUNDS, log
        assert "the secure sum of 3 devices' updates (gateway)" in log, log
    # ε in every round's row, growing; the summary says the devices added the noise
    assert all(isinstance(e, float) and e > 0 for e in epsilons) and epsilons == sorted(set(epsilons)), epsilons
    assert summary["dp"]["mode"] == "distributed" and "the devices" in summary["dp"]["noise_added_by"], summary["dp"]
    # the tabs trained every round, refused nothing, and sent only masked uint32 ring vectors (one a round)
    for name, state in pages.items():
        assert state["error"] is None and state["trained"] == ROUNDS and not state["refused"], (name, state)
        tensors = [frame for frame in state["sent"] if frame]
        assert tensors == [[["masked/vector", "uint32"]]] * ROUNDS, (name, state["sent"])
    # the model learned through the noise. Measured, 4 runs of this test (z = 0.3, clip 1.0, ε 42.8 at δ 1e-5):
    # 0.117 -> 0.471, 0.471, 0.643, 0.694; the flat simulation of the same six devices and noise: 0.117 -> 0.635
    # (clip 1.0), 0.655 (clip 3.0). The bar, 0.2 above the start, leaves 0.15 below the worst run (chance is 0.1: a
    # run whose noise swamped the update stays near it)
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.2, learned
