"""Flower's constructors on fedge's strategies: Flower's argument names, positions and defaults.

A plain Flower app that swaps ``from flwr.serverapp.strategy import FedAdam`` for fedge's
must get the same strategy from the same call: ``FedAdam(eta=0.1)``,
``FedAvg(0.5, 0.2, 3)``, ``Krum(num_malicious_nodes=1)``. fedge's own names
(``server_learning_rate``, ``num_byzantine``, ...) stay accepted beside Flower's.

Written here because Flower's classes cannot be subclassed for this: fedge's strategies
subclass Flower's ``FedAvg`` (its constructor and defaults are inherited as they are), but a
fedge ``FedAdam`` is a ``FedAvg`` with an adaptive server step, not Flower's ``FedAdam``,
so its constructor is read from Flower's class (:func:`flower_constructor`) and never copied:
a Flower release that changes a default changes fedge's with it.

Flower's public attributes are kept as well: a setting is its rule's (:class:`RuleSetting`,
read and written under fedge's name or Flower's), so changing it after construction changes
the next aggregation, as it does Flower's.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar, cast, overload

from fedge.errors import ConfigError

T = TypeVar("T", bound=type)


def _positional_names(flower_class: type) -> list[str]:
    """The names Flower's constructor takes by position, in order (``self`` left out)."""
    params = list(inspect.signature(flower_class).parameters.values())
    return [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]


def _defaults(flower_class: type) -> dict[str, Any]:
    """Flower's defaults for every constructor argument that has one."""
    params = list(inspect.signature(flower_class).parameters.values())
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def flower_keywords(flower_class: type, renames: Mapping[str, str], owner: str,
                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``args`` and ``kwargs`` of a call written for Flower's ``flower_class``, as fedge keywords.

    Positional arguments are named in Flower's order; Flower's names in ``renames`` become
    fedge's; an argument given neither way gets Flower's default.

    Raises
    ------
    TypeError
        More positional arguments than Flower's constructor takes, or one given twice
        (as Flower's own constructor would).
    ConfigError
        The same setting given under Flower's name and fedge's.
    """
    names = _positional_names(flower_class)
    if args and not names:
        raise TypeError(f"{owner}() takes its arguments by name only, as Flower's {flower_class.__name__} does")
    if len(args) > len(names):
        raise TypeError(f"{owner}() takes at most {len(names)} positional arguments in Flower's order "
                        f"({', '.join(names)}), got {len(args)}; pass the rest by name")
    out = dict(kwargs)
    for name, value in zip(names, args, strict=False):
        if name in out:
            raise TypeError(f"{owner}() got multiple values for argument '{name}'")
        out[name] = value
    for flower_name, fedge_name in renames.items():
        if flower_name in out and fedge_name in out:
            raise ConfigError(f"{owner}(): '{flower_name}' (Flower's name) and '{fedge_name}' (fedge's) set the "
                              "same thing; give one of them")
        if flower_name in out:
            out[fedge_name] = out.pop(flower_name)
    for name, default in _defaults(flower_class).items():
        out.setdefault(renames.get(name, name), default)
    return out


def flower_constructor(flower_class: type, **renames: str) -> Callable[[T], T]:
    """Class decorator: the class's constructor also takes ``flower_class``'s call.

    Parameters
    ----------
    flower_class : type
        The Flower strategy whose constructor (names, positions, defaults) the class accepts.
    **renames : str
        Flower's name -> fedge's name, for settings fedge calls otherwise (``eta="server_learning_rate"``).
    """
    def decorate(cls: T) -> T:
        init = cls.__init__  # type: ignore[misc]  # its own, or the one it inherits

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, **flower_keywords(flower_class, renames, cls.__name__, args, kwargs))

        cls.__init__ = __init__  # type: ignore[misc]
        cls.flower_class = flower_class  # type: ignore[attr-defined]
        return cls
    return decorate


V = TypeVar("V")


class RuleSetting(Generic[V]):
    """A strategy attribute that is its rule's setting, under fedge's name or Flower's.

    Flower's strategies read their settings (``server_momentum``, ``eta``, ``beta``, ...) when
    they aggregate, so an app may change one after construction, as Flower's own tests do
    (``strategy.server_learning_rate = ...``). fedge's rule holds the setting it uses; this
    attribute reads it from the rule and writes it there, so both names mean the one value.

    Parameters
    ----------
    name : str, optional
        The rule's attribute (default: the strategy attribute's own name).
    """

    def __init__(self, name: str | None = None) -> None:
        self.rule_name = name or ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.rule_name = self.rule_name or name

    @overload
    def __get__(self, strategy: None, owner: type | None = None) -> RuleSetting[V]: ...

    @overload
    def __get__(self, strategy: object, owner: type | None = None) -> V: ...

    def __get__(self, strategy: object | None, owner: type | None = None) -> V | RuleSetting[V]:
        if strategy is None:
            return self
        return cast(V, getattr(strategy.rule, self.rule_name))  # type: ignore[attr-defined]

    def __set__(self, strategy: object, value: V) -> None:
        setattr(strategy.rule, self.rule_name, value)  # type: ignore[attr-defined]


class CurrentArrays:
    """Flower's ``current_arrays``: a strategy's ``global_arrays`` (what ``aggregate_train`` checks replies
    against and steps from). Set it, as Flower's tests do, to aggregate without ``configure_train``
    (an ``ArrayRecord`` or numpy arrays by name); it reads back as Flower keeps it: numpy arrays
    (a copy) for the FedOpt family (``current_arrays_as_numpy``), the ``ArrayRecord`` otherwise."""

    def __get__(self, strategy: Any, owner: type | None = None) -> Any:
        if strategy is None:
            return self
        arrays = strategy.global_arrays
        if arrays is None or not strategy.current_arrays_as_numpy:
            return arrays
        return {name: array.numpy() for name, array in arrays.items()}

    def __set__(self, strategy: Any, arrays: Any) -> None:
        import numpy as np
        from flwr.app import Array, ArrayRecord

        if arrays is not None and not isinstance(arrays, Mapping):
            raise TypeError(f"current_arrays takes an ArrayRecord or a dict of numpy arrays by name, got "
                            f"{type(arrays).__name__}")
        if isinstance(arrays, Mapping) and not isinstance(arrays, ArrayRecord):
            arrays = ArrayRecord({name: value if isinstance(value, Array) else
                                  Array(np.ascontiguousarray(value)) for name, value in arrays.items()})
        if "rounds" in strategy.__dict__:  # Flower's __init__ sets it before the rounds exist
            strategy.global_arrays = arrays


class WeightedByKey:
    """Flower's ``weighted_by_key``: the train metric a reply's weight is read from; set after construction
    too, the strategy's validator reads the new key (a copy: a validator the caller shares stays as it was)."""

    def __get__(self, strategy: Any, owner: type | None = None) -> Any:
        if strategy is None:
            return self
        return strategy.__dict__["_weighted_by_key"]

    def __set__(self, strategy: Any, key: str) -> None:
        strategy.__dict__["_weighted_by_key"] = key
        if "rounds" in strategy.__dict__:  # not yet while Flower's __init__ runs
            strategy.validator = weighing(strategy.validator, key)


def weighing(validator: Any, key: str) -> Any:
    """``validator`` reading a reply's weight from ``key`` (a copy unless it already does)."""
    import copy

    if validator.weight_key == key:
        return validator
    validator = copy.copy(validator)
    validator.weight_key = key
    return validator
