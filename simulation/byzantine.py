"""Byzantine devices for simulation: honest training, then a corrupted update.

Attacks on the update delta ``d = local - global``, with ``s = attack-scale``:
``sign-flip`` sends ``global - s d`` and ``scale`` sends ``global + s d``
(``scale`` with s = 100 is the classic x100 attack; Blanchard et al. 2017;
Fang et al., USENIX Security 2020). The corrupted update is well-formed (finite,
right shapes), so validation passes it and only robust aggregation can help.
"""

from __future__ import annotations

import math

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

from fedge import wire

ATTACK_SIGN = {"sign-flip": -1.0, "scale": 1.0}


def byzantine_partitions(num_nodes: int, fraction: float, seed: int) -> set[int]:
    """``round(fraction * num_nodes)`` partition ids, chosen reproducibly."""
    count = int(math.floor(fraction * num_nodes + 0.5))
    return {int(i) for i in np.random.default_rng(seed + 7).permutation(num_nodes)[:count]}


def make_byzantine_client_app(honest: ClientApp, bad: set[int], attack: str, scale: float) -> ClientApp:
    """Wrap ``honest``: partitions in ``bad`` corrupt their train replies with ``attack``."""
    factor = ATTACK_SIGN[attack] * scale
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        start = {name: array.numpy() for name, array in msg.content.array_records[wire.ARRAYS].items()}
        reply = honest(msg, context)
        if int(context.node_config.get("partition-id", -1)) not in bad or reply.has_error():
            return reply
        local = reply.content.array_records[wire.ARRAYS]
        corrupted = {}
        for name, array in local.items():
            value = array.numpy()
            corrupted[name] = Array((start[name] + factor * (value - start[name])).astype(value.dtype))
        reply.content[wire.ARRAYS] = ArrayRecord(corrupted)
        return reply

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return honest(msg, context)

    return app
