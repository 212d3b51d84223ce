// Verify a fedge training or inference bundle in the browser before onnxruntime-web sees a byte of it.
//
// What fedge.edge.training_bundle.read_training_bundle checks in Python, done with WebCrypto:
// the zip holds manifest.json, manifest.sig and exactly the files the manifest lists, each
// stored or deflated at the top level, each name once; manifest.sig is an Ed25519 signature
// over manifest.json by the pinned bundle key (the coordinator's `signing.pub`); every file has
// its listed SHA-256 and size; the bundle is a training bundle that has not expired; its lineage
// and version pass the device's freshness record (checkFreshness); and each graph passes
// checkGraph (onnx-check.js: no external data, standard ONNX ops, the ops the signed manifest
// lists, not ORT-format bytes). Any failure throws an Error naming the bundle ("training bundle
// refused: ..." or "inference bundle refused: ...") and the reason; nothing is loaded.
//
// Threat model: the gateway relays the bundle and may be hostile. A valid signature says the
// coordinator shipped the graphs; the freshness record stops an older signed bundle of the same
// lineage (a rollback) and a bundle of another lineage (another run's, signed by the same key);
// the graph checks stop a signed graph that would read data it was not handed.

import {checkGraph} from "./onnx-check.js";

const MAX_ENTRIES = 16;
const TRAINING_FORMAT = "fedge-training-bundle/1";

// Each kind of bundle refuses under its own name: fail("training", reason) or fail("inference", reason).
function fail(kind, reason) { throw new Error(kind + " bundle refused: " + reason); }

function u16(view, at) { return view.getUint16(at, true); }
function u32(view, at) { return view.getUint32(at, true); }

const MAX_ENTRY = 64 << 20, MAX_TOTAL = 256 << 20, MAX_RATIO = 1032;  // deflate expands at most ~1032x

// Inflate `data`, refusing (and stopping) past `limit` bytes: a zip bomb costs at most `limit`.
async function inflate(data, limit, name, kind) {
  const reader = new Blob([data]).stream().pipeThrough(new DecompressionStream("deflate-raw")).getReader();
  const out = new Uint8Array(limit);
  let at = 0;
  for (;;) {
    const {done, value} = await reader.read();
    if (done) return out.subarray(0, at);
    if (at + value.length > limit) { await reader.cancel(); fail(kind, "entry " + name + " inflates past its declared size"); }
    out.set(value, at);
    at += value.length;
  }
}

// The zip's entries by name, each read on demand (central directory read; declared sizes bounded).
export async function unzip(buffer, kind = "training") {
  const bytes = new Uint8Array(buffer);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  let end = -1;
  for (let at = bytes.length - 22; at >= Math.max(0, bytes.length - 22 - 65535); at--) {
    if (u32(view, at) === 0x06054b50) { end = at; break; }
  }
  if (end < 0) fail(kind, "not a zip archive");
  const count = u16(view, end + 10);
  if (count > MAX_ENTRIES) fail(kind, "more than " + MAX_ENTRIES + " entries");
  let at = u32(view, end + 16), total = 0;
  const files = {};
  for (let i = 0; i < count; i++) {
    if (at + 46 > bytes.length || u32(view, at) !== 0x02014b50) fail(kind, "a damaged central directory");
    const method = u16(view, at + 10), packed = u32(view, at + 20), size = u32(view, at + 24);
    const nameLength = u16(view, at + 28), extra = u16(view, at + 30), comment = u16(view, at + 32);
    const local = u32(view, at + 42);
    const name = new TextDecoder().decode(bytes.subarray(at + 46, at + 46 + nameLength));
    at += 46 + nameLength + extra + comment;
    if (!/^[A-Za-z0-9_.-]+$/.test(name) || name.startsWith(".")) fail(kind, "a nested, hidden or odd entry name " + JSON.stringify(name));
    if (name in files) fail(kind, "entry " + name + " appears twice");
    if (method !== 0 && method !== 8) fail(kind, "entry " + name + " uses zip method " + method + " (only stored and deflate)");
    if (local + 30 > bytes.length || u32(view, local) !== 0x04034b50) fail(kind, "a damaged local header for " + name);
    const start = local + 30 + u16(view, local + 26) + u16(view, local + 28);
    if (start + packed > bytes.length) fail(kind, "entry " + name + " runs past the archive");
    total += size;
    if (size > MAX_ENTRY || total > MAX_TOTAL || (method === 0 ? size !== packed : size > packed * MAX_RATIO + 1024)) {
      fail(kind, "entry " + name + " declares a size its archive cannot hold");
    }
    const raw = bytes.subarray(start, start + packed);
    files[name] = async () => {
      const data = method === 0 ? raw.slice() : await inflate(raw, size, name, kind);
      if (data.length !== size) fail(kind, "entry " + name + " is not its declared size");
      return data;
    };
  }
  return files;
}

