"""Secure aggregation in the web SDK (issue 41 §1): browser tabs in a gateway's secure pool, beside Python devices.

Real parts: headless Chromium (WebCrypto's X25519, HKDF, AES-GCM, Ed25519; the vendored @noble/ciphers ChaCha20)
running ``web/secagg.js`` and ``web/fedge-device.js`` from a gateway's TLS listener (the demo page), fedge's Python
secure-aggregation functions on the other side, and for the end to end a live gateway running SecAgg+ over a pool of
three tabs and one reference protocol device. Bonawitz et al., CCS 2017; Bell et al., CCS 2020; Shamir, CACM 1979.

Needs Debian's chromium + chromedriver and the pinned onnxruntime-web under ``.cache/ortweb`` (``make test`` installs
both); skipped with the reason otherwise (the ``chromium`` fixture of test_web_device.py).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import re
import threading
import tomllib
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedge.aggregate import weighted_mean
from fedge.clients.gateway.protocol import Frame
from fedge.clients.gateway.secure_pool import SecureExchange
from fedge.clients.gateway.service import GatewaySettings
from fedge.edge.trainer import OnnxTrainer
from fedge.edge.training_bundle import read_training_bundle
from fedge.secagg import FixedPoint, config_digest, masked_input, open_sealed, rebuild_secret, seal
from fedge.web import ASSETS, VENDOR_FILES
from tests.live_gateway import recomputed
from tests.test_gateway_secure import SECURE, Polling, _recording
from tests.test_web_device import WebGateway, _open_device, chromium  # noqa: F401 - chromium: the fixture

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "docs" / "protocol-vectors"


def _vector(name: str) -> dict[str, Any]:
    return json.loads((VECTORS / f"{name}.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory, run: dict[str, Any], chromium: Any) -> Any:  # noqa: F811
    """Chromium on a gateway's demo page (the origin that serves web/secagg.js and its vendored imports)."""
    gateway = WebGateway(tmp_path_factory.mktemp("secagg-page"), run, GatewaySettings(name="gw-test"))
    chromium.get(f"{gateway.url}/web/demo.html?name=vectors")
    yield chromium
    gateway.close()


def _in_page(driver: Any, body: str, *args: Any) -> Any:
    """Run ``body`` (an async function body over ``S``, secagg.js, and ``args``) in the page; its JSON result."""
    script = ("const done = arguments[arguments.length - 1]; const args = Array.from(arguments).slice(0, -1);"
              "(async () => { const S = await import('./secagg.js');"
              f" return JSON.stringify(await (async (S, args) => {{ {body} }})(S, args)); }})()"
              ".then(done, (error) => done(JSON.stringify({error: String(error && error.stack || error)})));")
    result = json.loads(driver.execute_async_script(script, *args))
    assert not (isinstance(result, dict) and "error" in result), result
    return result


