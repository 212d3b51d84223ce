// fedge's training loop in a Web Worker, so the page stays responsive while a device trains.
//
// The semantics are fedge.edge.trainer.OnnxTrainer's (fedge.task.training.MomentumSGD): the
// training graph gives the mean loss of a batch and the gradient of every trainable weight; the
// step runs here in float32: v = g on the first step, then v = m v + g; p -= lr v; FedProx adds
// mu (p - p_start) to the gradient. Batches are fedge.batching.batch_order's, drawn with numpy's own
// generator (batch-order.js), so a browser device sends the update a Python device would.
//
// Messages: {id, type: "load", ortBase, train, eval, manifest} -> {id, ok}
//           {id, type: "train", weights, inputs, targets, config, seed} -> {id, weights, stats}
//           {id, type: "evaluate", weights, inputs, targets} -> {id, metrics, numExamples}
//           {id, type: "model", ortBase, model} -> {id, ok}   (a verified inference model)
//           {id, type: "infer", input, dtype, data, dims} -> {id, output: {data, dims}}
// inputs: [{data: TypedArray, dims}] in the manifest's input order; targets: {data, dims}.
"use strict";

importScripts("batch-order.js");  // fedgeBatchOrder: numpy's batch order

let trainSession = null, evalSession = null, manifest = null, modelSession = null;

const TYPES = {float32: Float32Array, float64: Float64Array, int64: BigInt64Array, int32: Int32Array,
               uint8: Uint8Array, int8: Int8Array, bool: Uint8Array};

function tensor(dtype, data, dims) { return new ort.Tensor(dtype, data, dims); }

// Every session reads its bytes as ONNX, never as an ORT-format model (onnxruntime picks that format
// when bytes 4..8 are "ORTM", and a file can be both: onnx-check.js checks the ONNX reading and refuses
// such bytes, and this pin makes onnxruntime-web run the reading that was checked).
function sessionOptions() {
  return {executionProviders: ["wasm"], extra: {session: {load_model_format: "ONNX"}}};
}

function rows(source, dims, index) {  // the rows `index` of an array shaped [N, ...]
  const width = dims.slice(1).reduce((a, b) => a * b, 1);
  const out = new source.constructor(index.length * width);
  for (let i = 0; i < index.length; i++) out.set(source.subarray(index[i] * width, (index[i] + 1) * width), i * width);
  return out;
}

function feeds(weights, inputs, targets, index) {  // the graph's feeds for the examples `index`
  const out = {};
  for (const entry of manifest.state) {
    out["state:" + entry.name] = tensor(entry.dtype, weights[entry.name], entry.shape);
  }
  manifest.inputs.forEach((spec, i) => {
    out[spec.name] = tensor(spec.dtype, rows(inputs[i].data, inputs[i].dims, index), [index.length, ...inputs[i].dims.slice(1)]);
  });
  out.targets = tensor(manifest.targets.dtype, rows(targets.data, targets.dims, index), [index.length, ...targets.dims.slice(1)]);
  return out;
}

function setting(config, key, fallback) {
  const value = config[key] === undefined ? fallback : config[key];
  if (typeof value !== "number" || !Number.isFinite(value)) throw new Error("the task's config has no number '" + key + "'");
  return value;
}

async function train(message) {
  const config = message.config;
  const lr = Math.fround(setting(config, "learning-rate")), momentum = Math.fround(setting(config, "momentum"));
  const mu = Math.fround(setting(config, "proximal-mu", 0));
  const batch = setting(config, "batch-size"), epochs = setting(config, "local-epochs");
  const weights = {};  // copies, each in its manifest dtype (buffers such as int64 counters pass through unchanged)
  for (const entry of manifest.state) weights[entry.name] = new TYPES[entry.dtype](message.weights[entry.name]);
  const anchor = {}, velocity = {};
  const trainable = manifest.state.filter((e) => e.trainable);
  for (const entry of trainable) anchor[entry.name] = Float32Array.from(weights[entry.name]);
  const size = message.targets.dims[0];
  let total = 0, seen = 0, steps = 0;
  for (const index of fedgeBatchOrder.batchOrder(size, batch, message.seed, epochs)) {
    {
      const out = await trainSession.run(feeds(weights, message.inputs, message.targets, index));
      for (const entry of trainable) {
        const p = weights[entry.name], g = out["grad:" + entry.name].data, a = anchor[entry.name];
        const v = velocity[entry.name];
        const nv = v || new Float32Array(p.length);
        for (let i = 0; i < p.length; i++) {  // MomentumUpdate: the proximal term when mu > 0, momentum when m > 0
          const grad = mu > 0 ? Math.fround(g[i] + Math.fround(mu * Math.fround(p[i] - a[i]))) : g[i];
          nv[i] = v && momentum > 0 ? Math.fround(Math.fround(momentum * v[i]) + grad) : grad;
          p[i] = Math.fround(p[i] - Math.fround(lr * nv[i]));
        }
        velocity[entry.name] = nv;
      }
      total += Number(out.loss.data[0]) * index.length;
      seen += index.length;
      steps += 1;
    }
  }
  return {weights: weights, stats: {loss: total / Math.max(seen, 1), numExamples: size, samplesProcessed: seen, steps: steps}};
}

