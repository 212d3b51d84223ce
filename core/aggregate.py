"""Aggregation math on plain numpy arrays. No Flower types in this module.

An update is a mapping ``name -> np.ndarray`` (one entry per model tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

Arrays = Mapping[str, NDArray[np.generic]]


class WeightedMeanAccumulator:
    """Streaming weighted mean: ``sum_i w_i x_i / sum_i w_i``, one update at a time.

    Memory is one float64 buffer per model tensor, O(model size), however many
    updates are added; each update can be freed once :meth:`add` returns. This is
    FedAvg's aggregation (McMahan et al., "Communication-Efficient Learning of
    Deep Networks from Decentralized Data", AISTATS 2017).
    """

    def __init__(self) -> None:
        self._sums: dict[str, NDArray[np.float64]] = {}
        self._dtypes: dict[str, np.dtype[np.generic]] = {}
        self.total_weight = 0.0
        self.count = 0

    def add(self, update: Arrays, weight: float) -> None:
        """Add ``weight * update`` to the running sum.

        Raises
        ------
        ValueError
            If ``weight`` is not positive and finite, or the update's names or
            shapes differ from the first update's.
        """
        if not np.isfinite(weight) or weight <= 0:
            raise ValueError(f"weight must be positive and finite, got {weight}")
        if not self._sums:
            self._dtypes = {name: value.dtype for name, value in update.items()}
            self._sums = {name: np.zeros(value.shape, np.float64) for name, value in update.items()}
        elif update.keys() != self._sums.keys():
            raise ValueError(f"update names {sorted(update)} differ from {sorted(self._sums)}")
        for name, value in update.items():
            buffer = self._sums[name]
            if value.shape != buffer.shape:
                raise ValueError(f"'{name}' has shape {value.shape}, expected {buffer.shape}")
            _add_scaled(buffer, value, weight)
        self.total_weight += weight
        self.count += 1

    def result(self) -> dict[str, NDArray[np.generic]]:
        """The weighted mean, cast back to each tensor's original dtype."""
        if self.count == 0:
            raise ValueError("no updates were added; nothing to average")
        return {
            name: _cast(buffer / self.total_weight, self._dtypes[name])
            for name, buffer in self._sums.items()
        }


_BLOCK = 1 << 16  # elements a block: the float64 temporary of one add stays at 512 KB


def _add_scaled(total: NDArray[np.float64], value: NDArray[np.generic], weight: float) -> None:
    """``total += weight * value`` in float64, block by block (no model-sized temporary)."""
    flat_total, flat_value = total.reshape(-1), np.asarray(value).reshape(-1)
    for start in range(0, flat_total.size, _BLOCK):
        block = slice(start, start + _BLOCK)
        flat_total[block] += np.multiply(flat_value[block], weight, dtype=np.float64)


def _cast(values: NDArray[np.float64], dtype: np.dtype[np.generic]) -> NDArray[np.generic]:
    """``values`` as ``dtype`` (integers rounded), an array even when 0-d (numpy's arithmetic on a
    0-d array gives a scalar)."""
    if np.issubdtype(dtype, np.integer):
        values = np.rint(values)
    return np.asarray(values).astype(dtype)


def c_contiguous(array: NDArray[np.generic]) -> NDArray[np.generic]:
    """``array`` in C order, shape kept: unlike ``np.ascontiguousarray``, which returns at least
    1-d, a 0-d array (BatchNorm's ``num_batches_tracked``, any scalar buffer) stays 0-d."""
    array = np.asarray(array)  # a numpy scalar becomes a 0-d array
    return array if array.flags.c_contiguous else np.array(array, order="C")


def squared_norm(vector: NDArray[Any]) -> float:
    """``sum(vector ** 2)`` of a 1-d array, in its own precision, without BLAS.

    numpy's ``dot`` (and ``linalg.norm``) hand a long vector to OpenBLAS, whose threads wait for
    cores a loaded machine does not have: 5-16 ms for 100,000 entries on this 2-core machine under
    load, against 0.06-0.14 ms for ``einsum``'s single-threaded loop (``bench/README.md``, issue 41 §3).
    """
    return float(np.einsum("i,i", vector, vector))


