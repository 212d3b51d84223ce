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

Distributed DP (``dp = "distributed"``, :class:`DistributedPrivacy`): the devices add the
noise inside secure aggregation, so the coordinator is not trusted with it.

Threat model of the central modes: the coordinator is trusted to add the noise; ε bounds what
anyone who sees the released global models learns about one device's participation.
Sensitivity ``clip / K`` holds for ``sum of clipped updates / K`` with equal weights and a
fixed denominator K (McMahan et al.), so under DP fedge divides by K whatever number of
updates arrived (dropouts and rejected updates shrink the step rather than the noise).
"""

from __future__ import annotations

import json
import logging
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
from fedge.distributed_noise import DistributedNoise
from fedge.errors import ConfigError
from fedge.strategies.registry import REGISTRY, strategy_spec

log = logging.getLogger("fedge.server.privacy")
DP_MODES = ("off", "server-fixed", "client-fixed", "server-adaptive", "client-adaptive", "distributed")
STATE_KEY = "dp-accountant"
CLIP_KEY = knobs.DP_CLIPPING_NORM  # in a checkpoint's state: adaptive clipping's current norm, under its knob's name
CLIENT_CLIPPING = wire.DP_CLIENT_CLIPPING


class _Accounted:
    """What both kinds of DP report: ε spent on their accountant, at their δ."""

    mode: str
    noise_multiplier: float
    accountant: RdpAccountant

    @property
    def epsilon(self) -> float:
        """ε spent at the configured δ (0 before the first release)."""
        return float(self.accountant.get_privacy_spent().epsilon) if self.accountant.num_releases else 0.0

    @property
    def delta(self) -> float:
        """The δ ε is reported at."""
        return float(self.accountant.config.target_delta)

    def _summary(self, clipping_norm: float, **extra: Any) -> dict[str, Any]:
        return {"mode": self.mode, "epsilon": self.epsilon, "delta": self.delta,
                "noise_multiplier": self.noise_multiplier, "clipping_norm": clipping_norm,
                "releases": self.accountant.num_releases, "accounting": ACCOUNTING, **extra}


class DifferentialPrivacy(_Accounted):
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
        self.accountant = _accountant(delta, self.population)

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

    def summary(self) -> dict[str, Any]:
        """What the run report says about privacy."""
        return self._summary(self.clipping_norm, noise_added_by="the coordinator (central DP: it is trusted to add it)")

    def state_dict(self) -> dict[str, NDArray[np.generic]]:
        """The accountant's history and the clipping norm, for checkpoints."""
        return {**_accountant_state(self.accountant), CLIP_KEY: np.array([self.clipping_norm])}

    def load_state_dict(self, state: Mapping[str, NDArray[np.generic]]) -> None:
        """Restore :meth:`state_dict` (a resumed run goes on spending from where it stopped)."""
        _load_accountant(self.accountant, state)
        if CLIP_KEY in state:
            self.wrapper.clipping_norm = float(state[CLIP_KEY][0])  # type: ignore[attr-defined]


class DistributedPrivacy(_Accounted):
    """Distributed DP (``dp = "distributed"``): the devices add the noise inside secure aggregation.

    Kairouz, Liu and Steinke, ICML 2021 (the distributed discrete Gaussian; where fedge
    differs: :mod:`fedge.distributed_noise`). Each device clips its update to
    ``clipping_norm`` (L2) and adds its share of discrete Gaussian noise to its masked
    vector, so every sum unmasked, by the coordinator or by a gateway over its pool, carries
    the noise of all its devices; nobody sees a noise-free sum. The secure driver
    (:class:`~fedge.strategies.drivers.secure.SecureAggregation`) runs the mechanism: it asks
    :meth:`noise` for a round's encoding and reports each unmasked sum to :meth:`release_sum`.

    Accounting: one Gaussian event per released sum on Flower's RDP accountant, with the
    multiplier that bounds the distributed discrete Gaussian's RDP for the devices that
    actually survived (:meth:`fedge.distributed_noise.DistributedNoise.multiplier`), no
    amplification by sampling, add-or-remove-one neighbours; the mean uses a fixed
    denominator (the devices asked), so a device's presence moves it by at most
    ``clipping_norm / K``.

    Threat model: the coordinator is not trusted with the noise; devices are trusted to add
    their share (see :mod:`fedge.distributed_noise`).
    """

    mode = "distributed"
    client_side = False  # devices clip inside secure aggregation's encoding, not with Flower's mods
    wrapper = None  # no Flower DP wrapper: the secure driver runs the mechanism

    def __init__(self, *, noise_multiplier: float, clipping_norm: float, num_sampled: int, population: int,
                 delta: float) -> None:
        self.noise_multiplier, self.clipping_norm, self.num_sampled = noise_multiplier, clipping_norm, num_sampled
        self.population = max(population, num_sampled)
        self.accountant = _accountant(delta, self.population)
        self.multipliers: list[float] = []  # each released sum's effective multiplier (its survivors' noise)

    def attach(self, strategy: Strategy) -> None:
        """Nothing wraps the strategy: the secure driver adds nothing and clips nothing itself."""

    def noise(self, *, scale: float, dimension: int, min_survivors: int, bits: int) -> DistributedNoise:
        """A round's encoding: each device's share calibrated so ``min_survivors`` shares make the multiplier."""
        return DistributedNoise.calibrated(multiplier=self.noise_multiplier, clip=self.clipping_norm, scale=scale,
                                           dimension=dimension, min_survivors=min_survivors, bits=bits)

    def release_sum(self, noise: DistributedNoise, *, survivors: int, dimension: int) -> float:
        """Account one unmasked sum of ``survivors`` noise shares; ε so far."""
        multiplier = noise.multiplier(survivors, dimension)
        self.multipliers.append(multiplier)
        self.accountant.compose(GaussianPrivacyEvent(noise_multiplier=multiplier, sample_size=self.num_sampled,
                                                     population_size=self.population))
        return self.epsilon

    def release_pools(self) -> float:
        """Account one round over gateways' secure pools; ε so far.

        Each pool's sum carries at least the calibrated multiplier on its own (its devices
        refuse to unmask with fewer survivors than it was calibrated for), and the
        coordinator's sum of pools carries more: one Gaussian event at the multiplier bounds
        what a gateway learns of its pool and what the coordinator learns of the fleet.
        """
        self.multipliers.append(self.noise_multiplier)
        self.accountant.compose(GaussianPrivacyEvent(noise_multiplier=self.noise_multiplier,
                                                     sample_size=self.num_sampled, population_size=self.population))
        return self.epsilon

    def release(self) -> float:
        """Refused: a distributed-DP sum is released by the secure driver (:meth:`release_sum`)."""
        raise RuntimeError("distributed DP releases sums through the secure driver (release_sum), not release()")

    def summary(self) -> dict[str, Any]:
        """What the run report says about privacy."""
        return self._summary(self.clipping_norm, effective_multipliers=self.multipliers,
                             noise_added_by="the devices, inside secure aggregation (distributed discrete Gaussian)")

    def state_dict(self) -> dict[str, NDArray[np.generic]]:
        """The accountant's history, for checkpoints."""
        return _accountant_state(self.accountant)

    def load_state_dict(self, state: Mapping[str, NDArray[np.generic]]) -> None:
        """Restore :meth:`state_dict` (a resumed run goes on spending from where it stopped)."""
        _load_accountant(self.accountant, state)