VECTOR_SCRIPT = """
const [keys, masks, shares, update, signaturesText] = args;
const hex = S.hex, un = S.fromHex, text = (t) => new TextEncoder().encode(t);
const signatures = JSON.parse(signaturesText), typed = S.parsePython(signaturesText);
const a = await S.importPrivate("X25519", un(keys.a_private_hex));
const b = await S.importPrivate("X25519", un(keys.b_private_hex));
const out = {
  shared_share: hex(await S.derive(a, un(keys.b_public_hex), "share")),
  shared_share_other: hex(await S.derive(b, un(keys.a_public_hex), "share")),
  mask_seed_round_3: hex(await S.derive(a, un(keys.b_public_hex), "mask", text("3"))),
};
const g = await S.importPrivate("Ed25519", un(keys.ed25519_seed_hex), true);
out.masks = Object.fromEntries(Object.keys(masks.masks_by_bits).map((bits) =>
  [bits, Array.from(S.expandMask(un(masks.mask_seed_hex), 5, Number(bits)), String)]));
const fp = masks.fixed_point;
const ring = S.ringArray(fp.bits, fp.values.length);
out.fixed_point = Array.from(S.fixedEncode(fp.values, fp.clip, fp.scale, fp.bits, ring), String);
const mi = masks.masked_input;
const pairs = Object.entries(mi.pair_seeds_hex).map(([peer, seed]) => [Number(peer), un(seed)]);
out.masked = Array.from(S.maskedInput(Uint32Array.from(mi.encoded), un(mi.self_seed_hex), pairs, mi.me, 32), String);
const shareOf = (secret, coefficients) => Object.fromEntries(Array.from(
  S.shareSecret(un(secret), shares.threshold, shares.holders, coefficients.map(BigInt)),
  ([holder, s]) => [holder, hex(s)]));
out.self_seed_shares = shareOf(shares.self_seed_hex, shares.self_seed_coefficients);
out.mask_key_shares = shareOf(shares.mask_key_hex, shares.mask_key_coefficients);
out.rebuilt = hex(S.rebuildSecret([un(out.self_seed_shares["29"]), un(out.self_seed_shares["4"])]));
const sl = shares.seal;
out.sealed = hex(await S.seal(un(sl.share_key_hex), un(sl.plaintext_hex), text(sl.associated_text), un(sl.nonce_hex)));
out.opened = hex(await S.openSealed(un(sl.share_key_hex), un(sl.sealed_hex), text(sl.associated_text)));
out.opened_elsewhere = await S.openSealed(un(sl.share_key_hex), un(sl.sealed_hex), text("7->12/3"));
const arrays = (spec) => Object.entries(spec).map(([name, e]) => ({name: name, shape: e.shape,
                                                                  data: Float64Array.from(e.values)}));
out.updates = update.cases.map((c) => Array.from(S.encodeUpdate(arrays(update.global),
  Object.fromEntries(arrays(update.trained).map((e) => [e.name, e.data])), c["num-examples"], c.steps, c.secagg),
  String));
const typedArrays = Object.entries(signatures.arrays).map(([name, e]) => ({name: name, shape: e.shape,
  data: e.dtype === "<i8" ? BigInt64Array.from(e.values.map(BigInt)) : Float32Array.from(e.values)}));
const arraysDigest = await S.arraysDigest(typedArrays), configDigest = await S.configDigest(typed.config, typed.secagg);
out.arrays_digest = hex(arraysDigest);
out.config_digest = hex(configDigest);
const received = S.receivedMessage(3, arraysDigest, configDigest);
out.received_message = new TextDecoder().decode(received);
out.received_signature = hex(await S.sign(g, received));
out.survivors_message = new TextDecoder().decode(S.survivorsMessage(3, signatures.survivors));
out.survivors_signature = hex(await S.sign(g, S.survivorsMessage(3, signatures.survivors)));
out.python_signature_verifies = await S.validSignature(un(keys.ed25519_public_hex),
                                                      un(signatures.received_signature_hex), received);
out.other_message_verifies = await S.validSignature(un(keys.ed25519_public_hex), un(signatures.received_signature_hex),
                                                   S.survivorsMessage(3, signatures.survivors));
out.public_key = (await crypto.subtle.exportKey("jwk", g)).x;  // base64url of the raw public key
return out;
"""


