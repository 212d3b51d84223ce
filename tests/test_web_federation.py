"""Browsers train in a real federation (issue 28): a coordinator, a `fedge gateway` serving the web
SDK's demo page, three headless-Chromium tabs and one Python protocol device, all on 127.0.0.1 over
TLS (the gateway's certificate from `fedge keys add-gateway`, the only one Chromium is told to trust).

The same run with four Python protocol devices (same names, so the same seeds, and the same
partitions), run beside it in its own federation (both mostly wait on processes: 81 -> 62 s on a quiet
machine), is the baseline: a browser sends the update a Python device sends (numpy's batch
order, float32 steps), so the two runs must learn alike. One tab reloads right after sending its
first result, while the round still waits for others: it must not be counted twice. The tabs'
files hold raw digits (grey levels 0..16, as a sensor gives them) and the Python devices'
preprocessed ones (0..1): the SDK applies the task's declared preprocessing as the Python devices
do (issue 39 §4; before, two tabs on raw digits trained at loss 51.7 and the model stayed at 0.10).

Needs Debian's chromium + chromedriver and the pinned onnxruntime-web (``make test`` installs both).
"""

from __future__ import annotations

import json
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
from fedge.simulation.loopback import LoopbackFederation, free_port
from fedge.task.loading import load_task
from fedge.web import ORT_FILES
from tests.test_web_device import ORT_DIST

pytestmark = pytest.mark.slow
ROUNDS, BROWSERS = 3, 3
NAMES = [*(f"browser{index}" for index in range(BROWSERS)), "phone3"]
RUN = ("model='mlp' local-epochs=2 export-onnx=false runtime='onnx' round-timeout=900.0 gateways=true "
       "min-train-replies=1")


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[LoopbackFederation]:
    if any(not (ORT_DIST / name).is_file() for name in ORT_FILES):
        pytest.skip(f"onnxruntime-web is not installed under {ORT_DIST.parent}; `make test` installs it with npm")
    fed = LoopbackFederation(tmp_path, num_devices=1)  # dev0: the gateway's node key
    yield fed
    fed.close()


def _shards() -> list[tuple[tuple[np.ndarray, ...], np.ndarray]]:
    config = resolve_run_config({"partitioner": "iid"})
    task = load_task(config)
    return [(tuple(s.inputs), s.targets) for s in (task.partition(i, len(NAMES), config) for i in range(len(NAMES)))]


def _start(federation: LoopbackFederation, shards: list[Any]) -> int:
    """Coordinator (one gateway a round) and a gateway with the demo page; the gateway's device port."""
    root, keys = federation.root, federation.keys
    federation.start_coordinator("--rounds", str(ROUNDS), "--clients-per-round", "1", "--run-config", RUN)
    federation.wait_for(federation.bundle_signing_key.exists, 900, "the bundle signing key")
    assert main(["keys", "add-gateway", "gw0", "--dir", str(keys.directory)]) == 0
    (root / "demo-data").mkdir()
    for name, (inputs, targets) in zip(NAMES, shards, strict=True):  # the tabs' files hold raw digits (0..16)
        raw = tuple(x * np.float32(16) for x in inputs)
        (root / "demo-data" / f"{name}.json").write_text(json.dumps(demo_examples(raw, targets)))
    add_protocol_device(root / "allow", "phone3")
    port = free_port()
    federation.devices[100] = federation.spawn(
        ["gateway", "start", "--coordinator", f"127.0.0.1:{federation.port}", "--name", "gw0",
         "--devices", str(root / "allow"), "--key", str(keys.devices / "dev0.key"), "--ca", str(keys.ca_cert),
         "--trust", str(federation.bundle_signing_key), "--cert", str(keys.directory / "gateways" / "gw0.crt"),
         "--cert-key", str(keys.directory / "gateways" / "gw0.key"), "--port", str(port),
         "--state-dir", str(root / "gw0"), "--devices-per-round", str(len(NAMES)), "--poll-interval", "0.5",
         "--round-deadline", "900", "--demo-page", "--ort-web", str(ORT_DIST), "--demo-data", str(root / "demo-data")],
        "gateway0.log")
    federation.wait_for(lambda: "web device demo page" in federation.log("gateway0"), 900, "the gateway")
    return port


def _python_device(federation: LoopbackFederation, port: int, name: str, shard: Any, stop: threading.Event,
                   trained: dict[str, int]) -> threading.Thread:
    device = ProtocolDevice(gateway=f"https://127.0.0.1:{port}", name=name,
                            key=federation.root / "allow" / f"{name}.key", data=shard,
                            trust=federation.bundle_signing_key, ca=federation.keys.ca_cert,
                            state_dir=federation.root / name)
    thread = threading.Thread(target=lambda: trained.update({name: device.run(stop=stop, max_wait_s=1.0)}),
                              daemon=True)
    thread.start()
    return thread


