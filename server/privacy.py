"""Differential privacy for a fedge run: Flower's DP wrappers, accounted with Flower's RDP accountant.

Central DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent Language
Models", ICLR 2018): each update is clipped to an L2 norm, the mean gets Gaussian noise
of std ``z * clip / K``. Four modes (run config ``dp``): clipping on the coordinator
(``server-fixed``, ``server-adaptive``) or on the devices (``client-fixed``,
``client-adaptive``, through Flower's ``fixedclipping_mod`` / ``adaptiveclipping_mod`` on
the train handler only); adaptive clipping follows Andrew et al., "Differentially Private
Learning with Adaptive Clipping", NeurIPS 2021. Flower does the clipping and the noise.

Accounting is fedge's glue, written here because Flower's wrappers cannot do it for
fedge: their built-in accountant hook requires Flower's own ``FedAvg.aggregate_train``
(fedge's strategies validate every reply in theirs) and the adaptive wrappers have none.
fedge composes one Gaussian event (multiplier ``z``, K of N devices) per released
aggregate on Flower's :class:`~flwr.serverapp.RdpAccountant`, without amplification by
sampling and with add-or-remove-one neighbours: the conservative setting Flower supports.
With adaptive clipping Flower splits the noise so that the update and the clipped count
together amount to multiplier ``z``, so the same event holds.

Threat model: the coordinator is trusted to add the noise (central DP); ε bounds what
anyone who sees the released global models learns about one device's participation.
Sensitivity ``clip / K`` holds for ``sum of clipped updates / K`` with equal weights and a
fixed denominator K (McMahan et al.), so under DP fedge divides by K whatever number of
updates arrived (dropouts and rejected updates shrink the step rather than the noise).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.serverapp import RdpAccountant
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from numpy.typing import NDArray

from fedge import knobs, wire
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.strategies.registry import REGISTRY, strategy_spec

DP_MODES = ("off", "server-fixed", "client-fixed", "server-adaptive", "client-adaptive")
STATE_KEY = "dp-accountant"
CLIP_KEY = knobs.DP_CLIPPING_NORM  # in a checkpoint's state: adaptive clipping's current norm, under its knob's name
CLIENT_CLIPPING = wire.DP_CLIENT_CLIPPING


class DifferentialPrivacy:
    """One run's DP: the Flower wrapper around the strategy, and the privacy spent so far.

    Given to a strategy's constructor (``FedAvg(privacy=...)``), which attaches it: the Flower
    wrapper goes around that strategy, whose aggregate gets noise.

    Parameters
    ----------
    mode : str
        One of :data:`DP_MODES` except ``off``.
    noise_multiplier : float
        ``z``; noise std is ``z * clipping_norm / num_sampled``.
    clipping_norm : float
        L2 clipping norm (the initial one with adaptive clipping).
    num_sampled : int
        Devices per round (K).
    population : int
        Devices in the fleet (N).
    delta : float
        ε is reported at this δ.
    """

    def __init__(self, *, mode: str, noise_multiplier: float, clipping_norm: float,
                 num_sampled: int, population: int, delta: float, target_quantile: float = 0.5,
                 clip_norm_lr: float = 0.2, clipped_count_stddev: float | None = None) -> None:
        self.mode, self.noise_multiplier, self.num_sampled = mode, noise_multiplier, num_sampled
        self.population = max(population, num_sampled)
        self._wrapping = (mode, noise_multiplier, clipping_norm, num_sampled, target_quantile, clip_norm_lr,
                          clipped_count_stddev)
        self._wrapper: Strategy | None = None
        self.accountant = RdpAccountant(PrivacyConfig(
            target_delta=delta, population_size=self.population,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION))

    def attach(self, strategy: Strategy) -> None:
        """Wrap ``strategy`` in Flower's DP wrapper for this mode (the strategy's constructor calls this)."""
        self._wrapper = _wrapper(strategy, *self._wrapping)

    @property
    def wrapper(self) -> Strategy:
        """Flower's DP wrapper around the strategy this privacy was given to."""
        if self._wrapper is None:
            raise RuntimeError("DifferentialPrivacy is not attached to a strategy: give it as FedAvg(privacy=...)")
        return self._wrapper

    @property
    def client_side(self) -> bool:
        """Whether devices clip (with Flower's mods)."""
        return self.mode.startswith("client")

    @property
    def clipping_norm(self) -> float:
        """The clipping norm now (adaptive clipping moves it every round)."""
        return float(self.wrapper.clipping_norm)  # type: ignore[attr-defined]

    def release(self) -> float:
        """Account one noised aggregate of ``num_sampled`` clipped updates; ε so far."""
        self.accountant.compose(GaussianPrivacyEvent(noise_multiplier=self.noise_multiplier,
                                                     sample_size=self.num_sampled,
                                                     population_size=self.population))
        return self.epsilon

    @property
    def epsilon(self) -> float:
        """ε spent at the configured δ (0 before the first release)."""
        return float(self.accountant.get_privacy_spent().epsilon) if self.accountant.num_releases else 0.0

    @property
    def delta(self) -> float:
        """The δ ε is reported at."""
        return float(self.accountant.config.target_delta)

    def summary(self) -> dict[str, Any]:
        """What the run report says about privacy."""
        return {"mode": self.mode, "epsilon": self.epsilon, "delta": self.delta,
                "noise_multiplier": self.noise_multiplier, "clipping_norm": self.clipping_norm,
                "releases": self.accountant.num_releases, "accounting": "rdp, no amplification, add-or-remove-one"}

    def state_dict(self) -> dict[str, NDArray[np.generic]]:
        """The accountant's history and the clipping norm, for checkpoints."""
        text = json.dumps(self.accountant.state_dict(), default=str)
        return {STATE_KEY: np.frombuffer(text.encode(), np.uint8).copy(),
                CLIP_KEY: np.array([self.clipping_norm])}

    def load_state_dict(self, state: Mapping[str, NDArray[np.generic]]) -> None:
        """Restore :meth:`state_dict` (a resumed run goes on spending from where it stopped)."""
        if STATE_KEY in state:
            self.accountant.load_state_dict(json.loads(bytes(state[STATE_KEY].astype(np.uint8)).decode()))
        if CLIP_KEY in state:
            self.wrapper.clipping_norm = float(state[CLIP_KEY][0])  # type: ignore[attr-defined]