def test_the_browser_makes_every_secure_aggregation_vector_byte_for_byte(page: Any) -> None:
    # Prepare: the shipped vectors (made by fedge's Python functions, docs/protocol-vectors/make_vectors.py)
    keys, masks, shares = _vector("secagg-keys"), _vector("secagg-masks"), _vector("secagg-shares")
    update, signatures = _vector("secagg-update"), _vector("secagg-signatures")
    # Execute: secagg.js in Chromium on the same fixed keys, seeds, coefficients and nonces
    out = _in_page(page, VECTOR_SCRIPT, keys, masks, shares, update,
                   (VECTORS / "secagg-signatures.json").read_text(encoding="utf-8"))
    # Assert: each output equals Python's, byte for byte
    assert out["shared_share"] == out["shared_share_other"] == keys["share_key_hex"]
    assert out["mask_seed_round_3"] == keys["mask_seed_round_3_hex"]
    assert base64.urlsafe_b64decode(out["public_key"] + "=").hex() == keys["ed25519_public_hex"]
    assert out["masks"] == {bits: [str(w) for w in words] for bits, words in masks["masks_by_bits"].items()}
    assert out["fixed_point"] == [str(w) for w in masks["fixed_point"]["encoded"]]
    assert out["masked"] == [str(w) for w in masks["masked_input"]["masked"]]
    assert out["self_seed_shares"] == shares["self_seed_shares_hex"]
    assert out["mask_key_shares"] == shares["mask_key_shares_hex"]
    assert out["rebuilt"] == shares["rebuilt_from_holders_29_4_hex"] == shares["self_seed_hex"]
    assert out["sealed"] == shares["seal"]["sealed_hex"]
    assert out["opened"] == shares["seal"]["plaintext_hex"] and out["opened_elsewhere"] is None
    assert out["updates"] == [[str(w) for w in case["vector"]] for case in update["cases"]]
    assert out["arrays_digest"] == signatures["arrays_digest_hex"]
    assert out["config_digest"] == signatures["config_digest_hex"]
    assert out["received_message"] == signatures["received_message_text"]
    assert out["received_signature"] == signatures["received_signature_hex"]  # Ed25519 is deterministic
    assert out["survivors_message"] == signatures["survivors_message_text"]
    assert out["survivors_signature"] == signatures["survivors_signature_hex"]
    assert out["python_signature_verifies"] is True and out["other_message_verifies"] is False


# Hand-picked config values whose Python repr a port gets wrong easily (JSON.parse loses 1.0 vs 1)
CONFIGS: list[dict[str, Any]] = [
    {"learning-rate": 0.05, "whole-float": 1.0, "int": 1, "zero": 0.0, "negative-zero": -0.0, "small": 1e-05,
     "smaller": 1.5e-07, "edge": 0.0001, "big": 1e16, "below-big": 1e15, "huge": 1.2345678901234568e+20,
     "tiny": 5e-324, "max": 1.7976931348623157e+308, "sum": 0.1 + 0.2, "large-int": 2**60 + 1, "negative": -3},
    {"text": "x", "apostrophe": "it's", "both": "a\"b'c", "escapes": "tab\there\nand\\", "accent": "é",
     "invisible": "\u200b\u00a0", "astral": "\U0001f600", "control": "\x7f", "true": True, "false": False,
     "ints": [1, 2, 3], "floats": [0.5, 1.0, 2000.0], "texts": ["a", "b'"], "empty": [], "local-epochs": 9},
    {"bytes": b"\x00ab'\x7f\xff", "quoted": b"it's \"x\"", "byte-list": [b"a", b"\n"]},
]


def test_the_browser_digests_a_config_as_python_does_keeping_floats_and_ints_apart(page: Any) -> None:
    # Prepare: each record as a gateway writes it (Python's json: floats keep their '.0', bytes go as {"b64"})
    from fedge.clients.gateway.protocol import records_from_json, records_to_json  # noqa: PLC0415

    texts = [json.dumps(records_to_json({"config": config})) for config in CONFIGS]
    python = [config_digest(records_from_json(json.loads(text))["config"]).hex() for text in texts]
    # Execute
    out = _in_page(page, "return await Promise.all(args[0].map(async (t) => "
                         "S.hex(await S.configDigest(S.parsePython(t).config))));", texts)
    # Assert: one digest per record, Python's; the int/float split matters (1 and 1.0 digest differently)
    assert out == python
    assert config_digest({"x": 1}) != config_digest({"x": 1.0})


