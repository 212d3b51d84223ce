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

from fedge import knobs
from fedge.errors import ConfigError
from fedge.knobs import KNOBS, Scalar

# Derived from fedge.knobs.KNOBS, where every key is declared once.
DEFAULTS: dict[str, Scalar] = {key: knob.default for key, knob in KNOBS.items()}

# Per-profile codecs: ``codec.<profile>`` (uplink) and ``downlink.<profile>``, for any profile
# name a fleet file may define; empty means the ``.default`` one.
CODEC_PREFIXES = ("codec.", "downlink.")


_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {key: knob.check for key, knob in KNOBS.items() if knob.check}

# Keys that change the model's arrays or meaning: a checkpoint made under other
# values of these cannot be continued.
MODEL_KEYS = (knobs.TASK, knobs.DATASET, knobs.MODEL, knobs.STRATEGY, knobs.SEED, knobs.SYNTHETIC_ALPHA,
              knobs.SYNTHETIC_BETA)


class RunConfig(dict[str, Scalar]):
    """A checked run config (what :func:`resolve_run_config` returns) with typed reads.

    It is still the flat ``dict`` Flower hands around, so it goes into ``ConfigRecord``s and
    JSON as is; :meth:`integer`, :meth:`number`, :meth:`text` and :meth:`flag` return a knob's
    value with its declared type, so use sites need no casts. Asking for a knob by the wrong
    type is a programming error (``TypeError``), not a config error: the values were checked
    when the config was resolved.
    """

    def _typed(self, key: str, kind: type) -> Any:
        knob = KNOBS.get(key)
        if knob is None and not key.startswith(CODEC_PREFIXES):
            raise KeyError(f"'{key}' is not a run-config knob (see fedge.knobs.KNOBS)")
        declared = type(knob.default) if knob is not None else str
        if declared is not kind:
            raise TypeError(f"run-config '{key}' is a {declared.__name__} knob, read as {kind.__name__}")
        return self[key]

    def integer(self, key: str) -> int:
        """The value of int knob ``key``."""
        value: int = self._typed(key, int)
        return value

    def number(self, key: str) -> float:
        """The value of float knob ``key``, or of int knob ``key`` widened to a float."""
        knob = KNOBS.get(key)
        if knob is not None and type(knob.default) is int:
            return float(self.integer(key))
        value: float = self._typed(key, float)
        return value

    def text(self, key: str) -> str:
        """The value of string knob ``key``."""
        value: str = self._typed(key, str)
        return value

    def flag(self, key: str) -> bool:
        """The value of bool knob ``key``."""
        value: bool = self._typed(key, bool)
        return value


def as_run_config(config: Mapping[str, Any]) -> RunConfig:
    """``config`` as a :class:`RunConfig`: itself when it already is one, else resolved (checked)."""
    return config if isinstance(config, RunConfig) else resolve_run_config(config)


def resolve_run_config(overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Merge ``overrides`` over :data:`DEFAULTS`, refusing unknown keys and bad values.

    Raises
    ------
    ConfigError
        Naming the key, the value and what is allowed.
    """
    config = RunConfig(DEFAULTS)
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
    allowed = KNOBS[key].allowed() if key in KNOBS else ()
    if allowed and value not in allowed:
        raise ConfigError(f"run-config '{key}' = {value!r} is not allowed; use one of: {', '.join(allowed)}")
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
