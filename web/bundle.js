// Verify a fedge training bundle in the browser before onnxruntime-web sees a byte of it.
//
// What fedge.edge.training_bundle.read_training_bundle checks in Python, done with WebCrypto:
// the zip holds manifest.json, manifest.sig and exactly the files the manifest lists, each
// stored or deflated at the top level, each name once; manifest.sig is an Ed25519 signature
// over manifest.json by the pinned bundle key (the coordinator's `signing.pub`); every file has
// its listed SHA-256 and size; the bundle is a training bundle that has not expired; and each
// graph passes checkGraph (onnx-check.js: no external data, standard ONNX ops, the ops the
// signed manifest lists). Any failure throws an Error naming it; nothing is loaded.
//
// Threat model: the gateway relays the bundle and may be hostile. A valid signature says the
// coordinator shipped the graphs; the graph checks stop a signed graph that would read data
// it was not handed.

import {checkGraph} from "./onnx-check.js";

const MAX_ENTRIES = 16;
const TRAINING_FORMAT = "fedge-training-bundle/1";

function fail(reason) { throw new Error("training bundle refused: " + reason); }

function u16(view, at) { return view.getUint16(at, true); }
function u32(view, at) { return view.getUint32(at, true); }

const MAX_ENTRY = 64 << 20, MAX_TOTAL = 256 << 20, MAX_RATIO = 1032;  // deflate expands at most ~1032x

// Inflate `data`, refusing (and stopping) past `limit` bytes: a zip bomb costs at most `limit`.
async function inflate(data, limit, name) {
  const reader = new Blob([data]).stream().pipeThrough(new DecompressionStream("deflate-raw")).getReader();
  const out = new Uint8Array(limit);
  let at = 0;
  for (;;) {
    const {done, value} = await reader.read();
    if (done) return out.subarray(0, at);
    if (at + value.length > limit) { await reader.cancel(); fail("entry " + name + " inflates past its declared size"); }
    out.set(value, at);
    at += value.length;
  }
}