ACCOUNTING = "rdp (Flower's RdpAccountant), no amplification, add-or-remove-one"


def _accountant(delta: float, population: int) -> RdpAccountant:
    return RdpAccountant(PrivacyConfig(target_delta=delta, population_size=population,
                                       neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                       sampling_method=SamplingMethod.NO_AMPLIFICATION))


def _accountant_state(accountant: RdpAccountant) -> dict[str, NDArray[np.generic]]:
    text = json.dumps(accountant.state_dict(), default=str)
    return {STATE_KEY: np.frombuffer(text.encode(), np.uint8).copy()}


def _load_accountant(accountant: RdpAccountant, state: Mapping[str, NDArray[np.generic]]) -> None:
    if STATE_KEY in state:
        accountant.load_state_dict(json.loads(bytes(state[STATE_KEY].astype(np.uint8)).decode()))


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


def build_privacy(config: RunConfig, population: int) -> DifferentialPrivacy | DistributedPrivacy | None:
    """The run's DP from run config (``dp`` and ``dp-*`` keys), or ``None`` when ``dp = "off"``.

    Raises
    ------
    ConfigError
        DP with a strategy whose aggregate is not a mean of updates, central DP with secure
        aggregation, distributed DP without it, or no noise.
    """
    mode = config.text(knobs.DP)
    if mode == "off":
        return None
    if not strategy_spec(config.text(knobs.STRATEGY)).dp:
        allowed = ", ".join(sorted(name for name, spec in REGISTRY.items() if spec.dp))
        raise ConfigError(f"dp = '{mode}' works with strategy {allowed} (the noise is calibrated "
                          f"to a mean of clipped updates), not '{config[knobs.STRATEGY]}'; use one of {allowed}")
    if config.number(knobs.DP_NOISE_MULTIPLIER) <= 0:
        raise ConfigError("dp-noise-multiplier must be > 0 when dp is on (0 adds no noise and ε is infinite)")
    if mode == "distributed":
        if not config[knobs.SECURE_AGGREGATION]:
            raise ConfigError("dp = 'distributed' adds the noise on the devices inside secure aggregation: set "
                              "secure-aggregation = true, or use a central mode (server-fixed, client-fixed, ...), "
                              "which trusts the coordinator to add the noise")
        return DistributedPrivacy(noise_multiplier=config.number(knobs.DP_NOISE_MULTIPLIER),
                                  clipping_norm=config.number(knobs.DP_CLIPPING_NORM),
                                  num_sampled=config.integer(knobs.CLIENTS_PER_ROUND), population=population,
                                  delta=config.number(knobs.DP_DELTA))
    if config[knobs.SECURE_AGGREGATION]:
        raise ConfigError(f"dp = '{mode}' is central DP (the coordinator clips or adds the noise), which secure "
                          "aggregation hides the updates from; use dp = 'distributed' (the devices add the noise "
                          "inside secure aggregation), or turn secure-aggregation off")
    log.warning("dp = '%s' is central DP: the coordinator adds the noise and is trusted to (one that deviates "
                "learns the noise-free aggregate); dp = 'distributed' with secure-aggregation trusts no one with it",
                mode)
    return DifferentialPrivacy(
        mode=mode, noise_multiplier=config.number(knobs.DP_NOISE_MULTIPLIER),
        clipping_norm=config.number(knobs.DP_CLIPPING_NORM), num_sampled=config.integer(knobs.CLIENTS_PER_ROUND),
        population=population, delta=config.number(knobs.DP_DELTA),
        target_quantile=config.number(knobs.DP_TARGET_QUANTILE), clip_norm_lr=config.number(knobs.DP_CLIP_NORM_LR),
        clipped_count_stddev=config.number(knobs.DP_CLIPPED_COUNT_STDDEV) or None)
