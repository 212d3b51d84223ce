// The demo page's logic: a FedgeDevice on the examples the operator left for this device name
// (data/NAME.json: {"inputs": [{"dtype", "dims", "b64"}], "targets": {"dtype", "dims", "b64"}}, bytes little-endian;
// `fedge gateway demo-data` makes them), which the gateway hands only to this device's session: fetched after
// check-in, with the session's MAC. The tab follows the run: it trains until the gateway says the run is over, and
// shows "round R of N" when the gateway's tasks carry the run's number of rounds. After an error, Join works again.
// window.__fedge exposes the state (the public key, progress events, errors, and once run() resolved: done, trained,
// outcome: "done" when the gateway said the run is over) to scripts and tests.
import {FedgeDevice} from "./fedge-device.js";
import {DTYPES} from "./frame.js";

const name = new URLSearchParams(location.search).get("name") || "browser";
const state = window.__fedge = {name: name, publicKeyPem: null, progress: [], error: null, done: false};
const $ = (id) => document.getElementById(id);

function array(entry, where) {
  if (!entry || !(entry.dtype in DTYPES) || !Array.isArray(entry.dims) || typeof entry.b64 !== "string") {
    throw new Error("this device's examples (data/" + name + ".json): " + where + " is not {dtype (one of " +
                    Object.keys(DTYPES).join(", ") + "), dims, b64}; the operator makes them with `fedge gateway demo-data`");
  }
  const bytes = Uint8Array.from(atob(entry.b64), (c) => c.charCodeAt(0));
  return {data: new DTYPES[entry.dtype](bytes.buffer), dims: entry.dims};
}

function examples(data) {
  if (!data || !Array.isArray(data.inputs)) {
    throw new Error("this device's examples (data/" + name + ".json) hold no 'inputs' list; the operator makes " +
                    "them with `fedge gateway demo-data`");
  }
  return {inputs: data.inputs.map((entry, i) => array(entry, "inputs[" + i + "]")), targets: array(data.targets, "targets")};
}

const of = (e) => e.round + (e.numRounds ? " of " + e.numRounds : "");
// What the page says of each outcome: "late" (the round closed before this tab's result arrived: 409) is normal,
// "done" is the gateway's word that the run is over; "inputs" says what the task's preprocessing made of the data;
// only "error" is shown as one.
const STATUS = {
  wait: () => "waiting for a round",
  train: (e) => "round " + of(e) + (e.secure ? ": trained and sent masked (secure aggregation: the gateway sees only the pool's sum)"
                                            : ": trained and sent"),
  evaluate: (e) => "round " + of(e) + ": evaluated and sent",
  late: (e) => "round " + of(e) + " closed before this tab's result arrived (not counted); waiting for the next",
  secagg: (e) => "round " + of(e) + ": secure aggregation, " + String(e.action || "").replace("secagg_", "") + " step sent",
  refused: (e) => "round " + of(e) + ": this tab refused a secure-aggregation step: " + e.reason,
  skipped: (e) => "round " + of(e) + ": not trained again: " + e.reason,
  done: (e) => "the run is over: " + e.reason,
  inputs: (e) => e.message,
  error: (e) => "error: " + e.error,
};

function render(event) {
  const line = document.createElement("li");
  if (event.kind === "late") {
    line.textContent = "round " + of(event) + " had closed when this tab's result arrived: not counted (normal)" +
      (event.loss !== undefined ? ", loss " + event.loss.toFixed(4) : "");
  } else if (event.kind === "done") {
    line.textContent = "the run is over: " + event.reason;
  } else if (event.kind === "inputs") {
    line.textContent = event.message;
  } else {
    line.textContent = event.kind + (event.round ? " round " + of(event) : "") +
      (event.loss !== undefined ? ", loss " + event.loss.toFixed(4) : "") + (event.error ? ": " + event.error : "") +
      (event.reason && !event.error ? ": " + event.reason : "");
  }
  if (event.kind === "error") line.className = "error";
  if (event.kind === "inputs" && event.verdict === "outside") line.className = "warning";
  $("log").prepend(line);
  if (event.numRounds) $("progress").max = event.numRounds;
  if (event.round) $("progress").value = event.round;
  if (event.kind === "inputs") return;  // a note in the log; the status line stays the round's
  $("status").textContent = (STATUS[event.kind] || ((e) => e.kind))(event);
  $("status").className = event.kind === "error" ? "error" : "";
}

async function join() {
  const bundleKeyPem = await (await fetch("bundle-key.pem", {cache: "no-store"})).text();
  // ?gateway=URL (repeatable): gateways to check in at when this page's own cannot be reached, in order
  const gateways = [location.origin, ...new URLSearchParams(location.search).getAll("gateway")];
  const device = new FedgeDevice({gateways: gateways, name: name, bundleKeyPem: bundleKeyPem, data: null,
                                  ortBase: new URL("ort/", location.href).href});
  const data = await device.getJson(new URL("data/" + encodeURIComponent(name) + ".json", location.href).pathname,
                                    "this device's examples");
  device.data = examples(data);
  state.device = device;
  const outcome = await device.run({maxWaitS: 2, onProgress: (event) => { state.progress.push(event); render(event); }});
  state.trained = outcome.trained;
  state.outcome = outcome.kind;
  state.done = true;
  $("status").className = "";
  $("status").textContent = outcome.kind === "done"
    ? "the run is over: " + outcome.reason + " (" + outcome.trained + " rounds trained here)"
    : "done: " + outcome.trained + " rounds trained";
}

// Join the federation until the run is over; after an error the Join button works again (no reload needed).
window.fedgeJoin = () => {
  state.error = null;
  state.done = false;
  $("join").disabled = true;
  return join().catch((error) => {
    state.error = String(error.message || error);
    $("status").textContent = state.error;
    $("status").className = "error";
  }).finally(() => { $("join").disabled = false; });
};

(async function main() {
  $("name").textContent = name;
  const identity = await FedgeDevice.identity(name);
  state.publicKeyPem = identity.publicKeyPem;
  $("key").textContent = identity.publicKeyPem;
  $("join").disabled = false;
  $("join").onclick = () => window.fedgeJoin();
})().catch((error) => { state.error = String(error.message || error); });