// fedge.edge.trainer.NUMPY_METRICS, per batch: accuracy (argmax over the last axis), mse and mae
// (the output squeezed to the targets' shape)
const METRICS = {
  accuracy: (output, targets, n) => {
    const classes = output.data.length / n;
    let correct = 0;
    for (let i = 0; i < n; i++) {
      let best = 0;
      for (let c = 1; c < classes; c++) if (output.data[i * classes + c] > output.data[i * classes + best]) best = c;
      correct += best === Number(targets[i]) ? 1 : 0;
    }
    return correct / n;
  },
  mse: (output, targets) => targets.reduce((sum, t, i) => sum + (output.data[i] - Number(t)) ** 2, 0) / targets.length,
  mae: (output, targets) => targets.reduce((sum, t, i) => sum + Math.abs(output.data[i] - Number(t)), 0) / targets.length,
};

async function evaluate(message) {
  const size = message.targets.dims[0];
  const names = (manifest.metrics || []).filter((name) => name in METRICS);
  const sums = {loss: 0};
  for (const name of names) sums[name] = 0;
  for (let start = 0; start < size; start += 256) {
    const index = Array.from({length: Math.min(256, size - start)}, (_, i) => start + i);
    const out = await evalSession.run(feeds(message.weights, message.inputs, message.targets, index));
    sums.loss += Number(out.loss.data[0]) * index.length;
    const targets = Array.from(rows(message.targets.data, message.targets.dims, index));
    for (const name of names) sums[name] += METRICS[name](out.output, targets, index.length) * index.length;
  }
  const metrics = {};
  for (const [name, total] of Object.entries(sums)) metrics[name] = total / size;
  return {metrics: metrics, numExamples: size};
}

self.onmessage = async function (event) {
  const message = event.data;
  try {
    if (message.type === "load") {
      if (typeof ort === "undefined") {
        importScripts(message.ortBase + "ort.wasm.min.js");
        ort.env.wasm.numThreads = 1;  // no SharedArrayBuffer, so no cross-origin isolation needed
        ort.env.wasm.wasmPaths = message.ortBase;
      }
      manifest = message.manifest;
      trainSession = await ort.InferenceSession.create(message.train, sessionOptions());
      evalSession = await ort.InferenceSession.create(message.eval, sessionOptions());
      self.postMessage({id: message.id, ok: true});
    } else if (message.type === "train") {
      self.postMessage({id: message.id, ...(await train(message))});
    } else if (message.type === "evaluate") {
      self.postMessage({id: message.id, ...(await evaluate(message))});
    } else if (message.type === "model") {
      if (typeof ort === "undefined") {
        importScripts(message.ortBase + "ort.wasm.min.js");
        ort.env.wasm.numThreads = 1;
        ort.env.wasm.wasmPaths = message.ortBase;
      }
      modelSession = await ort.InferenceSession.create(message.model, sessionOptions());
      self.postMessage({id: message.id, ok: true});
    } else if (message.type === "infer") {
      const out = await modelSession.run({[message.input]: tensor(message.dtype, message.data, message.dims)});
      const output = out[modelSession.outputNames[0]];
      self.postMessage({id: message.id, output: {data: output.data, dims: output.dims}});
    }
  } catch (error) {
    self.postMessage({id: message.id, error: String(error && error.message || error)});
  }
};