def update_norm(trained: Arrays, reference: Arrays) -> float:
    """The L2 norm of ``trained - reference`` over every floating-point tensor (each tensor's squared norm in
    its own precision, their sum in float64)."""
    total = 0.0
    for name, value in trained.items():
        array = np.asarray(value)
        if np.issubdtype(array.dtype, np.floating):  # the difference in the tensor's own precision, summed in float64
            delta = (array - np.asarray(reference[name], array.dtype)).ravel()
            total += squared_norm(delta)
    return float(np.sqrt(total))


def clip_update(trained: Arrays, reference: Arrays, bound: float) -> tuple[dict[str, NDArray[np.generic]], float, bool]:
    """``trained`` with its update ``trained - reference`` scaled to an L2 norm of at most ``bound``.

    The norm clipping of DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent
    Language Models", ICLR 2018) used as a bound on influence (Sun et al., "Can You Really
    Backdoor Federated Learning?", 2019): the update's direction is kept, its length capped.
    Returns the (possibly clipped) arrays, the update's norm before clipping, and whether it was
    clipped. ``bound`` 0 means no bound. Non-float tensors (counters) are left as they are.
    """
    norm = update_norm(trained, reference)
    if bound <= 0 or norm <= bound:
        return dict(trained), norm, False
    scale = bound / norm
    clipped = {}
    for name, value in trained.items():
        array = np.asarray(value)
        if np.issubdtype(array.dtype, np.floating):
            base = np.asarray(reference[name], np.float64)
            clipped[name] = (base + (array.astype(np.float64) - base) * scale).astype(array.dtype)
        else:
            clipped[name] = array
    return clipped, norm, True


def weighted_mean(updates: Iterable[Arrays], weights: Iterable[float]) -> dict[str, NDArray[np.generic]]:
    """Weighted mean of a batch of updates (same result as the streaming accumulator)."""
    accumulator = WeightedMeanAccumulator()
    for update, weight in zip(updates, weights, strict=True):
        accumulator.add(update, weight)
    return accumulator.result()


def weighted_mean_metrics(
    metrics: Iterable[Mapping[str, float]], weights: Iterable[float]
) -> dict[str, float]:
    """Weighted mean of scalar metrics present in every entry (others are dropped)."""
    rows, row_weights = list(metrics), list(weights)
    if not rows:
        return {}
    common = set.intersection(*(set(row) for row in rows))
    total = float(sum(row_weights))
    return {
        key: float(sum(w * float(row[key]) for row, w in zip(rows, row_weights, strict=True)) / total)
        for key in sorted(common)
    }


# --------------------------------------------------------------------------- robust rules
# These need every update at once (order statistics and pairwise distances), so
# they cannot stream; memory is O(updates x model).


def _stacked(updates: Sequence[Arrays], name: str) -> NDArray[np.float64]:
    return np.stack([np.asarray(update[name], dtype=np.float64) for update in updates])


def trimmed_mean(updates: Sequence[Arrays], trim_fraction: float) -> dict[str, NDArray[np.generic]]:
    """Coordinate-wise beta-trimmed mean (Yin et al., "Byzantine-Robust Distributed
    Learning: Towards Optimal Statistical Rates", ICML 2018).

    Drops the ``floor(trim_fraction * n)`` largest and smallest values of every
    coordinate, then averages the rest (unweighted).
    """
    if not 0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
    _require(updates)
    cut = trim_count(len(updates), trim_fraction)
    result = {}
    for name, first in updates[0].items():
        ordered = np.sort(_stacked(updates, name), axis=0)
        result[name] = _cast(ordered[cut:len(updates) - cut].mean(axis=0), first.dtype)
    return result


def trim_count(n: int, trim_fraction: float) -> int:
    """How many values the trimmed mean drops at each end of ``n``: floor(trim_fraction * n)."""
    return int(np.floor(trim_fraction * n))


