"""Data sets, partitioners and flat-file loaders the built-in tasks (:mod:`fedge.task.builtin`) use.

* ``digits``: scikit-learn's bundled 8x8 handwritten digits (no download).
* ``synthetic``: the Synthetic(alpha, beta) benchmark of FedProx
  (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020, sec. 5.1).
* ``npz`` / ``csv``: a user's own file, partitioned like the others.

Partitioners split a centralised training set into one shard per device:
IID, or label skew with per-class proportions drawn from Dirichlet(alpha)
(Hsu et al., 2019). Every training sample lands in exactly one shard.
"""

from __future__ import annotations

import csv
import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from fedge.errors import ConfigError
from fedge.npy import UNREADABLE_FILE_ERRORS

Features = NDArray[np.float32]
Labels = NDArray[np.int64]


def load_digits_arrays() -> tuple[Features, Labels]:
    """scikit-learn's bundled digits (1797 8x8 images), pixels scaled from [0, 16] to [0, 1].

    Reads the CSV that ships inside scikit-learn, as ``sklearn.datasets.load_digits``
    does, without importing scikit-learn (about 1 s per process, and the inline
    simulator and every device process would pay it).
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("dataset 'digits' needs scikit-learn installed (pip install scikit-learn)")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    table = np.loadtxt(path, delimiter=",")
    return (table[:, :-1] / 16.0).astype(np.float32), table[:, -1].astype(np.int64)


def load_npz(path: str | Path) -> tuple[Features, Labels]:
    """Load ``x`` (n, features) and ``y`` (n,) integer labels from a ``.npz`` file."""
    try:
        with np.load(path, allow_pickle=False) as data:
            keys = set(data.files)
            x_key = "x" if "x" in keys else "X"
            if x_key not in keys or "y" not in keys:
                raise ConfigError(
                    f"'{path}' holds arrays {sorted(keys)}; it needs 'x' (features) and 'y' (labels)"
                )
            return _checked_xy(data[x_key], data["y"], path)
    except UNREADABLE_FILE_ERRORS as exc:
        raise ConfigError(f"cannot read '{path}' as .npz: {exc}") from None


def load_csv(path: str | Path, label_column: str = "label") -> tuple[Features, Labels]:
    """Load a CSV with a header; the ``label_column`` (or the last column) is the label."""
    features, labels = load_csv_table(path, label_column)
    return _checked_xy(features, labels, path)


def load_csv_table(path: str | Path, label_column: str = "label") -> tuple[np.ndarray, np.ndarray]:
    """A numeric CSV with a header as (features, ``label_column`` or the last column), float64."""
    try:
        with open(path, newline="") as handle:
            rows = list(csv.reader(handle))
    except OSError as exc:
        raise ConfigError(f"cannot read '{path}': {exc}") from None
    if len(rows) < 2:
        raise ConfigError(f"'{path}' needs a header row and at least one data row")
    header, body = rows[0], rows[1:]
    label_at = header.index(label_column) if label_column in header else len(header) - 1
    try:
        table = np.array(body, dtype=np.float64)
    except ValueError as exc:
        raise ConfigError(f"'{path}' has a non-numeric cell: {exc}") from None
    return np.delete(table, label_at, axis=1), table[:, label_at]


@lru_cache(maxsize=4)
def load_local_file(path: str) -> tuple[Features, Labels]:
    """A device's own data: ``.npz`` (arrays ``x``, ``y``) or ``.csv`` (header, ``label`` column)."""
    if path.endswith(".npz"):
        return load_npz(path)
    if path.endswith(".csv"):
        return load_csv(path)
    raise ConfigError(f"device data '{path}' must be a .npz (arrays x, y) or .csv (header + label column)")


def _checked_xy(x: np.ndarray, y: np.ndarray, source: object) -> tuple[Features, Labels]:
    if x.ndim != 2 or y.ndim != 1 or len(x) != len(y):
        raise ConfigError(
            f"'{source}': features must be (n, d) and labels (n,), got {x.shape} and {y.shape}"
        )
    if not np.all(np.isfinite(x)):
        raise ConfigError(f"'{source}': features contain NaN or Inf")
    if np.any(y < 0) or np.any(y != np.round(y)):
        raise ConfigError(f"'{source}': labels must be integers >= 0")
    return x.astype(np.float32), y.astype(np.int64)


def iid_partition(num_samples: int, num_partitions: int, seed: int) -> list[NDArray[np.int64]]:
    """Shuffle sample indices and deal them into ``num_partitions`` near-equal shards."""
    check_partitionable(num_samples, num_partitions)
    order = np.random.default_rng(seed).permutation(num_samples)
    return [np.sort(shard) for shard in np.array_split(order, num_partitions)]


