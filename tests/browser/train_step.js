// One (or more) training steps of a fedge training graph in onnxruntime-web.
//
// case.json (or the file named by ?case=) says what to feed and how to step:
//   {"graph": "train.onnx", "learning_rate": 0.05, "momentum": 0.9, "steps": 1,
//    "loss": "loss",
//    "feeds": [{"name": "state:net.0.weight", "dtype": "float32", "dims": [64, 64], "data": "<base64>"}, ...],
//    "params": [{"name": "net.0.weight", "input": "state:net.0.weight", "grad": "grad:net.0.weight"}, ...]}
// The graph gives the loss and the gradients; the optimiser step is done here, in float32:
//   v = m * v + g;  p = p - lr * v   (v starts at 0, so one step is p - lr * g).
// The result goes to window.__result ({losses, weights: {name: base64 float32}, ...});
// any failure to window.__error.
"use strict";

(function () {
  const TYPED = {float32: Float32Array, int64: BigInt64Array, int32: Int32Array, uint8: Uint8Array,
                 bool: Uint8Array, float64: Float64Array};

  function fromBase64(text, dtype) {
    const raw = atob(text);
    const bytes = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    const Typed = TYPED[dtype];
    if (!Typed) throw new Error("unsupported dtype " + dtype);
    return new Typed(bytes.buffer);
  }

  function toBase64(typed) {
    const bytes = new Uint8Array(typed.buffer, typed.byteOffset, typed.byteLength);
    let raw = "";
    for (let i = 0; i < bytes.length; i += 0x8000) {
      raw += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
    }
    return btoa(raw);
  }

  async function main() {
    const base = new URL(".", window.location.href).href;
    ort.env.wasm.numThreads = 1;  // no SharedArrayBuffer, so no cross-origin isolation needed
    ort.env.wasm.proxy = false;
    ort.env.wasm.wasmPaths = base;  // ort-wasm-simd-threaded.{mjs,wasm} from this same loopback folder
    // case.json, or the file ?case= names; never from the HTTP cache (the test rewrites them)
    const caseFile = new URLSearchParams(window.location.search).get("case") || "case.json";
    const spec = await (await fetch(caseFile, {cache: "no-store"})).json();
    const graph = new Uint8Array(await (await fetch(spec.graph, {cache: "no-store"})).arrayBuffer());
    const session = await ort.InferenceSession.create(graph, {executionProviders: ["wasm"]});

    const feeds = {};
    for (const feed of spec.feeds) {
      feeds[feed.name] = new ort.Tensor(feed.dtype === "bool" ? "bool" : feed.dtype,
                                        fromBase64(feed.data, feed.dtype), feed.dims);
    }
    const lr = Math.fround(spec.learning_rate);
    const momentum = Math.fround(spec.momentum || 0);
    const velocity = {};
    const losses = [];
    for (let step = 0; step < (spec.steps || 1); step++) {
      const out = await session.run(feeds);
      losses.push(Number(out[spec.loss].data[0]));
      for (const param of spec.params) {
        const p = feeds[param.input].data;
        const g = out[param.grad].data;
        if (g.length !== p.length) throw new Error(param.grad + " has " + g.length + " values, " + param.input + " " + p.length);
        const v = velocity[param.name] || (velocity[param.name] = new Float32Array(p.length));
        const next = new Float32Array(p.length);
        for (let i = 0; i < p.length; i++) {
          v[i] = Math.fround(Math.fround(momentum * v[i]) + g[i]);
          next[i] = Math.fround(p[i] - Math.fround(lr * v[i]));
        }
        feeds[param.input] = new ort.Tensor("float32", next, feeds[param.input].dims);
      }
    }
    const weights = {};
    for (const param of spec.params) weights[param.name] = toBase64(feeds[param.input].data);
    return {losses: losses, weights: weights, inputs: session.inputNames, outputs: session.outputNames,
            userAgent: navigator.userAgent};
  }

  window.addEventListener("load", function () {
    main().then(function (result) {
      window.__result = result;
      document.getElementById("status").textContent = "done";
    }, function (error) {
      window.__error = String(error && error.stack ? error.stack : error);
      document.getElementById("status").textContent = "error: " + window.__error;
    });
  });
})();