def coordinate_median(updates: Sequence[Arrays]) -> dict[str, NDArray[np.generic]]:
    """Coordinate-wise median (Yin et al., ICML 2018)."""
    _require(updates)
    return {name: _cast(np.median(_stacked(updates, name), axis=0), first.dtype)
            for name, first in updates[0].items()}


def _median_bound(bound: float, norms: Sequence[float]) -> float:
    """The median of ``norms`` (the last round's, before clipping); ``bound`` kept when there are none or their
    median is 0 (0 would turn the bound off)."""
    finite = [norm for norm in norms if np.isfinite(norm)]
    median = float(np.median(finite)) if finite else 0.0
    return median if median > 0 else bound


NORM_BOUND_RULES: dict[str, Callable[[float, Sequence[float]], float]] = {
    "fixed": lambda bound, _norms: bound,
    "median": _median_bound,
}
"""How the device tier's L2 bound on each update (``max-update-norm``) moves between rounds, called with the
round's bound and the round's update norms before clipping: ``fixed`` keeps it; ``median`` makes the next round's
bound the median norm (norm bounding, Sun et al., "Can You Really Backdoor Federated Learning?", 2019, with the
bound following the norms, as the adaptive clipping of Andrew et al., NeurIPS 2021, follows a quantile of them;
fedge takes the last round's median itself: no DP noise on the count, so no learning rate to estimate it)."""


ROBUST_DEVICE_RULES: dict[str, Callable[[Sequence[Arrays], float], dict[str, NDArray[np.generic]]]] = {
    "median": lambda updates, _trim_fraction: coordinate_median(updates),
    "trimmed-mean": trimmed_mean,
}
"""Robust rules a plain gateway may reply with over its devices' updates (unweighted; called with the updates and
the trim fraction) instead of their weighted mean, so that a gateway with many devices is not one unit of trust."""

DEVICE_RULES = ("mean", *ROBUST_DEVICE_RULES)
"""What a plain gateway replies with over its devices' updates: ``mean`` (hierarchical FedAvg: the streaming
weighted mean) or a robust rule of :data:`ROBUST_DEVICE_RULES`."""


def krum_scores(updates: Sequence[Arrays], num_byzantine: int) -> NDArray[np.float64]:
    """Krum score of each update: the sum of squared distances to its ``n - f - 2``
    nearest other updates (Blanchard et al., "Machine Learning with Adversaries:
    Byzantine Tolerant Gradient Descent", NeurIPS 2017).
    """
    _require(updates)
    flat = np.stack([np.concatenate([np.asarray(u[k], np.float64).ravel() for k in sorted(u)])
                     for u in updates])
    squared = np.sum(flat**2, axis=1)
    distances = np.maximum(squared[:, None] + squared[None, :] - 2 * flat @ flat.T, 0.0)
    neighbours = max(len(updates) - num_byzantine - 2, 1)
    closest = np.sort(distances, axis=1)[:, 1:neighbours + 1]  # column 0 is the distance to itself
    return closest.sum(axis=1)  # type: ignore[no-any-return]


def multi_krum(
    updates: Sequence[Arrays], num_byzantine: int, num_selected: int = 1
) -> tuple[dict[str, NDArray[np.generic]], list[int]]:
    """Average of the ``num_selected`` updates with the lowest Krum scores (1 = Krum).

    Returns the aggregate and the indices of the selected updates.
    """
    if not 1 <= num_selected <= len(updates):
        raise ValueError(f"num_selected must be in [1, {len(updates)}], got {num_selected}")
    chosen = [int(i) for i in np.argsort(krum_scores(updates, num_byzantine), kind="stable")[:num_selected]]
    return weighted_mean([updates[i] for i in chosen], [1.0] * len(chosen)), chosen


