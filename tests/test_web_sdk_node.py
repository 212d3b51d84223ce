"""The web SDK's run loop under Node (skipped without it): what it does when the gateway cannot be reached.

The gateway and the network are scripted (``poll`` replaced), so the test is about the loop's
decisions only; Chromium tests (tests/test_web_device.py) cover the real requests.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="needs Node")

SCRIPT = """
globalThis.Worker = class { postMessage() {} };
globalThis.setTimeout = (resolve) => resolve();  // no real waiting: the waits are recorded
const {FedgeDevice} = await import(process.argv[1] + "/web/fedge-device.js");
const script = JSON.parse(process.argv[2]);
const device = new FedgeDevice({gateway: "https://127.0.0.1:1", name: "tab", bundleKeyPem: "", data: {},
                                maxNetworkFailures: 3});
device.poll = async () => {
  const step = script.shift();
  if (step === "unreachable") { const e = new Error("Failed to fetch"); e.network = true; throw e; }
  return step === "done" ? {kind: "done", reason: "the run is over", nextInS: 0} : {kind: "wait", nextInS: 1};
};
const waits = [];
try {
  const result = await device.run({maxWaitS: 30, onProgress: (o) => waits.push(o.nextInS)});
  console.log(JSON.stringify({result, waits}));
} catch (error) {
  console.log(JSON.stringify({error: error.message, waits}));
}
"""


def _run(script: list[str]) -> dict[str, Any]:
    out = subprocess.run([str(NODE), "--input-type=module", "-e", SCRIPT, str(ROOT), json.dumps(script)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def test_a_gateway_never_reached_stops_the_run_naming_the_likely_causes() -> None:
    # Execute
    outcome = _run(["unreachable"] * 5)
    # Assert: stopped after 3, saying what to check
    assert "3 requests in a row" in outcome["error"] and "CORS" in outcome["error"] and "TLS trust" in outcome["error"]


def test_a_gateway_that_answered_and_then_went_away_is_waited_for_with_backoff() -> None:
    # Execute: a wait, then 7 failures (a gateway restart), then the run's end
    outcome = _run(["wait", *["unreachable"] * 7, "done"])
    # Assert: the run ends as the gateway says, after waits of 2, 4, 8, 16, 30, 30, 30 s
    assert outcome["result"] == {"kind": "done", "trained": 0, "reason": "the run is over"}
    assert outcome["waits"][1:8] == [2, 4, 8, 16, 30, 30, 30]
