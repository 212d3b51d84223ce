"""What every round driver is, and the round report all of them fill in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fedge.strategies.validation import AcceptedUpdate, Failure, Rejection

if TYPE_CHECKING:
    from fedge.strategies.rounds import Rounds


@dataclass
class RoundReport:
    """What happened to the replies of one training round (explicit server state)."""

    server_round: int
    selected: int
    accepted: int = 0
    late: int = 0
    train_loss: float | None = None
    rejected: list[Rejection] = field(default_factory=list)
    failed: list[Rejection] = field(default_factory=list)
    aggregated: bool = False
    epsilon: float | None = None  # DP: privacy spent after this round
    inputs_raw: int = 0  # accepted updates whose device preprocessed raw inputs of its own (fedge.preprocessing)
    inputs_outside: int = 0  # ... whose device's inputs fall outside the task's declared range
    clipped_gateways: int = 0  # gateways' updates clipped to max-update-norm by the coordinator
    clipped_devices: int = 0  # devices' updates their gateways clipped to max-update-norm
    capped_devices: int = 0  # devices whose weight their gateways capped at max-device-examples
    stale_devices: int = 0  # asynchronous through gateways: device results a gateway folded in for an earlier round
    secagg_clipped_entries: int = 0  # secure aggregation: update entries the devices clipped (round total)
    secagg_clipped_devices: int = 0  # ... devices that clipped any entry
    secagg_capped_weights: int = 0  # ... devices whose weight was capped at max-num-examples
    dp_out_of_range: int = 0  # distributed DP: entries of the noised sum brought back into range
    group_norms: list[float] = field(default_factory=list)  # robust rules over groups: each group's update norm
    gateway_norms: list[float] = field(default_factory=list)  # each accepted gateway update's norm before clipping
    device_norm_medians: list[float] = field(default_factory=list)  # ... and its devices' median norm (plain rounds)
    norm_bounds: tuple[float, float] | None = None  # the device tier's bounds this round: (devices', gateways')

    def sort(self, verdict: AcceptedUpdate | Rejection) -> AcceptedUpdate | None:
        """File a reply's verdict: a failure or a rejection is kept here (and None returned); an
        accepted update is returned to be folded in (counted by the caller, who may still drop it)."""
        if isinstance(verdict, Failure):
            self.failed.append(verdict)
        elif isinstance(verdict, Rejection):
            self.rejected.append(verdict)
        else:
            return verdict
        return None


EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


class Driver(Protocol):
    """Runs rounds over a strategy's :class:`~fedge.strategies.rounds.Rounds` (see :mod:`fedge.strategies.drivers`)."""

    federated_evaluation: bool  # runs Flower's federated evaluation after its rounds
    asynchronous: bool  # folds updates trained from older models (no rounds a device waits for)

    def bind(self, rounds: Rounds) -> None:
        """Check that this driver can run ``rounds`` (their rule, their settings).

        Raises
        ------
        ConfigError
            Naming why not and what works.
        """

    def start(self, rounds: Rounds, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int, timeout: float,
              train_config: ConfigRecord, evaluate_config: ConfigRecord, evaluate_fn: EvaluateFn | None,
              start_round: int) -> Result:
        """Run rounds ``start_round..num_rounds`` (Flower's ``Strategy.start``, resumable)."""
