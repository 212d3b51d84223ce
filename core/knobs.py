"""Every run-config knob, declared once: default, allowed values, what it means, who reads it.

:mod:`fedge.config` derives its defaults, choices and range checks from :data:`KNOBS`;
``tests/test_config.py`` checks that ``pyproject.toml``'s ``[tool.flwr.app.config]`` holds
the same defaults and that docs/configuration.md's run-config reference is :func:`markdown_table`'s output
(``python -m fedge.knobs`` prints it). Strategy names are not listed here: the strategy
registry (:mod:`fedge.strategies.registry`) owns them.
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


KNOBS: dict[str, Knob] = {
    # ---- the run
    "num-rounds": Knob(50, "training rounds", "server", check=at_least(1)),
    "clients-per-round": Knob(10, "devices trained per round", "strategies", check=at_least(1)),
    "strategy": Knob("fedavg", "aggregation strategy: a name registered in fedge.strategies", "strategies"),
    "task": Knob("", "the task: a registered name (digits, synthetic, npz, csv, images, chars, diabetes) or "
                 "'package.module:object'; empty: the built-in task for dataset", "task"),
    "dataset": Knob("digits", "digits, synthetic (FedProx Synthetic(alpha, beta)), npz or csv (with data-path)",
                    "task", choices=("digits", "synthetic", "npz", "csv")),
    "model": Knob("cnn", "model architecture: a name registered in fedge.task.models (mlp, cnn, logreg)", "task"),
    "partitioner": Knob("dirichlet", "how simulated devices split the data: label skew or iid", "task",
                        choices=("dirichlet", "iid")),
    "dirichlet-alpha": Knob(0.5, "label skew of the dirichlet partitioner (smaller: more skewed)", "task",
                            check=above(0)),
    "test-fraction": Knob(0.2, "share of the data held out for central evaluation", "task",
                          check=within(0, 1, closed="()")),
    "fleet": Knob("phone=60,laptop=30,gpu-box=10", "simulated fleet: profile=count pairs", "simulation"),
    "fleet-file": Knob("", "TOML file defining profiles and the fleet (overrides fleet)", "simulation"),
    "local-epochs": Knob(5, "local epochs a device trains per round", "clients", check=at_least(1)),
    "batch-size": Knob(16, "local mini-batch size", "clients", check=at_least(1)),
    "learning-rate": Knob(0.05, "local SGD learning rate", "clients", check=above(0)),
    "momentum": Knob(0.9, "local SGD momentum", "clients", check=within(0, 1, closed="[)")),
    "seed": Knob(42, "seeds everything random (device selection per round)", "server",
                 check=((lambda v: 0 <= v < 2**63), "in [0, 2**63) (numpy and torch refuse negative seeds)")),
    "max-num-examples": Knob(100000, "largest sample count one device may claim (caps its weight)", "strategies",
                             check=at_least(1)),
    "max-device-examples": Knob(10000, "the device tier: largest weight one protocol device gets at its gateway or "
                                "in a secure pool (a larger claim is capped, counted); a gateway's reply may claim "
                                "aggregate-of times this", "strategies", check=at_least(1)),
    "max-gateway-devices": Knob(10000, "the device tier: most devices one gateway's reply may stand for (its "
                                "aggregate-of and secure-pool)", "strategies", check=at_least(1)),
    "max-update-norm": Knob(10.0, "the device tier: L2 bound on each device's update (clipped at its gateway) and on "
                            "each gateway's update (clipped at the coordinator), counted; 0: off", "strategies",
                            check=at_least(0)),
    "min-train-replies": Knob(2, "accepted updates needed to change the model", "strategies", check=at_least(1)),
    "round-timeout": Knob(600.0, "seconds a round waits for replies (and for devices to connect)", "strategies",
                          check=above(0)),
    "fraction-evaluate": Knob(0.0, "share of devices asked for federated evaluation each round", "strategies",
                              check=within(0, 1)),
    "device": Knob("auto", "torch device for training and evaluation", "task", choices=("auto", "cpu", "cuda", "mps")),
    "runtime": Knob("profile", "what trains on devices: each profile's runtime (built-ins: torch), or one runtime "
                    "for every device: " + "; ".join(f"{name} ({spec.summary})" for name, spec in RUNTIMES.items()),
                    "clients", choices=("profile",), more=lambda: tuple(RUNTIMES)),
    # ---- the run directory, checkpoints, bundles
    "runs-root": Knob("runs", "where run directories are made", "server"),
    "run-name": Knob("", "run directory name (empty: strategy-dataset-timestamp)", "server"),
    "run-dir": Knob("", "the run directory itself (overrides runs-root/run-name)", "server"),
    "init-checkpoint": Knob("", "start from this checkpoint.npz", "server"),
    "resume": Knob(False, "continue run-dir after its last checkpoint", "server"),
    "export-onnx": Knob(True, "export model.onnx and a signed bundle at the end", "server"),
    "export-every": Knob(0, "also sign a bundle every N rounds", "server", check=at_least(0, "0: only at the end")),
    "signing-key": Knob("", "Ed25519 private key for bundles (empty: a key made for the run)", "server"),
    "deployment": Knob(False, "set by fedge coordinator start", "server"),
    "grid-poll-interval": Knob(0.1, "seconds between the coordinator's pulls for replies", "server",
                               check=at_least(0, "0: Flower's own send_and_receive")),
    # ---- data
    "synthetic-alpha": Knob(1.0, "Synthetic(alpha, beta): model heterogeneity", "task", check=at_least(0)),
    "synthetic-beta": Knob(1.0, "Synthetic(alpha, beta): data heterogeneity", "task", check=at_least(0)),
    "data-path": Knob("", "the npz or csv file for dataset = npz | csv", "task"),
    # ---- strategies' own options
    "trim-fraction": Knob(0.2, "trimmed-mean: share cut at each end", "strategies", check=within(0, 0.5, closed="[)")),
    "num-byzantine": Knob(2, "krum, bulyan: Byzantine devices tolerated (f)", "strategies", check=at_least(0)),
    "krum-select": Knob(1, "krum: updates averaged (m > 1: Multi-Krum)", "strategies", check=at_least(1)),
    "qfedavg-q": Knob(0.1, "qfedavg: fairness q (0: FedAvg's objective; larger favours devices with larger loss)",
                      "strategies", check=at_least(0)),
    "proximal-mu": Knob(0.01, "fedprox: proximal term mu", "strategies", check=at_least(0)),
    "server-learning-rate": Knob(1.0, "fedavgm, fedbuff: server step size", "strategies", check=above(0)),
    "server-momentum": Knob(0.9, "fedavgm: server momentum", "strategies", check=within(0, 1, closed="[)")),
    "adaptive-learning-rate": Knob(0.01, "fedadagrad, fedadam, fedyogi: server learning rate", "strategies",
                                   check=above(0)),
    "asynchronous": Knob(False, "run the strategy's rule in FedBuff's asynchronous rounds (a server round is one "
                         "buffer; fedbuff always is)", "strategies"),
    "gateways": Knob(False, "devices reach the coordinator through fedge gateways (hierarchical FedAvg): strategies "
                     "that need each device's update are refused at start", "strategies"),
    "concurrency": Knob(20, "fedbuff, asynchronous: devices training at once", "strategies", check=at_least(1)),
    "buffer-size": Knob(10, "fedbuff, asynchronous: updates per server step", "strategies", check=at_least(1)),
    "staleness-exponent": Knob(0.5, "fedbuff, asynchronous: weight 1 / (1 + staleness)^a", "strategies",
                               check=at_least(0)),
    # ---- simulated attacks
    "byzantine-fraction": Knob(0.0, "share of simulated devices that attack", "simulation",
                               check=within(0, 1, closed="[)")),
    "byzantine-attack": Knob("sign-flip", "what attacking devices send", "simulation", choices=("sign-flip", "scale")),
    "attack-scale": Knob(1.0, "size of the attack", "simulation", check=above(0)),
    # ---- heterogeneous fleets
    "sub-models": Knob("off", "devices too small for the model: heterofl (each trains the leading channels at its "
                       "profile's width), fedrolex (a rolling window: fedrolex-stride), smallest (all on the fleet's "
                       "smallest width), "
                       "exclude (they sit out); a profile's model-width, or the widest that fits its memory-mb",
                       "strategies", choices=("off", "heterofl", "fedrolex", "smallest", "exclude")),
    "fedrolex-stride": Knob(1, "sub-models = fedrolex: units the window moves each round (1: the paper's; 0: by its "
                            "own length, every entry trained within ceil(1 / width) rounds)", "strategies",
                            check=at_least(0)),
    "sub-model-scaler": Knob(False, "sub-models: HeteroFL's scaler (a layer reading a scaled hidden input divides it "
                             "by the width); it stalled norm-free models at the default learning rate "
                             "(docs/sub-models.md)", "strategies"),
    "round-policy": Knob("sync", "sync: wait for all; deadline: first K before deadline-s", "strategies",
                         choices=("sync", "deadline")),
    "deadline-s": Knob(60.0, "round deadline in seconds (round-policy = deadline)", "strategies", check=above(0)),
    "over-selection": Knob(1.3, "devices asked per device needed (deadline rounds)", "strategies", check=at_least(1)),
    "device-behaviour": Knob(False, "simulated devices go offline, drop out and jitter per their profile",
                             "simulation"),
    "jitter": Knob(0.0, "random slowdown of simulated devices (log-normal sigma)", "simulation", check=at_least(0)),
    "local-budget": Knob("epochs", "local work per round: epochs, or the steps time-budget-s buys", "clients",
                         choices=("epochs", "time")),
    "time-budget-s": Knob(30.0, "seconds of local work per round (local-budget = time)", "clients", check=above(0)),
    "selector": Knob("random", "device selection: random or Oort-style", "strategies", choices=("random", "oort")),
    "preferred-round-s": Knob(10.0, "oort: round duration above which devices are penalised", "strategies",
                              check=above(0)),
    "exploration": Knob(0.2, "oort: share of each selection for unseen devices", "strategies", check=within(0, 1)),
    "fairness-rounds": Knob(20, "oort: a device unselected this long is taken first", "strategies", check=at_least(1)),
    "straggler-fraction": Knob(0.0, "share of each round that does only 1..E-1 epochs", "strategies",
                               check=within(0, 1)),
    # ---- secure aggregation
    "secure-aggregation": Knob(False, "rounds under SecAgg+ (the coordinator sees only the sum)", "strategies"),
    "secagg-threshold": Knob(0.5, "shares needed to rebuild a secret, as a fraction of a device's neighbours",
                             "strategies", check=within(0.5, 1, note="devices refuse half their neighbours or less")),
    "secagg-neighbours": Knob(0, "neighbours per device (0: all pairs)", "strategies",
                              check=((lambda v: v == 0 or v >= 2), "0 (all pairs) or >= 2")),
    "secagg-clip": Knob(1000.0, "largest |delta / a| per entry a device sends (clipped there, then weighted; "
                        "clipping is counted)", "strategies", check=above(0)),
    "secagg-precision": Knob(0.0001, "quantisation step of w * delta / a", "strategies", check=above(0)),
    "secagg-bits": Knob(32, "ring width: arithmetic in Z_2^bits", "strategies", check=within(8, 64)),
    # ---- differential privacy
    "dp": Knob("off", "Flower's DP wrappers: where clipping happens and how", "server",
               choices=("off", "server-fixed", "client-fixed", "server-adaptive", "client-adaptive")),
    "dp-noise-multiplier": Knob(1.0, "Gaussian noise / clipping norm", "server", check=at_least(0)),
    "dp-clipping-norm": Knob(1.0, "L2 clipping norm (initial one when adaptive)", "server", check=above(0)),
    "dp-delta": Knob(1e-05, "delta of the reported (epsilon, delta)", "server", check=within(0, 1, closed="()")),
    "dp-target-quantile": Knob(0.5, "adaptive clipping: target quantile of update norms", "server",
                               check=within(0, 1)),
    "dp-clip-norm-lr": Knob(0.2, "adaptive clipping: learning rate of the norm", "server", check=above(0)),
    "dp-clipped-count-stddev": Knob(0.0, "adaptive clipping: noise on the clipped count", "server",
                                    check=at_least(0, "0: max(K / 20, dp-noise-multiplier)")),
    # ---- compression (any profile name works after codec. / downlink.; these are the built-in ones)
    "codec.default": Knob("fp32", "uplink codec of devices whose profile sets none", "clients"),
    "codec.phone": Knob("", "uplink codec of phones (empty: codec.default)", "clients"),
    "codec.laptop": Knob("", "uplink codec of laptops (empty: codec.default)", "clients"),
    "codec.gpu-box": Knob("", "uplink codec of GPU boxes (empty: codec.default)", "clients"),
    "downlink.default": Knob("fp32", "downlink codec of devices whose profile sets none", "server"),
    "downlink.phone": Knob("", "downlink codec of phones (empty: downlink.default)", "server"),
    "downlink.laptop": Knob("", "downlink codec of laptops (empty: downlink.default)", "server"),
    "downlink.gpu-box": Knob("", "downlink codec of GPU boxes (empty: downlink.default)", "server"),
}


def _allowed(knob: Knob) -> str:
    if knob.choices:
        return " \\| ".join(f"`{c}`" for c in knob.allowed())
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