ROUND_TRIP = """
const [threshold, holders, pythonSealed, key, bits] = args;
const un = S.fromHex, text = (t) => new TextEncoder().encode(t);
const secret = crypto.getRandomValues(new Uint8Array(32));
const shares = S.shareSecret(secret, threshold, holders);  // random coefficients (rejection-sampled in [0, P))
const zero = new Uint8Array(32), one = new Uint8Array(32);
one[0] = 1;
const refused = async (peer) => {
  const mine = (await crypto.subtle.generateKey({name: "X25519"}, false, ["deriveBits"])).privateKey;
  try { await S.derive(mine, peer, "share"); return false; }
  catch (error) { return error instanceof S.ProtocolViolation; }
};
const seed = crypto.getRandomValues(new Uint8Array(32)), pairs = [[3, crypto.getRandomValues(new Uint8Array(32))]];
const encoded = S.fixedEncode([0.25, -1.5, 3e9, -0.0005], 4e9, 1000, bits, S.ringArray(bits, 4));
return {
  secret: S.hex(secret), shares: Array.from(shares.values(), S.hex),
  sealed: S.hex(await S.seal(un(key), text("from the browser"), text("1->2/3"))),
  opened: S.hex(await S.openSealed(un(key), un(pythonSealed), text("2->1/3"))),
  // the last byte (of the tag) flipped, so it differs whatever it was
  tampered: await S.openSealed(un(key), un(pythonSealed.slice(0, -2)
    + (parseInt(pythonSealed.slice(-2), 16) ^ 1).toString(16).padStart(2, "0")), text("2->1/3")),
  small_order_refused: [await refused(zero), await refused(one)],
  ring: {seed: S.hex(seed), pair: S.hex(pairs[0][1]), encoded: Array.from(encoded, String),
         masked: Array.from(S.maskedInput(encoded, seed, pairs, 5, bits), String)},
};
"""


@pytest.mark.parametrize("bits", [32, 20, 64, 40])
def test_browser_shares_and_seals_open_in_python_and_python_seals_open_in_the_browser(page: Any, bits: int) -> None:
    # Prepare: a share key both sides hold; a share Python sealed for the browser
    key = os.urandom(32)
    python_sealed = seal(key, b"from python", b"2->1/3")
    # Execute
    out = _in_page(page, ROUND_TRIP, 3, [11, 4, 29, 8], python_sealed.hex(), key.hex(), bits)
    # Assert: any 3 of the browser's shares rebuild its secret in Python, 2 do not
    shares = [bytes.fromhex(share) for share in out["shares"]]
    assert all(len(share) == 68 for share in shares)
    assert rebuild_secret(shares[:3]).hex() == rebuild_secret(shares[1:]).hex() == out["secret"]
    assert rebuild_secret(shares[:2]).hex() != out["secret"]
    assert open_sealed(key, bytes.fromhex(out["sealed"]), b"1->2/3") == b"from the browser"
    assert bytes.fromhex(out["opened"]) == b"from python" and out["tampered"] is None
    assert out["small_order_refused"] == [True, True]  # all-zero X25519 results (RFC 7748 §6.1) are refused
    # the ring: fixed point (half to even, two's complement) and masks in Z_2^bits, uint64 rings included
    ring = out["ring"]
    encoded = FixedPoint(4e9, 1000, bits).encode(np.array([0.25, -1.5, 3e9, -0.0005]))
    assert [str(int(w)) for w in encoded] == ring["encoded"]
    masked = masked_input(encoded, bytes.fromhex(ring["seed"]), {3: bytes.fromhex(ring["pair"])}, 5, bits)
    assert [str(int(w)) for w in masked] == ring["masked"]