def dirichlet_partition(
    labels: Labels, num_partitions: int, alpha: float, seed: int, *, max_tries: int = 1000
) -> list[NDArray[np.int64]]:
    """Label-skewed shards: each class is split across shards by Dirichlet(alpha) proportions.

    Draws again (seeded) until every shard has at least one sample. The first draw hands each
    class's proportions to the shards in order; a redraw also shuffles, per class, which shard
    takes which proportion. The cuts are floor-rounded, so with few samples of a class the
    in-order draw gives them to the same shards every time (20 samples, 10 shards, alpha 9:
    no draw of 1,000 filled shard 0); shuffling spreads them. The Dirichlet is symmetric, so the
    shuffle leaves the distribution of a shard's proportions unchanged, and a seeded partition
    that the first draw fills (every configuration fedge ships and benches) is the same as before.

    Raises
    ------
    ConfigError
        If there are more shards than samples, or no draw leaves every shard non-empty.
    """
    check_partitionable(len(labels), num_partitions)
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for attempt in range(max_tries):
        shards: list[list[int]] = [[] for _ in range(num_partitions)]
        for label in classes:
            members = rng.permutation(np.flatnonzero(labels == label))
            cuts = (np.cumsum(rng.dirichlet([alpha] * num_partitions)) * len(members)).astype(int)
            order = rng.permutation(num_partitions) if attempt else range(num_partitions)
            for index, part in zip(order, np.split(members, cuts[:-1]), strict=True):
                shards[index].extend(part.tolist())
        if min(map(len, shards)) > 0:
            return [np.sort(np.array(shard, dtype=np.int64)) for shard in shards]
    raise ConfigError(
        f"Dirichlet(alpha={alpha}) left some of {num_partitions} devices without data in "
        f"{max_tries} draws of {len(labels)} samples; use fewer devices, a larger "
        "dirichlet-alpha, or partitioner='iid'"
    )


def check_partitionable(num_samples: int, num_partitions: int) -> None:
    """Refuse fewer than one partition, or more partitions than examples."""
    if num_partitions < 1:
        raise ConfigError(f"number of devices must be >= 1, got {num_partitions}")
    if num_partitions > num_samples:
        raise ConfigError(
            f"cannot partition {num_samples} training samples across {num_partitions} devices;"
            " use a fleet with at most as many devices as samples"
        )


def synthetic_fedprox(
    alpha: float,
    beta: float,
    num_devices: int,
    seed: int,
    *,
    num_features: int = 60,
    num_classes: int = 10,
) -> list[tuple[Features, Labels]]:
    """FedProx's Synthetic(alpha, beta) data, one (x, y) set per device (see :func:`synthetic_device`)."""
    return [synthetic_device(alpha, beta, device, seed, num_features=num_features, num_classes=num_classes)
            for device in range(num_devices)]


def synthetic_device(
    alpha: float,
    beta: float,
    device: int,
    seed: int,
    *,
    num_features: int = 60,
    num_classes: int = 10,
) -> tuple[Features, Labels]:
    """Device ``device``'s Synthetic(alpha, beta) data, from its own seed ``(seed, device)``.

    For device k: ``u_k ~ N(0, alpha)``, ``B_k ~ N(0, beta)``; ``W_k ~ N(u_k, 1)``
    (d x c), ``b_k ~ N(u_k, 1)`` (c); ``v_k ~ N(B_k, 1)`` (d); inputs
    ``x ~ N(v_k, Sigma)`` with diagonal ``Sigma_jj = j^-1.2``; labels
    ``y = argmax(softmax(W_k^T x + b_k))``. Sample counts follow the paper's
    code: ``lognormal(4, 2) + 50``. ``alpha`` and ``beta`` are variances.

    A pure function of (alpha, beta, device, seed): any process, on any backend, that
    materialises the device gets the same examples, and no other device is generated.
    """
    if device < 0:
        raise ConfigError(f"synthetic device index must be >= 0, got {device}")
    rng = np.random.default_rng([seed % 2**63, device])
    count = int(rng.lognormal(4, 2)) + 50
    sigma = np.arange(1, num_features + 1, dtype=np.float64) ** -1.2
    u_k = rng.normal(0, np.sqrt(alpha))
    b_shift = rng.normal(0, np.sqrt(beta))
    weights = rng.normal(u_k, 1, (num_features, num_classes))
    bias = rng.normal(u_k, 1, num_classes)
    v_k = rng.normal(b_shift, 1, num_features)
    x = rng.normal(v_k, np.sqrt(sigma), (count, num_features))
    y = np.argmax(x @ weights + bias, axis=1)  # softmax is monotone
    return x.astype(np.float32), y.astype(np.int64)


def label_names(num_classes: int) -> list[str]:
    """Class names: the class indices (digits' classes are the digits themselves)."""
    return [str(index) for index in range(num_classes)]


def holdout(
    x: Features, y: Labels, test_fraction: float, seed: int
) -> tuple[Features, Labels, tuple[Features, Labels]]:
    """Stratified, seeded split: ``test_fraction`` of every class goes to the test set."""
    rng = np.random.default_rng(seed)
    test_idx = np.concatenate([
        members[: int(round(len(members) * test_fraction))]
        for members in (rng.permutation(np.flatnonzero(y == label)) for label in np.unique(y))
    ])
    is_test = np.zeros(len(y), dtype=bool)
    is_test[test_idx] = True
    return x[~is_test], y[~is_test], (x[is_test], y[is_test])
