"""Aggregation strategies: thin Flower ``Strategy`` subclasses around :mod:`.aggregate`.

Every strategy validates replies (see :class:`FedAvg`); they differ only in the
``aggregate_updates`` hook.
"""

from fedge.strategies.fedadam import FedAdam
from fedge.strategies.fedavg import FedAvg, RoundReport
from fedge.strategies.fedavgm import FedAvgM
from fedge.strategies.fedbuff import FedBuff
from fedge.strategies.fednova import FedNova
from fedge.strategies.fedprox import FedProx
from fedge.strategies.fedyogi import FedYogi
from fedge.strategies.krum import Krum
from fedge.strategies.median import Median
from fedge.strategies.trimmed_mean import TrimmedMean

STRATEGIES: dict[str, type[FedAvg]] = {
    "fedavg": FedAvg,
    "fedprox": FedProx,
    "fednova": FedNova,
    "fedbuff": FedBuff,
    "fedavgm": FedAvgM,
    "fedadam": FedAdam,
    "fedyogi": FedYogi,
    "trimmed-mean": TrimmedMean,
    "median": Median,
    "krum": Krum,
}

__all__ = ["STRATEGIES", "FedAdam", "FedAvg", "FedAvgM", "FedBuff", "FedNova", "FedProx", "FedYogi", "Krum", "Median",
           "RoundReport", "TrimmedMean"]
