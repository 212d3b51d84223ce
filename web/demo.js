// The demo page's logic: a FedgeDevice on the examples the operator left for this device name
// (data/NAME.json: {"inputs": [{"dtype", "dims", "b64"}], "targets": {"dtype", "dims", "b64"}}), which the
// gateway hands only to this device's session: fetched after check-in, with the session's MAC.
// window.__fedge exposes the state (the public key, progress events, errors, and once run() resolved: done, trained,
// outcome: "done" when the gateway said the run is over) to scripts and tests.
import {FedgeDevice} from "./fedge-device.js";
import {DTYPES} from "./frame.js";

const name = new URLSearchParams(location.search).get("name") || "browser";
const state = window.__fedge = {name: name, publicKeyPem: null, progress: [], error: null, done: false};
const $ = (id) => document.getElementById(id);

function array(entry) {
  const bytes = Uint8Array.from(atob(entry.b64), (c) => c.charCodeAt(0));
  return {data: new DTYPES[entry.dtype](bytes.buffer), dims: entry.dims};
}

// What the page says of each outcome: "late" (the round closed before this tab's result arrived: 409) is normal,
// "done" is the gateway's word that the run is over; only "error" is shown as one.
const STATUS = {
  wait: () => "waiting for a round",
  train: (e) => "round " + e.round + ": trained and sent",
  evaluate: (e) => "round " + e.round + ": evaluated and sent",
  late: (e) => "round " + e.round + " closed before this tab's result arrived (not counted); waiting for the next",
  refused: (e) => "round " + e.round + ": refused (secure aggregation is not implemented in the browser)",
  done: (e) => "the run is over: " + e.reason,
  error: (e) => "error: " + e.error,
};

function render(event) {
  const line = document.createElement("li");
  if (event.kind === "late") {
    line.textContent = "round " + event.round + " had closed when this tab's result arrived: not counted (normal)" +
      (event.loss !== undefined ? ", loss " + event.loss.toFixed(4) : "");
  } else if (event.kind === "done") {
    line.textContent = "the run is over: " + event.reason;
  } else {
    line.textContent = event.kind + (event.round ? " round " + event.round : "") +
      (event.loss !== undefined ? ", loss " + event.loss.toFixed(4) : "") + (event.error ? ": " + event.error : "");
  }
  if (event.kind === "error") line.className = "error";
  $("log").prepend(line);
  $("progress").value = event.trained || 0;
  $("status").textContent = (STATUS[event.kind] || ((e) => e.kind))(event);
  $("status").className = event.kind === "error" ? "error" : "";
}

async function join(rounds) {
  const bundleKeyPem = await (await fetch("bundle-key.pem", {cache: "no-store"})).text();
  const device = new FedgeDevice({gateway: location.origin, name: name, bundleKeyPem: bundleKeyPem, data: null,
                                  ortBase: new URL("ort/", location.href).href});
  const data = await device.getJson(new URL("data/" + encodeURIComponent(name) + ".json", location.href).pathname,
                                    "this device's examples");
  device.data = {inputs: data.inputs.map(array), targets: array(data.targets)};
  state.device = device;
  $("progress").max = rounds;
  const outcome = await device.run({rounds: rounds, maxWaitS: 2,
                                    onProgress: (event) => { state.progress.push(event); render(event); }});
  state.trained = outcome.trained;
  state.outcome = outcome.kind;
  state.done = true;
  $("status").className = "";
  $("status").textContent = outcome.kind === "done"
    ? "the run is over: " + outcome.reason + " (" + outcome.trained + " rounds trained here)"
    : "done: " + outcome.trained + " rounds trained";
}

window.fedgeJoin = (rounds) => join(rounds).catch((error) => {
  state.error = String(error.message || error);
  $("status").textContent = state.error;
  $("status").className = "error";
});

(async function main() {
  $("name").textContent = name;
  const identity = await FedgeDevice.identity(name);
  state.publicKeyPem = identity.publicKeyPem;
  $("key").textContent = identity.publicKeyPem;
  $("join").disabled = false;
  $("join").onclick = () => { $("join").disabled = true; window.fedgeJoin(Number($("rounds").value)); };
})().catch((error) => { state.error = String(error.message || error); });
