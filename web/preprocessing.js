// A task's declared preprocessing in the browser: fedge.preprocessing (core/preprocessing.py), rule for rule.
//
// The training manifest's `preprocessing` says what a caller does to raw inputs: `affine` is
// x * scale + offset in float32; `raw-range` ([low, high]) says what raw inputs span (the digits' 0..16).
// A device's inputs are judged as the Python devices judge them: inside the preprocessed range they are
// used as they are; inside the raw range the preprocessing is applied; outside both they are used as they
// are and flagged (the SDK's "inputs" event, a console warning). Floating-point inputs only: integer
// inputs (token ids, categories) are what the model takes. Without a declared range nothing is guessed.

export const AS_GIVEN = "preprocessed", RAW_SCALED = "raw", OUTSIDE = "outside";
export const TOLERANCE = 0.05;  // of the range's width: rounding and a sensor's small overshoot are inside

function number(spec, key, fallback) {
  const value = spec[key] === undefined ? fallback : spec[key];
  if (typeof value !== "number" || !Number.isFinite(value)) {
    throw new Error("preprocessing '" + key + "' must be a finite number, got " + JSON.stringify(value));
  }
  return value;
}

// The checked `preprocessing` entry of a manifest: {kind, scale, offset, rawRange, description}.
export function preprocessingOf(spec) {
  spec = spec || {};
  const kind = spec.kind === undefined ? ("scale" in spec || "offset" in spec ? "affine" : "none") : spec.kind;
  const description = String(spec.description || "");
  if (kind !== "none" && kind !== "affine") return {kind: kind, scale: 1, offset: 0, rawRange: null, description};
  const scale = number(spec, "scale", 1), offset = number(spec, "offset", 0);
  let rawRange = spec["raw-range"] === undefined || spec["raw-range"] === null ? null : spec["raw-range"];
  if (rawRange !== null && (!Array.isArray(rawRange) || rawRange.length !== 2 || !rawRange.every(Number.isFinite) ||
                            !(rawRange[0] < rawRange[1]))) {
    throw new Error("preprocessing 'raw-range' must be [low, high] with low < high, got " + JSON.stringify(rawRange));
  }
  if (rawRange !== null) rawRange = [Number(rawRange[0]), Number(rawRange[1])];
  return {kind, scale, offset, rawRange, description};
}

// Raw values as the model takes them: affine is x * scale + offset, each step in float32 (numpy's
// `np.float32(x) * np.float32(scale) + np.float32(offset)`; a float32 product or sum rounded from the
// exact double one is the correctly rounded float32 result).
export function applyPreprocessing(pre, data) {
  if (pre.kind === "none") return data;
  if (pre.kind !== "affine") {
    throw new Error("preprocessing '" + pre.kind + "' (" + (pre.description || "no description") + ") is the task's " +
                    "own; apply it to the raw inputs yourself");
  }
  const scale = Math.fround(pre.scale), offset = Math.fround(pre.offset);
  const out = new Float32Array(data.length);
  for (let i = 0; i < data.length; i++) out[i] = Math.fround(Math.fround(Math.fround(data[i]) * scale) + offset);
  return out;
}

// What preprocessed inputs span (the raw range through the affine map), when declared.
export function modelRange(pre) {
  if (pre.rawRange === null || (pre.kind !== "none" && pre.kind !== "affine")) return null;
  const ends = pre.rawRange.map((v) => pre.kind === "affine" ? v * pre.scale + pre.offset : v);
  return [Math.min(...ends), Math.max(...ends)];
}

function within(low, high, bounds) {
  const slack = TOLERANCE * (bounds[1] - bounds[0]);
  return bounds[0] - slack <= low && high <= bounds[1] + slack;
}

// Whether one input's values are preprocessed already, raw, or outside both declared ranges.
export function judge(pre, values) {
  const model = modelRange(pre);
  if (model === null || !values.length) return AS_GIVEN;
  let low = Infinity, high = -Infinity;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (Number.isNaN(v)) { low = high = NaN; break; }  // numpy's min and max are NaN then: outside
    if (v < low) low = v;
    if (v > high) high = v;
  }
  if (within(low, high, model)) return AS_GIVEN;
  if (pre.kind === "affine" && pre.rawRange !== null && within(low, high, pre.rawRange)) return RAW_SCALED;
  return OUTSIDE;
}

// Python's format(x, "g"): six significant digits, trailing zeros dropped, an exponent below 1e-4 or from 1e6.
export function formatG(x) {
  if (!Number.isFinite(x)) return Number.isNaN(x) ? "nan" : (x > 0 ? "inf" : "-inf");
  if (x === 0) return Object.is(x, -0) ? "-0" : "0";
  const [mantissa, exponent] = x.toExponential(5).split("e");
  const power = Number(exponent);
  const strip = (text) => text.includes(".") ? text.replace(/0+$/, "").replace(/\.$/, "") : text;
  if (power < -4 || power >= 6) {
    return strip(mantissa) + "e" + (power < 0 ? "-" : "+") + String(Math.abs(power)).padStart(2, "0");
  }
  return strip(x.toFixed(5 - power));
}

// `raw 0..16, 0..1 after x * 0.0625 + 0` (for messages), as Preprocessing.describe_ranges words it.
export function describeRanges(pre) {
  const model = modelRange(pre);
  if (model === null || pre.rawRange === null) return "no declared range";
  const after = pre.kind === "affine" ? " after x * " + formatG(pre.scale) + " + " + formatG(pre.offset) : "";
  return "raw " + formatG(pre.rawRange[0]) + ".." + formatG(pre.rawRange[1]) + ", " + formatG(model[0]) + ".." +
    formatG(model[1]) + after;
}

const FLOATS = [Float32Array, Float64Array];

// A device's own inputs ([{data, dims}], the manifest's order) as the model takes them, and what they were
// (AS_GIVEN, RAW_SCALED or OUTSIDE: the worst of its inputs): fedge.preprocessing.prepare_device_inputs.
export function prepareDeviceInputs(inputs, spec) {
  const pre = preprocessingOf(spec);
  const verdicts = new Set();
  const prepared = inputs.map((input) => {
    const verdict = FLOATS.some((type) => input.data instanceof type) ? judge(pre, input.data) : AS_GIVEN;
    verdicts.add(verdict);
    return verdict === RAW_SCALED ? {...input, data: applyPreprocessing(pre, input.data)} : input;
  });
  const worst = verdicts.has(OUTSIDE) ? OUTSIDE : verdicts.has(RAW_SCALED) ? RAW_SCALED : AS_GIVEN;
  return {inputs: prepared, verdict: worst};
}

// The line a Python device logs for a verdict (fedge.clients.common.prepared_device_inputs), or null for
// inputs used as given. `source` names the data (a Python device names its file).
export function inputsMessage(verdict, spec, source) {
  const ranges = describeRanges(preprocessingOf(spec));
  if (verdict === RAW_SCALED) {
    return "'" + source + "' holds raw inputs (" + ranges + "): the task's preprocessing is applied on this device";
  }
  if (verdict === OUTSIDE) {
    return "'" + source + "': inputs fall outside the task's declared range (" + ranges + "); they are used as they " +
      "are: check the data (units, scaling)";
  }
  return null;
}
