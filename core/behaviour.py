"""How simulated devices behave: availability, mid-round dropout, speed jitter. Seeded.

* availability: a device is online only within its profile's diurnal ``online_hours``
  (if any), and there in a slot of simulated time (``slot_s``) with its profile's
  ``availability`` probability, drawn afresh each slot;
* dropout: a device that received work vanishes before replying with its profile's
  ``dropout`` probability;
* jitter: each reply's duration is multiplied by ``exp(N(0, jitter^2))``.

Every draw is a pure function of (seed, node, slot or exchange), so runs reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedge.profiles import DeviceProfile, Fleet

_ONLINE, _DROP, _SPEED = 1, 2, 3


@dataclass(frozen=True)
class Behaviour:
    """Seeded behaviour of a simulated fleet."""

    seed: int
    availability: dict[str, float]
    dropout: dict[str, float]
    jitter: float = 0.0
    slot_s: float = 60.0
    profiles: dict[str, DeviceProfile] = field(default_factory=dict)

    @classmethod
    def from_fleet(cls, fleet: Fleet, *, seed: int, enabled: bool, jitter: float) -> Behaviour:
        """Availability and dropout from the fleet's profiles when ``enabled``; always-on otherwise."""
        names = list(fleet.profiles)
        return cls(
            seed=seed,
            availability={n: fleet.profiles[n].availability if enabled else 1.0 for n in names},
            dropout={n: fleet.profiles[n].dropout if enabled else 0.0 for n in names},
            jitter=jitter,
            profiles=dict(fleet.profiles) if enabled else {},
        )

    def _uniform(self, kind: int, node: int, index: int) -> float:
        return float(np.random.default_rng([self.seed, kind, node, index]).random())

    def online(self, node: int, profile: str, now_s: float) -> bool:
        """Whether ``node`` is online at simulated time ``now_s`` (diurnal trace, then availability)."""
        trace = self.profiles.get(profile)
        if trace is not None and not trace.online_at_hour((now_s / 3600.0) % 24.0):
            return False
        p = self.availability.get(profile, 1.0)
        return p >= 1.0 or self._uniform(_ONLINE, node, int(now_s // self.slot_s)) < p

    def drops(self, node: int, profile: str, exchange: int) -> bool:
        """Whether ``node`` vanishes during its ``exchange``-th piece of work."""
        p = self.dropout.get(profile, 0.0)
        return p > 0 and self._uniform(_DROP, node, exchange) < p

    def slowdown(self, node: int, exchange: int) -> float:
        """Multiplier on the device's round time for this exchange (1 without jitter)."""
        if not self.jitter:
            return 1.0
        return float(np.exp(np.random.default_rng([self.seed, _SPEED, node, exchange]).normal(0, self.jitter)))
