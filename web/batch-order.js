// The order in which a device visits its examples: numpy's, so a browser device draws the very
// batches a Python device with the same seed draws (fedge.batching.batch_order):
//   rng = numpy.random.default_rng(seed); each epoch: rng.permutation(size), cut into batch_size pieces.
// That is SeedSequence (numpy's entropy hashing) -> PCG64 (XSL-RR 128/64) -> Generator.shuffle
// (Fisher-Yates from the end, each index drawn by random_interval: masked rejection on 32-bit draws).
// Written out here because no JavaScript library reproduces numpy's generator; checked against
// numpy itself by tests/test_web_device.py. 128-bit arithmetic is BigInt.
// A classic script (the worker importScripts it) that also loads in Node: defines fedgeBatchOrder.
"use strict";

(function (root) {
  const M32 = 0xFFFFFFFFn, M64 = (1n << 64n) - 1n, M128 = (1n << 128n) - 1n;
  const MULT = 0x2360ED051FC65DA44385DF649FCCF645n;

  function mul32(a, b) { return Number(BigInt.asUintN(32, BigInt(a) * BigInt(b))); }

  // numpy.random.SeedSequence(seed).generate_state(4, uint64), for a non-negative integer seed
  function seedState(seed) {
    let n = BigInt(seed);
    const entropy = [];
    if (n === 0n) entropy.push(0);
    while (n > 0n) { entropy.push(Number(n & M32)); n >>= 32n; }
    let hashConst = 0x43b0d7e5;
    function hashmix(value) {
      value = (value ^ hashConst) >>> 0;
      hashConst = mul32(hashConst, 0x931e8875);
      value = mul32(value, hashConst);
      return (value ^ (value >>> 16)) >>> 0;
    }
    function mix(x, y) {
      const result = Number(BigInt.asUintN(32, 0xca01f9ddn * BigInt(x) - 0x4973f715n * BigInt(y)));
      return (result ^ (result >>> 16)) >>> 0;
    }
    const pool = [0, 0, 0, 0];
    for (let i = 0; i < 4; i++) pool[i] = hashmix(i < entropy.length ? entropy[i] : 0);
    for (let src = 0; src < 4; src++) {
      for (let dst = 0; dst < 4; dst++) if (src !== dst) pool[dst] = mix(pool[dst], hashmix(pool[src]));
    }
    for (let src = 4; src < entropy.length; src++) {
      for (let dst = 0; dst < 4; dst++) pool[dst] = mix(pool[dst], hashmix(entropy[src]));
    }
    let constB = 0x8b51f9dd;
    const words = [];
    for (let i = 0; i < 8; i++) {
      let value = (pool[i % 4] ^ constB) >>> 0;
      constB = mul32(constB, 0x58f38ded);
      value = mul32(value, constB);
      words.push((value ^ (value >>> 16)) >>> 0);
    }
    const u64 = [];
    for (let i = 0; i < 8; i += 2) u64.push(BigInt(words[i]) | (BigInt(words[i + 1]) << 32n));
    return u64;
  }

  // numpy.random.PCG64(SeedSequence(seed)) with its 32-bit draw buffer
  function pcg64(seed) {
    const [s0, s1, i0, i1] = seedState(seed);
    const initState = (s0 << 64n) | s1, inc = (((i0 << 64n) | i1) << 1n | 1n) & M128;
    let state = 0n;
    const step = () => { state = (state * MULT + inc) & M128; };
    step();
    state = (state + initState) & M128;
    step();
    let buffered = null;
    function next64() {
      step();
      const x = ((state >> 64n) ^ state) & M64, rot = state >> 122n;
      return ((x >> rot) | (x << ((64n - rot) & 63n))) & M64;
    }
    function next32() {
      if (buffered !== null) { const out = buffered; buffered = null; return out; }
      const value = next64();
      buffered = Number(value >> 32n);
      return Number(value & M32);
    }
    return {next32: next32, next64: next64};
  }

  // numpy's random_interval: a uniform integer in [0, max]
  function interval(rng, max) {
    if (max === 0) return 0;
    let mask = max;
    for (const shift of [1, 2, 4, 8, 16]) mask |= mask >>> shift;
    mask >>>= 0;
    if (max <= 0xFFFFFFFF) {
      let value;
      while ((value = (rng.next32() & mask) >>> 0) > max);
      return value;
    }
    throw new Error("more than 2^32 examples");
  }

  // Index batches: a fresh permutation per epoch, cut into batchSize pieces, the last partial batch kept
  function batchOrder(size, batchSize, seed, epochs) {
    const rng = pcg64(seed), batches = [];
    for (let epoch = 0; epoch < epochs; epoch++) {
      const order = Array.from({length: size}, (_, i) => i);
      for (let i = size - 1; i >= 1; i--) {
        const j = interval(rng, i);
        const t = order[i]; order[i] = order[j]; order[j] = t;
      }
      for (let start = 0; start < size; start += batchSize) batches.push(order.slice(start, start + batchSize));
    }
    return batches;
  }

  root.fedgeBatchOrder = {batchOrder: batchOrder, seedState: seedState, pcg64: pcg64};
})(typeof self !== "undefined" ? self : globalThis);
