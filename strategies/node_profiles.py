"""Which device profile a node has, as far as the coordinator knows: what per-profile policies read.

fedge's simulation tells the Grid each node's profile (``grid.node_profile``); a deployed
device names its profile in every train reply's meta. Until a device has replied, its
profile is unknown (``""``), and each policy says what an unknown device gets (the downlink:
the default codec; sub-models: the smallest width).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import Message

from fedge import wire


class NodeProfiles:
    """Node id -> profile name: the Grid's answer, else the profile the node named in its last reply."""

    def __init__(self) -> None:
        self.named: dict[int, str] = {}

    def of(self, node: int, grid: object) -> str:
        """The profile of ``node`` (``""`` when unknown)."""
        lookup: Any = getattr(grid, "node_profile", None)
        known = lookup(node) if callable(lookup) else None
        return str(known or self.named.get(node, ""))

    def learn(self, replies: Iterable[Message]) -> None:
        """Remember the profiles devices named in their replies."""
        for reply in replies:
            meta = None if reply.has_error() else wire.read_reply_meta_or_none(reply.content)
            if meta and meta.profile:
                self.named[reply.metadata.src_node_id] = meta.profile