def test_the_gateway_serves_and_the_package_ships_the_vendored_chacha20(page: Any) -> None:
    # Prepare: the hashes web/vendor/README.md records
    readme = (ASSETS / "vendor" / "README.md").read_text(encoding="utf-8")
    recorded = dict(re.findall(r"\| `([\w.]+)` \| `([0-9a-f]{64})` \|", readme))
    # Execute: what the gateway serves at /web/vendor/...
    served = _in_page(page, "return await Promise.all(args[0].map(async (path) => { const r = await fetch(path);"
                            " return [r.status, Array.from(new Uint8Array(await crypto.subtle.digest('SHA-256',"
                            " await r.arrayBuffer())), (b) => b.toString(16).padStart(2, '0')).join('')]; }));",
                      [f"/web/{path}" for path in VENDOR_FILES])
    # Assert: every vendored file is served byte for byte, hashed in the README, and in the package data
    files = [ASSETS / path for path in VENDOR_FILES]
    assert served == [[200, hashlib.sha256(path.read_bytes()).hexdigest()] for path in files]
    assert {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in files} == recorded
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["fedge.web"]
    assert all(any(fnmatch(path, pattern) for pattern in patterns) for path in (*VENDOR_FILES, "vendor/README.md"))
    assert "@noble/ciphers 2.4.0" in readme and "MIT" in (ASSETS / "vendor" / "noble-ciphers" / "LICENSE").read_text()


# ---------------------------------------------------------------------------------------------- distributed DP
DP_MASKED_SCRIPT = """
const [vector] = args;
const arrays = (spec) => Object.entries(spec).map(([name, e]) => ({name: name, shape: e.shape,
                                                                  data: Float64Array.from(e.values)}));
const globalArrays = arrays(vector.global);
const trained = Object.fromEntries(arrays(vector.trained).map((e) => [e.name, e.data]));
const out = {encoded: vector.cases.map((c) => Array.from(S.encodeNoised(globalArrays, trained, c.secagg), String))};
// the whole masked step under DP (a device with no neighbours: threshold 0), then the consistency step
const params = vector.cases[0].secagg, me = 1;
const typed = S.parsePython(JSON.stringify({config: {"server-round": 3}, secagg: params}));
const attempt = async (survivors) => {
  const {state} = await S.setup(3);
  state.stage = "secagg_share"; state.neighbours = []; state.threshold = 0;
  state.b = crypto.getRandomValues(new Uint8Array(32));
  const answer = await S.masked(state, {inbox: {}, params: params, config: {"server-round": 3},
    typedRecords: [typed.config, typed.secagg], globalArrays: globalArrays, me: me,
    train: async () => ({arrays: trained, numExamples: 120, steps: 4})});
  const selfMask = S.expandMask(state.b, answer.vector.length, 32);  // no neighbours: PRG(b) is the only mask
  const plain = answer.vector.map((w, i) => w - selfMask[i]);  // Uint32Array: mod 2^32
  try {
    await S.consistency(state, {"server-round": 3, survivors: survivors}, me);
    return {plain: Array.from(plain, String), signed: true, minSurvivors: state.minSurvivors};
  } catch (error) {
    return {plain: Array.from(plain, String), minSurvivors: state.minSurvivors,
            refused: error instanceof S.ProtocolViolation ? error.message : String(error)};
  }
};
out.two = await attempt([1, 5]);
out.three = await attempt([1, 5, 9]);
return out;
"""


def test_the_browser_encodes_distributed_dp_as_python_and_refuses_fewer_survivors_than_calibrated(page: Any) -> None:
    # Prepare: the shipped vector (Python's encode_noised, dp-stddev 1e-3: no noise drawn but 0)
    vector = _vector("secagg-dp")
    # Execute: secagg.js' encoding, and its masked step then consistency step with dp-min-survivors = 3
    out = _in_page(page, DP_MASKED_SCRIPT, vector)
    # Assert: each case byte for byte (clipped and not, half to even, rings of 20, 32 and 64 bits)
    assert out["encoded"] == [[str(w) for w in case["vector"]] for case in vector["cases"]]
    # the masked step no longer refuses DP: its vector less the self mask is that encoding
    expected = [str(w) for w in vector["cases"][0]["vector"]]
    assert out["two"]["plain"] == out["three"]["plain"] == expected
    assert out["two"]["minSurvivors"] == out["three"]["minSurvivors"] == 3
    # a survivor set of 2 is refused, naming the calibration; one of 3 is signed
    assert "holds 2 devices, fewer than the 3 the distributed-DP noise was calibrated for" in out["two"]["refused"]
    assert out["three"]["signed"] is True


