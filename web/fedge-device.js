// fedge's web device SDK: a browser tab trains in a fedge federation through a gateway.
//
// It speaks the device protocol (docs/device-protocol.md) as fedge.clients.protocol_device does:
// hello, a check-in signed with the device's ECDSA P-256 key (WebCrypto, non-extractable, kept in
// IndexedDB), then HMAC-SHA256 session MACs; it fetches the coordinator's signed training graph,
// verifies it (bundle.js) and trains in a Web Worker (worker.js); every answer's next-in-s paces it.
//
// Usage (see docs/devices.md, "A web app"):
//   const identity = await FedgeDevice.identity("phone-017");   // once: the operator admits identity.publicKeyPem
//   const device = new FedgeDevice({gateway: "https://gw1.example.org:9443", name: "phone-017",
//                                   bundleKeyPem: SIGNING_PUB, data: {inputs, targets}});
//   const outcome = await device.run({onProgress: (event) => ...});  // until the gateway says the run is over
//     // outcome: {kind: "done" (the gateway said the run is over; outcome.reason says why) | "rounds" | "stopped", trained}
//   const scores = await device.predict({data, dims});  // the coordinator's latest signed inference model
//
// Threat model (device side): the gateway is authenticated by TLS (the browser's trust store);
// the private key never leaves WebCrypto; the training graph must be signed by the pinned bundle
// key and pass the graph checks before onnxruntime-web sees it. Bundles are fresh and of one lineage,
// as `fedge pull` and `fedge device --runtime onnx` keep them: per device name and kind (training,
// inference), localStorage keeps the model_id this device follows (pinned on the first bundle it
// accepted, or named by the app: the `trainingModelId` and `modelId` options) and the highest version
// accepted per model_id; another lineage, or a lower version (a rollback), is refused. Whoever can
// write the origin's localStorage can reset that record, as whoever can write a Python device's
// freshness directory can. Every onnxruntime-web session pins the ONNX format. A page reload loses the session
// and the round's work, not the key: the device checks in again, and the gateway, which counts a
// device once a round by name, gives it the round's task again only if it had not answered it.
// Raw inputs get the task's declared preprocessing (preprocessing.js), as the Python devices apply it;
// inputs outside both declared ranges are used as they are and flagged (an "inputs" event, a console warning).
// A gateway on another origin must allow the app's origin (`fedge gateway start --allow-origin ORIGIN`); the
// browser hides why a request failed, so when a gateway never answered, after `maxNetworkFailures` failures in a
// row run() stops with an error naming the likely causes (the origin, the TLS trust, the address) instead of
// retrying forever; a gateway that answered before and then goes away (a restart) is waited for.
// Secure aggregation (kind "secagg" tasks): the five SecAgg+ steps of secagg.js (Bonawitz et al., CCS 2017; Bell et
// al., CCS 2020), answered as fedge.clients.protocol_device answers them, byte-compatible with Python devices in one
// gateway pool; the check-in declares "secure-aggregation" (when secagg.js loads). The masked step trains with the same worker as a plain
// round and sends only the masked ring vector: the gateway learns the pool's sum, not this tab's update. A step the
// tab refuses (secagg.js' checks) is answered with the reason and forgets the round's secrets; a step sent again
// with the same task id (its answer was lost on the way) gets the same answer again, not a second run of the step.

import {FRAME_TYPE, TASK_CAPABILITIES, decodeFrame, encodeFrame, int8Delta, taskValues} from "./frame.js";
import {importBundleKey, recordAccepted, verifyInferenceBundle, verifyTrainingBundle} from "./bundle.js";
import {AS_GIVEN, OUTSIDE, inputsMessage, prepareDeviceInputs} from "./preprocessing.js";

// secagg.js (and the ChaCha20 it imports from vendor/noble-ciphers/), loaded on first use: an app that serves only the
// plain SDK files still trains in plain runs, and its check-in then does not declare secure aggregation.
let secagg = null, secaggLoad = null;
function loadSecureAggregation() {
  secaggLoad = secaggLoad || import("./secagg.js").then((module) => { secagg = module; return module; }, (error) => {
    console.warn("fedge: secagg.js (and vendor/noble-ciphers/) could not be loaded beside fedge-device.js (" +
                 String(error.message || error) + "): this device does not declare secure aggregation, and a run that " +
                 "uses it refuses it at check-in");
    return null;
  });
  return secaggLoad;
}

