"""The strategy registry: each strategy file registers its class, its run-config name and how
it reads its options from the run config. Adding a strategy is one file (plus tests).

The registry knows whether a strategy works with ``dp`` (the noise is calibrated to a mean
of clipped updates), so DP asks it instead of keeping a list of names. What a strategy's
rule allows (secure aggregation, asynchronous rounds) the rule declares itself
(:mod:`fedge.strategies.rule`) and the driver checks (:mod:`fedge.strategies.drivers`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
    """

    name: str
    cls: type
    options: Options
    dp: bool = False


REGISTRY: dict[str, StrategySpec] = {}


def register(name: str, *, options: Options = no_options, dp: bool = False) -> Callable[[T], T]:
    """Class decorator: register a strategy under ``name``."""
    def decorate(cls: T) -> T:
        if name in REGISTRY and REGISTRY[name].cls is not cls:
            raise ConfigError(f"two strategies registered as '{name}': {REGISTRY[name].cls.__name__} and "
                              f"{cls.__name__}; give one another name")
        REGISTRY[name] = StrategySpec(name, cls, options, dp)
        return cls
    return decorate


def names_where(fits: Callable[[Any], bool]) -> str:
    """The registered strategies whose rule ``fits`` (a predicate on a :class:`fedge.strategies.rule.Rule`),
    as an error message lists them (``fedavg, fedprox or fedyogi``): each strategy is built as a default
    run config builds it, so a strategy registered later is listed too."""
    from fedge.config import resolve_run_config  # noqa: PLC0415 - the knobs load only for a message

    strategy_spec("fedavg")  # every built-in strategy registered
    defaults = resolve_run_config({})
    names = sorted(name for name, spec in REGISTRY.items() if fits(spec.cls(**spec.options(defaults, None)).rule))
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)


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
