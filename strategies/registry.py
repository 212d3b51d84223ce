"""The strategy registry: each strategy file registers its class, its run-config name and how
it reads its options from the run config. Adding a strategy is one file (plus tests).

The registry knows whether a strategy works with ``dp`` (the noise is calibrated to a mean
of clipped updates), so DP asks it instead of keeping a list of names; and which class runs
its rounds under secure aggregation (:func:`register_secure`), so secure aggregation asks it too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fedge.config import Scalar
from fedge.errors import ConfigError

Options = Callable[[Mapping[str, Scalar], int | None], dict[str, Any]]
T = TypeVar("T", bound=type)


def no_options(config: Mapping[str, Scalar], num_nodes: int | None) -> dict[str, Any]:
    """For strategies without options of their own."""
    return {}


@dataclass(frozen=True)
class StrategySpec:
    """One registered strategy.

    Attributes
    ----------
    name : str
        Its run-config name (``strategy = "<name>"``).
    cls : type
        The strategy class.
    options : Callable
        Constructor keyword arguments from the run config (and the fleet size, when known).
    dp : bool
        Works with differential privacy (a mean of clipped updates).
    needs_individual_updates : bool
        Needs each update on its own (robust aggregation): cannot run under secure aggregation,
        and holds all of a round's updates (O(K x P) memory).
    secure : type | None
        The class that runs its rounds under secure aggregation (None: it cannot).
    """

    name: str
    cls: type
    options: Options
    dp: bool = False
    needs_individual_updates: bool = False
    secure: type | None = None


REGISTRY: dict[str, StrategySpec] = {}


def register(name: str, *, options: Options = no_options, dp: bool = False,
             needs_individual_updates: bool = False) -> Callable[[T], T]:
    """Class decorator: register a strategy under ``name``."""
    def decorate(cls: T) -> T:
        if name in REGISTRY and REGISTRY[name].cls is not cls:
            raise ConfigError(f"two strategies registered as '{name}': {REGISTRY[name].cls.__name__} and "
                              f"{cls.__name__}; give one another name")
        REGISTRY[name] = StrategySpec(name, cls, options, dp, needs_individual_updates)
        return cls
    return decorate


def register_secure(name: str) -> Callable[[T], T]:
    """Class decorator: ``cls`` runs strategy ``name``'s rounds under secure aggregation.

    Register the plain strategy first (its module is imported by the secure one's).
    """
    def decorate(cls: T) -> T:
        if name not in REGISTRY:
            raise ConfigError(f"{cls.__name__} is registered as the secure variant of '{name}', which is not a "
                              "registered strategy; register the strategy first")
        if REGISTRY[name].needs_individual_updates:
            raise ConfigError(f"strategy '{name}' needs individual updates, which secure aggregation hides; "
                              f"{cls.__name__} cannot be its secure variant")
        REGISTRY[name] = replace(REGISTRY[name], secure=cls)
        return cls
    return decorate


def strategy_spec(name: str) -> StrategySpec:
    """The registered strategy ``name``.

    Raises
    ------
    ConfigError
        Naming the strategies there are.
    """
    import fedge.strategies  # noqa: F401 - importing the package registers every built-in strategy

    if name not in REGISTRY:
        raise ConfigError(f"run-config 'strategy' = {name!r} is not a registered strategy; use one of: "
                          f"{', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]