const PREFIX = "/v1";
const enc = new TextEncoder();

function b64(bytes) {
  let raw = "";
  for (let i = 0; i < bytes.length; i += 0x8000) raw += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(raw);
}
function unb64(text) { return Uint8Array.from(atob(text), (c) => c.charCodeAt(0)); }
// A gateway's free text, fit for one line of a page: no control characters, at most 300 characters.
function printable(text) { return String(text).replace(/[\u0000-\u001f\u007f-\u009f]/g, " ").slice(0, 300); }
async function sha256Hex(data) {
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", data));
  return Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join("");
}

// ------------------------------------------------------------------ the device key, kept in IndexedDB
function keyStore(mode, action) {
  return new Promise((resolve, reject) => {
    const open = indexedDB.open("fedge-device", 1);
    open.onupgradeneeded = () => open.result.createObjectStore("keys");
    open.onerror = () => reject(open.error);
    open.onsuccess = () => {
      const db = open.result;
      const request = action(db.transaction("keys", mode).objectStore("keys"));
      request.onsuccess = () => { resolve(request.result); db.close(); };
      request.onerror = () => { reject(request.error); db.close(); };
    };
  });
}

function pem(spki) {
  const body = b64(new Uint8Array(spki)).match(/.{1,64}/g).join("\n");
  return "-----BEGIN PUBLIC KEY-----\n" + body + "\n-----END PUBLIC KEY-----\n";
}

export class FedgeDevice {
  // This browser's key pair for `name` (made on first use; the private half is not extractable).
  // The operator saves publicKeyPem as NAME.pub in the gateway's allow-list.
  static async identity(name) {
    let pair = await keyStore("readonly", (store) => store.get(name));
    if (!pair) {
      pair = await crypto.subtle.generateKey({name: "ECDSA", namedCurve: "P-256"}, false, ["sign", "verify"]);
      await keyStore("readwrite", (store) => store.put(pair, name));
    }
    return {keys: pair, publicKeyPem: pem(await crypto.subtle.exportKey("spki", pair.publicKey))};
  }

  // modelId / trainingModelId: the lineage (signed model_id) of the inference / training bundles to accept;
  // without them, the first lineage this device accepts of each kind is the only one it accepts.
  // gatewayName: the gateway's name (`fedge keys add-gateway NAME`) this app expects. A page cannot read the
  // TLS certificate, so without it the device signs whatever name `hello` announces, and a gateway could
  // relay that check-in to another gateway; with it, a `hello` naming another gateway is refused.
  // maxNetworkFailures: requests in a row that fail to reach a gateway that has not answered yet (no answer at
  // all: CORS, TLS trust, a wrong address) before run() stops; once it has answered, run() keeps trying.
  // gateways: several gateways' URLs instead of one (gatewayNames: their names, in the same order): when the one in
  // use cannot be reached, the device checks in at the next, and it trains each round at most once whichever
  // gateway asks (the coordinator counts its result once a round).
  constructor({gateway, gateways, name, bundleKeyPem, data, ortBase, workerUrl, modelId, trainingModelId,
               gatewayName, gatewayNames, maxNetworkFailures = 5}) {
    this.gateways = (gateways ?? (gateway ? [gateway] : [])).map((url) => url.replace(/\/$/, ""));
    if (!this.gateways.length) throw new Error("name the gateway: {gateway: URL}, or {gateways: [URL, ...]}");
    this.expectedGateways = gatewayNames ?? (gatewayName ? [gatewayName] : null);
    if (this.expectedGateways && this.expectedGateways.length !== this.gateways.length) {
      throw new Error("gatewayNames must name each of the " + this.gateways.length + " gateways, in the same order");
    }
    this.gateway = this.gateways[0];
    this.expectedGateway = this.expectedGateways ? this.expectedGateways[0] : null;
    this.trainedRound = -1;  // the last round this device trained a plain task for (at any gateway)
    this.unsent = null;  // {task, frame, work}: a train result no gateway answered yet (sent again if its task comes)
    this.name = name;
    this.bundleKeyPem = bundleKeyPem;
    this.lineage = {inference: modelId ?? null, training: trainingModelId ?? null};
    this.data = data;  // {inputs: [{data, dims}], targets: {data, dims}}: raw or preprocessed, in the manifest's order
    this.prepared = null;  // {source, manifest, data, verdict}: this.data as the model takes it
    this.maxNetworkFailures = maxNetworkFailures;
    this.ortBase = ortBase || new URL("./ort/", import.meta.url).href;
    this.worker = new Worker(workerUrl || new URL("./worker.js", import.meta.url).href);
    this.pending = new Map();
    this.nextId = 1;
    this.worker.onmessage = (event) => {
      const waiter = this.pending.get(event.data.id);
      this.pending.delete(event.data.id);
      if (event.data.error) waiter.reject(new Error(event.data.error)); else waiter.resolve(event.data);
    };
    this.session = null;
    this.graph = null;  // the architecture of the verified graph loaded in the worker
    this.inference = null;  // the manifest of the verified inference model loaded in the worker
    this.log = [];
    this.secureRound = null;  // this round's secure-aggregation secrets (secagg.js state)
    this.answered = null;  // the last secure step answered: {task, reply, frame} (sent again if the step comes again)
    this.unmasked = null;  // the last round this device unmasked in (a later setup at or before it is refused)
    this.secureWork = null;  // what the masked step trained: {loss, numExamples}
  }