// The zip's entries by name, each read on demand (central directory read; declared sizes bounded).
export async function unzip(buffer) {
  const bytes = new Uint8Array(buffer);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  let end = -1;
  for (let at = bytes.length - 22; at >= Math.max(0, bytes.length - 22 - 65535); at--) {
    if (u32(view, at) === 0x06054b50) { end = at; break; }
  }
  if (end < 0) fail("not a zip archive");
  const count = u16(view, end + 10);
  if (count > MAX_ENTRIES) fail("more than " + MAX_ENTRIES + " entries");
  let at = u32(view, end + 16), total = 0;
  const files = {};
  for (let i = 0; i < count; i++) {
    if (at + 46 > bytes.length || u32(view, at) !== 0x02014b50) fail("a damaged central directory");
    const method = u16(view, at + 10), packed = u32(view, at + 20), size = u32(view, at + 24);
    const nameLength = u16(view, at + 28), extra = u16(view, at + 30), comment = u16(view, at + 32);
    const local = u32(view, at + 42);
    const name = new TextDecoder().decode(bytes.subarray(at + 46, at + 46 + nameLength));
    at += 46 + nameLength + extra + comment;
    if (!/^[A-Za-z0-9_.-]+$/.test(name) || name.startsWith(".")) fail("a nested, hidden or odd entry name " + JSON.stringify(name));
    if (name in files) fail("entry " + name + " appears twice");
    if (method !== 0 && method !== 8) fail("entry " + name + " uses zip method " + method + " (only stored and deflate)");
    if (local + 30 > bytes.length || u32(view, local) !== 0x04034b50) fail("a damaged local header for " + name);
    const start = local + 30 + u16(view, local + 26) + u16(view, local + 28);
    if (start + packed > bytes.length) fail("entry " + name + " runs past the archive");
    total += size;
    if (size > MAX_ENTRY || total > MAX_TOTAL || (method === 0 ? size !== packed : size > packed * MAX_RATIO + 1024)) {
      fail("entry " + name + " declares a size its archive cannot hold");
    }
    const raw = bytes.subarray(start, start + packed);
    files[name] = async () => {
      const data = method === 0 ? raw.slice() : await inflate(raw, size, name);
      if (data.length !== size) fail("entry " + name + " is not its declared size");
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
async function verifySigned(buffer, trusted, now) {
  const entries = await unzip(buffer);
  if (!entries["manifest.json"] || !entries["manifest.sig"]) fail("manifest.json or manifest.sig is missing");
  const manifestBytes = await entries["manifest.json"](), envelopeBytes = await entries["manifest.sig"]();
  let envelope;
  try { envelope = JSON.parse(new TextDecoder().decode(envelopeBytes)); } catch (e) { fail("manifest.sig is malformed"); }
  if (envelope.algorithm !== "ed25519") fail("manifest.sig uses " + envelope.algorithm + "; only ed25519 is accepted");
  if (envelope.key_fingerprint !== trusted.fingerprint) fail("it is signed by untrusted key " + String(envelope.key_fingerprint).slice(0, 80));
  const signature = Uint8Array.from(atob(envelope.signature), (c) => c.charCodeAt(0));
  if (!await crypto.subtle.verify({name: "Ed25519"}, trusted.key, signature, manifestBytes)) {
    fail("the signature does not verify: manifest.json or manifest.sig was altered after signing");
  }
  const manifest = JSON.parse(new TextDecoder().decode(manifestBytes));
  if (manifest.expires_at !== undefined && manifest.expires_at !== null) {
    const expires = Date.parse(manifest.expires_at);
    if (Number.isNaN(expires)) fail("its expires_at is not a time");
    if (expires < now) fail("it expired at " + manifest.expires_at);
  }
  const listed = manifest.files || {};
  const present = Object.keys(entries).filter((n) => n !== "manifest.json" && n !== "manifest.sig");
  const extra = present.filter((n) => !(n in listed)), missing = Object.keys(listed).filter((n) => !(n in entries));
  if (extra.length || missing.length) fail("files " + JSON.stringify({missing: missing, extra: extra}) + " differ from the manifest");
  const files = {};
  for (const [name, entry] of Object.entries(listed)) {  // read only now: after the signature, each file once
    files[name] = await entries[name]();
    if (files[name].length !== entry.bytes || await sha256Hex(files[name]) !== entry.sha256) {
      fail(name + ": its SHA-256 does not match manifest.json (altered or damaged)");
    }
  }
  return {manifest: manifest, files: files};
}

export async function verifyTrainingBundle(buffer, trusted, now = Date.now()) {
  const {manifest, files} = await verifySigned(buffer, trusted, now);
  if (manifest.kind !== "training" || manifest.format !== TRAINING_FORMAT) fail("it is not a training bundle");
  if (manifest.optimizer !== "sgd-momentum") fail("its optimizer is " + manifest.optimizer + ", not sgd-momentum");
  const both = new Uint8Array(files["train.onnx"].length + files["eval.onnx"].length);
  both.set(files["train.onnx"]);
  both.set(files["eval.onnx"], files["train.onnx"].length);
  if (manifest.architecture !== await sha256Hex(both)) fail("its architecture is not the SHA-256 of its graphs");
  for (const name of ["train.onnx", "eval.onnx"]) {
    const declared = ((manifest.graph_ops || {})[name] || {}).ops;
    if (!declared) fail("the manifest lists no ops for " + name);
    checkGraph(files[name], name, declared);
  }
  return {manifest: manifest, train: files["train.onnx"], eval: files["eval.onnx"]};
}

// An inference bundle (`fedge export`, published by the coordinator, relayed by the gateway):
// signature, files and expiry as above; then freshness, as fedge.edge.bundle.FreshnessStore: a
// version lower than highestFor(model_id) (the highest this device accepted for that model) is a
// rollback and refused; then the graph checks of the fp32 model. The manifest and that model's bytes.
export async function verifyInferenceBundle(buffer, trusted, highestFor, now = Date.now()) {
  const {manifest, files} = await verifySigned(buffer, trusted, now);
  if (manifest.format !== "fedge-bundle/1") fail("it is not an inference bundle (format fedge-bundle/1)");
  if (!Number.isInteger(manifest.version) || typeof manifest.model_id !== "string") {
    fail("its manifest has no model_id and version, so a rollback could not be told apart");
  }
  const highest = highestFor(manifest.model_id);
  if (highest !== null && highest !== undefined && manifest.version < highest) {
    fail("it is version " + manifest.version + " of " + manifest.model_id + ", older than version " + highest +
         " this device accepted: a rollback");
  }
  const file = ((manifest.variants || {}).fp32 || {}).file;
  if (!file || !files[file]) fail("it has no fp32 model");
  checkGraph(files[file], file, null);
  return {manifest: manifest, model: files[file]};
}
