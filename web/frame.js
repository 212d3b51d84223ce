// fedge device protocol frames (docs/device-protocol.md, "Frame format"), in the browser.
//
//   "FDG1" | u32 little-endian H | H bytes of UTF-8 JSON header | tensor bytes
//
// The header's "tensors" lists {name, dtype, shape} (and "scale" for int8) in the order their
// bytes follow: C order, little-endian, nothing between or after them. Every length is checked
// against what is left before anything is allocated (the Python reader, fedge.clients.gateway.protocol,
// does the same).

export const FRAME_TYPE = "application/vnd.fedge.frame";
const MAGIC = [0x46, 0x44, 0x47, 0x31];
const MAX_HEADER = 1 << 20;
export const DTYPES = {
  float32: Float32Array, float64: Float64Array, float16: Uint16Array, int8: Int8Array, int32: Int32Array,
  int64: BigInt64Array, uint32: Uint32Array, uint64: BigUint64Array,
};
// the lossy task encodings this SDK reads (docs/device-protocol.md, "Task encodings"): its check-in names them
export const TASK_CAPABILITIES = ["task:fp16", "task:int8"];

// IEEE 754 half (its 16 bits) to a number, exactly: sign, 5-bit exponent (bias 15), 10-bit fraction
function halfToNumber(bits) {
  const sign = bits & 0x8000 ? -1 : 1, exponent = (bits >> 10) & 0x1f, fraction = bits & 0x3ff;
  if (exponent === 0) return sign * fraction * 2 ** -24;  // zero and subnormals
  if (exponent === 0x1f) return fraction ? NaN : sign * Infinity;
  return sign * (1 + fraction / 1024) * 2 ** (exponent - 15);
}

// A task tensor's values as float32, whatever its encoding: float16 widened (exact), int8 read as q * scale (the
// product of an int8 and a float32 is exact in float64, so rounding it once to float32 is numpy's float32 product)
export function taskValues(tensor) {
  if (tensor.data instanceof Float32Array) return tensor.data;
  const out = new Float32Array(tensor.data.length);
  if (tensor.data instanceof Uint16Array) {
    for (let i = 0; i < out.length; i++) out[i] = halfToNumber(tensor.data[i]);
  } else if (tensor.data instanceof Int8Array) {
    const scale = Math.fround(tensor.scale);
    for (let i = 0; i < out.length; i++) out[i] = tensor.data[i] * scale;
  } else {
    throw new Error("a task's tensors are float32, float16 or int8, not " + tensor.data.constructor.name);
  }
  return out;
}

function dtypeOf(typed) {
  for (const [name, Typed] of Object.entries(DTYPES)) if (typed instanceof Typed) return name;
  throw new Error("frames carry " + Object.keys(DTYPES).join(", ") + ", not " + typed.constructor.name);
}

// tensors: {name: {data: TypedArray, shape: [..], scale?: number}}
export function encodeFrame(header, tensors = {}) {
  const entries = [];
  const blobs = [];
  for (const [name, tensor] of Object.entries(tensors)) {
    const entry = {name: name, dtype: dtypeOf(tensor.data), shape: tensor.shape};
    if (entry.dtype === "int8") entry.scale = tensor.scale || 0;
    entries.push(entry);
    blobs.push(new Uint8Array(tensor.data.buffer, tensor.data.byteOffset, tensor.data.byteLength));
  }
  const text = new TextEncoder().encode(JSON.stringify({...header, tensors: entries}));
  const size = 8 + text.length + blobs.reduce((sum, blob) => sum + blob.length, 0);
  const out = new Uint8Array(size);
  out.set(MAGIC, 0);
  new DataView(out.buffer).setUint32(4, text.length, true);
  out.set(text, 8);
  let offset = 8 + text.length;
  for (const blob of blobs) { out.set(blob, offset); offset += blob.length; }
  return out;
}

export function decodeFrame(buffer, maxElements = 1 << 28) {
  const bytes = new Uint8Array(buffer);
  if (bytes.length < 8 || MAGIC.some((value, i) => bytes[i] !== value)) throw new Error("not a fedge frame");
  const length = new DataView(bytes.buffer, bytes.byteOffset).getUint32(4, true);
  if (length > Math.min(MAX_HEADER, bytes.length - 8)) throw new Error("frame header length " + length + " is too long");
  const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + length)));
  const entries = header.tensors || [];
  delete header.tensors;
  const tensors = {};
  let offset = 8 + length;
  for (const entry of entries) {
    const Typed = DTYPES[entry.dtype];
    if (!Typed) throw new Error("tensor " + entry.name + ": dtype " + entry.dtype + " is not a frame dtype");
    const count = entry.shape.reduce((a, b) => a * b, 1);
    if (!(count >= 0 && count <= maxElements)) throw new Error("tensor " + entry.name + " is too large");
    const size = count * Typed.BYTES_PER_ELEMENT;
    if (offset + size > bytes.length) throw new Error("tensor " + entry.name + " runs past the frame");
    // a copy: the frame's offsets need not be aligned for the typed array
    const data = new Typed(bytes.slice(offset, offset + size).buffer);
    tensors[entry.name] = {data: data, shape: entry.shape, scale: entry.scale};
    offset += size;
  }
  if (offset !== bytes.length) throw new Error((bytes.length - offset) + " bytes follow the last tensor");
  return {header: header, tensors: tensors};
}

// round to nearest, halves to even (numpy's rint, what the reference device and fedge.codec do)
export function roundHalfEven(x) {
  const r = Math.round(x);  // halves up
  return Math.abs(x % 1) === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

// int8-delta (the uplink codec): q = roundHalfEven((trained - base) / scale), scale = max|trained - base| / 127,
// in float64 (docs/device-protocol.md, "int8-delta, exactly")
export function int8Delta(trained, base) {
  const q = new Int8Array(trained.length);
  let peak = 0;
  for (let i = 0; i < trained.length; i++) peak = Math.max(peak, Math.abs(trained[i] - base[i]));
  const scale = peak > 0 ? peak / 127 : 0;
  if (scale > 0) for (let i = 0; i < trained.length; i++) q[i] = roundHalfEven((trained[i] - base[i]) / scale);
  return {data: q, scale: scale};
}