  call(message, transfer) {
    return new Promise((resolve, reject) => {
      const id = this.nextId++;
      this.pending.set(id, {resolve: resolve, reject: reject});
      this.worker.postMessage({...message, id: id}, transfer || []);
    });
  }

  // Check in at the next gateway named (the one in use cannot be reached): a new session and gateway name; what
  // was trained and unmasked is remembered across gateways.
  nextGateway() {
    this.gateways.push(this.gateways.shift());
    if (this.expectedGateways) this.expectedGateways.push(this.expectedGateways.shift());
    this.gateway = this.gateways[0];
    this.expectedGateway = this.expectedGateways ? this.expectedGateways[0] : null;
    this.session = null;
    this.gatewayName = null;
    this.answered = null;
  }

  // ---------------------------------------------------------------- transport
  async send(method, path, body, headers = {}) {
    let response;
    try {
      response = await fetch(this.gateway + path, {method: method, body: body, headers: headers, cache: "no-store"});
    } catch (error) {  // no answer at all: the browser hides why (a refused origin, an untrusted certificate, no server)
      const failed = new Error("cannot reach the gateway at " + this.gateway + ": " + String(error.message || error));
      failed.network = true;
      throw failed;
    }
    return {status: response.status, type: response.headers.get("content-type") || "", body: new Uint8Array(await response.arrayBuffer())};
  }

  static json(answer, what) {
    const value = JSON.parse(new TextDecoder().decode(answer.body) || "{}");
    if (answer.status !== 200) throw new Error(what + ": the gateway answered " + answer.status + ": " + (value.error || ""));
    return value;
  }

  async checkIn() {
    if (!this.gatewayName) {
      const announced = FedgeDevice.json(await this.send("GET", PREFIX + "/hello"), "hello").gateway;
      if (this.expectedGateway !== null && announced !== this.expectedGateway) {
        throw new Error("the gateway at " + this.gateway + " announces '" + announced + "', but this app expects gateway '" +
                        this.expectedGateway + "': no check-in is signed for it (it could relay one to another gateway)");
      }
      this.gatewayName = announced;
    }
    const {keys} = await FedgeDevice.identity(this.name);
    const issued = Math.floor(Date.now() / 1000), nonce = b64(crypto.getRandomValues(new Uint8Array(16)));
    const message = enc.encode(["fedge-check-in/1", this.name, this.gatewayName, String(issued), nonce].join("\n"));
    const signature = new Uint8Array(await crypto.subtle.sign({name: "ECDSA", hash: "SHA-256"}, keys.privateKey, message));
    const answer = FedgeDevice.json(await this.send("POST", PREFIX + "/check-in", JSON.stringify({
      protocol: 1, device: this.name, time: issued, nonce: nonce, signature: b64(signature),
      capabilities: ["fp32", "int8-delta", ...TASK_CAPABILITIES, ...(await loadSecureAggregation() ? ["secure-aggregation"] : [])]}),
      {"Content-Type": "application/json"}), "check-in");
    const key = await crypto.subtle.importKey("raw", unb64(answer.key), {name: "HMAC", hash: "SHA-256"}, false, ["sign"]);
    this.session = {token: answer.session, key: key, counter: 0};
    return answer["next-in-s"] || 0;
  }