SAMPLER_SCRIPT = """
const [sigmas, draws] = args;
const random = Math.random;
Math.random = () => { throw new Error("Math.random was called"); };  // the sampler must use crypto.getRandomValues
try {
  return sigmas.map((sigma) => {
    const x = S.discreteGaussian(sigma, draws);
    let sum = 0, squares = 0, whole = true;
    for (const y of x) { sum += y; whole = whole && Number.isInteger(y); }
    const mean = sum / draws;
    for (const y of x) squares += (y - mean) ** 2;
    return {mean: mean, variance: squares / (draws - 1), whole: whole, nonzero: x.filter((y) => y !== 0).length};
  });
} finally { Math.random = random; }
"""


def _discrete_gaussian_moments(sigma: float) -> tuple[float, float]:
    """The exact variance and fourth moment of N_Z(0, sigma^2) (summed to 40 sigma, where the tail is below 1e-300)."""
    k = np.arange(-int(40 * sigma) - 10, int(40 * sigma) + 11, dtype=np.float64)
    p = np.exp(-k * k / (2 * sigma * sigma))
    p /= p.sum()
    return float(np.sum(p * k ** 2)), float(np.sum(p * k ** 4))


def test_the_browsers_discrete_gaussian_has_mean_zero_and_variance_sigma_squared(page: Any) -> None:
    # Prepare: 200,000 draws per sigma; the tolerances are five standard errors of each estimator (two-sided: a false
    # failure has probability ~6e-7 per check), from the distribution's exact moments, not tuned by hand
    sigmas, draws = [1.0, 7.5, 400.0], 200_000
    # Execute
    out = _in_page(page, SAMPLER_SCRIPT, [*sigmas, 1e-3], draws)
    # Assert: integers; mean 0 within 5 sigma / sqrt(n); variance within 5 sqrt((mu4 - var^2) / n) of N_Z's
    for sigma, stats in zip(sigmas, out, strict=False):
        variance, fourth = _discrete_gaussian_moments(sigma)
        assert abs(variance / sigma ** 2 - 1) < 1e-6  # N_Z(0, sigma^2)'s variance is sigma^2 for sigma >= 1
        mean_se, variance_se = np.sqrt(variance / draws), np.sqrt((fourth - variance ** 2) / draws)
        assert stats["whole"] is True
        assert abs(stats["mean"]) <= 5 * mean_se, (sigma, stats, mean_se)
        assert abs(stats["variance"] - variance) <= 5 * variance_se, (sigma, stats, variance, variance_se)
        assert 5 * variance_se / variance < 0.02  # "within a few %": here 1.6 %
    assert out[-1] == {"mean": 0, "variance": 0, "whole": True, "nonzero": 0}  # sigma 1e-3: always 0


# ---------------------------------------------------------------------------------------------- end to end
def _expected_mean(run: dict[str, Any], names: list[str], server_round: int) -> tuple[dict[str, np.ndarray], int]:
    """Each device's training recomputed by the Python trainer (its shard, the round's seed); their weighted mean."""
    bundle = read_training_bundle(run["bundle"], trusted_keys=[run["trust"]])
    trainer = OnnxTrainer(bundle.train_onnx, bundle.eval_onnx, bundle.manifest)
    trained, counts = recomputed(trainer, run, names, server_round)
    return weighted_mean(trained, counts), sum(counts)


LEAVE_AFTER_SHARE = """
const [round, done] = arguments;
import('./fedge-device.js').then(({FedgeDevice}) => {
  const step = FedgeDevice.prototype.secureStep;
  FedgeDevice.prototype.secureStep = async function (task, ...rest) {
    const outcome = await step.call(this, task, ...rest);
    if (task.action === 'secagg_share' && task['server-round'] === round) {
      window.__shared = true;
      await new Promise(() => {});  // the user closes the tab now: it never polls again
    }
    return outcome;
  };
  done(true);
});
"""


