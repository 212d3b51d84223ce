// fedge's secure aggregation in the browser: the five device steps of SecAgg / SecAgg+ and their primitives,
// byte for byte what the Python device does (fedge.clients.secagg_device over fedge.secagg), so one gateway pool
// may mix browsers and Python protocol devices.
//
// SecAgg: Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning", CCS 2017 (§4,
// rounds 0-4: AdvertiseKeys, ShareKeys, MaskedInputCollection, ConsistencyCheck, Unmasking). SecAgg+: Bell et al.,
// "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020 (per-neighbourhood sharing).
// Shamir, "How to Share a Secret", CACM 1979. Model inconsistency: Pasquini et al., CCS 2022. FedNova's weight:
// Wang et al., NeurIPS 2020. docs/device-protocol.md ("Secure aggregation, bit for bit") writes out every byte;
// docs/protocol-vectors/secagg-*.json check each piece (tests/test_web_secagg.py runs them in Chromium).
// Distributed DP (a masked step whose `secagg` record carries dp-stddev): the update is clipped, scaled, rounded
// and given this device's discrete Gaussian share before masking (Kairouz, Liu and Steinke, ICML 2021; the sampler:
// Canonne, Kamath and Steinke, NeurIPS 2020, Alg. 3, on crypto.getRandomValues), as fedge.distributed_noise does, and
// the consistency step refuses a survivor set smaller than dp-min-survivors (docs/secure-aggregation.md).
//
// Where the primitives come from (no hand-written cryptography):
//   X25519 (RFC 7748), HKDF-SHA256 (RFC 5869), AES-256-GCM, Ed25519 (RFC 8032), SHA-256: WebCrypto.
//   ChaCha20 (RFC 7539 block function; the masks' keystream): @noble/ciphers, vendored and pinned under
//   ./vendor/noble-ciphers (vendor/README.md: version, source, hashes; the gateway serves it, no CDN).
//   Shamir sharing over GF(2^521 - 1): textbook polynomial evaluation and Lagrange interpolation in BigInt, written
//   here (as fedge.secagg writes it in Python), with coefficients from crypto.getRandomValues, rejection-sampled
//   uniformly in [0, P).
//
// Threat model: fedge.secagg's (the gateway sits in the coordinator's seat). Every check a Python device makes
// before it shares, masks, signs or reveals is made here too, with the same rules: threshold t with
// max(2, floor(k/2) + 1) <= t <= k; shares from at least t neighbours before masking; a survivor set that holds this
// device and t of its neighbours, signed once a round, and only if every surviving neighbour signed the model and
// config this device received; t signatures over that set before revealing; one share per neighbour, chosen here
// from the signed set. The round's private keys are WebCrypto keys; the mask key is extractable because its raw
// bytes are Shamir-shared (the protocol needs it), the share and signing keys are not.

import {chacha20} from "./vendor/noble-ciphers/chacha.js";
import {roundHalfEven} from "./frame.js";

const enc = new TextEncoder();
export const STEPS = ["secagg_setup", "secagg_share", "secagg_masked", "secagg_consistency", "secagg_unmask"];
export const PUBLIC_KEYS = ["c-pk", "s-pk", "g-pk"];
export const PRIME = (1n << 521n) - 1n;  // the Mersenne prime 2^521 - 1: one field element holds a 32-byte secret
export const SHARE_BYTES = 2 + 66;  // holder index (u16, big-endian) + field element (66 bytes, big-endian)
// In `secagg`, distributed DP (fedge.distributed_noise): the L2 clip, ring units per unit, each device's noise share
// (std. dev. in ring units) and the fewest survivors the noise was calibrated for.
export const DP_CLIP = "dp-clip", DP_SCALE = "dp-scale", DP_STDDEV = "dp-stddev", DP_MIN_SURVIVORS = "dp-min-survivors";
const PER_DEVICE_CONFIG = new Set(["local-epochs"]);  // left out of the config digest (fedge.secagg.PER_DEVICE_CONFIG)
export const COUNTS = ["clipped-entries", "clipped-devices", "capped-weights"];

// A step this device refuses: obeying it could reveal more than the sum (fedge.secagg.ProtocolViolation).
export class ProtocolViolation extends Error {}