  async authenticated(method, path, body = new Uint8Array(0)) {
    for (let attempt = 0; attempt < 2; attempt++) {
      if (!this.session) await this.checkIn();
      const counter = ++this.session.counter;
      const text = ["fedge-request/1", method, path, String(counter), await sha256Hex(body)].join("\n");
      const mac = b64(new Uint8Array(await crypto.subtle.sign("HMAC", this.session.key, enc.encode(text))));
      const answer = await this.send(method, path, method === "GET" ? undefined : body, {
        "Authorization": "Fedge-Session " + this.session.token, "X-Fedge-Counter": String(counter),
        "X-Fedge-Mac": mac, "Content-Type": FRAME_TYPE});
      if (answer.status === 401 && attempt === 0) { this.session = null; continue; }  // expired or a restarted gateway
      return answer;
    }
  }

  // A JSON answer to an authenticated GET of `path` (a gateway resource only this device's session may read).
  async getJson(path, what) {
    return FedgeDevice.json(await this.authenticated("GET", path), what);
  }

  // ---------------------------------------------------------------- freshness records (localStorage)
  // {inference: {pin, highest}, training: {pin, highest}} for this device name; a damaged record refuses
  // every bundle (fail closed) until it is removed.
  records(kind) {
    const key = "fedge-bundles/" + this.name;
    const stored = localStorage.getItem(key);
    let records = null;
    try {
      records = stored !== null ? JSON.parse(stored) : {  // the first record: the earlier SDK's inference versions
        inference: {pin: null, highest: JSON.parse(localStorage.getItem("fedge-models") || "{}")},
        training: {pin: null, highest: {}}};
    } catch (e) { records = null; }
    const sound = (r) => r && typeof r.highest === "object" && r.highest !== null && (r.pin === null || typeof r.pin === "string");
    if (!records || !sound(records.inference) || !sound(records.training)) {
      throw new Error(kind + " bundle refused: this browser's record of accepted bundles (localStorage '" + key +
                      "') is damaged; every bundle is refused until it is removed and the lineage named again");
    }
    return records;
  }

  accepted(kind, manifest) {
    const records = this.records(kind);
    records[kind] = recordAccepted(records[kind], manifest);
    localStorage.setItem("fedge-bundles/" + this.name, JSON.stringify(records));
  }

  freshness(kind) {
    return {record: this.records(kind)[kind], modelId: this.lineage[kind]};
  }

  // ---------------------------------------------------------------- the training graph
  async ready(architecture) {
    if (this.graph && (!architecture || this.graph === architecture)) return;
    const answer = await this.authenticated("GET", PREFIX + "/bundles/training");
    if (answer.status !== 200) FedgeDevice.json(answer, "training graph");
    const trusted = await importBundleKey(this.bundleKeyPem);
    // throws before the worker sees anything: signature, files, freshness and lineage, graph checks
    const bundle = await verifyTrainingBundle(answer.body, trusted, this.freshness("training"));
    if (architecture && bundle.manifest.architecture !== architecture) {
      throw new Error("the gateway's training graph is not the one the task names; try again later");
    }
    await this.call({type: "load", ortBase: this.ortBase, train: bundle.train, eval: bundle.eval, manifest: bundle.manifest});
    this.accepted("training", bundle.manifest);
    this.manifest = bundle.manifest;
    this.graph = bundle.manifest.architecture;
  }

