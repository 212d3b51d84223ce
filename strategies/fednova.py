"""FedNova."""

from __future__ import annotations

from typing import Any

from fedge import knobs
from fedge.aggregate import FedNovaAccumulator, fednova_norm
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.registry import register
from fedge.strategies.rule import Arrays, LinearRule, RoundContext, Update


class NormalisedMean(LinearRule):
    """FedNova's normalised averaging (Wang et al., NeurIPS 2020), streaming.

    Each device's change is divided by ``a_i`` (its local steps, adjusted for momentum) and
    the mean change rescaled by the weighted mean ``a``. Linear in ``(w * delta / a, w, w * a)``:
    secure aggregation masks those three (:attr:`work_momentum` tells devices ``a_i``'s momentum).
    """

    needs_global_model = True  # steps from the global model configure_train sent
    takes_stale_updates = False  # normalises by local steps, which asynchronous arrivals do not carry
    hierarchical = False  # normalises each device's steps, which a gateway's mean does not carry
    takes_sub_models = False  # its normalised sums are whole-model; a per-entry version is not written

    def __init__(self, *, local_momentum: float = 0.0) -> None:
        super().__init__()
        self.work_momentum = local_momentum

    def begin(self, context: RoundContext) -> None:  # noqa: D102
        super().begin(context)
        self.normalised: FedNovaAccumulator | None = None

    def fold(self, update: Update) -> None:
        """Add ``update``'s change normalised by its local work (steps checked by validation)."""
        if self.normalised is None:
            self.normalised = FedNovaAccumulator(self.context.global_numpy())
        steps = update.steps if update.steps is not None else 1
        self.normalised.add(update.arrays, update.weight, fednova_norm(steps, self.work_momentum or 0.0))

    def result(self) -> Arrays | None:  # noqa: D102
        if self.normalised is None or not self.normalised.count:
            return None
        return self.step(self.normalised.result())


@register("fednova", options=lambda c, n: {"local_momentum": float(c[knobs.MOMENTUM])})
class FedNova(FedAvg):
    """FedNova (Wang et al., NeurIPS 2020): normalise each update by its local work.

    Devices that ran more local steps move further; FedAvg then biases the model
    toward them. FedNova divides each device's change by ``a_i`` (its number of
    local steps, adjusted for momentum) and rescales by the weighted mean ``a``, so
    the objective stays the weighted sum of local objectives. Devices report their
    steps in fedge's reply meta (``steps``). :class:`FedAvg` with the :class:`NormalisedMean` rule.

    Parameters
    ----------
    local_momentum : float
        The devices' SGD momentum (enters ``a_i``).
    """

    def __init__(self, *, local_momentum: float = 0.0, **kwargs: Any) -> None:
        super().__init__(rule=NormalisedMean(local_momentum=local_momentum), **kwargs)
        self.local_momentum = local_momentum
