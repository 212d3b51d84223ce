"""How simulated devices behave: availability, mid-round dropout, speed jitter. Seeded.

* availability: a device is online only within its profile's diurnal ``online_hours``
  (if any), and there in a slot of simulated time (``slot_s``) with its profile's
  ``availability`` probability, drawn afresh each slot;
* dropout: a device that received work vanishes before replying with its profile's
  ``dropout`` probability;
* jitter: each reply's duration is multiplied by ``exp(N(0, jitter^2))``.

Every draw is a pure function of (seed, node, slot or exchange), so runs reproduce.
Availability is drawn for a whole fleet at once (:meth:`Behaviour.online_mask`: a counter-based
hash over arrays of node ids, no per-device objects), so asking who is online costs a few
array operations even for a million devices; :meth:`Behaviour.online` is the same draw for one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from fedge.profiles import DeviceProfile, Fleet

_ONLINE, _DROP, _SPEED = 1, 2, 3
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def hashed_uniforms(seed: int, kind: int, nodes: NDArray[np.int64], index: int) -> NDArray[np.float64]:
    """A uniform [0, 1) draw per node, a pure function of (seed, kind, node, index) (SplitMix64)."""
    key = np.uint64((seed * 0x100000001B3 + kind * 0x1000193 + index) % 2**64)
    x = (np.asarray(nodes, dtype=np.int64).astype(np.uint64) * _GOLDEN) ^ _mix(np.full(1, key, np.uint64))
    x = _mix(x + _GOLDEN)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _mix(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


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
        return bool(self.online_mask(np.array([node]), np.zeros(1, np.int16), (profile,), now_s)[0])

    def online_mask(self, nodes: NDArray[np.int64], codes: NDArray[np.int16], names: tuple[str, ...],
                    now_s: float) -> NDArray[np.bool_]:
        """Which of ``nodes`` (with profile ``names[codes[i]]``) are online at ``now_s``, as one array."""
        hour = (now_s / 3600.0) % 24.0
        allowed = np.array([name not in self.profiles or self.profiles[name].online_at_hour(hour)
                            for name in names], dtype=bool)
        p = np.array([self.availability.get(name, 1.0) for name in names], dtype=np.float64)
        if len(names) == 0:
            return np.zeros(len(nodes), dtype=bool)
        mask = allowed[codes]
        if (p[allowed] >= 1.0).all():
            return mask
        draws = hashed_uniforms(self.seed, _ONLINE, nodes, int(now_s // self.slot_s))
        return mask & ((p >= 1.0)[codes] | (draws < p[codes]))

    def drops(self, node: int, profile: str, exchange: int) -> bool:
        """Whether ``node`` vanishes during its ``exchange``-th piece of work."""
        p = self.dropout.get(profile, 0.0)
        return p > 0 and self._uniform(_DROP, node, exchange) < p

    def slowdown(self, node: int, exchange: int) -> float:
        """Multiplier on the device's round time for this exchange (1 without jitter)."""
        if not self.jitter:
            return 1.0
        return float(np.exp(np.random.default_rng([self.seed, _SPEED, node, exchange]).normal(0, self.jitter)))