  // this.data as the training graph's manifest takes it (preprocessing.js): the same object for the same data and
  // manifest; a new verdict other than "preprocessed" is logged once and reported (an "inputs" event from run()).
  preparedData() {
    if (!this.data) throw new Error("this device has no examples: give `data` ({inputs, targets}) before it trains");
    if (this.prepared && this.prepared.source === this.data && this.prepared.manifest === this.manifest) {
      return this.prepared.data;
    }
    const spec = this.manifest.preprocessing;
    const {inputs, verdict} = prepareDeviceInputs(this.data.inputs, spec);
    const message = inputsMessage(verdict, spec, "device " + this.name + "'s data");
    if (verdict === OUTSIDE) console.warn(message); else if (verdict !== AS_GIVEN) console.info(message);
    this.prepared = {source: this.data, manifest: this.manifest, data: {...this.data, inputs: inputs}, verdict: verdict};
    if (verdict !== AS_GIVEN) this.inputsNotice = {verdict: verdict, message: message};
    return this.prepared.data;
  }

  // ---------------------------------------------------------------- one poll
  // What it did: {kind, nextInS, round, ...}. kind: "wait"; "train" (loss) or "evaluate" (metrics), sent;
  // "late": the result came after its round closed (409, a normal outcome: it was not counted; reason says why);
  // "secagg": a secure-aggregation step answered (action; the masked step's loss), and "train" for its last step
  // (secure: true); "refused": a secure step this tab refused (reason); "done": the run is over (reason: the
  // gateway's words). A task's outcome carries
  // numRounds, the run's number of rounds, when the gateway knows it.
  async poll() {
    const answer = await this.authenticated("GET", PREFIX + "/task");
    if (answer.status !== 200 || !answer.type.startsWith(FRAME_TYPE)) {
      const body = FedgeDevice.json(answer, "task");
      if (body.kind === "done") return {kind: "done", nextInS: 0, reason: printable(body.reason || "the run is over")};
      return {kind: "wait", nextInS: body["next-in-s"] || 1};
    }
    const {header: task, tensors} = decodeFrame(answer.body.buffer);
    if (task.kind === "secagg") return this.secureStep(task, tensors, answer.body);
    await this.ready(task.graph);
    const data = this.preparedData();
    const numRounds = Number.isInteger(task["num-rounds"]) && task["num-rounds"] > 0 ? {numRounds: task["num-rounds"]} : {};
    const weights = {};
    for (const [name, tensor] of Object.entries(tensors)) weights[name] = taskValues(tensor);  // fp32, fp16 or int8
    if (task.kind === "evaluate") {
      const result = await this.call({type: "evaluate", weights: weights, ...data});
      const sent = await this.result(encodeFrame({task: task.task, kind: "evaluate", "num-examples": result.numExamples,
                                                  metrics: result.metrics}));
      const kind = sent.late ? "late" : "evaluate";
      return {kind: kind, nextInS: sent["next-in-s"], round: task["server-round"], metrics: result.metrics, ...numRounds,
              ...(sent.late ? {reason: sent.reason} : {})};
    }
    if (this.unsent && this.unsent.task === task.task) {  // this task's result did not reach the gateway: again
      const again = await this.result(this.unsent.frame);
      const work = this.unsent.work;
      this.unsent = null;
      return {kind: again.late ? "late" : "train", nextInS: again["next-in-s"], round: task["server-round"], ...work,
              ...numRounds, resent: true, ...(again.late ? {reason: again.reason} : {})};
    }
    // a synchronous run counts a device once a round, through whichever gateway; an asynchronous one hands a model
    // version out again and again (each gateway flush), and each training of it is a result of its own
    if (!task.asynchronous && task["server-round"] <= this.trainedRound) {
      return {kind: "skipped", nextInS: 5, round: task["server-round"],  // trained, and sent through another gateway
              reason: "this device trained round " + task["server-round"] + " already (through another gateway)"};
    }
    const trained = await this.call({type: "train", weights: weights, config: task.config, seed: String(task.seed), ...data});
    this.trainedRound = task["server-round"];  // even if the result does not arrive: it may have, through this gateway
    const header = {task: task.task, kind: "train", "num-examples": trained.stats.numExamples,
                    "samples-processed": trained.stats.samplesProcessed, steps: trained.stats.steps,
                    metrics: {"train-loss": trained.stats.loss}, encoding: task.uplink || "fp32"};
    const out = {};
    for (const entry of this.manifest.state) {
      const shape = entry.shape;
      if (header.encoding === "int8-delta") {
        const {data, scale} = int8Delta(trained.weights[entry.name], weights[entry.name]);
        out[entry.name] = {data: data, shape: shape, scale: scale};
      } else {
        out[entry.name] = {data: trained.weights[entry.name], shape: shape};
      }
    }
    const frame = encodeFrame(header, out);
    // ... and if this task comes again, it did not: the same result is sent again (until the gateway answers it)
    this.unsent = {task: task.task, frame: frame, work: {loss: trained.stats.loss, numExamples: trained.stats.numExamples}};
    const sent = await this.result(frame);
    this.unsent = null;
    return {kind: sent.late ? "late" : "train", nextInS: sent["next-in-s"], round: task["server-round"],
            loss: trained.stats.loss, numExamples: trained.stats.numExamples, ...numRounds,
            ...(sent.late ? {reason: sent.reason} : {})};
  }

