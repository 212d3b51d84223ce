"""The run configuration: embedded defaults, validation, CLI overrides.

Keys are kebab-case as in Flower apps' ``[tool.flwr.app.config]``; the same
defaults live in ``pyproject.toml`` so that ``flwr run .`` and ``fedge simulate``
agree (a test checks they do). Flower hands apps a flat ``UserConfig``
(``str | int | float | bool`` values), so the config stays a flat dict.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import shlex
import tomllib
from collections.abc import Callable, Mapping
from typing import Any

from fedge.errors import ConfigError

Scalar = bool | int | float | str

DEFAULTS: dict[str, Scalar] = {
    "num-rounds": 50,
    "clients-per-round": 10,
    "strategy": "fedavg",
    "dataset": "digits",
    "model": "cnn",
    "partitioner": "dirichlet",
    "dirichlet-alpha": 0.5,
    "test-fraction": 0.2,
    "fleet": "phone=60,laptop=30,gpu-box=10",
    "fleet-file": "",
    "local-epochs": 5,
    "batch-size": 16,
    "learning-rate": 0.05,
    "momentum": 0.9,
    "seed": 42,
    "max-num-examples": 100000,
    "min-train-replies": 2,
    "round-timeout": 600.0,
    "fraction-evaluate": 0.0,
    "runs-root": "runs",
    "run-name": "",
    "run-dir": "",
    "init-checkpoint": "",
    "export-onnx": True,
    "export-every": 0,
    "signing-key": "",
    "synthetic-alpha": 1.0,
    "synthetic-beta": 1.0,
    "data-path": "",
    "device": "auto",
    "trim-fraction": 0.2,
    "num-byzantine": 2,
    "krum-select": 1,
    "byzantine-fraction": 0.0,
    "byzantine-attack": "sign-flip",
    "attack-scale": 1.0,
    "resume": False,
    "deployment": False,
    "proximal-mu": 0.01,
    "server-learning-rate": 1.0,
    "server-momentum": 0.9,
    "adaptive-learning-rate": 0.01,
    "round-policy": "sync",
    "deadline-s": 60.0,
    "over-selection": 1.3,
    "device-behaviour": False,
    "jitter": 0.0,
    "local-budget": "epochs",
    "time-budget-s": 30.0,
    "concurrency": 20,
    "buffer-size": 10,
    "staleness-exponent": 0.5,
    "selector": "random",
    "preferred-round-s": 10.0,
    "exploration": 0.2,
    "fairness-rounds": 20,
    "straggler-fraction": 0.0,
    "secure-aggregation": False,
    "secagg-threshold": 0.5,
    "secagg-neighbours": 0,
    "secagg-clip": 1000.0,
    "secagg-precision": 0.0001,
    "secagg-bits": 32,
    "grid-poll-interval": 0.1,
    "dp": "off",
    "dp-noise-multiplier": 1.0,
    "dp-clipping-norm": 1.0,
    "dp-delta": 1e-05,
    "dp-target-quantile": 0.5,
    "dp-clip-norm-lr": 0.2,
    "dp-clipped-count-stddev": 0.0,
    "codec.default": "fp32",
    "codec.phone": "",
    "codec.laptop": "",
    "codec.gpu-box": "",
    "downlink.default": "fp32",
    "downlink.phone": "",
    "downlink.laptop": "",
    "downlink.gpu-box": "",
}

# Per-profile codecs: ``codec.<profile>`` (uplink) and ``downlink.<profile>``, for any profile
# name a fleet file may define; empty means the ``.default`` one.
CODEC_PREFIXES = ("codec.", "downlink.")

CHOICES: dict[str, tuple[str, ...]] = {
    "byzantine-attack": ("sign-flip", "scale"),
    "round-policy": ("sync", "deadline"),
    "local-budget": ("epochs", "time"),
    "selector": ("random", "oort"),
    "dataset": ("digits", "synthetic", "npz", "csv"),
    "model": ("mlp", "cnn", "logreg"),
    "partitioner": ("dirichlet", "iid"),
    "device": ("auto", "cpu", "cuda", "mps"),
    "dp": ("off", "server-fixed", "client-fixed", "server-adaptive", "client-adaptive"),
}

_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "num-rounds": (lambda v: v >= 1, ">= 1"),
    "clients-per-round": (lambda v: v >= 1, ">= 1"),
    "dirichlet-alpha": (lambda v: v > 0, "> 0"),
    "test-fraction": (lambda v: 0 < v < 1, "in (0, 1)"),
    "local-epochs": (lambda v: v >= 1, ">= 1"),
    "batch-size": (lambda v: v >= 1, ">= 1"),
    "learning-rate": (lambda v: v > 0, "> 0"),
    "momentum": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "max-num-examples": (lambda v: v >= 1, ">= 1"),
    "min-train-replies": (lambda v: v >= 1, ">= 1"),
    "round-timeout": (lambda v: v > 0, "> 0"),
    "fraction-evaluate": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "export-every": (lambda v: v >= 0, ">= 0 (0: only at the end)"),
    "trim-fraction": (lambda v: 0 <= v < 0.5, "in [0, 0.5)"),
    "num-byzantine": (lambda v: v >= 0, ">= 0"),
    "krum-select": (lambda v: v >= 1, ">= 1"),
    "byzantine-fraction": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "attack-scale": (lambda v: v > 0, "> 0"),
    "grid-poll-interval": (lambda v: v >= 0, ">= 0 (0: Flower's own send_and_receive)"),
    "proximal-mu": (lambda v: v >= 0, ">= 0"),
    "server-learning-rate": (lambda v: v > 0, "> 0"),
    "server-momentum": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "adaptive-learning-rate": (lambda v: v > 0, "> 0"),
    "deadline-s": (lambda v: v > 0, "> 0"),
    "over-selection": (lambda v: v >= 1, ">= 1"),
    "jitter": (lambda v: v >= 0, ">= 0"),
    "time-budget-s": (lambda v: v > 0, "> 0"),
    "concurrency": (lambda v: v >= 1, ">= 1"),
    "buffer-size": (lambda v: v >= 1, ">= 1"),
    "staleness-exponent": (lambda v: v >= 0, ">= 0"),
    "preferred-round-s": (lambda v: v > 0, "> 0"),
    "exploration": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "fairness-rounds": (lambda v: v >= 1, ">= 1"),
    "straggler-fraction": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "secagg-threshold": (lambda v: 0.5 <= v <= 1,
                         "in [0.5, 1] (devices refuse a threshold of half their neighbours or less)"),
    "secagg-neighbours": (lambda v: v == 0 or v >= 2, "0 (all pairs) or >= 2"),
    "secagg-clip": (lambda v: v > 0, "> 0"),
    "secagg-precision": (lambda v: v > 0, "> 0"),
    "secagg-bits": (lambda v: 8 <= v <= 64, "in [8, 64]"),
    "dp-noise-multiplier": (lambda v: v >= 0, ">= 0"),
    "dp-clipping-norm": (lambda v: v > 0, "> 0"),
    "dp-delta": (lambda v: 0 < v < 1, "in (0, 1)"),
    "dp-target-quantile": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "dp-clip-norm-lr": (lambda v: v > 0, "> 0"),
    "dp-clipped-count-stddev": (lambda v: v >= 0, ">= 0 (0: max(K / 20, dp-noise-multiplier))"),
    "seed": (lambda v: 0 <= v < 2**63, "in [0, 2**63) (numpy and torch refuse negative seeds)"),
    "synthetic-alpha": (lambda v: v >= 0, ">= 0"),
    "synthetic-beta": (lambda v: v >= 0, ">= 0"),
}

# Keys that change the model's arrays or meaning: a checkpoint made under other
# values of these cannot be continued.
MODEL_KEYS = ("dataset", "model", "strategy", "seed", "synthetic-alpha", "synthetic-beta")


def resolve_run_config(overrides: Mapping[str, Any] | None = None) -> dict[str, Scalar]:
    """Merge ``overrides`` over :data:`DEFAULTS`, refusing unknown keys and bad values.

    Raises
    ------
    ConfigError
        Naming the key, the value and what is allowed.
    """
    config: dict[str, Scalar] = dict(DEFAULTS)
    for key, value in (overrides or {}).items():
        config[key] = _checked(key, value)
    return config


def _shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages about arbitrary input."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _checked(key: str, value: Any) -> Scalar:
    if not isinstance(key, str):
        raise ConfigError(f"run-config key {_shown(key)} is not a string; keys look like 'num-rounds'")
    if key.startswith(CODEC_PREFIXES):
        return _checked_codec(key, value)
    if key not in DEFAULTS:
        close = difflib.get_close_matches(key, DEFAULTS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(
            f"unknown run-config key {_shown(key)}{hint}; allowed keys: {', '.join(sorted(DEFAULTS))}"
        )
    value = _coerced(key, value, DEFAULTS[key])
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(
            f"run-config '{key}' = {value!r} is not allowed; use one of: "
            + ", ".join(CHOICES[key])
        )
    if key in _RANGES and not _RANGES[key][0](value):
        raise ConfigError(f"run-config '{key}' = {value!r} must be {_RANGES[key][1]}")
    return value


def _checked_codec(key: str, value: Any) -> str:
    """A ``codec.<profile>`` / ``downlink.<profile>`` value: a codec name that parses."""
    from fedge.codec import parse_codec  # the codec module owns the names

    if not isinstance(value, str):
        raise ConfigError(f"run-config '{key}' = {_shown(value)} must be a codec name string like 'int8'")
    codec = parse_codec(value, key=key)
    if key.startswith("downlink.") and codec.sparse:
        raise ConfigError(f"run-config '{key}' = '{value}': top-k cannot compress the downlink (a device needs "
                          "the whole model); use fp16 or int8")
    return value


def codec_policy(config: Mapping[str, Scalar]) -> dict[str, Scalar]:
    """The ``codec.*`` and ``downlink.*`` keys of ``config``."""
    return {key: value for key, value in config.items() if key.startswith(CODEC_PREFIXES)}


def _coerced(key: str, value: Any, default: Scalar) -> Scalar:
    """``value`` as the type of ``default`` (an int is taken for a float), checked for what
    every later use needs: finite floats, int64 ints (Flower's config values), no NUL in text."""
    expected = type(default)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:  # beyond ~1.8e308
            raise ConfigError(f"run-config '{key}' = {_shown(value)} must be a finite number like the default "
                              f"{default!r}") from None
    if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
        raise ConfigError(
            f"run-config '{key}' = {_shown(value)} has type {type(value).__name__}; "
            f"it must be a {expected.__name__} like the default {default!r}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"run-config '{key}' = {value!r} must be a finite number like the default {default!r}")
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        raise ConfigError(f"run-config '{key}' = {_shown(value)} does not fit in a 64-bit integer")
    if isinstance(value, str) and "\x00" in value:
        raise ConfigError(f"run-config '{key}' = {_shown(value)} contains a NUL character")
    return value  # type: ignore[no-any-return]


def parse_run_config_args(text: str) -> dict[str, Scalar]:
    """Parse Flower-style ``"key=value key2='text'"`` overrides (values as TOML).

    A value that is not valid TOML is taken as a plain string, so
    ``fleet=phone=10,laptop=5`` works without quotes. Types and ranges are checked
    by :func:`resolve_run_config`.

    Raises
    ------
    ConfigError
        Unbalanced quotes, or an item that is not ``key=value``.
    """
    if not isinstance(text, str):  # shlex.split(None) would read standard input
        raise ConfigError(f"run-config overrides must be a string like 'num-rounds=5', got {_shown(text)}")
    try:
        items = shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"run-config overrides {_shown(text)}: {exc}; quote values with spaces as "
                          "key='some text'") from None
    overrides: dict[str, Scalar] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"run-config override {_shown(item)} is not key=value")
        try:
            overrides[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except ValueError:  # not TOML (TOMLDecodeError), or an int of > 4300 digits
            overrides[key.strip()] = raw
        except RecursionError:
            raise ConfigError(f"run-config '{key.strip()}': the value nests too deeply") from None
    return overrides


def model_keys(config: Mapping[str, Scalar]) -> dict[str, Scalar]:
    """The values of :data:`MODEL_KEYS` (what a checkpoint records about its origin)."""
    return {key: config[key] for key in MODEL_KEYS}


def config_fingerprint(config: Mapping[str, Scalar], keys: tuple[str, ...] = MODEL_KEYS) -> str:
    """A short stable hash of the values of ``keys`` (what a checkpoint depends on)."""
    chosen = {key: config.get(key) for key in keys}
    return hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:16]
