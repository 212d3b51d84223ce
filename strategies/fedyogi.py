"""FedYogi."""

from __future__ import annotations

from fedge.strategies.fedadam import FedAdam
from fedge.strategies.registry import register


@register("fedyogi", options=lambda c, n: {"server_learning_rate": float(c["adaptive-learning-rate"])})
class FedYogi(FedAdam):
    """FedYogi (Reddi et al., ICLR 2021): FedAdam with Yogi's additive second-moment update,
    which grows ``v`` more slowly when gradients are sparse or noisy."""

    rule = "yogi"