export async function sha256Hex(data) {
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", data));
  return Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join("");
}

function pemBody(pem) {
  const text = pem.replace(/-----[^-]+-----/g, "").replace(/\s+/g, "");
  return Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
}

// The pinned bundle key: the PEM of `fedge keys signing init`'s signing.pub (Ed25519 SPKI).
export async function importBundleKey(pem) {
  const spki = pemBody(pem);
  const key = await crypto.subtle.importKey("spki", spki, {name: "Ed25519"}, true, ["verify"]);
  const raw = new Uint8Array(await crypto.subtle.exportKey("raw", key));
  return {key: key, fingerprint: "sha256:" + await sha256Hex(raw)};
}

// Signature, files, expiry: what both kinds of bundle share. The manifest, and the files by name.
async function verifySigned(buffer, trusted, now, kind) {
  const entries = await unzip(buffer, kind);
  if (!entries["manifest.json"] || !entries["manifest.sig"]) fail(kind, "manifest.json or manifest.sig is missing");
  const manifestBytes = await entries["manifest.json"](), envelopeBytes = await entries["manifest.sig"]();
  let envelope;
  try { envelope = JSON.parse(new TextDecoder().decode(envelopeBytes)); } catch (e) { fail(kind, "manifest.sig is malformed"); }
  if (envelope.algorithm !== "ed25519") fail(kind, "manifest.sig uses " + envelope.algorithm + "; only ed25519 is accepted");
  if (envelope.key_fingerprint !== trusted.fingerprint) fail(kind, "it is signed by untrusted key " + String(envelope.key_fingerprint).slice(0, 80));
  const signature = Uint8Array.from(atob(envelope.signature), (c) => c.charCodeAt(0));
  if (!await crypto.subtle.verify({name: "Ed25519"}, trusted.key, signature, manifestBytes)) {
    fail(kind, "the signature does not verify: manifest.json or manifest.sig was altered after signing");
  }
  let manifest;
  try { manifest = JSON.parse(new TextDecoder().decode(manifestBytes)); } catch (e) { fail(kind, "manifest.json is not JSON"); }
  if (!manifest || typeof manifest !== "object" || Array.isArray(manifest)) fail(kind, "manifest.json is not an object");
  if (manifest.expires_at !== undefined && manifest.expires_at !== null) {
    const expires = Date.parse(manifest.expires_at);
    if (Number.isNaN(expires)) fail(kind, "its expires_at is not a time");
    if (expires < now) fail(kind, "it expired at " + manifest.expires_at);
  }
  const listed = manifest.files || {};
  const present = Object.keys(entries).filter((n) => n !== "manifest.json" && n !== "manifest.sig");
  const extra = present.filter((n) => !(n in listed)), missing = Object.keys(listed).filter((n) => !(n in entries));
  if (extra.length || missing.length) fail(kind, "files " + JSON.stringify({missing: missing, extra: extra}) + " differ from the manifest");
  const files = {};
  for (const [name, entry] of Object.entries(listed)) {  // read only now: after the signature, each file once
    files[name] = await entries[name]();
    if (files[name].length !== entry.bytes || await sha256Hex(files[name]) !== entry.sha256) {
      fail(kind, name + ": its SHA-256 does not match manifest.json (altered or damaged)");
    }
  }
  return {manifest: manifest, files: files};
}

