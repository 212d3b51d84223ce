"""FedYogi."""

from __future__ import annotations

from flwr.serverapp.strategy import FedYogi as FlowerFedYogi

from fedge import knobs
from fedge.strategies.fedadam import FedAdam
from fedge.strategies.flower_args import flower_constructor
from fedge.strategies.registry import register


@register("fedyogi", options=lambda c, n: {"server_learning_rate": float(c[knobs.ADAPTIVE_LEARNING_RATE])})
@flower_constructor(FlowerFedYogi, eta="server_learning_rate", beta_1="beta1", beta_2="beta2")
class FedYogi(FedAdam):
    """FedYogi (Reddi et al., ICLR 2021): FedAdam with Yogi's additive second-moment update,
    which grows ``v`` more slowly when gradients are sparse or noisy.

    Takes Flower's ``FedYogi`` call and defaults (``eta`` 0.01, ``eta_l`` 0.0316, ...)."""

    kind = "yogi"