def bulyan(updates: Sequence[Arrays], num_byzantine: int) -> tuple[dict[str, NDArray[np.generic]], list[int]]:
    """Bulyan (El Mhamdi et al., "The Hidden Vulnerability of Distributed Learning in
    Byzantium", ICML 2018): select ``theta = n - 2f`` updates by Krum score, then, per
    coordinate, average the ``beta = theta - 2f`` selected values closest to their median.

    The selection is one pass of Multi-Krum scores, as Flower's ``Bulyan`` does by default
    (the paper applies Krum ``theta`` times, removing the chosen one each time). Returns the
    aggregate and the indices of the selected updates.

    Raises
    ------
    ValueError
        Fewer than ``4f + 3`` updates: Bulyan's guarantee needs them.
    """
    _require(updates)
    if len(updates) < 4 * num_byzantine + 3:
        raise ValueError(f"bulyan needs at least 4f + 3 = {4 * num_byzantine + 3} updates for f = {num_byzantine}, "
                         f"got {len(updates)}")
    theta = len(updates) - 2 * num_byzantine
    beta = theta - 2 * num_byzantine
    chosen = [int(i) for i in np.argsort(krum_scores(updates, num_byzantine), kind="stable")[:theta]]
    result = {}
    for name, first in updates[0].items():
        values = _stacked([updates[i] for i in chosen], name)
        nearest = np.argsort(np.abs(values - np.median(values, axis=0)), axis=0, kind="stable")[:beta]
        result[name] = _cast(np.take_along_axis(values, nearest, axis=0).mean(axis=0), first.dtype)
    return result, chosen


def _require(updates: Sequence[Arrays]) -> None:
    if not updates:
        raise ValueError("no updates to aggregate")


# --------------------------------------------------------------------------- server optimisers
# Reddi et al., "Adaptive Federated Optimization", ICLR 2021 (Algorithm 2), and FedAvgM
# (Hsu et al., 2019). The pseudo-gradient is delta = average - global.

State = dict[str, NDArray[np.float64]]


def _delta(global_arrays: Arrays, average: Arrays) -> State:
    return {k: np.asarray(average[k], np.float64) - np.asarray(global_arrays[k], np.float64) for k in global_arrays}


def fedavgm_step(
    global_arrays: Arrays, average: Arrays, velocity: State, *, server_lr: float, momentum: float
) -> tuple[dict[str, NDArray[np.generic]], State]:
    """``v <- momentum v + delta``; ``x <- x + server_lr v``. Returns (new arrays, new velocity)."""
    delta = _delta(global_arrays, average)
    velocity = {k: momentum * velocity.get(k, 0.0) + d for k, d in delta.items()}
    new = {k: _cast(np.asarray(global_arrays[k], np.float64) + server_lr * velocity[k], global_arrays[k].dtype)
           for k in global_arrays}
    return new, velocity


def adaptive_step(
    global_arrays: Arrays,
    average: Arrays,
    first: State,
    second: State,
    *,
    server_lr: float,
    beta1: float = 0.9,
    beta2: float = 0.99,
    tau: float = 1e-3,
    rule: str = "adam",
) -> tuple[dict[str, NDArray[np.generic]], State, State]:
    """FedAdagrad / FedAdam / FedYogi server step (no bias correction, as in the paper's Algorithm 2).

    ``m <- b1 m + (1 - b1) delta``; Adagrad: ``v <- v + delta^2``; Adam:
    ``v <- b2 v + (1 - b2) delta^2``; Yogi: ``v <- v - (1 - b2) delta^2 sign(v - delta^2)``;
    ``x <- x + lr m / (sqrt(v) + tau)``.
    ``v`` starts at ``tau^2`` as in the paper.
    """
    delta = _delta(global_arrays, average)
    new_first, new_second, new = {}, {}, {}
    for key, d in delta.items():
        m = beta1 * first.get(key, np.zeros_like(d)) + (1 - beta1) * d
        v_old = second.get(key, np.full_like(d, tau**2))
        squared = d * d
        v = _second_moment(rule, v_old, squared, beta2)
        new_first[key], new_second[key] = m, v
        x = np.asarray(global_arrays[key], np.float64) + server_lr * m / (np.sqrt(v) + tau)
        new[key] = _cast(x, global_arrays[key].dtype)
    return new, new_first, new_second


