"""Distributed differential privacy inside secure aggregation: the devices add the noise.

The distributed discrete Gaussian (Kairouz, Liu and Steinke, "The Distributed Discrete
Gaussian Mechanism for Federated Learning with Secure Aggregation", ICML 2021). Each device
clips its update to an L2 norm ``c``, scales it by ``s`` (ring units per unit), rounds it
to integers, adds discrete Gaussian noise ``N_Z(0, sigma^2)`` per entry and masks the
result in the secure-aggregation ring Z_{2^bits}. The unmasked sum of ``n`` devices carries
``n`` noise shares, variance ``n sigma^2``: no party, the coordinator included, sees a
noise-free sum, and a coordinator that deviates cannot leave the noise out (it never had it).

Where fedge differs from the paper:

* **Nearest rounding, no random rotation.** The paper rotates (randomised Hadamard) and
  rounds conditionally at random so that a small ring (12-20 bits) holds the sum. fedge
  keeps the 32-bit ring of its secure aggregation, which holds ``n (c s + 1/2)`` plus eight
  standard deviations of noise for the fleets it runs (:meth:`DistributedNoise.fits`,
  checked at start), so the rotation buys nothing and rounding to nearest keeps the L2
  sensitivity at ``c s + sqrt(d) / 2`` (each entry moves at most 1/2). Its bias (at most
  1/2 of a ring unit per entry) is far below the noise.
* **Sampler.** Canonne, Kamath and Steinke ("The Discrete Gaussian for Differential
  Privacy", NeurIPS 2020, Algorithm 3: rejection from a discrete Laplace), vectorised in
  numpy with a floating-point acceptance test, as TensorFlow Federated's sampler does, not
  their exact rational arithmetic; numpy's PCG64 seeded with 128 bits from the OS, not a
  cryptographic generator. Each share is masked before it leaves the device, so only sums
  of shares are ever seen.

Accounting (:meth:`DistributedNoise.multiplier`): the paper's Theorem 1 with its
Proposition 14 (eq. 17, second term) bounds the sum's Rényi DP by that of a Gaussian
mechanism with multiplier ``1 / (Delta / sqrt(n sigma^2) + sqrt(d) tau)``, ``tau = 10
sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1))``; fedge composes that Gaussian event on
Flower's RDP accountant (:mod:`fedge.server.privacy`). ``tau`` is below 1e-30 for ``sigma >= 3``.

Threat model. Devices are trusted to clip and add their share (secure aggregation hides
each device's vector, so the coordinator cannot check either): a device that adds no
noise lowers the sum's noise by its share; a device that sends an unclipped vector moves the
sum by at most the ring's per-device range, and an entry of the sum outside what ``n``
clipped devices and the noise can reach is counted and brought back into range
(:meth:`DistributedNoise.decode_sum`). The noise is calibrated for the fewest survivors a
round may unmask with (``min_survivors``), and every device refuses to sign a survivor set
smaller than that (:func:`fedge.clients.secagg_device.check_survivors`): dropouts cannot
leave a released sum with less noise than accounted for.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from fedge.aggregate import squared_norm
from fedge.secagg import Vector, to_ring

DISTRIBUTED = "distributed"
"""The run config's ``dp`` mode that adds the noise on the devices."""

DP_CLIP, DP_SCALE, DP_STDDEV, DP_MIN_SURVIVORS = "dp-clip", "dp-scale", "dp-stddev", "dp-min-survivors"
"""The secure-aggregation parameters (the ``secagg`` record a device's masked step brings) that
ask it to clip and noise: :class:`DistributedNoise`'s fields."""

TAIL_SIGMAS = 8.0
"""Standard deviations of the sum's noise the ring holds beyond the clipped sum (a normal
draw exceeds 8 sigma with probability ~1e-15 per entry)."""


def noise_generator() -> np.random.Generator:
    """A generator for one device's noise share, seeded with 128 bits from the OS."""
    return np.random.Generator(np.random.PCG64(secrets.randbits(128)))


def discrete_gaussian(sigma: float, size: int, rng: np.random.Generator) -> NDArray[np.int64]:
    """``size`` draws of the discrete Gaussian ``N_Z(0, sigma^2)``: ``P(x) ~ exp(-x^2 / (2 sigma^2))``.

    Canonne, Kamath and Steinke, NeurIPS 2020, Algorithm 3: draw ``Y`` from the discrete
    Laplace of scale ``t = floor(sigma) + 1``, a difference of two geometric draws with
    ``P(G >= k) = exp(-k / t)``, each ``floor(t E)`` for an exponential ``E`` (by inversion:
    ``P(floor(t E) >= k) = P(E >= k / t)``; numpy's ziggurat exponential is 3x faster than its
    geometric draws), and keep it with probability ``exp(-(|Y| - sigma^2 / t)^2 / (2 sigma^2))``
    (~76 % are kept); refused draws are drawn again, in batches.
    """
    if sigma <= 0:
        raise ValueError(f"the discrete Gaussian needs sigma > 0, got {sigma}")
    t = math.floor(sigma) + 1
    shift, scale = sigma * sigma / t, -1.0 / (2 * sigma * sigma)
    out = np.empty(size, np.int64)
    filled = 0
    while filled < size:
        want = max(int((size - filled) * 1.4), 64)
        geometric = np.floor(rng.standard_exponential(2 * want) * t)
        laplace = geometric[:want] - geometric[want:]
        weight = np.abs(laplace)
        weight -= shift
        weight *= weight
        weight *= scale
        np.exp(weight, out=weight)
        kept = laplace[rng.random(want) < weight][:size - filled]
        out[filled:filled + len(kept)] = kept
        filled += len(kept)
    return out


