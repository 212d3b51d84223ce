"""Aggregation strategies: thin Flower ``Strategy`` subclasses around :mod:`.aggregate`.

Every strategy validates replies (see :class:`FedAvg`); they differ only in the
``aggregate_updates`` hook.
"""

from fedge.strategies.fedavg import FedAvg, RoundReport
from fedge.strategies.krum import Krum
from fedge.strategies.median import Median
from fedge.strategies.trimmed_mean import TrimmedMean

STRATEGIES: dict[str, type[FedAvg]] = {
    "fedavg": FedAvg,
    "trimmed-mean": TrimmedMean,
    "median": Median,
    "krum": Krum,
}

__all__ = ["STRATEGIES", "FedAvg", "Krum", "Median", "RoundReport", "TrimmedMean"]