// ------------------------------------------------------------------------------------------------ bytes
export function hex(bytes) { return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join(""); }
export function fromHex(text) {
  const out = new Uint8Array(text.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(text.substr(2 * i, 2), 16);
  return out;
}
export function concat(...parts) {
  const out = new Uint8Array(parts.reduce((sum, part) => sum + part.length, 0));
  let offset = 0;
  for (const part of parts) { out.set(part, offset); offset += part.length; }
  return out;
}
function u64be(n) {
  const out = new Uint8Array(8);
  new DataView(out.buffer).setBigUint64(0, BigInt(n), false);
  return out;
}
function u16be(n) { return Uint8Array.of((n >> 8) & 0xff, n & 0xff); }
function sameBytes(a, b) { return a.length === b.length && a.every((value, i) => value === b[i]); }
function bigFromBytes(bytes) { return bytes.length ? BigInt("0x" + hex(bytes)) : 0n; }
function bigToBytes(value, length) { return fromHex(value.toString(16).padStart(2 * length, "0")); }
function bytesOf(value, what) {
  if (!(value instanceof Uint8Array)) throw new ProtocolViolation("refusing: '" + what + "' is not bytes");
  return value;
}
async function sha256(data) { return new Uint8Array(await crypto.subtle.digest("SHA-256", data)); }

// ------------------------------------------------------------------------------------------------ keys
// PKCS#8 wrappers of raw 32-byte private keys (RFC 8410): WebCrypto imports Curve25519 private keys only this way.
const PKCS8_PREFIX = {X25519: fromHex("302e020100300506032b656e04220420"),
                      Ed25519: fromHex("302e020100300506032b657004220420")};

// A WebCrypto key from a raw private key: X25519 (deriveBits) or Ed25519 (sign).
export function importPrivate(name, raw, extractable = false) {
  if (raw.length !== 32) throw new Error(name + " private keys are 32 bytes");
  return crypto.subtle.importKey("pkcs8", concat(PKCS8_PREFIX[name], raw), {name: name}, extractable,
                                 name === "X25519" ? ["deriveBits"] : ["sign"]);
}

// The raw 32 bytes of an extractable X25519 or Ed25519 private key.
export async function rawPrivate(key) {
  const der = new Uint8Array(await crypto.subtle.exportKey("pkcs8", key));
  const prefix = PKCS8_PREFIX[key.algorithm.name];
  if (der.length !== 48 || !sameBytes(der.subarray(0, 16), prefix)) {
    throw new Error("unexpected PKCS#8 encoding of a " + key.algorithm.name + " key");
  }
  return der.slice(16);
}

export async function rawPublic(key) { return new Uint8Array(await crypto.subtle.exportKey("raw", key)); }

// 32 bytes from X25519(private, peer) through HKDF-SHA256 (salt none, info "fedge-secagg/<purpose>/<context>"):
// fedge.secagg.derive. An all-zero X25519 result (a peer key of small order) is refused (RFC 7748 §6.1).
export async function derive(privateKey, peerPublic, purpose, context = new Uint8Array(0)) {
  if (!(peerPublic instanceof Uint8Array) || peerPublic.length !== 32) {
    throw new ProtocolViolation("refusing: a neighbour's X25519 public key is not 32 bytes");
  }
  let shared;
  try {
    const peer = await crypto.subtle.importKey("raw", peerPublic, {name: "X25519"}, false, []);
    shared = new Uint8Array(await crypto.subtle.deriveBits({name: "X25519", public: peer}, privateKey, 256));
  } catch (error) {  // WebCrypto refuses an all-zero secret itself (the Secure Curves spec)
    throw new ProtocolViolation("refusing: X25519 with a neighbour's key failed (a key of small order: the shared " +
                                "secret would be all zeros)");
  }
  if (shared.every((b) => b === 0)) throw new ProtocolViolation("refusing: an all-zero X25519 shared secret");
  const ikm = await crypto.subtle.importKey("raw", shared, "HKDF", false, ["deriveBits"]);
  const info = concat(enc.encode("fedge-secagg/" + purpose + "/"), context);
  // salt none: RFC 5869 uses HashLen zero bytes, which HMAC pads an empty key to (the same PRK)
  return new Uint8Array(await crypto.subtle.deriveBits({name: "HKDF", hash: "SHA-256", salt: new Uint8Array(0),
                                                        info: info}, ikm, 256));
}

// AES-256-GCM with a fresh random 12-byte nonce, prepended: nonce ‖ ciphertext ‖ tag (fedge.secagg.seal).
export async function seal(key, plaintext, associated, nonce = crypto.getRandomValues(new Uint8Array(12))) {
  const aes = await crypto.subtle.importKey("raw", key, "AES-GCM", false, ["encrypt"]);
  const sealed = await crypto.subtle.encrypt({name: "AES-GCM", iv: nonce, additionalData: associated, tagLength: 128},
                                             aes, plaintext);
  return concat(nonce, new Uint8Array(sealed));
}

// seal()'s plaintext, or null when the bytes were altered, cut, emptied or sealed under another key or data.
export async function openSealed(key, sealed, associated) {
  if (!(sealed instanceof Uint8Array) || sealed.length < 12 + 16) return null;
  try {
    const aes = await crypto.subtle.importKey("raw", key, "AES-GCM", false, ["decrypt"]);
    return new Uint8Array(await crypto.subtle.decrypt({name: "AES-GCM", iv: sealed.subarray(0, 12),
                                                       additionalData: associated, tagLength: 128},
                                                      aes, sealed.subarray(12)));
  } catch (error) {
    return null;
  }
}

export async function sign(key, message) {
  return new Uint8Array(await crypto.subtle.sign({name: "Ed25519"}, key, message));
}

// Whether `signature` is `publicRaw`'s Ed25519 signature over `message` (anything malformed: false).
export async function validSignature(publicRaw, signature, message) {
  if (!(signature instanceof Uint8Array) || signature.length !== 64 || !(publicRaw instanceof Uint8Array)) return false;
  try {
    const key = await crypto.subtle.importKey("raw", publicRaw, {name: "Ed25519"}, false, ["verify"]);
    return await crypto.subtle.verify({name: "Ed25519"}, key, signature, message);
  } catch (error) {
    return false;
  }
}

export function survivorsMessage(serverRound, survivors) {
  const sorted = [...new Set(survivors)].sort((a, b) => a - b);
  return enc.encode("fedge-secagg/consistency/" + serverRound + "/" + sorted.join(","));
}

export function receivedMessage(serverRound, arraysDigestBytes, configDigestBytes) {
  return enc.encode("fedge-secagg/received/" + serverRound + "/" + hex(arraysDigestBytes) + "/" + hex(configDigestBytes));
}

// ------------------------------------------------------------------------------------------------ Shamir
// Written by hand (allowed: textbook). Shamir 1979: a random polynomial of degree t - 1 over GF(2^521 - 1) with the
// secret as constant term; holder number i of the list (from 1, in list order) gets u16be(i) ‖ f(i) (66 bytes).
export function randomFieldElement() {
  const bytes = new Uint8Array(66);  // 528 bits; the top 7 cleared: uniform in [0, 2^521), then P rejected
  for (;;) {
    crypto.getRandomValues(bytes);
    bytes[0] &= 0x01;
    const value = bigFromBytes(bytes);
    if (value < PRIME) return value;
  }
}

// holder -> SHARE_BYTES bytes (a Map, in holder order). `coefficients` (a1.. as BigInt) replaces the random draw.
export function shareSecret(secret, threshold, holders, coefficients = null) {
  if (secret.length !== 32 || !(threshold >= 1 && threshold <= holders.length && holders.length < 65536)) {
    throw new Error("need a 32-byte secret and 1 <= threshold <= number of holders < 65536");
  }
  const drawn = coefficients ?? Array.from({length: threshold - 1}, randomFieldElement);
  const poly = [bigFromBytes(secret), ...drawn.map(BigInt)];
  const shares = new Map();
  holders.forEach((holder, index) => {
    const x = BigInt(index + 1);
    let y = 0n;
    for (let k = poly.length - 1; k >= 0; k--) y = (y * x + poly[k]) % PRIME;  // Horner
    shares.set(holder, concat(u16be(index + 1), bigToBytes(y, 66)));
  });
  return shares;
}

function modPow(base, exponent) {
  let result = 1n, b = ((base % PRIME) + PRIME) % PRIME, e = exponent;
  while (e > 0n) {
    if (e & 1n) result = (result * b) % PRIME;
    b = (b * b) % PRIME;
    e >>= 1n;
  }
  return result;
}

// The secret from at least `threshold` shares (Lagrange interpolation at 0; mod 2^256, 32 bytes): what the gateway
// does; here for tests and checks.
export function rebuildSecret(shares) {
  const points = shares.map((share) => [bigFromBytes(share.subarray(0, 2)), bigFromBytes(share.subarray(2, SHARE_BYTES))]);
  let secret = 0n;
  points.forEach(([xj, yj], j) => {
    let numerator = 1n, denominator = 1n;
    points.forEach(([xm], m) => {
      if (m !== j) {
        numerator = (numerator * xm) % PRIME;
        denominator = (((denominator * (xm - xj)) % PRIME) + PRIME) % PRIME;
      }
    });
    secret = (secret + yj * numerator * modPow(denominator, PRIME - 2n)) % PRIME;
  });
  return bigToBytes(secret % (1n << 256n), 32);
}

// ------------------------------------------------------------------------------------------------ the ring
const LITTLE_ENDIAN = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;
const ZERO_NONCE = new Uint8Array(12);
const MASK_BLOCK = 1 << 20;  // keystream bytes made at a time (a multiple of ChaCha20's 64-byte block)

function checkBits(bits) {
  if (!Number.isInteger(bits) || bits < 2 || bits > 64) {
    throw new ProtocolViolation("refusing: secure aggregation works in Z_(2^bits) with 2 <= bits <= 64, got " + bits);
  }
}

// A zero vector of the ring Z_(2^bits): Uint32Array up to 32 bits, BigUint64Array above.
export function ringArray(bits, length) {
  checkBits(bits);
  return bits <= 32 ? new Uint32Array(length) : new BigUint64Array(length);
}

// total += PRG(seed) (or -=) in Z_(2^bits), in place. PRG: the ChaCha20 keystream (RFC 7539 block function, key
// `seed`, counter and nonce zero: cryptography's ChaCha20(seed, 16 zero bytes)), read as little-endian u32 words
// (u64 above 32 bits); words wrap at 2^32 / 2^64, multiples of 2^bits, so one reduction at the end suffices.
export function addMask(total, seed, bits, subtract = false) {
  checkBits(bits);
  if (!LITTLE_ENDIAN) throw new Error("secure aggregation's masks are read little-endian; this platform is not");
  if (seed.length !== 32) throw new Error("mask seeds are 32 bytes");
  const word = bits <= 32 ? 4 : 8;
  const perBlock = MASK_BLOCK / word;
  const zeros = new Uint8Array(Math.min(total.length * word, MASK_BLOCK));
  const stream = new Uint8Array(zeros.length);
  for (let start = 0; start < total.length; start += perBlock) {
    const count = Math.min(perBlock, total.length - start);
    const bytes = count * word;
    chacha20(seed, ZERO_NONCE, zeros.subarray(0, bytes), stream.subarray(0, bytes), (start * word) / 64);
    if (word === 4) {
      const keys = new Uint32Array(stream.buffer, 0, count);
      if (subtract) for (let i = 0; i < count; i++) total[start + i] -= keys[i];  // stored mod 2^32
      else for (let i = 0; i < count; i++) total[start + i] += keys[i];
    } else {
      const keys = new BigUint64Array(stream.buffer, 0, count);
      if (subtract) for (let i = 0; i < count; i++) total[start + i] -= keys[i];  // stored mod 2^64
      else for (let i = 0; i < count; i++) total[start + i] += keys[i];
    }
  }
  reduce(total, bits);
  return total;
}

function reduce(total, bits) {
  if (bits === 32 || bits === 64) return;
  if (bits < 32) {
    const mask = 2 ** bits - 1;
    for (let i = 0; i < total.length; i++) total[i] &= mask;
  } else {
    const mask = (1n << BigInt(bits)) - 1n;
    for (let i = 0; i < total.length; i++) total[i] &= mask;
  }
}

// `length` ring elements of PRG(seed) (fedge.secagg.expand_mask).
export function expandMask(seed, length, bits = 32) { return addMask(ringArray(bits, length), seed, bits); }

// x + PRG(b) + sum_{j > me} PRG(s_j) - sum_{j < me} PRG(s_j) in Z_(2^bits); pairSeeds: [[peer, seed], ...].
export function maskedInput(encoded, selfSeed, pairSeeds, me, bits = 32) {
  const total = ringArray(bits, encoded.length);
  total.set(encoded);
  reduce(total, bits);
  addMask(total, selfSeed, bits);
  for (const [peer, seed] of pairSeeds) addMask(total, seed, bits, me > peer);
  return total;
}

// ------------------------------------------------------------------------------------------------ fixed point
// E(x; clip, scale): round_half_to_even(clip(x, ±clip) · scale) in float64, as a signed integer, mod 2^bits
// (two's complement), into `out` from `offset` (fedge.secagg.FixedPoint.encode).
export function fixedEncode(values, clip, scale, bits, out, offset = 0) {
  const wide = bits > 32, modulus = 2 ** bits;
  for (let i = 0; i < values.length; i++) {
    const x = Number(values[i]);
    if (Number.isNaN(x)) throw new Error("a secure update holds NaN: nothing is masked");
    const y = roundHalfEven(Math.min(Math.max(x, -clip), clip) * scale);
    if (wide) {
      out[offset + i] = BigInt.asUintN(bits, BigInt(y));
    } else {
      const r = y % modulus;  // exact: y is a whole double and % is exact
      out[offset + i] = r < 0 ? r + modulus : r;
    }
  }
  return out;
}

// ||a||_1 of local SGD with heavy-ball momentum over `steps` steps (FedNova: Wang et al., NeurIPS 2020).
export function fednovaNorm(steps, momentum) {
  if (momentum === 0) return steps;
  const rho = momentum;
  return (steps - rho * (1 - rho ** steps) / (1 - rho)) / (1 - rho);
}

function param(params, key) {
  const value = params[key];
  if (typeof value !== "number" || !Number.isFinite(value)) {
    throw new ProtocolViolation("malformed secagg_masked step: 'secagg' has no number '" + key + "'");
  }
  return value;
}

// delta = trained - global in float64, tensors in name order (the order Python's sorted() gives), each in C order.
function deltaOf(globalArrays, trained) {
  const ordered = [...globalArrays].sort((a, b) => compareText(a.name, b.name));
  const size = ordered.reduce((sum, entry) => sum + entry.data.length, 0);
  const delta = new Float64Array(size);
  let at = 0;
  for (const entry of ordered) {
    const after = trained[entry.name];
    if (!after || after.length !== entry.data.length) throw new Error("training gave no array '" + entry.name + "'");
    for (let i = 0; i < after.length; i++) delta[at + i] = Number(after[i]) - Number(entry.data[i]);
    at += after.length;
  }
  return delta;
}

// The masked step's encoded update (fedge.clients.secagg_device.encode_update): w · clip(delta / a) on the update's
// scale, then w and w · a, then the device's clipping counts. globalArrays: [{name, data}]; trained: {name: data};
// delta = trained - global in float64, tensors in name order, C order.
export function encodeUpdate(globalArrays, trained, numExamples, steps, params) {
  let weight = Number(numExamples);
  const momentum = param(params, "work-momentum");
  const work = momentum >= 0 ? Math.min(fednovaNorm(Math.max(steps, 1), momentum), param(params, "work-cap")) : 1.0;
  const delta = deltaOf(globalArrays, trained), size = delta.length;
  const bits = param(params, "bits");
  checkBits(bits);
  const clip = param(params, "clip"), scale = param(params, "scale");
  const weightClip = param(params, "weight-clip"), weightScale = param(params, "weight-scale");
  const workClip = param(params, "work-clip"), workScale = param(params, "work-scale");
  if (!("update-clip" in params)) {  // an older coordinator: w · delta / a clipped at clip, no counts
    const out = ringArray(bits, size + 2);
    for (let i = 0; i < size; i++) delta[i] = delta[i] * weight / work;
    fixedEncode(delta, clip, scale, bits, out, 0);
    fixedEncode([weight], weightClip, weightScale, bits, out, size);
    fixedEncode([weight * work], workClip, workScale, bits, out, size + 1);
    return out;
  }
  const capped = weight > weightClip;
  weight = Math.min(weight, weightClip);
  const limit = param(params, "update-clip");
  let entries = 0;
  for (let i = 0; i < size; i++) {
    let u = delta[i] / work;
    let clipped = Math.abs(u) > limit;
    u = Math.min(Math.max(u, -limit), limit) * weight;
    clipped = clipped || Math.abs(u) > clip;
    entries += clipped ? 1 : 0;
    delta[i] = u;
  }
  if (entries) {
    console.info("this device's update was clipped in " + entries + " of " + size + " entries for secure " +
                 "aggregation; the round's total is counted by the coordinator");
  }
  const out = ringArray(bits, size + 5);
  fixedEncode(delta, clip, scale, bits, out, 0);
  fixedEncode([weight], weightClip, weightScale, bits, out, size);
  fixedEncode([weight * work], workClip, workScale, bits, out, size + 1);
  fixedEncode([entries, entries > 0 ? 1 : 0, capped ? 1 : 0], param(params, "count-clip"), 1.0, bits, out, size + 2);
  return out;
}

// ------------------------------------------------------------------------------------------------ distributed DP
// The distributed discrete Gaussian (Kairouz, Liu and Steinke, ICML 2021) as fedge.distributed_noise runs it: each
// device clips its update to L2 norm dp-clip, scales it by dp-scale, rounds each entry to the nearest integer (half
// to even: numpy's rint), adds its share of discrete Gaussian noise N_Z(0, dp-stddev^2) per entry and masks the
// result in Z_(2^bits) as every secure input is; the unmasked sum carries every survivor's share.

// Uniform randomness from crypto.getRandomValues (the browser's CSPRNG; never Math.random), drawn in blocks of
// 16,384 words (getRandomValues' limit is 65,536 bytes a call).
export class CryptoRandom {
  constructor() { this.words = new Uint32Array(16384); this.at = this.words.length; }
  word() {
    if (this.at === this.words.length) { crypto.getRandomValues(this.words); this.at = 0; }
    return this.words[this.at++];
  }
  // A uniform double in [0, 1) with 53 random bits: (27 bits * 2^26 + 26 bits) / 2^53, every value exact.
  uniform() { return ((this.word() >>> 5) * 67108864 + (this.word() >>> 6)) / 9007199254740992; }
}

// `size` draws of the discrete Gaussian N_Z(0, sigma^2), P(x) ~ exp(-x^2 / (2 sigma^2)), as an Float64Array of
// integers (fedge.distributed_noise.discrete_gaussian). Canonne, Kamath and Steinke, "The Discrete Gaussian for
// Differential Privacy", NeurIPS 2020, Algorithm 3: draw Y from the discrete Laplace of scale t = floor(sigma) + 1,
// P(Y = y) ~ exp(-|y| / t), as the difference of two geometric draws (failures before a success of probability
// 1 - e^(-1/t)), and keep it with probability exp(-(|Y| - sigma^2 / t)^2 / (2 sigma^2)); a refused draw is drawn again.
//
// The geometric draws are by inversion: G = floor(t * -ln(U)) with U uniform in (0, 1], since P(G >= k) =
// P(-ln U >= k / t) = e^(-k/t) = (e^(-1/t))^k, the geometric law exactly for a real U. Sound in floating point because
// U is a multiple of 2^-53 drawn uniformly (53 random bits): each P(G >= k) is off by at most 2^-53 plus the rounding of
// ln (V8: fdlibm, within an ulp) and of the product, and the tail beyond -ln(2^-53) = 36.7 (G <= 36.7 t) has
// probability 2^-53. Inversion takes one uniform per geometric draw where the Bernoulli steps take ~t. The acceptance
// test is a float comparison U' < exp(...), as fedge's numpy sampler (numpy's geometric inverts too, for p < 1/3) and
// TensorFlow Federated's do, not the paper's exact Bernoulli(exp(-gamma)) steps over rationals: the same ~2^-53 error
// per probability, far below the delta the accountant spends (the paper's Bernoulli steps gain over this only in
// exact rational arithmetic).
export function discreteGaussian(sigma, size, random = new CryptoRandom()) {
  if (!(sigma > 0) || !Number.isFinite(sigma)) throw new Error("the discrete Gaussian needs sigma > 0, got " + sigma);
  const t = Math.floor(sigma) + 1, centre = sigma * sigma / t, twice = 2 * sigma * sigma;
  const out = new Float64Array(size);
  for (let i = 0; i < size;) {
    const y = Math.floor(t * -Math.log(1 - random.uniform())) - Math.floor(t * -Math.log(1 - random.uniform()));
    const gap = Math.abs(y) - centre;
    if (random.uniform() < Math.exp(-(gap * gap) / twice)) out[i++] = y;
  }
  return out;
}

// A device's noised share (fedge.distributed_noise.DistributedNoise.encode): x = delta clipped to L2 norm c, times s
// (factor = s * (c / ||delta|| if clipped else 1), then each entry times it), rounded half to even, plus the noise, mod
// 2^bits, into `out`. Whether the update was clipped stays in this function: a device's norm is a statistic of its
// data, so it is neither returned, logged nor sent. The norm is a compensated sum of squares (numpy's BLAS dot may
// differ from it in the last bit; the two encodings differ only where an entry times the factor lies within that of a
// half-integer).
export function noisedShare(delta, clip, scale, stddev, bits, out, random = new CryptoRandom()) {
  let sum = 0, carry = 0;  // Neumaier's compensated summation
  for (let i = 0; i < delta.length; i++) {
    const term = delta[i] * delta[i], next = sum + term;
    carry += Math.abs(sum) >= Math.abs(term) ? (sum - next) + term : (term - next) + sum;
    sum = next;
  }
  const norm = Math.sqrt(sum + carry);
  if (Number.isNaN(norm)) throw new Error("a secure update holds NaN: nothing is masked");
  const factor = scale * (norm > clip ? clip / norm : 1.0);
  const noise = discreteGaussian(stddev, delta.length, random);
  const wide = bits > 32, modulus = 2 ** bits;
  for (let i = 0; i < delta.length; i++) {
    const y = roundHalfEven(delta[i] * factor) + noise[i];  // whole doubles below 2^53: exact
    if (wide) {
      out[i] = BigInt.asUintN(bits, BigInt(y));
    } else {
      const r = y % modulus;
      out[i] = r < 0 ? r + modulus : r;
    }
  }
  return out;
}

// The masked step's encoded update under distributed DP (fedge.clients.secagg_device.encode_noised): the noised share
// of delta = trained - global (float64, tensors in name order, C order), then weight 1 and work 1 (DP averages devices
// uniformly, over a fixed denominator) and zero clipping counts, each tail entry on its own fixed point as in
// encodeUpdate. `random` replaces crypto.getRandomValues for tests only.
export function encodeNoised(globalArrays, trained, params, random = undefined) {
  const delta = deltaOf(globalArrays, trained), size = delta.length;
  const bits = param(params, "bits");
  checkBits(bits);
  const stddev = param(params, DP_STDDEV);
  if (!(stddev > 0)) throw new ProtocolViolation("refusing secagg_masked: '" + DP_STDDEV + "' is " + stddev + ", not > 0");
  const out = ringArray(bits, size + 2 + COUNTS.length);
  noisedShare(delta, param(params, DP_CLIP), param(params, DP_SCALE), stddev, bits, out, random);
  fixedEncode([1.0], param(params, "weight-clip"), param(params, "weight-scale"), bits, out, size);
  fixedEncode([1.0], param(params, "work-clip"), param(params, "work-scale"), bits, out, size + 1);
  fixedEncode(new Array(COUNTS.length).fill(0), param(params, "count-clip"), 1.0, bits, out, size + 2);
  return out;
}

// ------------------------------------------------------------------------------------------------ digests
// Python's sorted() of str: by code point (JavaScript's default sort compares UTF-16 code units).
function compareText(a, b) {
  const x = Array.from(a, (c) => c.codePointAt(0)), y = Array.from(b, (c) => c.codePointAt(0));
  for (let i = 0; i < Math.min(x.length, y.length); i++) if (x[i] !== y[i]) return x[i] - y[i];
  return x.length - y.length;
}

function absorb(parts, part) { parts.push(u64be(part.length), part); }

const DTYPE_STR = {float32: "<f4", float64: "<f8", int8: "|i1", int32: "<i4", int64: "<i8", uint32: "<u4",
                   uint64: "<u8", uint8: "|u1"};
const TYPED_DTYPE = [[Float32Array, "float32"], [Float64Array, "float64"], [Int8Array, "int8"], [Int32Array, "int32"],
                     [BigInt64Array, "int64"], [Uint32Array, "uint32"], [BigUint64Array, "uint64"], [Uint8Array, "uint8"]];
export function dtypeName(typed) {
  for (const [Typed, name] of TYPED_DTYPE) if (typed instanceof Typed) return name;
  throw new Error("no dtype for " + typed.constructor.name);
}
// Python's repr of a shape tuple: (), (2,), (1, 2)
function shapeRepr(shape) { return shape.length === 1 ? "(" + shape[0] + ",)" : "(" + shape.join(", ") + ")"; }

// SHA-256 over the named arrays in name order (fedge.secagg.arrays_digest). arrays: [{name, shape, data}] (the
// frame's dtype from the typed array: float32 is numpy's "<f4"); little-endian bytes, C order.
export async function arraysDigest(arrays) {
  if (!LITTLE_ENDIAN) throw new Error("array digests read little-endian bytes; this platform is not");
  const parts = [enc.encode("fedge-secagg/arrays/v1")];
  for (const entry of [...arrays].sort((a, b) => compareText(a.name, b.name))) {
    absorb(parts, enc.encode(entry.name));
    absorb(parts, enc.encode(DTYPE_STR[entry.dtype || dtypeName(entry.data)]));
    absorb(parts, enc.encode(shapeRepr(entry.shape)));
    const data = entry.data;
    parts.push(u64be(data.byteLength), new Uint8Array(data.buffer, data.byteOffset, data.byteLength));
  }
  return sha256(concat(...parts));
}

// ---- the config digest: Python's type name and repr of each value, as json.loads gave them to a Python device.
// JSON.parse loses whether a number was written as a float (1.0) or an int (1); parsePython keeps it: a number
// written with '.', 'e' or 'E' (or NaN / Infinity, which Python's json reads) is a PyFloat, else a PyInt (BigInt,
// exact at any size), as Python's json module reads them.
export class PyInt { constructor(value) { this.value = value; } }
export class PyFloat { constructor(value) { this.value = value; } }

export function parsePython(text) {
  let at = 0;
  const space = () => { while (at < text.length && " \t\n\r".includes(text[at])) at++; };
  const fail = (what) => { throw new Error("malformed JSON at " + at + ": " + what); };
  function value() {
    space();
    const c = text[at];
    if (c === "{") {
      at++;
      const out = {};
      space();
      if (text[at] === "}") { at++; return out; }
      for (;;) {
        space();
        if (text[at] !== "\"") fail("a key");
        const key = string();
        space();
        if (text[at++] !== ":") fail("':'");
        out[key] = value();
        space();
        if (text[at] === ",") { at++; continue; }
        if (text[at] === "}") { at++; return out; }
        fail("',' or '}'");
      }
    }
    if (c === "[") {
      at++;
      const out = [];
      space();
      if (text[at] === "]") { at++; return out; }
      for (;;) {
        out.push(value());
        space();
        if (text[at] === ",") { at++; continue; }
        if (text[at] === "]") { at++; return out; }
        fail("',' or ']'");
      }
    }
    if (c === "\"") return string();
    for (const [word, result] of [["true", true], ["false", false], ["null", null], ["NaN", new PyFloat(NaN)],
                                  ["Infinity", new PyFloat(Infinity)], ["-Infinity", new PyFloat(-Infinity)]]) {
      if (text.startsWith(word, at)) { at += word.length; return result; }
    }
    const number = /^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/.exec(text.slice(at, at + 1100));
    if (!number) fail("a value");
    at += number[0].length;
    return number[2] || number[3] ? new PyFloat(Number(number[0])) : new PyInt(BigInt(number[0]));
  }
  function string() {
    const start = at++;
    while (at < text.length && text[at] !== "\"") at += text[at] === "\\" ? 2 : 1;
    if (at >= text.length) fail("an unterminated string");
    at++;
    return JSON.parse(text.slice(start, at));
  }
  const out = value();
  space();
  if (at !== text.length) fail("text after the value");
  return out;
}

// Python's repr of a float: the shortest text that reads back the same double (JavaScript's own digits are that
// too), '.0' on whole numbers, exponent form below 1e-4 and from 1e16 up ('1e-05', '1e+16').
export function floatRepr(x) {
  if (Number.isNaN(x)) return "nan";
  if (!Number.isFinite(x)) return x > 0 ? "inf" : "-inf";
  if (x === 0) return Object.is(x, -0) ? "-0.0" : "0.0";
  const sign = x < 0 ? "-" : "";
  const [mantissa, exponent] = String(Math.abs(x)).split("e");
  const [whole, fraction = ""] = mantissa.split(".");
  let digits = (whole + fraction).replace(/^0+/, "");
  const leading = (whole + fraction).length - digits.length;  // zeros before the first digit
  let point = whole.length - leading + Number(exponent || 0);  // value = 0.DIGITS × 10^point
  digits = digits.replace(/0+$/, "");
  if (point <= -4 || point > 16) {
    const e = point - 1;
    return sign + digits[0] + (digits.length > 1 ? "." + digits.slice(1) : "") + "e" + (e < 0 ? "-" : "+") +
      String(Math.abs(e)).padStart(2, "0");
  }
  if (point <= 0) return sign + "0." + "0".repeat(-point) + digits;
  if (point >= digits.length) return sign + digits + "0".repeat(point - digits.length) + ".0";
  return sign + digits.slice(0, point) + "." + digits.slice(point);
}

const NOT_PRINTABLE = /[\p{Cc}\p{Cf}\p{Cs}\p{Co}\p{Cn}\p{Zl}\p{Zp}\p{Zs}]/u;  // str.isprintable's categories
const ESCAPES = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"};

function quoteOf(text) { return text.includes("'") && !text.includes("\"") ? "\"" : "'"; }

// Python's repr of a str.
export function strRepr(text) {
  const quote = quoteOf(text);
  let out = quote;
  for (const ch of text) {
    const code = ch.codePointAt(0);
    if (ch === quote) out += "\\" + ch;
    else if (ESCAPES[ch]) out += ESCAPES[ch];
    else if (code < 0x20 || code === 0x7f) out += "\\x" + code.toString(16).padStart(2, "0");
    else if (code < 0x7f || (ch !== " " && !NOT_PRINTABLE.test(ch))) out += ch;
    else if (code <= 0xff) out += "\\x" + code.toString(16).padStart(2, "0");
    else if (code <= 0xffff) out += "\\u" + code.toString(16).padStart(4, "0");
    else out += "\\U" + code.toString(16).padStart(8, "0");
  }
  return out + quote;
}

// Python's repr of bytes.
function bytesRepr(bytes) {
  const text = String.fromCharCode(...bytes);
  const quote = quoteOf(text);
  let out = "b" + quote;
  for (const code of bytes) {
    const ch = String.fromCharCode(code);
    if (ch === quote || ch === "\\") out += "\\" + ch;
    else if (ESCAPES[ch]) out += ESCAPES[ch];
    else if (code < 0x20 || code >= 0x7f) out += "\\x" + code.toString(16).padStart(2, "0");
    else out += ch;
  }
  return out + quote;
}

// [Python's type name, repr] of a parsePython value as fedge.clients.gateway.protocol.records_from_json gives it
// ({"b64": ...} objects are bytes).
export function pythonValue(value) {
  if (value instanceof PyInt) return ["int", value.value.toString()];
  if (value instanceof PyFloat) return ["float", floatRepr(value.value)];
  if (value === true || value === false) return ["bool", value ? "True" : "False"];
  if (value === null) return ["NoneType", "None"];
  if (typeof value === "string") return ["str", strRepr(value)];
  if (value instanceof Uint8Array) return ["bytes", bytesRepr(value)];
  if (Array.isArray(value)) return ["list", "[" + value.map((item) => pythonValue(item)[1]).join(", ") + "]"];
  if (value && typeof value === "object" && Object.keys(value).length === 1 && typeof value.b64 === "string") {
    return pythonValue(Uint8Array.from(atob(value.b64), (c) => c.charCodeAt(0)));
  }
  throw new ProtocolViolation("refusing: a config value is neither a number, text, boolean, bytes nor a list");
}

// SHA-256 over config records in order, each key in sorted order with its Python type and repr, leaving out
// local-epochs (fedge.secagg.config_digest). records: parsePython values.
export async function configDigest(...records) {
  const parts = [enc.encode("fedge-secagg/config/v1")];
  for (const record of records) {
    absorb(parts, enc.encode("record"));
    for (const key of Object.keys(record).filter((k) => !PER_DEVICE_CONFIG.has(k)).sort(compareText)) {
      const [type, repr] = pythonValue(record[key]);
      absorb(parts, enc.encode(key));
      absorb(parts, enc.encode(type));
      absorb(parts, enc.encode(repr));
    }
  }
  return sha256(concat(...parts));
}

// A frame's JSON header as text (docs/device-protocol.md, "Frame format"), for parsePython.
export function frameHeaderText(frame) {
  const bytes = frame instanceof Uint8Array ? frame : new Uint8Array(frame);
  const length = new DataView(bytes.buffer, bytes.byteOffset).getUint32(4, true);
  return new TextDecoder().decode(bytes.subarray(8, 8 + length));
}

// ------------------------------------------------------------------------------------------------ records
// JSON records ({"b64": ...} values are bytes, in lists too), as fedge.clients.gateway.protocol reads them.
export function recordsFromJson(raw) {
  const decode = (value) => {
    if (Array.isArray(value)) return value.map(decode);
    if (value && typeof value === "object") {
      if (Object.keys(value).length !== 1 || typeof value.b64 !== "string") {
        throw new ProtocolViolation("malformed step: an object value must be {\"b64\": ...} (bytes)");
      }
      return Uint8Array.from(atob(value.b64), (c) => c.charCodeAt(0));
    }
    return value;
  };
  if (!raw || typeof raw !== "object" || Array.isArray(raw)) throw new ProtocolViolation("malformed step: 'records'");
  const out = {};
  for (const [name, record] of Object.entries(raw)) {
    if (!record || typeof record !== "object" || Array.isArray(record)) {
      throw new ProtocolViolation("malformed step: record '" + name.slice(0, 40) + "' is not an object");
    }
    out[name] = Object.fromEntries(Object.entries(record).map(([key, value]) => [key, decode(value)]));
  }
  return out;
}

function b64(bytes) {
  let raw = "";
  for (let i = 0; i < bytes.length; i += 0x8000) raw += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(raw);
}

export function recordsToJson(records) {
  const encode = (value) => value instanceof Uint8Array ? {b64: b64(value)} : Array.isArray(value) ? value.map(encode) : value;
  return Object.fromEntries(Object.entries(records).map(([name, record]) =>
    [name, Object.fromEntries(Object.entries(record).map(([key, value]) => [key, encode(value)]))]));
}

// ------------------------------------------------------------------------------------------------ the five steps
// A round's state: {round, stage, c, s, g (CryptoKeys), sRaw, b, neighbours, threshold, peer keys, shares held,
// digests received, the survivor set signed}. Each step checks it is the next one of this round.

function whole(value, what) {
  if (typeof value !== "number" || !Number.isFinite(value)) throw new ProtocolViolation("malformed step: '" + what + "'");
  return Math.trunc(value);  // Python's int() of the record's number
}

// Node ids from a list value (a malformed one is a protocol violation).
export function ids(values) {
  if (!Array.isArray(values) || !values.every((v) => Number.isInteger(v))) {
    throw new ProtocolViolation("refusing: a node list is malformed");
  }
  return values.slice();
}

function sortedUnique(values) { return [...new Set(values)].sort((a, b) => a - b); }

function ad(sender, receiver, serverRound) { return enc.encode(sender + "->" + receiver + "/" + serverRound); }

// Refuse a step from another round or out of order (a replayed or reordered message): each step runs at most once a
// round, so a device signs at most one survivor set.
export function advance(state, stage, serverRound) {
  const index = STEPS.indexOf(state.stage);
  const expected = index < STEPS.length - 1 ? STEPS[index + 1] : null;
  if (state.round !== serverRound || stage !== expected) {
    throw new ProtocolViolation("refusing " + stage + " for round " + serverRound + ": this device is at " + state.stage +
                                " of round " + state.round + " (a replayed or reordered message)");
  }
  state.stage = stage;
}

// Refuse a round at or before the last one this device unmasked in (two sums of the same updates over different
// device sets would reveal their difference).
export function checkNotUnmasked(lastUnmasked, serverRound) {
  if (lastUnmasked !== null && lastUnmasked !== undefined && serverRound <= lastUnmasked) {
    throw new ProtocolViolation("refusing secagg_setup for round " + serverRound + ": this device already unmasked in " +
                                "round " + lastUnmasked + " (a second sum of the same updates would reveal differences " +
                                "between device sets)");
  }
}

export function minimumThreshold(neighbours) { return Math.max(2, Math.floor(neighbours / 2) + 1); }

// Round 0 (AdvertiseKeys): this round's fresh secrets and the public keys to send.
export async function setup(serverRound) {
  const c = await crypto.subtle.generateKey({name: "X25519"}, false, ["deriveBits"]);
  const s = await crypto.subtle.generateKey({name: "X25519"}, true, ["deriveBits"]);  // its raw key is shared
  const g = await crypto.subtle.generateKey({name: "Ed25519"}, false, ["sign", "verify"]);
  const state = {round: serverRound, stage: "secagg_setup", c: c.privateKey, s: s.privateKey, g: g.privateKey,
                 sRaw: await rawPrivate(s.privateKey), peers: {}};
  const keys = {"c-pk": await rawPublic(c.publicKey), "s-pk": await rawPublic(s.publicKey),
                "g-pk": await rawPublic(g.publicKey)};
  return {state: state, keys: keys};
}

// Refuse a threshold or neighbourhood a device must not share its secrets under (Bonawitz et al. §4 round 1).
export function checkThreshold(threshold, neighbours, me) {
  if (new Set(neighbours).size !== neighbours.length || neighbours.includes(me)) {
    throw new ProtocolViolation("refusing secagg_share: the neighbour list repeats a node or holds this device");
  }
  const floor = minimumThreshold(neighbours.length);
  if (!(floor <= threshold && threshold <= neighbours.length)) {
    throw new ProtocolViolation("refusing secagg_share: threshold " + threshold + " with " + neighbours.length +
                                " neighbours; a device needs " + floor + " <= t <= " + neighbours.length +
                                " (at least 2 and more than half its neighbours)");
  }
}

// Round 1 (ShareKeys): Shamir shares of the self-mask seed and the mask key, one pair sealed for each neighbour.
export async function share(state, peers, me) {
  const serverRound = whole(peers["server-round"], "server-round");
  advance(state, "secagg_share", serverRound);
  const neighbours = ids(peers.neighbours);
  const threshold = whole(peers.threshold, "threshold");
  checkThreshold(threshold, neighbours, me);
  for (const kind of PUBLIC_KEYS) {
    const seen = new Set(neighbours.map((peer) => hex(bytesOf(peers[kind + "/" + peer], kind + "/" + peer))));
    if (seen.size !== neighbours.length) throw new ProtocolViolation("refusing secagg_share: two neighbours have the same " + kind);
  }
  const selfSeed = crypto.getRandomValues(new Uint8Array(32));
  const seedShares = shareSecret(selfSeed, threshold, neighbours);
  const keyShares = shareSecret(state.sRaw, threshold, neighbours);
  const sealed = {};
  for (const peer of neighbours) {
    const key = await derive(state.c, peers["c-pk/" + peer], "share");
    sealed["to/" + peer] = await seal(key, concat(seedShares.get(peer), keyShares.get(peer)), ad(me, peer, serverRound));
    state.peers[peer] = Object.fromEntries(PUBLIC_KEYS.map((kind) => [kind, peers[kind + "/" + peer]]));
  }
  state.b = selfSeed;
  state.neighbours = neighbours;
  state.threshold = threshold;
  return sealed;
}

// Two Shamir shares (self-mask seed, mask key) of one nonzero index.
function wellFormed(opened) {
  return opened !== null && opened.length === 2 * SHARE_BYTES && opened[0] === opened[SHARE_BYTES] &&
    opened[1] === opened[SHARE_BYTES + 1] && (opened[0] << 8 | opened[1]) >= 1;
}

async function openShares(state, inbox, me) {
  const holding = [], bad = [];
  for (const peer of state.neighbours) {
    const sealed = inbox["from/" + peer];
    if (sealed === undefined) continue;  // not relayed: the peer did not share (a dropout)
    const key = await derive(state.c, state.peers[peer]["c-pk"], "share");
    const opened = sealed instanceof Uint8Array ? await openSealed(key, sealed, ad(peer, me, state.round)) : null;
    if (wellFormed(opened)) {
      holding.push(peer);
      state.peers[peer].from = sealed;
    } else {
      bad.push(peer);
    }
  }
  return {holding: holding, bad: bad};
}

// Round 2 (MaskedInputCollection): open the relayed shares, train, mask the encoded update, sign the digests of the
// model and config received. globalArrays: [{name, dtype, shape, data}]; typedRecords: [config, secagg] as
// parsePython read them (for the config digest); train(): {arrays: {name: data}, numExamples, steps}.
// {vector, received: {arrays, config, signature}} or {bad: [peers whose shares did not open]}.
export async function masked(state, {inbox, params, config, typedRecords, globalArrays, me, train}) {
  advance(state, "secagg_masked", whole(config["server-round"], "server-round"));
  const serverRound = state.round, threshold = state.threshold;
  const {holding, bad} = await openShares(state, inbox, me);
  if (bad.length) {
    console.warn("round " + serverRound + ": the shares relayed from neighbours " + bad.join(", ") + " do not open " +
                 "or are malformed; reported, nothing masked");
    return {bad: bad};
  }
  if (holding.length < threshold) {  // Bonawitz et al. round 2: |U2| >= t, else the self-mask alone hides x
    throw new ProtocolViolation("refusing secagg_masked: shares from only " + holding.length + " neighbours reached " +
                                "this device, fewer than the threshold " + threshold);
  }
  state.holding = holding;
  state.minSurvivors = whole(params[DP_MIN_SURVIVORS] ?? 0, DP_MIN_SURVIVORS);  // checked at consistency
  const trained = await train();
  const bits = param(params, "bits");
  const encoded = DP_STDDEV in params ? encodeNoised(globalArrays, trained.arrays, params)
    : encodeUpdate(globalArrays, trained.arrays, trained.numExamples, trained.steps, params);
  const pairSeeds = [];
  for (const peer of holding) {
    pairSeeds.push([peer, await derive(state.s, state.peers[peer]["s-pk"], "mask", enc.encode(String(serverRound)))]);
  }
  const vector = maskedInput(encoded, state.b, pairSeeds, me, bits);
  state.received = {arrays: await arraysDigest(globalArrays), config: await configDigest(...typedRecords)};
  const signature = await sign(state.g, receivedMessage(serverRound, state.received.arrays, state.received.config));
  return {vector: vector, received: {arrays: state.received.arrays, config: state.received.config, signature: signature}};
}

// The checks on a survivor set before signing it (Bonawitz et al. §4 round 3, per neighbourhood as Bell et al.).
// Under distributed DP the set also holds at least minSurvivors devices (fedge.clients.secagg_device.check_survivors):
// the noise was calibrated for that many shares, and a smaller sum would carry less than accounted for.
export function checkSurvivors(survivors, me, holding, neighbours, threshold, minSurvivors = 0) {
  const alive = new Set(survivors);
  if (!alive.has(me)) throw new ProtocolViolation("refusing the survivor set: this device sent its masked input but is not in it");
  const foreign = neighbours.filter((peer) => alive.has(peer) && !holding.includes(peer)).sort((a, b) => a - b);
  if (foreign.length) {
    throw new ProtocolViolation("refusing the survivor set: it names neighbour " + foreign[0] + ", whose shares never " +
                                "reached this device (it cannot have masked with it)");
  }
  if (alive.size < minSurvivors) {
    throw new ProtocolViolation("refusing the survivor set: it holds " + alive.size + " devices, fewer than the " +
                                minSurvivors + " the distributed-DP noise was calibrated for (their sum would carry " +
                                "less noise than accounted for)");
  }
  const count = holding.filter((peer) => alive.has(peer)).length;
  if (count < threshold) {
    throw new ProtocolViolation("refusing the survivor set: it holds " + count + " of this device's neighbours, fewer " +
                                "than the threshold " + threshold);
  }
}

// Round 3 (ConsistencyCheck): check the survivor set and that every surviving neighbour signed the model and config
// this device received (Pasquini et al., CCS 2022), then sign the set (at most once a round).
export async function consistency(state, check, me) {
  advance(state, "secagg_consistency", whole(check["server-round"], "server-round"));
  const survivors = sortedUnique(ids(check.survivors));
  checkSurvivors(survivors, me, state.holding, state.neighbours, state.threshold, state.minSurvivors ?? 0);
  const message = receivedMessage(state.round, state.received.arrays, state.received.config);
  for (const peer of state.neighbours.filter((p) => survivors.includes(p)).sort((a, b) => a - b)) {
    if (!await validSignature(state.peers[peer]["g-pk"], check["received/" + peer], message)) {
      console.warn("round " + state.round + ": neighbour " + peer + " did not sign the global model and training config " +
                   "this device received; refusing to sign the survivor set (nothing will be unmasked)");
      throw new ProtocolViolation("refusing the survivor set: neighbour " + peer + " did not sign the global model and " +
                                  "training config this device received (it was sent a different model or config: a " +
                                  "coordinator isolating one device's update, Pasquini et al., CCS 2022)");
    }
  }
  const signature = await sign(state.g, survivorsMessage(state.round, survivors));
  state.signed = survivors;
  return signature;
}

// Round 4 (Unmasking): with t neighbours' signatures over the set this device signed, reveal one share per neighbour
// held: a survivor's self-mask share b/<j>, a dropout's mask-key share s/<j>, decided from the signed set.
export async function unmask(state, ask, me) {
  advance(state, "secagg_unmask", whole(ask["server-round"], "server-round"));
  if (!state.signed) throw new ProtocolViolation("refusing secagg_unmask: this device signed no survivor set this round");
  const survivors = state.signed;
  const asked = sortedUnique(ids(ask.survivors));
  if (asked.length !== survivors.length || asked.some((node, i) => node !== survivors[i])) {
    throw new ProtocolViolation("refusing secagg_unmask: its survivor set is not the one this device signed");
  }
  const message = survivorsMessage(state.round, survivors);
  let signers = 0;
  for (const peer of state.neighbours) {  // stop at t: that is all the check needs
    signers += await validSignature(state.peers[peer]["g-pk"], ask["sig/" + peer], message) ? 1 : 0;
    if (signers === state.threshold) break;
  }
  if (signers < state.threshold) {  // Bonawitz et al. round 4: |U5| >= t valid signatures over the same U3
    throw new ProtocolViolation("refusing secagg_unmask: " + signers + " neighbours signed the survivor set this device " +
                                "signed, fewer than the threshold " + state.threshold + " (inconsistent dropouts?)");
  }
  const alive = new Set(survivors);
  const revealed = {};
  for (const peer of state.holding) {
    const key = await derive(state.c, state.peers[peer]["c-pk"], "share");
    const shares = await openSealed(key, state.peers[peer].from, ad(peer, me, state.round));
    if (alive.has(peer)) revealed["b/" + peer] = shares.slice(0, SHARE_BYTES);
    else revealed["s/" + peer] = shares.slice(SHARE_BYTES);
  }
  return revealed;
}
