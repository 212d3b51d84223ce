// Refuse ONNX graphs that could read data they were not handed, before onnxruntime-web loads them.
//
// The browser's counterpart of fedge.edge.graph_check (read its threat model). Refused:
// - any tensor with external data or a non-default data location, wherever it sits: graph
//   initializers, sparse initializers, node attributes (t, tensors, sparse_tensor(s)), and the
//   same inside every subgraph (g, graphs) up to 16 levels deep;
// - any node outside the standard ONNX domain ("" or "ai.onnx");
// - model-local functions, training info, and the "ort_config" metadata key;
// - a graph whose op types differ from the list its signed manifest declares (training graphs;
//   inference manifests list none);
// - bytes onnxruntime would take for an ORT-format model: the flatbuffer file identifier "ORTM" at
//   bytes 4..8. onnxruntime picks the format from those bytes, and a file can be a valid ONNX message
//   and an ORT-format model at once (tests/ort_polyglot.py): this walk would check the one and
//   onnxruntime-web run the other. The worker also pins the ONNX format for every session it makes.
//
// Why a hand-written protobuf walk: the browser has no `onnx` package, onnxruntime-web exposes no
// parsed graph, and a protobuf library for the whole ONNX schema is a large download for the dozen
// field numbers read here. They are those of onnx/onnx.proto (IR version 10); a field this walk does
// not know is skipped, and Python's checker (on the coordinator, at export) re-serializes the model
// with the schema's own parser, so a signed graph carries no unknown fields.

const MAX_DEPTH = 16;
const ORT_FORMAT_ID = [0x4f, 0x52, 0x54, 0x4d];  // "ORTM", the ORT-format flatbuffer's identifier, at bytes 4..8

// `what` is the graph's label in messages: "<bundle> bundle refused: <file>" (see checkGraph)
function refuse(what, reason) {
  throw new Error(what + " " + reason + "; re-export it with fedge");
}

export function isOrtFormat(bytes) {
  return bytes.length >= 8 && ORT_FORMAT_ID.every((byte, i) => bytes[4 + i] === byte);
}

// The fields of one protobuf message in bytes[start, end): [{field, wire, value | start, end}]
function fields(bytes, start, end) {
  const out = [];
  let pos = start;
  function varint() {
    let result = 0, scale = 1, byte;
    do {
      if (pos >= end) throw new Error("truncated varint");
      byte = bytes[pos++];
      result += (byte & 0x7f) * scale;
      scale *= 128;
    } while (byte & 0x80);
    return result;
  }
  while (pos < end) {
    const key = varint();
    const field = Math.floor(key / 8), wire = key % 8;
    if (wire === 0) out.push({field: field, wire: 0, value: varint()});
    else if (wire === 1) pos += 8;
    else if (wire === 5) pos += 4;
    else if (wire === 2) {
      const length = varint();
      if (pos + length > end) throw new Error("a field runs past its message");
      out.push({field: field, wire: 2, start: pos, end: pos + length});
      pos += length;
    } else throw new Error("wire type " + wire);
  }
  if (pos !== end) throw new Error("a message runs past its end");
  return out;
}

function text(bytes, f) { return new TextDecoder().decode(bytes.subarray(f.start, f.end)); }
function sub(list, field) { return list.filter((f) => f.field === field && f.wire === 2); }

// TensorProto: external_data = 13, data_location = 14 (EXTERNAL = 1)
function checkTensor(bytes, f, where, what) {
  for (const g of fields(bytes, f.start, f.end)) {
    if (g.field === 13 || (g.field === 14 && g.value !== 0)) refuse(what, "keeps tensor data outside the model (" + where + ")");
  }
}

// SparseTensorProto: values = 1, indices = 2
function checkSparse(bytes, f, where, what) {
  const parts = fields(bytes, f.start, f.end);
  for (const g of sub(parts, 1).concat(sub(parts, 2))) checkTensor(bytes, g, where, what);
}

// GraphProto: node = 1, initializer = 5, sparse_initializer = 15
function walkGraph(bytes, f, depth, ops, what) {
  if (depth > MAX_DEPTH) refuse(what, "nests subgraphs deeper than " + MAX_DEPTH + " levels");
  const graph = fields(bytes, f.start, f.end);
  for (const t of sub(graph, 5)) checkTensor(bytes, t, "an initializer", what);
  for (const t of sub(graph, 15)) checkSparse(bytes, t, "a sparse initializer", what);
  for (const n of sub(graph, 1)) {  // NodeProto: op_type = 4, attribute = 5, domain = 7
    const node = fields(bytes, n.start, n.end);
    // protobuf keeps the last of a repeated singular field; a parser that kept the first would disagree
    // with onnxruntime about which op runs, so a node that repeats either field is refused
    if (sub(node, 4).length > 1 || sub(node, 7).length > 1) refuse(what, "has a node that names its op or domain twice");
    const opType = sub(node, 4).map((x) => text(bytes, x))[0] || "";
    const domain = sub(node, 7).map((x) => text(bytes, x))[0] || "";
    if (domain !== "" && domain !== "ai.onnx") refuse(what, "uses op " + opType + " of domain " + domain + " (only standard ONNX ops run)");
    ops.add(opType);
    for (const a of sub(node, 5)) {  // AttributeProto: t = 5, g = 6, tensors = 10, graphs = 11, sparse = 22, 23
      const attribute = fields(bytes, a.start, a.end);
      for (const t of sub(attribute, 5).concat(sub(attribute, 10))) checkTensor(bytes, t, "an attribute of " + opType, what);
      for (const t of sub(attribute, 22).concat(sub(attribute, 23))) checkSparse(bytes, t, "an attribute of " + opType, what);
      for (const g of sub(attribute, 6).concat(sub(attribute, 11))) walkGraph(bytes, g, depth + 1, ops, what);
    }
  }
}

// ModelProto: graph = 7, metadata_props = 14 (key = 1), training_info = 20, functions = 25.
// `bundle` names the bundle in messages: "training" (the default) or "inference".
export function checkGraph(bytes, file, declaredOps, bundle = "training") {
  const what = bundle + " bundle refused: " + file;
  if (isOrtFormat(bytes)) {
    refuse(what, "is an ORT-format model (file identifier 'ORTM' at byte 4), which onnxruntime-web would run " +
                 "instead of the ONNX graph checked here");
  }
  let model;
  try { model = fields(bytes, 0, bytes.length); } catch (e) { refuse(what, "does not parse as an ONNX model (" + e.message + ")"); }
  if (sub(model, 25).length) refuse(what, "defines model-local functions");
  if (sub(model, 20).length) refuse(what, "carries training info");
  for (const p of sub(model, 14)) {
    if (sub(fields(bytes, p.start, p.end), 1).some((k) => text(bytes, k) === "ort_config")) {
      refuse(what, "sets onnxruntime session options in its metadata (ort_config)");
    }
  }
  const graphs = sub(model, 7);
  if (graphs.length !== 1) refuse(what, "has no graph");
  const ops = new Set();
  walkGraph(bytes, graphs[0], 0, ops, what);
  if (declaredOps === null) return [...ops].sort();  // an inference model: its manifest lists no ops
  const listed = new Set(declaredOps);
  const extra = [...ops].filter((op) => !listed.has(op)), missing = [...listed].filter((op) => !ops.has(op));
  if (extra.length || missing.length) {
    refuse(what, "uses ops " + JSON.stringify(extra) + " its signed manifest does not list (and lacks " + JSON.stringify(missing) + ")");
  }
  return [...ops].sort();
}