def _state(driver: Any) -> dict[str, Any]:
    return dict(driver.execute_script(
        "const s = window.__fedge || {}; return {key: s.publicKeyPem || null, done: !!s.done, error: s.error || null,"
        " trained: (s.progress || []).filter((e) => e.kind === 'train').length};"))


def _wait_page(driver: Any, condition: Any) -> dict[str, Any]:
    """The page's state once ``condition`` holds (an event in the page, not a duration)."""
    while not condition(state := _state(driver)):
        if state["error"]:
            raise AssertionError(f"the page failed: {state['error']}")
        driver.execute_async_script("setTimeout(arguments[0], 100)")
    return state


def _python_baseline(root: Path, shards: list[Any]) -> tuple[LoopbackFederation, threading.Event, list[Any]]:
    """The baseline, started: four Python protocol devices (the same names and partitions) in a fresh federation."""
    baseline = LoopbackFederation(root, num_devices=1)
    port = _start(baseline, shards)
    stop, trained = threading.Event(), {}
    for name in NAMES[:BROWSERS]:
        add_protocol_device(baseline.root / "allow", name)
    threads = [_python_device(baseline, port, name, shard, stop, trained)
               for name, shard in zip(NAMES, shards, strict=True)]
    return baseline, stop, threads


@pytest.mark.deployment
def test_three_browsers_and_a_python_device_train_like_an_all_python_fleet(federation: LoopbackFederation,
                                                                             tmp_path: Path) -> None:
    # Prepare: the federation; Chromium trusting the gateway's certificate only; four devices' examples; the
    # all-Python baseline runs beside it (its own coordinator and gateway: both runs mostly wait on processes)
    shards = _shards()
    baseline, baseline_stop, baseline_threads = _python_baseline(tmp_path / "python", shards)
    try:
        rows, gateway_log, states = _browser_run(federation, shards)
        baseline.wait_for(lambda: (baseline.run_dir / "summary.json").exists(), 900, "the baseline's summary")
        python_rows = baseline.rows()
    finally:
        baseline_stop.set()
        for thread in baseline_threads:
            thread.join(60)
        baseline.close()
    # Assert: every round aggregated the gateway's 4 device results (the reloaded tab counted once)
    assert [row["round"] for row in rows] == list(range(ROUNDS + 1)), federation.log("coordinator")
    assert all(row["aggregated"] and row["participants"] == 1 and row["rejected"] == 0 for row in rows[1:]), rows
    assert gateway_log.count("4 device results (0 rejected, 0 clipped") == ROUNDS, gateway_log
    assert all(state["error"] is None for state in states.values()), states
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.3
    # ... and learned like the all-Python fleet: within 0.5 accuracy points, round for round
    assert [row["round"] for row in python_rows] == list(range(ROUNDS + 1))
    gaps = [abs(a["accuracy"] - b["accuracy"]) for a, b in zip(rows, python_rows, strict=True)]
    assert max(gaps) <= 0.005, (gaps, [r["accuracy"] for r in rows], [r["accuracy"] for r in python_rows])


def _browser_run(federation: LoopbackFederation, shards: list[Any]
                 ) -> tuple[list[dict[str, Any]], str, dict[str, dict[str, Any]]]:
    """Three tabs and a Python device through one gateway, one tab reloaded mid-round: (rows, gateway log, tab
    states)."""
    port = _start(federation, shards)
    root = federation.root
    driver = start_chromium(trust_certificate_flag((root / "keys" / "gateways" / "gw0.crt").read_bytes()))
    driver.set_script_timeout(60)
    stop, trained = threading.Event(), {}
    tabs = {}
    try:
        # Execute: three tabs become devices (the operator admits each page's key) on raw digits, joined for the run
        for index, name in enumerate(NAMES[:BROWSERS]):
            if index:
                driver.switch_to.new_window("tab")
            driver.get(f"https://127.0.0.1:{port}/web/demo.html?name={name}")
            pem = _wait_page(driver, lambda s: s["key"])["key"]
            (root / "allow" / f"{name}.pub").write_text(pem)
            tabs[name] = driver.current_window_handle
        for handle in tabs.values():
            driver.switch_to.window(handle)
            driver.execute_script("window.fedgeJoin()")  # the tab follows the run
        python = _python_device(federation, port, "phone3", shards[3], stop, trained)
        # browser0 reloads right after sending its first result (its round waits for the others)
        driver.switch_to.window(tabs["browser0"])
        _wait_page(driver, lambda s: s["trained"] >= 1)
        driver.refresh()
        _wait_page(driver, lambda s: s["key"])
        driver.execute_script("window.fedgeJoin()")
        federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 900, "the summary")
        states = {}
        for name, handle in tabs.items():
            driver.switch_to.window(handle)
            states[name] = _wait_page(driver, lambda s: s["done"])
    finally:
        stop.set()
        driver.quit()
    python.join(60)
    return federation.rows(), federation.log("gateway0"), states