  // ---------------------------------------------------------------- secure aggregation
  // One SecAgg+ step the gateway asked for, answered (clients/protocol_device.py's _secure_step). Outcome kinds:
  // "secagg" (a step answered), "train" (the unmask step: this tab's update is in the pool's sum), "refused" (this
  // tab refused the step: reason), "late" (the step closed before the answer arrived: 409, normal).
  async secureStep(task, tensors, frame) {
    const action = String(task.action || "");
    const round = Number.isInteger(task["server-round"]) ? task["server-round"] : null;
    let reply, body;
    if (this.answered && task.task === this.answered.task) {
      // the step answered last, sent again: its answer did not reach the gateway; the same answer again
      ({reply, frame: body} = this.answered);
    } else {
      ({reply, frame: body} = await this.secureReply(action, task, tensors, frame));
      this.answered = {task: task.task, reply: reply, frame: body};
    }
    const sent = await this.result(body);
    const nextInS = sent["next-in-s"] ?? 0.5;
    if (sent.late) return {kind: "late", nextInS: nextInS, round: round, action: action, reason: sent.reason};
    if (reply.error) return {kind: "refused", nextInS: nextInS, round: round, action: action, reason: printable(reply.error)};
    if (action === "secagg_unmask") {
      return {kind: "train", nextInS: nextInS, round: round, secure: true, ...(this.secureWork || {})};
    }
    return {kind: "secagg", nextInS: nextInS, round: round, action: action,
            ...(action === "secagg_masked" && this.secureWork ? this.secureWork : {})};
  }

  // {reply (the answer's header), frame (its bytes)}: the step's answer, or the reason it is refused.
  async secureReply(action, task, tensors, frame) {
    let records = {}, out = {};
    if (!await loadSecureAggregation()) {
      const reply = {task: task.task, kind: "secagg", error: "this web device cannot load secagg.js: it takes no part " +
                     "in secure aggregation"};
      return {reply: reply, frame: encodeFrame(reply)};
    }
    try {
      if (!Number.isInteger(task["server-round"])) {
        throw new secagg.ProtocolViolation("malformed " + action + " step: 'server-round' is not a whole number");
      }
      [records, out] = await this.secureAnswer(action, task, tensors, frame);
      const reply = {task: task.task, kind: "secagg", records: secagg.recordsToJson(records)};
      return {reply: reply, frame: encodeFrame(reply, out)};
    } catch (error) {
      // a graph this tab refuses, or a gateway out of reach: not the step's fault; run() handles it (the step stays)
      if (error.network || /training bundle refused|training graph/.test(String(error.message))) throw error;
      this.secureRound = null;
      const reason = error instanceof secagg.ProtocolViolation ? error.message
        : "malformed " + action + " step (" + (error.name || "Error") + ": " + String(error.message || error) + ")";
      console.warn("device " + this.name + ": " + reason);
      const reply = {task: task.task, kind: "secagg", error: reason};
      return {reply: reply, frame: encodeFrame(reply)};
    }
  }

