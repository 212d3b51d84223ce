"""FedAdagrad."""

from __future__ import annotations

from typing import Any

from flwr.serverapp.strategy import FedAdagrad as FlowerFedAdagrad

from fedge import knobs
from fedge.strategies.fedadam import FedAdam
from fedge.strategies.flower_args import flower_constructor
from fedge.strategies.registry import register


@register("fedadagrad", options=lambda c, n: {"server_learning_rate": float(c[knobs.ADAPTIVE_LEARNING_RATE])})
@flower_constructor(FlowerFedAdagrad, eta="server_learning_rate")
class FedAdagrad(FedAdam):
    """FedAdagrad (Reddi et al., "Adaptive Federated Optimization", ICLR 2021).

    The server accumulates the squared pseudo-gradients (``v <- v + delta^2``) and steps by
    ``eta * delta / (sqrt(v) + tau)``: no first-moment decay (``beta_1 = 0``, as Flower's
    ``FedAdagrad``). Takes Flower's ``FedAdagrad`` call and defaults (``eta``, ``eta_l``, ``tau``).
    """

    kind = "adagrad"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(beta1=0.0, beta2=0.0, **kwargs)  # beta2 unused; Flower's FedAdagrad holds 0 too
