"""Coordinator side of fedge's secure aggregation: SecAgg+ over Flower's Message API.

Flower 1.42's SecAgg+ runs only through its legacy workflow (it cannot drive the
Message-API strategies fedge uses) and expands masks from a seed folded to 32 bits,
so fedge runs its own four steps (``train.secagg_setup|share|masked|unmask`` actions of
the same ClientApp), with the math in :mod:`fedge.secagg`. The coordinator relays public
keys and sealed shares, sums masked vectors, asks survivors for exactly the shares the
protocol allows, removes the masks and applies ``sum(w * delta) / sum(w)`` to the model.

Threat model: see :mod:`fedge.secagg`. Individual updates are never visible here, so
per-update validation (NaN, shapes) is replaced by checks on the decoded aggregate;
median, trimmed mean and Krum cannot be combined with it (refused at start).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedge.secagg import FixedPoint, derive, neighbour_graph, rebuild_secret, unmask
from fedge.server.validation import Rejection
from fedge.strategies.fedavg import FedAvg, RoundReport

log = logging.getLogger("fedge.server.secure")

ACTIONS = ("secagg_setup", "secagg_share", "secagg_masked", "secagg_unmask")


class SecureFedAvg(FedAvg):
    """FedAvg whose rounds run the secure-aggregation protocol.

    Parameters
    ----------
    threshold : float
        Shares needed to rebuild a secret, as a fraction of a device's neighbours (ceil).
    neighbours : int
        Neighbours per device (0: all pairs; SecAgg+ uses O(log n)).
    clip : float
        Largest ``|w * delta|`` (and weight ``w``) a device may contribute.
    """

    def __init__(self, *, threshold: float = 0.5, neighbours: int = 0, clip: float = 10_000.0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.threshold_fraction, self.neighbours, self.clip = threshold, neighbours, clip

    def train_round(
        self, grid: Grid, server_round: int, arrays: ArrayRecord, config: ConfigRecord, timeout: float
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The four protocol steps; the model changes only if enough devices finish them."""
        self.global_arrays = arrays
        selected = self.select_nodes(server_round, grid)
        report = RoundReport(server_round=server_round, selected=len(selected))
        self.reports.append(report)
        scale = math.floor((2**31 - 1) / (max(len(selected), 1) * self.clip))
        try:
            total, survivors = self._protocol(grid, server_round, arrays, config, timeout, selected, scale, report)
        except _RoundFailed as exc:
            log.warning("round %d: secure aggregation failed (%s); global model kept", server_round, exc)
            return None, MetricRecord({"accepted": 0, "failed": len(report.failed)})
        decoded = FixedPoint(self.clip, float(scale)).decode_sum(total, len(survivors))
        weight = float(decoded[-1])
        if not np.all(np.isfinite(decoded)) or weight <= 0:
            return None, MetricRecord({"accepted": 0, "failed": len(report.failed)})
        report.accepted, report.aggregated = len(survivors), True
        return self._apply(arrays, decoded[:-1] / weight), MetricRecord(
            {"accepted": len(survivors), "failed": len(report.failed), "weight": weight})

    def _protocol(self, grid: Grid, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                  timeout: float, selected: list[int], scale: int, report: RoundReport) -> tuple[Any, list[int]]:
        keys = self._step(grid, "secagg_setup", {n: RecordDict({"config": ConfigRecord(
            {"server-round": server_round})}) for n in selected}, timeout, report)
        alive = [n for n, reply in keys.items() if _has_keys(reply)]
        graph = neighbour_graph(alive, self.neighbours or len(alive), seed=self.selector.seed + server_round)
        threshold = self._threshold(graph)
        peers = {n: RecordDict({"peers": _peer_record(keys, graph[n], server_round, threshold)}) for n in alive}
        sealed = self._step(grid, "secagg_share", peers, timeout, report)
        shared = [n for n in alive if n in sealed]
        inboxes = {n: ConfigRecord({f"from/{p}": sealed[p].content.config_records["sealed"][f"to/{n}"]
                                    for p in graph[n] if p in sealed}) for n in shared}
        params = ConfigRecord({"clip": self.clip, "scale": float(scale)})
        masked = self._step(grid, "secagg_masked", {n: RecordDict({
            "arrays": arrays, "config": ConfigRecord({**config, "server-round": server_round}),
            "inbox": inboxes[n], "secagg": params}) for n in shared}, timeout, report)
        length = sum(int(np.prod(a.shape)) for a in arrays.values()) + 1
        survivors = [n for n in shared if n in masked and _vector(masked[n], length) is not None]
        if len(survivors) < max(threshold, self.min_train_replies):
            raise _RoundFailed(f"{len(survivors)} devices sent masked inputs, need {threshold}")
        dropped = [n for n in shared if n not in survivors]
        ask = ConfigRecord({"survivors": survivors, "dropped": dropped or [0]})
        revealed = self._step(grid, "secagg_unmask", {n: RecordDict({"ask": ask}) for n in survivors},
                              timeout, report)
        total = np.zeros(length, np.uint32)
        for n in survivors:
            total = (total + _vector(masked[n], length)).astype(np.uint32)  # type: ignore[operator]
        seeds = [self._rebuild(revealed, f"b/{u}", threshold, u) for u in survivors]
        leftovers: list[tuple[int, int, bytes]] = []
        for gone in dropped:
            private = X25519PrivateKey.from_private_bytes(self._rebuild(revealed, f"s/{gone}", threshold, gone))
            for v in graph[gone] & set(survivors):
                public = bytes(keys[v].content.config_records["keys"]["s-pk"])  # type: ignore[arg-type]
                leftovers.append((v, gone, derive(private, public, "mask", str(server_round).encode())))
        return unmask(total, seeds, leftovers), survivors

    def _step(self, grid: Grid, action: str, contents: dict[int, RecordDict], timeout: float,
              report: RoundReport) -> dict[int, Message]:
        messages = [Message(content, dst_node_id=node, message_type=f"{MessageType.TRAIN}.{action}")
                    for node, content in contents.items()]
        replies = {}
        for reply in grid.send_and_receive(messages, timeout=timeout):
            if reply.has_error():
                report.failed.append(Rejection(reply.metadata.src_node_id, f"{action}: {reply.error.reason}"))
            else:
                replies[reply.metadata.src_node_id] = reply
        return replies

    def _threshold(self, graph: dict[int, set[int]]) -> int:
        smallest = min((len(peers) for peers in graph.values()), default=0)
        if smallest == 0:
            raise _RoundFailed("too few devices to share secrets")
        return max(1, math.ceil(self.threshold_fraction * smallest))

    @staticmethod
    def _rebuild(revealed: dict[int, Message], name: str, threshold: int, owner: int) -> bytes:
        shares = [bytes(reply.content.config_records["revealed"][name]) for reply in revealed.values()  # type: ignore[arg-type]
                  if name in reply.content.config_records["revealed"]]
        if len(shares) < threshold:
            raise _RoundFailed(f"only {len(shares)} of {threshold} shares to unmask device {owner}")
        return rebuild_secret(shares[:threshold])

    def _apply(self, arrays: ArrayRecord, delta: np.ndarray) -> ArrayRecord:
        new, offset = {}, 0
        for name in sorted(arrays):
            current = arrays[name].numpy()
            size = current.size
            new[name] = Array((current + delta[offset:offset + size].reshape(current.shape)).astype(current.dtype))
            offset += size
        return ArrayRecord({name: new[name] for name in arrays})


class _RoundFailed(Exception):
    pass


def _peer_record(keys: dict[int, Message], neighbours: set[int], server_round: int, threshold: int) -> ConfigRecord:
    """What one device needs for the share step: its neighbours and their public keys."""
    record = ConfigRecord({"server-round": server_round, "threshold": threshold, "neighbours": sorted(neighbours)})
    for peer in neighbours:
        for kind in ("c-pk", "s-pk"):
            record[f"{kind}/{peer}"] = keys[peer].content.config_records["keys"][kind]
    return record


def _has_keys(reply: Message) -> bool:
    keys = reply.content.config_records.get("keys")
    return keys is not None and all(isinstance(keys.get(k), bytes) and len(keys[k]) == 32  # type: ignore[arg-type]
                                    for k in ("c-pk", "s-pk"))


def _vector(reply: Message, length: int) -> np.ndarray | None:
    record = reply.content.array_records.get("masked")
    if record is None or "vector" not in record:
        return None
    try:
        vector = record["vector"].numpy()
    except Exception:  # noqa: BLE001 - malformed bytes from a device
        return None
    return vector if vector.dtype == np.uint32 and vector.shape == (length,) else None