SecondMoment = Callable[[NDArray[np.float64], NDArray[np.float64], float], NDArray[np.float64]]
SECOND_MOMENTS: dict[str, SecondMoment] = {
    # Reddi et al., ICLR 2021, Algorithm 2: v from the old v, the squared pseudo-gradient and beta2
    "adagrad": lambda old, squared, beta2: old + squared,
    "adam": lambda old, squared, beta2: beta2 * old + (1 - beta2) * squared,
    "yogi": lambda old, squared, beta2: old - (1 - beta2) * squared * np.sign(old - squared),
}
"""The adaptive server steps' second-moment updates, by name (a new one is an entry here)."""


def _second_moment(rule: str, old: NDArray[np.float64], squared: NDArray[np.float64],
                   beta2: float) -> NDArray[np.float64]:
    """The adaptive rule ``rule``'s second-moment update (:data:`SECOND_MOMENTS`)."""
    if rule not in SECOND_MOMENTS:
        raise ValueError(f"unknown adaptive rule '{rule}': use one of {', '.join(SECOND_MOMENTS)}")
    return SECOND_MOMENTS[rule](old, squared, beta2)


# --------------------------------------------------------------------------- FedNova


def fednova_norm(local_steps: int, momentum: float = 0.0) -> float:
    """``||a_i||_1`` for local SGD with heavy-ball momentum over ``local_steps`` steps.

    Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
    Optimization", NeurIPS 2020: ``tau`` for plain SGD, and
    ``(tau - rho (1 - rho^tau) / (1 - rho)) / (1 - rho)`` with momentum ``rho``.
    """
    if local_steps < 1:
        raise ValueError(f"local_steps must be >= 1, got {local_steps}")
    if momentum == 0:
        return float(local_steps)
    rho = momentum
    return (local_steps - rho * (1 - rho**local_steps) / (1 - rho)) / (1 - rho)


class FedNovaAccumulator:
    """Streaming FedNova: ``x <- x - tau_eff * sum_i p_i (x - x_i) / a_i``, ``tau_eff = sum_i p_i a_i``.

    ``p_i`` are the sample weights normalised to 1; ``a_i`` from :func:`fednova_norm`.
    """

    def __init__(self, global_arrays: Arrays) -> None:
        self.global_arrays = global_arrays
        self._directions = WeightedMeanAccumulator()
        self._tau = 0.0

    def add(self, update: Arrays, weight: float, norm: float) -> None:
        """Fold in one device's arrays, its sample weight and its ``a_i``."""
        direction = {k: (np.asarray(self.global_arrays[k], np.float64) - np.asarray(v, np.float64)) / norm
                     for k, v in update.items()}
        self._directions.add(direction, weight)
        self._tau += weight * norm

    @property
    def count(self) -> int:  # noqa: D102
        return self._directions.count

    def result(self) -> dict[str, NDArray[np.generic]]:
        """The FedNova update of the global arrays."""
        tau_eff = self._tau / self._directions.total_weight
        direction = self._directions.result()
        return {k: _cast(np.asarray(g, np.float64) - tau_eff * np.asarray(direction[k], np.float64), g.dtype)
                for k, g in self.global_arrays.items()}


# --------------------------------------------------------------------------- q-FedAvg


