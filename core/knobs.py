"""Every run-config knob, declared once: default, allowed values, what it means, who reads it.

:mod:`fedge.config` derives its defaults, choices and range checks from :data:`KNOBS`;
``tests/test_config.py`` checks that ``pyproject.toml``'s ``[tool.flwr.app.config]`` holds
the same defaults and that docs/configuration.md's run-config reference is :func:`markdown_table`'s output
(``python -m fedge.knobs`` prints it). Strategy names are not listed here: the strategy
registry (:mod:`fedge.strategies.registry`) owns them.

Each key's name is a module constant (``LOCAL_EPOCHS = "local-epochs"``), its only literal outside
tests and docs: code reads the run config as ``config.integer(knobs.LOCAL_EPOCHS)``, and
``tests/test_knob_literals.py`` fails on a key written out anywhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedge.profiles import RUNTIMES

Scalar = bool | int | float | str
Check = tuple[Callable[[Any], bool], str]


def at_least(low: float, note: str = "") -> Check:
    """``value >= low``."""
    return (lambda v: v >= low), f">= {low:g}" + (f" ({note})" if note else "")


def above(low: float) -> Check:
    """``value > low``."""
    return (lambda v: v > low), f"> {low:g}"


def within(low: float, high: float, *, closed: str = "[]", note: str = "") -> Check:
    """``low <= value <= high``; ``closed`` says which ends are included, as interval brackets."""
    left, right = closed[0], closed[-1]

    def check(v: Any) -> bool:
        return (v >= low if left == "[" else v > low) and (v <= high if right == "]" else v < high)

    text = f"in {left}{low:g}, {high:g}{right}" + (f" ({note})" if note else "")
    return check, text


def _norm_bound_rules() -> tuple[str, ...]:
    from fedge.aggregate import NORM_BOUND_RULES  # noqa: PLC0415 - numpy: read when a value is checked

    return tuple(NORM_BOUND_RULES)


@dataclass(frozen=True)
class Knob:
    """One run-config key.

    Attributes
    ----------
    default : Scalar
        Its value when a run does not set it (its type is the key's type).
    doc : str
        What it means, in one line.
    owner : str
        The fedge package that reads it.
    choices : tuple[str, ...]
        Allowed values of a string key (empty: any string).
    more : Callable, optional
        Further allowed values, read from a registry when a value is checked (so a name
        registered later is allowed and listed).
    check : Check | None
        A range check on a number, with its words.
    """

    default: Scalar
    doc: str
    owner: str
    choices: tuple[str, ...] = ()
    check: Check | None = None
    more: Callable[[], tuple[str, ...]] | None = None

    def allowed(self) -> tuple[str, ...]:
        """Every value a string key allows now (empty: any string)."""
        return self.choices + (self.more() if self.more else ())


# Each key's name, written once: code reads the run config through these (tests/test_knob_literals.py).
# ---- the run
NUM_ROUNDS = "num-rounds"
CLIENTS_PER_ROUND = "clients-per-round"
STRATEGY = "strategy"
TASK = "task"
DATASET = "dataset"
MODEL = "model"
PARTITIONER = "partitioner"
DIRICHLET_ALPHA = "dirichlet-alpha"
TEST_FRACTION = "test-fraction"
FLEET = "fleet"
FLEET_FILE = "fleet-file"
LOCAL_EPOCHS = "local-epochs"
BATCH_SIZE = "batch-size"
LEARNING_RATE = "learning-rate"
MOMENTUM = "momentum"
SEED = "seed"
MAX_NUM_EXAMPLES = "max-num-examples"
MAX_DEVICE_EXAMPLES = "max-device-examples"
MAX_GATEWAY_DEVICES = "max-gateway-devices"
MAX_UPDATE_NORM = "max-update-norm"
UPDATE_NORM_BOUND = "update-norm-bound"
MIN_TRAIN_REPLIES = "min-train-replies"
ROUND_TIMEOUT = "round-timeout"
FRACTION_EVALUATE = "fraction-evaluate"
DEVICE = "device"
RUNTIME = "runtime"
# ---- the run directory, checkpoints, bundles
RUNS_ROOT = "runs-root"
RUN_NAME = "run-name"
RUN_DIR = "run-dir"
INIT_CHECKPOINT = "init-checkpoint"
RESUME = "resume"
EXPORT_ONNX = "export-onnx"
EXPORT_EVERY = "export-every"
SIGNING_KEY = "signing-key"
DEPLOYMENT = "deployment"
GRID_POLL_INTERVAL = "grid-poll-interval"
# ---- data
SYNTHETIC_ALPHA = "synthetic-alpha"
SYNTHETIC_BETA = "synthetic-beta"
DATA_PATH = "data-path"
# ---- strategies' own options
TRIM_FRACTION = "trim-fraction"
NUM_BYZANTINE = "num-byzantine"
KRUM_SELECT = "krum-select"
QFEDAVG_Q = "qfedavg-q"
PROXIMAL_MU = "proximal-mu"
SERVER_LEARNING_RATE = "server-learning-rate"
SERVER_MOMENTUM = "server-momentum"
ADAPTIVE_LEARNING_RATE = "adaptive-learning-rate"
ASYNCHRONOUS = "asynchronous"
GATEWAYS = "gateways"
CONCURRENCY = "concurrency"
BUFFER_SIZE = "buffer-size"
STALENESS_EXPONENT = "staleness-exponent"
# ---- simulated attacks
BYZANTINE_FRACTION = "byzantine-fraction"
BYZANTINE_ATTACK = "byzantine-attack"
ATTACK_SCALE = "attack-scale"
# ---- heterogeneous fleets
SUB_MODELS = "sub-models"
FEDROLEX_STRIDE = "fedrolex-stride"
SUB_MODEL_SCALER = "sub-model-scaler"
ROUND_POLICY = "round-policy"
DEADLINE_S = "deadline-s"
OVER_SELECTION = "over-selection"
DEVICE_BEHAVIOUR = "device-behaviour"
JITTER = "jitter"
LOCAL_BUDGET = "local-budget"
TIME_BUDGET_S = "time-budget-s"
SELECTOR = "selector"
PREFERRED_ROUND_S = "preferred-round-s"
EXPLORATION = "exploration"
FAIRNESS_ROUNDS = "fairness-rounds"
STRAGGLER_FRACTION = "straggler-fraction"
# ---- secure aggregation
SECURE_AGGREGATION = "secure-aggregation"
SECAGG_THRESHOLD = "secagg-threshold"
SECAGG_NEIGHBOURS = "secagg-neighbours"
SECAGG_CLIP = "secagg-clip"
SECAGG_PRECISION = "secagg-precision"
SECAGG_BITS = "secagg-bits"
SECURE_GROUPS = "secure-groups"
# ---- differential privacy
DP = "dp"
DP_NOISE_MULTIPLIER = "dp-noise-multiplier"
DP_CLIPPING_NORM = "dp-clipping-norm"
DP_DELTA = "dp-delta"
DP_TARGET_QUANTILE = "dp-target-quantile"
DP_CLIP_NORM_LR = "dp-clip-norm-lr"
DP_CLIPPED_COUNT_STDDEV = "dp-clipped-count-stddev"
# ---- compression (any profile name works after codec. / downlink.; these are the built-in ones)
CODEC_DEFAULT = "codec.default"
CODEC_PHONE = "codec.phone"
CODEC_LAPTOP = "codec.laptop"
CODEC_GPU_BOX = "codec.gpu-box"
DOWNLINK_DEFAULT = "downlink.default"
DOWNLINK_PHONE = "downlink.phone"
DOWNLINK_LAPTOP = "downlink.laptop"
DOWNLINK_GPU_BOX = "downlink.gpu-box"

KNOBS: dict[str, Knob] = {
    # ---- the run
    NUM_ROUNDS: Knob(50, "training rounds", "server", check=at_least(1)),
    CLIENTS_PER_ROUND: Knob(10, "devices trained per round", "strategies", check=at_least(1)),
    STRATEGY: Knob("fedavg", "aggregation strategy: a name registered in fedge.strategies", "strategies"),
    TASK: Knob("", "the task: a registered name (digits, synthetic, npz, csv, images, chars, diabetes) or "
               "'package.module:object'; empty: the built-in task for dataset", "task"),
    DATASET: Knob("digits", "digits, synthetic (FedProx Synthetic(alpha, beta)), npz or csv (with data-path)",
                  "task", choices=("digits", "synthetic", "npz", "csv")),
    MODEL: Knob("cnn", "model architecture: a name registered in fedge.task.models (mlp, cnn, logreg)", "task"),
    PARTITIONER: Knob("dirichlet", "how simulated devices split the data: label skew or iid", "task",
                      choices=("dirichlet", "iid")),
    DIRICHLET_ALPHA: Knob(0.5, "label skew of the dirichlet partitioner (smaller: more skewed)", "task",
                          check=above(0)),
    TEST_FRACTION: Knob(0.2, "share of the data held out for central evaluation", "task",
                        check=within(0, 1, closed="()")),
    FLEET: Knob("phone=60,laptop=30,gpu-box=10", "simulated fleet: profile=count pairs", "simulation"),
    FLEET_FILE: Knob("", "TOML file defining profiles and the fleet (overrides fleet)", "simulation"),
    LOCAL_EPOCHS: Knob(5, "local epochs a device trains per round", "clients", check=at_least(1)),
    BATCH_SIZE: Knob(16, "local mini-batch size", "clients", check=at_least(1)),
    LEARNING_RATE: Knob(0.05, "local SGD learning rate", "clients", check=above(0)),
    MOMENTUM: Knob(0.9, "local SGD momentum", "clients", check=within(0, 1, closed="[)")),
    SEED: Knob(42, "seeds everything random (device selection per round)", "server",
               check=((lambda v: 0 <= v < 2**63), "in [0, 2**63) (numpy and torch refuse negative seeds)")),
    MAX_NUM_EXAMPLES: Knob(100000, "largest sample count one device may claim (caps its weight)", "strategies",
                           check=at_least(1)),
    MAX_DEVICE_EXAMPLES: Knob(10000, "the device tier: largest weight one protocol device gets at its gateway or "
                              "in a secure pool (a larger claim is capped, counted); a gateway's reply may claim "
                              "aggregate-of times this", "strategies", check=at_least(1)),
    MAX_GATEWAY_DEVICES: Knob(10000, "the device tier: most devices one gateway's reply may stand for (its "
                              "aggregate-of and secure-pool)", "strategies", check=at_least(1)),
    MAX_UPDATE_NORM: Knob(10.0, "the device tier: L2 bound on each device's update (clipped at its gateway) and on "
                          "each gateway's update (clipped at the coordinator), counted; 0: off", "strategies",
                          check=at_least(0)),
    UPDATE_NORM_BOUND: Knob("fixed", "the device tier's max-update-norm between rounds: fixed, or median (each "
                            "round's bound is the last round's median update norm before clipping, devices' at "
                            "their gateways and gateways' at the coordinator; max-update-norm is the first round's "
                            "and the ceiling; 0: the first round unbounded, no ceiling)",
                            "strategies", choices=(), more=_norm_bound_rules),
    MIN_TRAIN_REPLIES: Knob(2, "accepted updates needed to change the model", "strategies", check=at_least(1)),
    ROUND_TIMEOUT: Knob(600.0, "seconds a round waits for replies (and for devices to connect)", "strategies",
                        check=above(0)),
    FRACTION_EVALUATE: Knob(0.0, "share of devices asked for federated evaluation each round", "strategies",
                            check=within(0, 1)),
    DEVICE: Knob("auto", "torch device for training and evaluation", "task", choices=("auto", "cpu", "cuda", "mps")),
    RUNTIME: Knob("profile", "what trains on devices: each profile's runtime (built-ins: torch), or one runtime "
                  "for every device: " + "; ".join(f"{name} ({spec.summary})" for name, spec in RUNTIMES.items()),
                  "clients", choices=("profile",), more=lambda: tuple(RUNTIMES)),
    # ---- the run directory, checkpoints, bundles
    RUNS_ROOT: Knob("runs", "where run directories are made", "server"),
    RUN_NAME: Knob("", "run directory name (empty: strategy-dataset-timestamp)", "server"),
    RUN_DIR: Knob("", "the run directory itself (overrides runs-root/run-name)", "server"),
    INIT_CHECKPOINT: Knob("", "start from this checkpoint.npz", "server"),
    RESUME: Knob(False, "continue run-dir after its last checkpoint", "server"),
    EXPORT_ONNX: Knob(True, "export model.onnx and a signed bundle at the end", "server"),
    EXPORT_EVERY: Knob(0, "also sign a bundle every N rounds", "server", check=at_least(0, "0: only at the end")),
    SIGNING_KEY: Knob("", "Ed25519 private key for bundles (empty: a key made for the run)", "server"),
    DEPLOYMENT: Knob(False, "set by fedge coordinator start", "server"),
    GRID_POLL_INTERVAL: Knob(0.1, "seconds between the coordinator's pulls for replies", "server",
                             check=at_least(0, "0: Flower's own send_and_receive")),
    # ---- data
    SYNTHETIC_ALPHA: Knob(1.0, "Synthetic(alpha, beta): model heterogeneity", "task", check=at_least(0)),
    SYNTHETIC_BETA: Knob(1.0, "Synthetic(alpha, beta): data heterogeneity", "task", check=at_least(0)),
    DATA_PATH: Knob("", "the npz or csv file for dataset = npz | csv", "task"),
    # ---- strategies' own options
    TRIM_FRACTION: Knob(0.2, "trimmed-mean: share cut at each end", "strategies", check=within(0, 0.5, closed="[)")),
    NUM_BYZANTINE: Knob(2, "krum, bulyan: Byzantine devices tolerated (f)", "strategies", check=at_least(0)),
    KRUM_SELECT: Knob(1, "krum: updates averaged (m > 1: Multi-Krum)", "strategies", check=at_least(1)),
    QFEDAVG_Q: Knob(0.1, "qfedavg: fairness q (0: FedAvg's objective; larger favours devices with larger loss)",
                    "strategies", check=at_least(0)),
    PROXIMAL_MU: Knob(0.01, "fedprox: proximal term mu", "strategies", check=at_least(0)),
    SERVER_LEARNING_RATE: Knob(1.0, "fedavgm, fedbuff: server step size", "strategies", check=above(0)),
    SERVER_MOMENTUM: Knob(0.9, "fedavgm: server momentum", "strategies", check=within(0, 1, closed="[)")),
    ADAPTIVE_LEARNING_RATE: Knob(0.01, "fedadagrad, fedadam, fedyogi: server learning rate", "strategies",
                                 check=above(0)),
    ASYNCHRONOUS: Knob(False, "run the strategy's rule in FedBuff's asynchronous rounds (a server round is one "
                       "buffer; fedbuff always is)", "strategies"),
    GATEWAYS: Knob(False, "devices reach the coordinator through fedge gateways (hierarchical aggregation): linear "
                   "strategies as if flat, robust ones over the gateways' means, the rest refused at start",
                   "strategies"),
    CONCURRENCY: Knob(20, "fedbuff, asynchronous: devices training at once", "strategies", check=at_least(1)),
    BUFFER_SIZE: Knob(10, "fedbuff, asynchronous: updates per server step", "strategies", check=at_least(1)),
    STALENESS_EXPONENT: Knob(0.5, "fedbuff, asynchronous: weight 1 / (1 + staleness)^a", "strategies",
                             check=at_least(0)),
    # ---- simulated attacks
    BYZANTINE_FRACTION: Knob(0.0, "share of simulated devices that attack", "simulation",
                             check=within(0, 1, closed="[)")),
    BYZANTINE_ATTACK: Knob("sign-flip", "what attacking devices send", "simulation", choices=("sign-flip", "scale")),
    ATTACK_SCALE: Knob(1.0, "size of the attack", "simulation", check=above(0)),
    # ---- heterogeneous fleets
    SUB_MODELS: Knob("off", "devices too small for the model: heterofl (each trains the leading channels at its "
                     "profile's width), fedrolex (a rolling window: fedrolex-stride), smallest (all on the fleet's "
                     "smallest width), "
                     "exclude (they sit out); a profile's model-width, or the widest that fits its memory-mb",
                     "strategies", choices=("off", "heterofl", "fedrolex", "smallest", "exclude")),
    FEDROLEX_STRIDE: Knob(1, "sub-models = fedrolex: units the window moves each round (1: the paper's; 0: by its "
                          "own length, every entry trained within ceil(1 / width) rounds)", "strategies",
                          check=at_least(0)),
    SUB_MODEL_SCALER: Knob(False, "sub-models: HeteroFL's scaler (a layer reading a scaled hidden input divides it "
                           "by the width); it stalled norm-free models at the default learning rate "
                           "(docs/sub-models.md)", "strategies"),
    ROUND_POLICY: Knob("sync", "sync: wait for all; deadline: first K before deadline-s", "strategies",
                       choices=("sync", "deadline")),
    DEADLINE_S: Knob(60.0, "round deadline in seconds (round-policy = deadline)", "strategies", check=above(0)),
    OVER_SELECTION: Knob(1.3, "devices asked per device needed (deadline rounds)", "strategies", check=at_least(1)),
    DEVICE_BEHAVIOUR: Knob(False, "simulated devices go offline, drop out and jitter per their profile",
                           "simulation"),
    JITTER: Knob(0.0, "random slowdown of simulated devices (log-normal sigma)", "simulation", check=at_least(0)),
    LOCAL_BUDGET: Knob("epochs", "local work per round: epochs, or the steps time-budget-s buys", "clients",
                       choices=("epochs", "time")),
    TIME_BUDGET_S: Knob(30.0, "seconds of local work per round (local-budget = time)", "clients", check=above(0)),
    SELECTOR: Knob("random", "device selection: random or Oort-style", "strategies", choices=("random", "oort")),
    PREFERRED_ROUND_S: Knob(10.0, "oort: round duration above which devices are penalised", "strategies",
                            check=above(0)),
    EXPLORATION: Knob(0.2, "oort: share of each selection for unseen devices", "strategies", check=within(0, 1)),
    FAIRNESS_ROUNDS: Knob(20, "oort: a device unselected this long is taken first", "strategies", check=at_least(1)),
    STRAGGLER_FRACTION: Knob(0.0, "share of each round that does only 1..E-1 epochs", "strategies",
                             check=within(0, 1)),
    # ---- secure aggregation
    SECURE_AGGREGATION: Knob(False, "rounds under SecAgg+ (the coordinator sees only the sum)", "strategies"),
    SECAGG_THRESHOLD: Knob(0.5, "shares needed to rebuild a secret, as a fraction of a device's neighbours",
                           "strategies", check=within(0.5, 1, note="devices refuse half their neighbours or less")),
    SECAGG_NEIGHBOURS: Knob(0, "neighbours per device (0: all pairs)", "strategies",
                            check=((lambda v: v == 0 or v >= 2), "0 (all pairs) or >= 2")),
    SECAGG_CLIP: Knob(1000.0, "largest |delta / a| per entry a device sends (clipped there, then weighted; "
                      "clipping is counted)", "strategies", check=above(0)),
    SECAGG_PRECISION: Knob(0.0001, "quantisation step of w * delta / a", "strategies", check=above(0)),
    SECAGG_BITS: Knob(32, "ring width: arithmetic in Z_2^bits", "strategies", check=within(8, 64)),
    SECURE_GROUPS: Knob(0, "secure aggregation in K random groups of >= 3 devices, the strategy's rule over the "
                        "groups' means (robust rules: median, trimmed-mean, krum, bulyan); 0: one instance",
                        "strategies", check=at_least(0)),
    # ---- differential privacy
    DP: Knob("off", "differential privacy: central (Flower's DP wrappers: where clipping happens and how) or "
             "distributed (devices add the noise inside secure aggregation)", "server",
             choices=("off", "server-fixed", "client-fixed", "server-adaptive", "client-adaptive", "distributed")),
    DP_NOISE_MULTIPLIER: Knob(1.0, "Gaussian noise / clipping norm", "server", check=at_least(0)),
    DP_CLIPPING_NORM: Knob(1.0, "L2 clipping norm (initial one when adaptive)", "server", check=above(0)),
    DP_DELTA: Knob(1e-05, "delta of the reported (epsilon, delta)", "server", check=within(0, 1, closed="()")),
    DP_TARGET_QUANTILE: Knob(0.5, "adaptive clipping: target quantile of update norms", "server",
                             check=within(0, 1)),
    DP_CLIP_NORM_LR: Knob(0.2, "adaptive clipping: learning rate of the norm", "server", check=above(0)),
    DP_CLIPPED_COUNT_STDDEV: Knob(0.0, "adaptive clipping: noise on the clipped count", "server",
                                  check=at_least(0, "0: max(K / 20, dp-noise-multiplier)")),
    # ---- compression (any profile name works after codec. / downlink.; these are the built-in ones)
    CODEC_DEFAULT: Knob("fp32", "uplink codec of devices whose profile sets none", "clients"),
    CODEC_PHONE: Knob("", "uplink codec of phones (empty: codec.default)", "clients"),
    CODEC_LAPTOP: Knob("", "uplink codec of laptops (empty: codec.default)", "clients"),
    CODEC_GPU_BOX: Knob("", "uplink codec of GPU boxes (empty: codec.default)", "clients"),
    DOWNLINK_DEFAULT: Knob("fp32", "downlink codec of devices whose profile sets none", "server"),
    DOWNLINK_PHONE: Knob("", "downlink codec of phones (empty: downlink.default)", "server"),
    DOWNLINK_LAPTOP: Knob("", "downlink codec of laptops (empty: downlink.default)", "server"),
    DOWNLINK_GPU_BOX: Knob("", "downlink codec of GPU boxes (empty: downlink.default)", "server"),
}


def _allowed(knob: Knob) -> str:
    if allowed := knob.allowed():
        return " \\| ".join(f"`{c}`" for c in allowed)
    return knob.check[1] if knob.check else ""


def markdown_table() -> str:
    """docs/configuration.md's run-config reference, made from :data:`KNOBS`."""
    lines = ["| key | default | allowed | meaning | read by |", "|---|---|---|---|---|"]
    for key, knob in KNOBS.items():
        default = str(knob.default).lower() if isinstance(knob.default, bool) else knob.default
        shown = f"`{default}`" if default != "" else '""'
        lines.append(f"| `{key}` | {shown} | {_allowed(knob)} | {knob.doc} | {knob.owner} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m fedge.knobs > table.md
    print(markdown_table(), end="")
