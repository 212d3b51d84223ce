"""Width-scaled sub-models in a strategy's rounds: who trains which window of the global model.

The math is in :mod:`fedge.submodels` (windows, the per-entry mean); this is its plumbing. A
strategy given :class:`SubModels` sends each device the window of the global model its
profile's width holds (on the downlink, and as what its reply is checked against), and its
linear rule averages each entry over the devices that held it
(:class:`fedge.submodels.CoverageMean`). Which window a width takes in a round is the run's
*extraction*, a registry (:func:`register_extraction`):

* ``heterofl``: HeteroFL's leading channels (Diao, Ding and Tarokh, ICLR 2021);
* ``fedrolex``: FedRolex's rolling window (Alam et al., NeurIPS 2022): ``fedrolex-stride`` units a
  round, 1 as in the paper; 0 moves it by its own length, so every entry is trained within
  ``ceil(1 / r)`` rounds;
* ``smallest``: every device trains the fleet's smallest width (leading channels): the fleet
  cut down to the model its smallest device can train;
* ``exclude``: devices too small for the whole model sit out (what a fleet does without sub-models).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from fedge import wire
from fedge.errors import ConfigError
from fedge.strategies.node_profiles import NodeProfiles
from fedge.submodels import Offset, WidthPlan, Window, rolling_offset

log = logging.getLogger("fedge.strategies.submodels")

MODEL_WIDTH = wire.MODEL_WIDTH  # the width of the sub-model an instruction carries (the arrays' shapes say it too)


@dataclass(frozen=True)
class Extraction:
    """How a run gives devices their windows.

    Attributes
    ----------
    name : str
        Its ``sub-models`` value.
    offset : Callable[[Fraction, int, int], Offset]
        The window's start for a width in a round, given the run's ``fedrolex-stride``.
    fleet_width : Callable[[Fraction | None, Fraction], Fraction | None]
        The width a profile trains from the one it can hold and the fleet's smallest (None: it sits out).
    unknown_width : Callable[[Fraction], Fraction]
        The width a device whose profile is not known yet trains, from the fleet's smallest
        (default: the smallest, which fits any of the fleet's devices).
    """

    name: str
    offset: Callable[[Fraction, int, int], Offset]
    fleet_width: Callable[[Fraction | None, Fraction], Fraction | None]
    unknown_width: Callable[[Fraction], Fraction] = lambda smallest: smallest


EXTRACTIONS: dict[str, Extraction] = {}


def register_extraction(extraction: Extraction) -> Extraction:
    """Make ``extraction`` a ``sub-models`` value."""
    EXTRACTIONS[extraction.name] = extraction
    return extraction


def _leading(width: Fraction, server_round: int, stride: int) -> Offset:
    return Offset()


def _own(width: Fraction | None, smallest: Fraction) -> Fraction | None:
    return width


register_extraction(Extraction("heterofl", _leading, _own))
register_extraction(Extraction("fedrolex", rolling_offset, _own))
register_extraction(Extraction("smallest", _leading, lambda width, smallest: None if width is None else smallest))
# `exclude`: a device not known yet is sent the whole model, as without sub-models (else it would never reply,
# and never name its profile); once it has, a device too small for the model sits out
register_extraction(Extraction("exclude", _leading, lambda width, smallest: width if width == 1 else None,
                               lambda smallest: Fraction(1)))


def extraction(name: str) -> Extraction:
    """The extraction registered as ``name``.

    Raises
    ------
    ConfigError
        Naming the registered ones.
    """
    if name not in EXTRACTIONS:
        raise ConfigError(f"sub-models = {name!r} is not registered; use off or one of: {', '.join(EXTRACTIONS)}")
    return EXTRACTIONS[name]


class SubModels:
    """Each device's window of the global model, per round.

    Parameters
    ----------
    plan : WidthPlan
        Which axes of the model's arrays scale.
    widths : Mapping[str, float | None]
        The width each profile can hold (None: not even the smallest one fits).
    extraction : Extraction
        How widths and windows are chosen (``heterofl``, ``fedrolex``, ...).
    profiles : NodeProfiles, optional
        Who has which profile. A device whose profile is not known yet (a deployed device
        before its first reply, or one naming a profile the fleet does not have) gets the
        fleet's smallest width, a guess that fits it (``exclude``: the whole model).
    scaler : bool
        Whether devices train and evaluate their sub-models with HeteroFL's scaler
        (:func:`fedge.task.submodels.add_scaler`; the instruction says so).
    stride : int
        ``fedrolex-stride``: units a rolling window moves each round (0: its own length).
    """

    def __init__(self, plan: WidthPlan, widths: Mapping[str, float | None], extraction: Extraction,
                 profiles: NodeProfiles | None = None, *, scaler: bool = False, stride: int = 1) -> None:
        held = {name: None if width is None else plan.check_width(width) for name, width in widths.items()}
        known = [width for width in held.values() if width is not None]
        if not known:
            raise ConfigError("sub-models: no profile of the fleet can train even the smallest width; give the "
                              "profiles model-width or more memory-mb")
        self.plan, self.extraction, self.scaler, self.stride = plan, extraction, scaler, stride
        self.smallest = min(known)
        self.widths = {name: extraction.fleet_width(width, self.smallest) for name, width in held.items()}
        self.profiles = profiles or NodeProfiles()
        self.windows: dict[int, Window] = {}  # this round's training windows, by node
        self._sent: dict[tuple[int, Fraction, Offset], tuple[ArrayRecord, ArrayRecord]] = {}
        self._sent_to: dict[int, ArrayRecord] = {}
        self.training_graphs: dict[Fraction, str] = {}  # each width's training graph (onnx devices), by width
        self._round = 0

    def width_of(self, node: int, grid: object) -> Fraction | None:
        """The width ``node`` trains (None: it sits out)."""
        profile = self.profiles.of(node, grid)
        if profile not in self.widths:
            return self.extraction.unknown_width(self.smallest)
        return self.widths[profile]

    def eligible(self, nodes: Iterable[int], grid: object) -> list[int]:
        """The nodes that train at some width (``exclude``: the ones that hold the whole model)."""
        return [node for node in nodes if self.width_of(node, grid) is not None]

    def begin_round(self, server_round: int) -> None:
        """Forget the previous round's windows and sent sub-models."""
        if server_round != self._round:
            self._round, self.windows, self._sent, self._sent_to = server_round, {}, {}, {}

    def window_of(self, node: int, grid: object, server_round: int) -> Window:
        """``node``'s window in ``server_round``."""
        width = self.width_of(node, grid)
        if width is None:
            raise ConfigError(f"node {node} sits out under sub-models = {self.extraction.name}: it was not selectable")
        return self.plan.window(width, self.extraction.offset(width, server_round, self.stride))

    def record_for(self, node: int, record: RecordDict, grid: object, server_round: int, *,
                   train: bool = True) -> RecordDict:
        """``record`` with its arrays cut to ``node``'s window and the instruction naming the width.

        A train instruction's window and sub-model are remembered: the reply is checked
        against the sub-model and folded into the entries of the window.
        """
        self.begin_round(server_round)
        window = self.window_of(node, grid, server_round)
        arrays = self.sub_arrays(record.array_records[wire.ARRAYS], window)
        if train:
            self.windows[node], self._sent_to[node] = window, arrays
        config = ConfigRecord({**record.config_records[wire.CONFIG], MODEL_WIDTH: float(window.width)})
        if self.scaler and not window.full:
            config[wire.MODEL_SCALER] = True
        if window.width in self.training_graphs and wire.TRAINING_GRAPH in config:  # onnx devices: this width's graph
            config[wire.TRAINING_GRAPH] = self.training_graphs[window.width]
        return RecordDict({wire.ARRAYS: arrays, wire.CONFIG: config})

    def sub_arrays(self, arrays: ArrayRecord, window: Window) -> ArrayRecord:
        """The window's part of ``arrays``, cut once per model, width and offset a round."""
        if window.full:
            return arrays
        key = (id(arrays), window.width, window.offset)
        if key not in self._sent:
            numpy = {name: array.numpy() for name, array in arrays.items()}
            cut = ArrayRecord({name: Array(value) for name, value in window.take(numpy).items()})
            self._sent[key] = (arrays, cut)  # the source is held so that its id stays its own
        return self._sent[key][1]

    def reference_of(self, node: int) -> ArrayRecord | None:
        """What ``node``'s reply is checked against: the sub-model it was sent to train (None: the whole model)."""
        window = self.windows.get(node)
        return None if window is None or window.full else self._sent_to.get(node)

    def learn(self, replies: Iterable[Message]) -> None:
        """Remember the profiles devices named."""
        self.profiles.learn(replies)

    def describe(self) -> str:
        """``heterofl: phone 1/4, laptop 1/2, gpu-box 1`` (profiles that sit out: ``-``)."""
        shown = ", ".join(f"{name} {'-' if width is None else width}" for name, width in self.widths.items())
        return f"{self.extraction.name}: {shown}"
