"""The device tier's L2 bounds on updates, round by round (``max-update-norm``, ``update-norm-bound``).

Under ``gateways = true`` each device's update is clipped at its gateway and each gateway's update
at the coordinator (norm bounding: Sun et al., "Can You Really Backdoor Federated Learning?", 2019).
A fixed bound must be guessed before the run and stays loose as updates shrink; the adaptive
clipping of Andrew et al. ("Differentially Private Learning with Adaptive Clipping", NeurIPS 2021)
makes it follow a quantile of the norms. fedge's ``median`` rule (:data:`fedge.aggregate.NORM_BOUND_RULES`)
takes the quantile 0.5 of the last round's norms before clipping directly, where fedge differs:
no DP noise guards the count here, so there is nothing to estimate privately and no learning rate.
The devices' level uses the median over gateways of each gateway's median device norm (a gateway
reports one number, not each device's norm); the gateways' level the median of their update norms,
which the coordinator measures itself. The first round uses ``max-update-norm`` at both levels.

Threat model: hostile devices and gateways report or cause the norms. A moved bound never exceeds
``max-update-norm`` when that is set (above 0): the median only tightens the operator's bound. Below
it, hostile reports fewer than half of those counted cannot raise the median above an honest
report (with exactly two reports the median is their mean: one can raise it, up to the ceiling);
they can lower it, which clips honest updates harder and slows training (counted:
``clipped_devices``, ``clipped_gateways``), not steers it. Only a plain gateway's reply may carry a
device norm median (:func:`fedge.wire.read_reply_meta` rejects it on any other); a secure pool's
gateway sees no device norms and reports none: with no plain gateway the devices' bound stays.
With ``max-update-norm = 0`` the first round is unbounded and the median sets the bounds after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from fedge.aggregate import NORM_BOUND_RULES
from fedge.errors import ConfigError
from fedge.strategies.drivers.base import RoundReport

NORM_BOUND_STATE = "norm-bound/"  # checkpoint keys: this module's state


@dataclass
class NormBounds:
    """This round's bounds (``device``: each device's update at its gateway; ``gateway``: each gateway's at
    the coordinator) and the rule that moves them after each round (explicit server state, checkpointed)."""

    rule: str
    device: float
    gateway: float
    observed: int = field(default=0)  # the last round whose norms moved the bounds
    ceiling: float = field(init=False)  # max-update-norm, when set: a moved bound never exceeds it

    def __post_init__(self) -> None:
        if self.rule not in NORM_BOUND_RULES:
            raise ConfigError(f"update-norm-bound '{self.rule}': use one of {', '.join(NORM_BOUND_RULES)}")
        self.ceiling = max(self.device, self.gateway)

    def observe(self, report: RoundReport) -> None:
        """Move the bounds by ``report``'s norms (once per round: a second call for it does nothing)."""
        if report.server_round <= self.observed:
            return
        move = NORM_BOUND_RULES[self.rule]
        self.device = self._capped(move(self.device, report.device_norm_medians))
        self.gateway = self._capped(move(self.gateway, report.gateway_norms))
        self.observed = report.server_round

    def _capped(self, bound: float) -> float:
        return min(bound, self.ceiling) if self.ceiling > 0 else bound

    def state_dict(self) -> dict[str, NDArray[np.generic]]:
        """The bounds and the round they follow, for a checkpoint."""
        return {f"{NORM_BOUND_STATE}device-level": np.array(self.device),
                f"{NORM_BOUND_STATE}gateway-level": np.array(self.gateway),
                f"{NORM_BOUND_STATE}observed": np.array(self.observed)}

    def load_state_dict(self, state: dict[str, NDArray[np.generic]]) -> None:
        """Restore :meth:`state_dict` (a checkpoint without it, made with fixed bounds, keeps these)."""
        if f"{NORM_BOUND_STATE}device-level" in state:
            self.device = float(state[f"{NORM_BOUND_STATE}device-level"])
            self.gateway = float(state[f"{NORM_BOUND_STATE}gateway-level"])
            self.observed = int(state[f"{NORM_BOUND_STATE}observed"])