  async secureAnswer(action, task, tensors, frame) {
    const node = task.node, round = task["server-round"];
    if (!Number.isInteger(node)) {
      throw new secagg.ProtocolViolation("malformed " + action + " step: 'node' is not a whole number");
    }
    const records = secagg.recordsFromJson(task.records || {});
    if (action === "secagg_setup") {
      this.secureWork = null;
      secagg.checkNotUnmasked(this.unmasked, round);
      const {state, keys} = await secagg.setup(round);
      this.secureRound = {...state, me: node};
      return [{keys: keys}, {}];
    }
    const state = this.secureRound;
    if (!state) {
      throw new secagg.ProtocolViolation("refusing " + action + ": this device has no secure-aggregation round in " +
                                         "progress (a replayed or reordered step)");
    }
    if (state.me !== node) {
      throw new secagg.ProtocolViolation("refusing " + action + ": the gateway changed this device's node id mid-round");
    }
    const need = (name) => {
      if (!records[name]) throw new secagg.ProtocolViolation("malformed " + action + " step: no record '" + name + "'");
      return records[name];
    };
    if (action === "secagg_share") return [{sealed: await secagg.share(state, need("peers"), node)}, {}];
    if (action === "secagg_masked") return this.secureMasked(state, task, records, tensors, frame, node);
    if (action === "secagg_consistency") {
      return [{consistency: {signature: await secagg.consistency(state, need("check"), node)}}, {}];
    }
    if (action === "secagg_unmask") {
      const revealed = await secagg.unmask(state, need("ask"), node);
      this.secureRound = null;
      this.unmasked = state.round;
      return [{revealed: revealed}, {}];
    }
    throw new secagg.ProtocolViolation("refusing '" + action.slice(0, 40) + "': not a secure-aggregation step");
  }

  // The masked step: train on the step's global arrays with the worker (as a plain round), mask the update, sign the
  // digests of the model and config received. The config digest reads the header's own text (parsePython), so that
  // 1.0 stays a float and 1 an int, as a Python device's json reading keeps them.
  async secureMasked(state, task, records, tensors, frame, node) {
    for (const name of ["config", "inbox", "secagg"]) {
      if (!records[name]) throw new secagg.ProtocolViolation("malformed secagg_masked step: no record '" + name + "'");
    }
    const weights = {}, arrays = [];
    for (const [key, tensor] of Object.entries(tensors)) {
      if (!key.startsWith("arrays/")) continue;
      const name = key.slice("arrays/".length);
      weights[name] = tensor.data;
      arrays.push({name: name, shape: tensor.shape, data: tensor.data});
    }
    await this.ready(task.graph);
    const data = this.preparedData();
    const typed = secagg.parsePython(secagg.frameHeaderText(frame)).records;
    const train = async () => {
      const trained = await this.call({type: "train", weights: weights, config: records.config, seed: String(task.seed), ...data});
      this.secureWork = {loss: trained.stats.loss, numExamples: trained.stats.numExamples};
      return {arrays: trained.weights, numExamples: trained.stats.numExamples, steps: trained.stats.steps};
    };
    const answer = await secagg.masked(state, {inbox: records.inbox, params: records.secagg, config: records.config,
                                               typedRecords: [typed.config, typed.secagg], globalArrays: arrays,
                                               me: node, train: train});
    if (answer.bad) {
      this.secureRound = null;
      return [{"secagg-bad-shares": {senders: answer.bad}}, {}];
    }
    return [{"secagg-received": answer.received, fedge: {"server-round": state.round}},
            {"masked/vector": {data: answer.vector, shape: [answer.vector.length]}}];
  }

  // The gateway's answer to a result; {late: true, reason} when it came after its round closed (409): normal.
  async result(frame) {
    const answer = await this.authenticated("POST", PREFIX + "/result", frame);
    if (answer.status === 409) {
      let body = {};
      try { body = JSON.parse(new TextDecoder().decode(answer.body)) || {}; } catch (e) { body = {}; }
      return {late: true, reason: printable(body.error || "the round had closed"), "next-in-s": body["next-in-s"] || 1};
    }
    return FedgeDevice.json(answer, "result");
  }

