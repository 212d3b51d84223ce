"""Aggregation strategies: Flower ``Strategy`` classes composed of a rule and a driver.

Every strategy is :class:`FedAvg` (which validates replies) with its own aggregation rule
(:mod:`fedge.strategies.rule`: fold, result, state; the math is :mod:`fedge.aggregate`),
run by a round driver (:mod:`fedge.strategies.drivers`: synchronous, asynchronous, secure).
Flower's message-API strategies are here under Flower's names and calls (``FedMedian``,
``FedTrimmedAvg``, ``MultiKrum``, ``FedAdagrad``, ``Bulyan``, ``QFedAvg`` beside fedge's names;
see :mod:`fedge.strategies.flower_args` and docs/flower-dropin.md).
"""

import importlib
import pkgutil

from fedge.strategies.bulyan import Bulyan
from fedge.strategies.drivers.asynchronous import AsynchronousDriver
from fedge.strategies.drivers.secure import SecureAggregation
from fedge.strategies.drivers.sync import SyncDriver
from fedge.strategies.fedadagrad import FedAdagrad
from fedge.strategies.fedadam import FedAdam
from fedge.strategies.fedavg import FedAvg, RoundReport
from fedge.strategies.fedavgm import FedAvgM
from fedge.strategies.fedbuff import FedBuff
from fedge.strategies.fednova import FedNova
from fedge.strategies.fedprox import FedProx
from fedge.strategies.fedyogi import FedYogi
from fedge.strategies.krum import Krum, MultiKrum
from fedge.strategies.median import FedMedian, Median
from fedge.strategies.qfedavg import QFedAvg
from fedge.strategies.registry import REGISTRY, StrategySpec, register, strategy_spec
from fedge.strategies.rule import EachUpdateRule, LinearRule, RoundContext, Rule, Update
from fedge.strategies.trimmed_mean import FedTrimmedAvg, TrimmedMean

# A strategy registers itself when its module is imported: import every module of the
# package, so a new strategy file needs no line here.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

# Every registered strategy by run-config name.
STRATEGIES: dict[str, type[FedAvg]] = {name: spec.cls for name, spec in REGISTRY.items()}

__all__ = ["REGISTRY", "STRATEGIES", "AsynchronousDriver", "Bulyan", "EachUpdateRule", "FedAdagrad", "FedAdam",
           "FedAvg", "FedAvgM", "FedBuff", "FedMedian", "FedNova", "FedProx", "FedTrimmedAvg", "FedYogi", "Krum",
           "LinearRule", "Median", "MultiKrum", "QFedAvg", "RoundContext", "RoundReport", "Rule", "SecureAggregation",
           "StrategySpec", "SyncDriver", "TrimmedMean", "Update", "register", "strategy_spec"]
