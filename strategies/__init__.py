"""Aggregation strategies: thin Flower ``Strategy`` subclasses around :mod:`.aggregate`."""

from fedge.strategies.fedavg import FedAvg, RoundReport

STRATEGIES = {"fedavg": FedAvg}

__all__ = ["STRATEGIES", "FedAvg", "RoundReport"]