LOSE_MASKED_ANSWER_ONCE = """
const [done] = arguments;
import('./fedge-device.js').then(({FedgeDevice}) => {
  const result = FedgeDevice.prototype.result;
  FedgeDevice.prototype.result = async function (frame) {
    if (!window.__lost && new TextDecoder().decode(frame.subarray(0, 2000)).includes('secagg-received')) {
      window.__lost = true;  // a POST that timed out before the gateway had it: the gateway sends the step again
      throw Object.assign(new Error('the answer to the masked step was lost on the way'), {network: true});
    }
    return result.call(this, frame);
  };
  done(true);
});
"""


def _when(driver: Any, condition: str) -> Any:
    """The page's state once ``condition`` (JavaScript over the demo page's state ``s``) holds: an event, no pause."""
    return driver.execute_async_script(
        "const done = arguments[0];"
        "(function wait() { const s = window.__fedge;"
        " if (" + condition + ") done({error: s.error, progress: s.progress.map((e) => ({kind: e.kind, round: e.round,"
        "  action: e.action || null, reason: e.reason || e.error || null}))});"
        " else setTimeout(wait, 100); })();")


def test_three_tabs_and_a_python_device_aggregate_securely_for_three_rounds_and_a_closed_tab_drops_out(
        tmp_path: Path, run: dict[str, Any], chromium: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # Prepare: a gateway whose secure pool is 4 devices: tabs browser0-2 (shards 0-2) and the reference protocol
    # device phone3 (shard 3); every device's answer is recorded. A step's deadline bounds how long the gateway waits
    # for a closed tab: 600 s in rounds 1-2 (a loaded machine), 40 s in round 3, where browser2 closes.
    sent: list[tuple[str, Frame]] = []
    monkeypatch.setattr(SecureExchange, "answer", _recording(sent))
    settings = GatewaySettings(name="gw-test", devices_per_round=4, round_deadline_s=600, idle_poll_s=2)
    gateway = WebGateway(tmp_path, run, settings)
    tabs = {}
    polling = None
    try:
        first = chromium.current_window_handle
        for index in range(3):
            if index:
                chromium.switch_to.new_window("window")  # a window each: none is a hidden background tab
            tabs[f"browser{index}"] = chromium.current_window_handle
            _open_device(chromium, gateway, f"browser{index}")
        chromium.switch_to.window(tabs["browser2"])
        assert chromium.execute_async_script(LEAVE_AFTER_SHARE, 3)  # browser2 is closed after round 3's share step
        chromium.switch_to.window(tabs["browser1"])
        assert chromium.execute_async_script(LOSE_MASKED_ANSWER_ONCE)  # browser1 loses its first masked answer
        for handle in tabs.values():
            chromium.switch_to.window(handle)
            chromium.execute_script("window.fedgeJoin()")
        polling = Polling([gateway.device("phone3", 3, secure=True)])
        # Execute: three secure rounds from the coordinator; in round 3, browser2's window closes after it shared
        results = {}
        for server_round in (1, 2, 3):
            box: dict[str, Any] = {}
            if server_round == 3:
                gateway.gateway.settings = dataclasses.replace(settings, round_deadline_s=40)
            thread = threading.Thread(target=lambda r=server_round, b=box: b.update(result=gateway.round(
                secure=SECURE, server_round=r)), daemon=True)
            thread.start()
            if server_round == 3:
                chromium.switch_to.window(tabs["browser2"])
                _when(chromium, "window.__shared || s.error")
                chromium.close()
                del tabs["browser2"]
            thread.join()
            results[server_round] = box["result"]
        pages = {}
        for name, handle in tabs.items():
            chromium.switch_to.window(handle)
            pages[name] = _when(chromium, "s.progress.filter((e) => e.kind === 'train').length >= 3 || s.error")
            pages[name]["lost"] = chromium.execute_script("return window.__lost === true")
    finally:
        if polling is not None:
            polling.close()
        for handle in tabs.values():
            if handle != first:
                chromium.switch_to.window(handle)
                chromium.close()
        chromium.switch_to.window(first)
        gateway.close()
    # Assert: each round is the plaintext weighted mean of its devices within the quantisation step; round 3 without
    # browser2, whose pairwise masks were rebuilt from its shares and removed
    everyone = ["browser0", "browser1", "browser2", "phone3"]
    for server_round, (header, arrays) in results.items():
        names = everyone if server_round < 3 else [n for n in everyone if n != "browser2"]
        mean, examples = _expected_mean(run, names, server_round)
        assert header["secure-pool"] == len(names) and header["num-examples"] == examples, (server_round, header)
        assert header["rejected"] == (0 if server_round < 3 else 1)
        assert max(float(np.max(np.abs(arrays[k] - mean[k]))) for k in mean) <= 1e-5, server_round
    for name, state in pages.items():
        assert state["error"] is None and [e["round"] for e in state["progress"] if e["kind"] == "train"] == [1, 2, 3]
        assert not [e for e in state["progress"] if e["kind"] == "refused"], (name, state["progress"])
        # browser1's lost answer: one failed POST, then the step came again and got the same answer (not refused)
        errors = [e["reason"] for e in state["progress"] if e["kind"] == "error"]
        assert errors == (["the answer to the masked step was lost on the way"] if name == "browser1" else []), errors
        assert state["lost"] == (name == "browser1")
    # the gateway got from the tabs only masked ring vectors: no float tensor, no plain result, five steps a round
    tabs_sent = [(device, frame) for device, frame in sent if device.startswith("browser")]
    assert sorted(device for device, _ in tabs_sent) == sorted(["browser0", "browser1"] * 15 + ["browser2"] * 12)
    masked = [frame for _, frame in tabs_sent if frame.tensors]
    assert len(masked) == 8 and all(set(frame.tensors) == {"masked/vector"} for frame in masked)
    assert all(frame.tensors["masked/vector"].dtype == np.uint32 for frame in masked)
    assert all(set(frame.header["records"]) == {"secagg-received", "fedge"} for frame in masked)
    assert not any(frame.header.get("error") for _, frame in tabs_sent)
    assert polling.trained["phone3"] == 3


def test_a_mixed_pool_aggregates_in_a_64_bit_ring(tmp_path: Path, run: dict[str, Any], chromium: Any,  # noqa: F811
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a pool of two tabs (browser0-1) and two reference devices (phone2-3) under secagg-bits = 64
    sent: list[tuple[str, Frame]] = []
    monkeypatch.setattr(SecureExchange, "answer", _recording(sent))
    gateway = WebGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=4, round_deadline_s=600,
                                                       idle_poll_s=2))
    tabs, polling = [], None
    try:
        first = chromium.current_window_handle
        for index in range(2):
            if index:
                chromium.switch_to.new_window("window")
            tabs.append(chromium.current_window_handle)
            _open_device(chromium, gateway, f"browser{index}")
            chromium.execute_script("window.fedgeJoin()")
        polling = Polling([gateway.device(f"phone{index}", index, secure=True) for index in (2, 3)])
        # Execute: one secure round
        header, arrays = gateway.round(secure={**SECURE, "bits": 64})
    finally:
        if polling is not None:
            polling.close()
        for handle in tabs:
            if handle != first:
                chromium.switch_to.window(handle)
                chromium.close()
        chromium.switch_to.window(first)
        gateway.close()
    # Assert: the four devices' mean; the tabs sent uint64 masked vectors only
    mean, examples = _expected_mean(run, ["browser0", "browser1", "phone2", "phone3"], 1)
    assert header["secure-pool"] == 4 and header["num-examples"] == examples and header["rejected"] == 0, header
    assert max(float(np.max(np.abs(arrays[k] - mean[k]))) for k in mean) <= 1e-5
    masked = [frame for device, frame in sent if device.startswith("browser") and frame.tensors]
    assert len(masked) == 2 and all(frame.tensors["masked/vector"].dtype == np.uint64 for frame in masked)
