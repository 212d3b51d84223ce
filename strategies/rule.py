"""Aggregation rules: what a round's accepted updates become, and nothing else.

A rule folds updates in (``fold``), gives the new global model (``result``) and keeps its own
state (``state_dict``); it sees plain numpy arrays and never a Flower type, a device or a
round. Round drivers (:mod:`fedge.strategies.drivers`) decide how updates reach it: one at
a time as replies arrive (synchronous), buffered across model versions (asynchronous), or
as one masked sum (secure aggregation, which only a linear rule can take).

A rule declares what drivers may do with it:

* ``linear``: its result is a server step applied to the weighted mean of the updates
  (:meth:`LinearRule.step`), so secure aggregation, DP and hierarchical pre-aggregation
  may compute that mean in another way and hand it over;
* ``hierarchical``: a mean of pools' means, weighted by each pool's examples, stands for the
  mean of every update, so gateways may pre-aggregate their devices (linear rules whose
  updates carry nothing per device beyond their weight);
* ``needs_each_update``: it holds every update of a round at once (robust rules: O(K x P)
  memory), which secure aggregation hides;
* ``takes_group_means``: it is a robust rule that may run over groups' means instead of
  devices' updates (SHARE: Velicheti, Xia and Koyejo, 2021): each update it folds is then one
  group's mean (a gateway's reply, or one secure-aggregation group of ``secure-groups``), one
  unit of trust, and its bound counts hostile groups, not devices (:meth:`Rule.groups_needed`);
* ``needs_global_model``: it steps from the model the round started from;
* ``takes_stale_updates``: it folds updates trained from older models (``Update.base``), as
  the asynchronous driver sends them;
* ``takes_sub_models``: it folds updates of width-scaled sub-models (``Update.window``), each
  entry averaged over the updates that hold it (HeteroFL, FedRolex: :mod:`fedge.submodels`);
* state to checkpoint: :meth:`Rule.state_dict`, whose keys name what a checkpoint holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from fedge.aggregate import WeightedMeanAccumulator, statistic_names
from fedge.errors import CheckpointMismatch, ConfigError
from fedge.submodels import CoverageMean, Window

Arrays = dict[str, NDArray[np.generic]]


@dataclass
class Update:
    """One accepted update, decoded and validated.

    Attributes
    ----------
    node_id : int
        The device it came from (rules that select updates log whom they kept).
    arrays : dict
        The model the device trained, by name. A rule may clear it once folded in.
    weight : float
        Its weight (``num-examples`` by default; 1 under DP; a staleness weight under FedBuff).
    steps : int, optional
        Local optimiser steps the device ran (FedNova normalises by them).
    metrics : Mapping
        The device's train metrics (q-FedAvg reads its loss).
    base : Mapping, optional
        The model the device trained from when that is not the round's global model (an
        asynchronous driver's stale update); None otherwise.
    window : Window, optional
        The part of the global model the device trained (a width-scaled sub-model, see
        :mod:`fedge.submodels`); None: the whole model.
    devices : int
        The device results behind it: 1, or a gateway's mean of several (FedBuff counts each).
    """

    node_id: int
    arrays: Arrays
    weight: float
    steps: int | None = None
    metrics: Mapping[str, Any] = field(default_factory=dict)
    base: Mapping[str, NDArray[np.generic]] | None = None
    window: Window | None = None
    devices: int = 1


class RoundContext:
    """What a rule knows of the round it aggregates.

    Parameters
    ----------
    global_arrays : Mapping or Callable, optional
        The model the round started from, or a function that reads it (called once, when a
        rule first asks: FedAvg's mean never does, so it costs no copy of the model); None
        when Flower's ``aggregate_train`` is called without ``configure_train`` (rules that
        need it refuse then).
    buffer_names : frozenset, optional
        The model's statistics (BatchNorm buffers), averaged and never stepped; None: torch's
        buffer names and integer arrays count (:func:`fedge.aggregate.statistic_names`).
    """

    def __init__(self, global_arrays: Mapping[str, NDArray[np.generic]] | Callable[[], Arrays] | None = None,
                 buffer_names: frozenset[str] | None = None) -> None:
        self._global = global_arrays
        self.buffer_names = buffer_names

    @property
    def has_global_model(self) -> bool:
        """Whether the round's starting model is known."""
        return self._global is not None

    def statistics_of(self, arrays: Mapping[str, NDArray[np.generic]]) -> frozenset[str]:
        """Which of ``arrays`` are model statistics."""
        return statistic_names(arrays, self.buffer_names)

    def global_numpy(self) -> Arrays:
        """The round's starting model as numpy (read once)."""
        if self._global is None:
            raise RuntimeError("no global model for this round: configure_train has not run")
        if callable(self._global):
            self._global = self._global()
        return dict(self._global)