// Freshness and lineage, as fedge.edge.delivery.pull and fedge.edge.bundle.FreshnessStore do: `record` is
// what this device accepted of this kind ({pin: the model_id it follows or null, highest: {model_id:
// version}}); `modelId` names the lineage to accept (the app's choice), else the pinned one is the only
// one accepted. A version lower than the highest accepted of its lineage is a rollback. Nothing is
// recorded here: recordAccepted once the bundle is in use.
export function checkFreshness(kind, manifest, record, modelId = null) {
  if (!Number.isInteger(manifest.version) || manifest.version < 0 || typeof manifest.model_id !== "string") {
    fail(kind, "its manifest has no model_id and version, so a rollback could not be told apart");
  }
  const follows = modelId ?? record.pin ?? null;
  if (follows !== null && manifest.model_id !== follows) {
    fail(kind, "it is of model " + JSON.stringify(manifest.model_id) + ", but this device follows model " +
         JSON.stringify(follows) + (modelId ? " (the app's modelId)" : " (pinned when it first accepted one)") +
         "; a bundle of another lineage is accepted only when the app names it (" +
         (kind === "training" ? "trainingModelId" : "modelId") + ")");
  }
  const highest = record.highest[manifest.model_id];
  if (highest !== undefined && manifest.version < highest) {
    fail(kind, "it is version " + manifest.version + " of " + manifest.model_id + ", older than version " + highest +
         " this device accepted: a rollback");
  }
}

// `record` after the bundle of `manifest` was put in use: its lineage pinned, its version the highest.
export function recordAccepted(record, manifest) {
  const highest = {...record.highest};
  highest[manifest.model_id] = Math.max(manifest.version, highest[manifest.model_id] ?? 0);
  return {pin: manifest.model_id, highest: highest};
}

// A training bundle: signature, files, expiry; freshness (when `freshness` = {record, modelId} is given:
// the SDK always gives it); the graph checks of train.onnx and eval.onnx against the manifest's op lists.
export async function verifyTrainingBundle(buffer, trusted, freshness = null, now = Date.now()) {
  const kind = "training";
  const {manifest, files} = await verifySigned(buffer, trusted, now, kind);
  if (manifest.kind !== "training" || manifest.format !== TRAINING_FORMAT) fail(kind, "it is not a training bundle");
  if (freshness) checkFreshness(kind, manifest, freshness.record, freshness.modelId);
  if (manifest.optimizer !== "sgd-momentum") fail(kind, "its optimizer is " + manifest.optimizer + ", not sgd-momentum");
  const both = new Uint8Array(files["train.onnx"].length + files["eval.onnx"].length);
  both.set(files["train.onnx"]);
  both.set(files["eval.onnx"], files["train.onnx"].length);
  if (manifest.architecture !== await sha256Hex(both)) fail(kind, "its architecture is not the SHA-256 of its graphs");
  for (const name of ["train.onnx", "eval.onnx"]) {
    const declared = ((manifest.graph_ops || {})[name] || {}).ops;
    if (!declared) fail(kind, "the manifest lists no ops for " + name);
    checkGraph(files[name], name, declared, kind);
  }
  return {manifest: manifest, train: files["train.onnx"], eval: files["eval.onnx"]};
}

// An inference bundle (`fedge export`, published by the coordinator, relayed by the gateway):
// signature, files and expiry as above; then freshness and lineage (checkFreshness with `freshness` =
// {record, modelId}); then the graph checks of the fp32 model. The manifest and that model's bytes.
export async function verifyInferenceBundle(buffer, trusted, freshness, now = Date.now()) {
  const kind = "inference";
  const {manifest, files} = await verifySigned(buffer, trusted, now, kind);
  if (manifest.format !== "fedge-bundle/1") fail(kind, "it is not an inference bundle (format fedge-bundle/1)");
  checkFreshness(kind, manifest, freshness.record, freshness.modelId);
  const file = ((manifest.variants || {}).fp32 || {}).file;
  if (!file || !files[file]) fail(kind, "it has no fp32 model");
  checkGraph(files[file], file, null, kind);
  return {manifest: manifest, model: files[file]};
}