  // Poll until the gateway says the run is over, stop() is called or (when given) `rounds` train tasks are done,
  // waiting what the gateway says. Resolves with {kind: "done" | "rounds" | "stopped", trained, reason (for "done")}.
  // Rejects on a refused training bundle, a refused check-in, or maxNetworkFailures requests in a row that got no
  // answer (the error names the likely causes).
  // Once the gateway has answered, an unreachable gateway is one that restarts or a network that comes and
  // goes: run() keeps trying, backing off to maxWaitS between tries, and never stops for it.
  async run({rounds = Infinity, maxWaitS = 30, onProgress = () => {}} = {}) {
    let trained = 0, unreachable = 0, reached = false;
    this.stopped = false;
    while (!this.stopped && trained < rounds) {
      let outcome;
      try {
        outcome = await this.poll();
        unreachable = 0;
        reached = true;
      } catch (error) {
        outcome = {kind: "error", nextInS: 2, error: String(error.message || error)};
        if (/training bundle refused|cannot take part/.test(outcome.error)) { onProgress(outcome); throw error; }
        unreachable = error.network ? unreachable + 1 : 0;
        if (reached && unreachable) outcome.nextInS = Math.min(2 ** Math.min(unreachable, 5), maxWaitS);
        if (error.network && this.gateways.length > 1) {  // the next gateway named: at once, until each was tried
          this.nextGateway();
          outcome.error += "; checking in at " + this.gateway;
          if (unreachable % this.gateways.length) outcome.nextInS = 0;
        }
        if (!reached && unreachable >= this.maxNetworkFailures) {
          const stop = new Error(this.unreachable(unreachable, outcome.error));
          onProgress({...outcome, error: stop.message, trained: trained});
          throw stop;
        }
      }
      if (this.inputsNotice) {  // the data's verdict against the task's declared ranges, once
        onProgress({kind: "inputs", ...this.inputsNotice, trained: trained});
        this.inputsNotice = null;
      }
      if (outcome.kind === "train") trained++;
      onProgress({...outcome, trained: trained});
      if (outcome.kind === "done") return {kind: "done", trained: trained, reason: outcome.reason};
      await new Promise((resolve) => setTimeout(resolve, 1000 * Math.min(outcome.nextInS || 0, maxWaitS)));
    }
    return {kind: this.stopped ? "stopped" : "rounds", trained: trained};
  }

  stop() { this.stopped = true; }

  // Why a gateway that never answers is most likely out of reach, and what to do (a browser hides the cause).
  unreachable(failures, last) {
    const origin = typeof location !== "undefined" ? location.origin : "this app's origin";
    const own = typeof location !== "undefined" && new URL(this.gateway).origin === location.origin;
    return "stopped: " + failures + " requests in a row to the gateway at " + this.gateway + " got no answer (" + last +
      "). A browser does not say why; the likely causes: " +
      (own ? "" : "(1) CORS: the gateway does not allow this page's origin " + origin + ": its operator starts it with " +
                  "`fedge gateway start ... --allow-origin " + origin + "`; ") +
      (own ? "(1)" : "(2)") + " TLS trust: this browser does not trust the gateway's certificate: install the CA that " +
      "signed it (the coordinator's ca.crt) in the browser's or the system's trust store, then open " + this.gateway +
      "/v1/hello once to check; " + (own ? "(2)" : "(3)") + " the gateway is not running at that address, or the " +
      "network blocks it. The browser's console names the cause.";
  }

  // The coordinator's latest signed inference bundle, relayed by the gateway: verified (signature,
  // hashes, expiry, graph checks), refused if of another lineage than the one this device follows (the
  // app's modelId, else the first it accepted) or older than the highest version it accepted of its
  // lineage (a rollback), then loaded in the worker and recorded (localStorage).
  async model() {
    const answer = await this.authenticated("GET", PREFIX + "/bundles/inference");
    if (answer.status !== 200) FedgeDevice.json(answer, "inference bundle");
    const trusted = await importBundleKey(this.bundleKeyPem);
    const {manifest, model} = await verifyInferenceBundle(answer.body, trusted, this.freshness("inference"));
    await this.call({type: "model", ortBase: this.ortBase, model: model});
    this.accepted("inference", manifest);
    this.inference = manifest;
    return manifest;
  }

  // The signed inference model on the app's inputs ({data, dims}, as the manifest's first input takes
  // them): its first output. Pulls the model first if this device holds none.
  async predict(input) {
    if (!this.inference) await this.model();
    const spec = this.inference.inputs[0];
    return (await this.call({type: "infer", input: spec.name, dtype: spec.dtype, data: input.data, dims: input.dims})).output;
  }
}