class QFedAvgAccumulator:
    """Streaming q-FedAvg (Li et al., "Fair Resource Allocation in Federated Learning", ICLR 2020,
    Algorithm 2): with ``L = 1 / client_lr`` and each device's loss ``F_k`` before its update,
    ``Delta_k = L (x - x_k)``, ``delta_k = F_k^q Delta_k``,
    ``h_k = q F_k^(q-1) ||Delta_k||^2 + L F_k^q``; ``x <- x - sum_k delta_k / sum_k h_k``.

    Larger ``q`` weights devices with larger losses more (q = 0: FedAvg's objective, each
    device equally). Memory O(model): each update is folded in and can be freed.
    """

    def __init__(self, global_arrays: Arrays, *, q: float, client_lr: float) -> None:
        if q < 0 or client_lr <= 0:
            raise ValueError(f"q must be >= 0 and client_lr > 0, got q = {q}, client_lr = {client_lr}")
        self.global_arrays, self.q, self.lipschitz = global_arrays, q, 1.0 / client_lr
        self._sums = {k: np.zeros(np.shape(v), np.float64) for k, v in global_arrays.items()}
        self._h = 0.0
        self.count = 0

    def add(self, update: Arrays, loss: float) -> None:
        """Fold in one device's arrays and its training loss (the ``F_k`` of the paper; >= 0)."""
        if not np.isfinite(loss) or loss < 0:
            raise ValueError(f"loss must be finite and >= 0, got {loss}")
        step = {k: self.lipschitz * (np.asarray(g, np.float64) - np.asarray(update[k], np.float64))
                for k, g in self.global_arrays.items()}
        scale = float(np.float_power(loss + 1e-10, self.q))
        for name, value in step.items():
            self._sums[name] += scale * value
        norm = float(sum(np.sum(v * v) for v in step.values()))
        self._h += self.q * float(np.float_power(loss + 1e-10, self.q - 1)) * norm + self.lipschitz * scale
        self.count += 1

    def result(self) -> dict[str, NDArray[np.generic]]:
        """The q-FedAvg update of the global arrays."""
        return {k: _cast(np.asarray(g, np.float64) - self._sums[k] / self._h, g.dtype)
                for k, g in self.global_arrays.items()}


# --------------------------------------------------------------------------- FedBuff


def staleness_weight(staleness: int, exponent: float = 0.5) -> float:
    """``1 / (1 + s)^exponent`` (FedBuff, Nguyen et al., AISTATS 2022, uses exponent 0.5)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return float((1.0 + staleness) ** -exponent)


def apply_buffer(
    global_arrays: Arrays, deltas: Sequence[Arrays], weights: Sequence[float], server_lr: float,
    count: int | None = None,
) -> dict[str, NDArray[np.generic]]:
    """FedBuff's server step: ``x <- x - server_lr * (1/K) sum_i w_i delta_i``, ``delta_i = x_start_i - x_i``;
    ``K`` is ``count`` (the device results behind the deltas: a gateway's mean stands for several), else
    ``len(deltas)``."""
    _require(deltas)
    divisor = count if count is not None else len(deltas)
    return {k: _cast(np.asarray(g, np.float64) - server_lr * sum(
                w * np.asarray(d[k], np.float64) for d, w in zip(deltas, weights, strict=True)) / divisor,
                g.dtype)
            for k, g in global_arrays.items()}


# torch's BatchNorm buffers by the names its state_dict gives them (a plain Flower app has no model to ask)
STATISTIC_SUFFIXES = (".running_mean", ".running_var", ".num_batches_tracked", "running_mean", "running_var",
                      "num_batches_tracked")


def statistic_names(arrays: Arrays, declared: Iterable[str] | None = None) -> frozenset[str]:
    """The entries of ``arrays`` that are statistics a model keeps (buffers), not weights it learns.

    ``declared``: the model's buffer names, when the coordinator has the model; else the
    names torch gives BatchNorm's running mean, variance and batch counter, and every
    integer array (a counter: a server step on it means nothing).
    """
    if declared is not None:
        return frozenset(declared) & frozenset(arrays)
    return frozenset(name for name, value in arrays.items()
                     if name.endswith(STATISTIC_SUFFIXES) or np.issubdtype(np.asarray(value).dtype, np.integer))


def with_statistics(stepped: Arrays, means: Arrays, statistics: Iterable[str]) -> dict[str, NDArray[np.generic]]:
    """``stepped`` with each of ``statistics`` replaced by its weighted mean over the devices.

    A server optimiser's step (momentum, Adam, FedBuff's stale deltas) is meant for weights;
    on BatchNorm's running statistics it overshoots (a running variance went negative and
    accuracy fell to chance by round 2 under FedAvgM). Statistics are averaged instead, as
    FedAvg averages them (Li et al., "FedBN", ICLR 2021, keep them local; averaging is
    FedAvg's choice and the default here).
    """
    out = dict(stepped)
    for name in statistics:
        if name in out and name in means:
            out[name] = _cast(np.asarray(means[name], np.float64), np.asarray(out[name]).dtype)
    return out