class Rule:
    """The contract every aggregation rule keeps: begin, fold, result, state.

    Subclasses set the class properties and implement :meth:`fold` and :meth:`result`.
    """

    linear: ClassVar[bool] = False
    hierarchical: ClassVar[bool] = False
    needs_each_update: ClassVar[bool] = False
    takes_stale_updates: ClassVar[bool] = False
    takes_sub_models: ClassVar[bool] = False
    takes_group_means: ClassVar[bool] = False
    needs_global_model: bool = False
    state_prefixes: ClassVar[tuple[str, ...]] = ()  # what the keys of its state_dict start with

    def __init__(self) -> None:
        self.context = RoundContext()

    def begin(self, context: RoundContext) -> None:
        """Start a round's aggregation (drops whatever a previous round folded in)."""
        self.context = context

    def fold(self, update: Update) -> None:
        """Take one update in."""
        raise NotImplementedError

    def result(self) -> Arrays | None:
        """The new global model from what was folded in; None when nothing was."""
        raise NotImplementedError

    def state_dict(self) -> Arrays:
        """State to checkpoint with the model (none by default)."""
        return {}

    def groups_needed(self) -> tuple[int, str]:
        """The fewest groups a round must have for this rule's own guarantee over group means, and that
        guarantee in words (``takes_group_means`` rules; others need 1 and promise nothing)."""
        return 1, "no robustness"

    def load_state_dict(self, state: Mapping[str, NDArray[np.generic]]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def check_state(self, state: Mapping[str, NDArray[np.generic]]) -> None:
        """Refuse checkpointed state this rule does not keep (another strategy, or DP, wrote it).

        Raises
        ------
        CheckpointMismatch
            Naming the rule and the keys it does not keep.
        """
        foreign = sorted(key for key in state if not key.startswith(self.state_prefixes))
        if foreign:
            shown = ", ".join(repr(key) for key in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3
                                                                   else "")
            raise CheckpointMismatch(f"the checkpoint holds strategy state the rule {type(self).__name__} does not "
                                     f"keep: {shown}; resume with the strategy and dp setting that wrote it, or start "
                                     "a new run-dir")


class LinearRule(Rule):
    """A server step applied to the weighted mean of the updates (FedAvg: no step).

    Folds each update into a running weighted sum (O(model) memory); subclasses change
    :meth:`step` (server optimisers) or the mean itself (FedNova's normalised one, with
    :attr:`work_momentum` set so that secure aggregation masks the same quantities).
    """

    linear = True
    hierarchical = True  # the weighted mean of pool means is the weighted mean
    takes_stale_updates = True  # rebased onto the round's model (see fold)
    takes_sub_models = True  # a per-entry weighted mean (see fold)
    work_momentum: float | None = None  # FedNova: the devices' momentum in its local-work norm

    def begin(self, context: RoundContext) -> None:  # noqa: D102
        super().begin(context)
        self.mean = WeightedMeanAccumulator()
        self.entries: CoverageMean | None = None  # sub-models' updates: each entry's own weighted mean

    def fold(self, update: Update) -> None:
        """Add ``update`` to the weighted sum and let its arrays go.

        An update trained from an older model (``update.base``) counts as its change applied
        to the round's model; its statistics (BatchNorm buffers) count as they are. An update
        of a sub-model (``update.window``) adds to the entries its window holds.
        """
        if update.window is not None:
            if self.entries is None:
                self.entries = CoverageMean({name: np.shape(value)
                                             for name, value in self.context.global_numpy().items()})
            self.entries.add(update.arrays, update.window, update.weight)
        else:
            arrays = update.arrays if update.base is None else self.rebased(update.arrays, update.base)
            self.mean.add(arrays, update.weight)
        update.arrays.clear()  # folded in: let it go before the next reply is made or pulled

    def result(self) -> Arrays | None:
        """:meth:`step` from the weighted mean (per entry, for sub-models); None without updates."""
        if self.entries is not None:
            if self.mean.count:
                raise ValueError("a round mixed updates with and without windows: give every update its window")
            return self.step_entries(self.entries, self.context.global_numpy())
        return self.step(self.mean.result()) if self.mean.count else None

    def step(self, mean: Arrays) -> Arrays:
        """The new global model from the updates' weighted mean (identity: FedAvg)."""
        return mean

    def step_entries(self, entries: CoverageMean, start: Mapping[str, NDArray[np.generic]]) -> Arrays:
        """:meth:`step` from sub-models' per-entry mean; an entry nobody held keeps its ``start`` value
        (a server optimiser's momentum would otherwise move it)."""
        stepped, held = self.step(entries.result(start)), entries.coverage()
        return {name: np.where(held[name] > 0, value, start[name]).astype(value.dtype)
                for name, value in stepped.items()}

    def rebased(self, arrays: Arrays, base: Mapping[str, NDArray[np.generic]]) -> Arrays:
        """``arrays`` trained from ``base``, moved onto the round's model: ``current + (arrays - base)``."""
        current, statistics = self.context.global_numpy(), self.context.statistics_of(arrays)
        return {name: value if name in statistics else
                (np.asarray(current[name], np.float64) + np.asarray(value, np.float64)
                 - np.asarray(base[name], np.float64)).astype(value.dtype)
                for name, value in arrays.items()}


class Mean(LinearRule):
    """FedAvg's rule: the weighted mean of the updates (McMahan et al., AISTATS 2017), streaming."""


class EachUpdateRule(Rule):
    """A rule that needs every update of the round at once (robust aggregation).

    Each update may be a group's mean (``takes_group_means``): the statistic is then taken over
    groups, unweighted (a group's size is what its gateway claims, so weighting by it would let
    one hostile gateway outweigh the rest). :attr:`norms` keeps each update's L2 distance from the
    round's model (each group's update norm), by node id, when the model is known.
    """

    needs_each_update = True

    def begin(self, context: RoundContext) -> None:  # noqa: D102
        super().begin(context)
        self.updates: list[Update] = []
        self.norms: dict[int, float] = {}

    def fold(self, update: Update) -> None:
        """Keep ``update`` until :meth:`result`."""
        self.updates.append(update)

    def result(self) -> Arrays | None:
        """:meth:`combine` over the round's updates; None without any."""
        if not self.updates:
            return None
        if self.context.has_global_model:
            self.norms = update_norms(self.updates, self.context.global_numpy())
        return self.combine(self.updates)

    def combine(self, updates: list[Update]) -> Arrays | None:
        """The new global model from all of the round's updates."""
        raise NotImplementedError


def update_norms(updates: list[Update], start: Mapping[str, NDArray[np.generic]]) -> dict[int, float]:
    """Each update's L2 distance from ``start`` (the round's model) over the arrays it holds, by node id
    (under ``takes_group_means``: each group's update norm)."""
    norms = {}
    for update in updates:
        squared = sum(float(np.sum(np.square(np.asarray(value, np.float64) - np.asarray(start[name], np.float64))))
                      for name, value in update.arrays.items() if name in start)
        norms[update.node_id] = float(np.sqrt(squared))
    return norms


def check_groups(rule: Rule, name: str, groups: int, what: str, see: str = "") -> None:
    """Refuse at start a robust rule over ``groups`` group means (``what`` they are, e.g. "gateways a round
    (clients-per-round)") when that count cannot meet the rule's own bound (:meth:`Rule.groups_needed`).

    Raises
    ------
    ConfigError
        Naming the rule's bound, the count and what to change.
    """
    needed, bound = rule.groups_needed()
    if groups < needed:
        raise ConfigError(f"strategy '{name}' over group means: {bound}, but there are {groups} {what}; "
                          f"give at least {needed} groups, or tolerate fewer hostile groups{see}")