def _wrapper(strategy: Strategy, mode: str, z: float, clip: float, k: int, quantile: float, lr: float,
             count_stddev: float | None) -> Strategy:
    if mode == "server-fixed":
        return DifferentialPrivacyServerSideFixedClipping(strategy, z, clip, k)
    if mode == "client-fixed":
        return DifferentialPrivacyClientSideFixedClipping(strategy, z, clip, k)
    # Flower's default count noise (K / 20) is too small for small K: at least z keeps z < 2 sigma_b
    stddev = count_stddev if count_stddev else max(k / 20, z)
    adaptive = (DifferentialPrivacyServerSideAdaptiveClipping if mode == "server-adaptive"
                else DifferentialPrivacyClientSideAdaptiveClipping)
    return adaptive(strategy, z, k, initial_clipping_norm=clip, target_clipped_quantile=quantile,
                    clip_norm_lr=lr, clipped_count_stddev=stddev)


def build_privacy(config: RunConfig, population: int) -> DifferentialPrivacy | None:
    """The run's DP from run config (``dp`` and ``dp-*`` keys), or ``None`` when ``dp = "off"``.

    Raises
    ------
    ConfigError
        DP with a strategy whose aggregate is not a mean of updates, with secure
        aggregation, or with no noise.
    """
    mode = config.text(knobs.DP)
    if mode == "off":
        return None
    if not strategy_spec(config.text(knobs.STRATEGY)).dp:
        allowed = ", ".join(sorted(name for name, spec in REGISTRY.items() if spec.dp))
        raise ConfigError(f"dp = '{mode}' works with strategy {allowed} (the noise is calibrated "
                          f"to a mean of clipped updates), not '{config[knobs.STRATEGY]}'; use one of {allowed}")
    if config[knobs.SECURE_AGGREGATION]:
        raise ConfigError("dp with secure-aggregation is not supported yet (the coordinator cannot clip updates it "
                          "cannot see, and fedge does not add distributed noise on devices); turn one of them off")
    if config.number(knobs.DP_NOISE_MULTIPLIER) <= 0:
        raise ConfigError("dp-noise-multiplier must be > 0 when dp is on (0 adds no noise and ε is infinite)")
    return DifferentialPrivacy(
        mode=mode, noise_multiplier=config.number(knobs.DP_NOISE_MULTIPLIER),
        clipping_norm=config.number(knobs.DP_CLIPPING_NORM), num_sampled=config.integer(knobs.CLIENTS_PER_ROUND),
        population=population, delta=config.number(knobs.DP_DELTA),
        target_quantile=config.number(knobs.DP_TARGET_QUANTILE), clip_norm_lr=config.number(knobs.DP_CLIP_NORM_LR),
        clipped_count_stddev=config.number(knobs.DP_CLIPPED_COUNT_STDDEV) or None)