@dataclass(frozen=True)
class DistributedNoise:
    """One round's distributed-DP encoding, the same for every device of a secure-aggregation instance.

    Parameters
    ----------
    clip : float
        L2 norm ``c`` each device clips its update to.
    scale : float
        Ring units per unit of the update (``1 / secagg-precision``).
    stddev : float
        ``sigma``: each device's noise share per entry, in ring units.
    bits : int
        Ring width.
    min_survivors : int
        The fewest devices a round may unmask with; ``stddev`` was calibrated for them.
    """

    clip: float
    scale: float
    stddev: float
    bits: int = 32
    min_survivors: int = 2

    @classmethod
    def calibrated(cls, *, multiplier: float, clip: float, scale: float, dimension: int, min_survivors: int,
                   bits: int = 32) -> DistributedNoise:
        """The per-device share so that ``min_survivors`` shares sum to ``multiplier`` x the L2 sensitivity."""
        sensitivity = clip * scale + math.sqrt(dimension) / 2
        stddev = multiplier * sensitivity / math.sqrt(max(min_survivors, 1))
        return cls(clip=clip, scale=scale, stddev=stddev, bits=bits, min_survivors=min_survivors)

    def sensitivity(self, dimension: int) -> float:
        """The sum's L2 sensitivity in ring units when one device joins or leaves: ``c s + sqrt(d) / 2``."""
        return self.clip * self.scale + math.sqrt(dimension) / 2

    def bound(self, count: int) -> float:
        """The largest ``|entry|`` of a sum of ``count`` honest encodings, but with probability ~1e-15."""
        return count * (self.clip * self.scale + 0.5) + TAIL_SIGMAS * self.stddev * math.sqrt(count)

    def fits(self, count: int) -> bool:
        """Whether a sum of ``count`` encodings stays inside the ring's signed range."""
        return self.bound(count) < 2 ** (self.bits - 1)

    def multiplier(self, survivors: int, dimension: int) -> float:
        """The Gaussian noise multiplier whose RDP bounds this round's sum of ``survivors`` shares.

        Kairouz, Liu and Steinke, ICML 2021, Theorem 1 with Proposition 14 (eq. 17, second
        term): ``1 / (Delta / sqrt(n sigma^2) + sqrt(d) tau)``.
        """
        if survivors < 1:
            raise ValueError("a released sum has at least one device's share")
        variance = self.stddev ** 2
        tau = 10 * sum(math.exp(-2 * math.pi ** 2 * variance * k / (k + 1)) for k in range(1, survivors))
        return 1.0 / (self.sensitivity(dimension) / math.sqrt(survivors * variance) + math.sqrt(dimension) * tau)

    def encode(self, update: NDArray[np.floating], *, rng: np.random.Generator) -> tuple[Vector, bool]:
        """A device's share: ``update`` clipped to L2 norm ``c``, scaled, rounded, noised, in the ring.

        Returns the ring vector and whether the update was clipped (which the device keeps to
        itself: its norm is a statistic of its data).
        """
        values = np.asarray(update, np.float64)
        norm = math.sqrt(squared_norm(values.ravel()))
        clipped = norm > self.clip
        factor = self.scale * (self.clip / norm if clipped else 1.0)
        integers = np.rint(values * factor).astype(np.int64)
        integers += discrete_gaussian(self.stddev, len(integers), rng)
        return to_ring(integers.view(np.uint64), self.bits), clipped

    def decode_sum(self, total: Vector, count: int) -> tuple[NDArray[np.float64], int]:
        """The float sum of ``count`` shares, and how many entries lay outside what they can reach.

        An entry beyond :meth:`bound` (a device that did not clip, or noise past eight
        standard deviations) is brought back to the bound and counted: the caller shows the count.
        """
        shift = np.uint64(64 - self.bits)
        signed = ((np.asarray(total).astype(np.uint64) << shift).view(np.int64)
                  >> np.int64(64 - self.bits)).astype(np.float64)
        limit = self.bound(count)
        outside = int(np.count_nonzero(np.abs(signed) > limit))
        if outside:
            np.clip(signed, -limit, limit, out=signed)
        return signed / self.scale, outside
