"""Collect a round's replies from real devices, and resend to a device that restarted.

A SuperNode pulls its instruction, and if the device dies after that, the SuperLink
still holds the message as delivered. Once the device's session expires the SuperLink
answers for it with an error ("node unavailable"); if the device restarts and activates
again (a device keeps its node id: it is bound to the device's registered key), nothing
will ever answer the message its previous session took, and a synchronous round would
wait for it until the round timeout. Flower's Grid has no notion of this, so it is
handled here: the exchange watches which of its devices are online, and when a device
it is waiting on was offline and is back (or the SuperLink reported it unavailable),
it pushes the same instruction again and waits for that reply instead.

A device that went away and does not come back within :attr:`Rejoins.rejoin_wait_s`
(or the round's timeout, whichever ends first) is given up on: its error reply is
passed on, and the round goes on without it. A device whose key the operator revoked
will not come back: the coordinator lists revoked node ids in the file named by
``FEDGE_REVOKED_NODES``, and the exchange stops waiting for those at its next look.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from flwr.app import Message
from flwr.serverapp import Grid

log = logging.getLogger("fedge.server")

NODE_UNAVAILABLE = 5  # Flower's ErrorCode.NODE_UNAVAILABLE: the SuperLink answered for an offline node
REVOKED_ENV = "FEDGE_REVOKED_NODES"  # the coordinator's list of revoked node ids (a JSON list of strings)


def revoked_nodes(path: str | None = None) -> set[int]:
    """Node ids whose key the operator revoked, from ``path`` (default: ``$FEDGE_REVOKED_NODES``; none: empty)."""
    path = path if path is not None else os.environ.get(REVOKED_ENV)
    if not path:
        return set()
    try:
        listed = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    return {int(node) for node in listed if str(node).isdigit()} if isinstance(listed, list) else set()


@dataclass
class _Waiting:
    """One device the exchange still waits on."""

    message: Message  # the instruction, to send again after a restart
    ids: set[str] = field(default_factory=set)  # every message id sent to it this exchange
    offline_since: float | None = None  # when it was last seen offline (or reported unavailable)
    error: Message | None = None  # the SuperLink's "unavailable" answer, passed on if it never returns


class Rejoins:
    """Push ``messages``, then pull every ``poll_s`` seconds until all replied or time is up.

    Parameters
    ----------
    grid : Grid
        The Flower grid (a SuperLink connection, or Flower's simulation engine).
    messages : list of Message
        One instruction per device.
    timeout : float or None
        The round's limit in seconds (``None``: none).
    poll_s : float
        Seconds between pulls.
    sent_to : dict
        Filled with every message id sent and its device's node id.
    """

    rejoin_wait_s = 30.0  # how long a device that went away gets to come back within a round
    online_check_s = 2.0  # how often the online devices are listed while waiting (O(fleet) a listing)

    def __init__(self, grid: Grid, messages: list[Message], timeout: float | None, poll_s: float,
                 sent_to: dict[str, int]) -> None:
        self.grid, self.poll_s, self.sent_to = grid, poll_s, sent_to
        self.deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
        self.timeout = timeout
        self.count = len(messages)
        self.waiting: dict[int, _Waiting] = {m.metadata.dst_node_id: _Waiting(m) for m in messages}
        self.resent = 0
        self._push(messages)

    def _push(self, messages: list[Message]) -> None:
        ids = list(self.grid.push_messages(messages))
        for index, message in enumerate(messages):
            node = message.metadata.dst_node_id
            message_id = ids[index] if index < len(ids) else None
            if not message_id:  # the link did not store it (Flower then returns fewer ids, or None)
                log.warning("node %d: the coordinator's SuperLink did not take its instruction", node)
                continue
            self.sent_to[message_id] = node
            self.waiting[node].ids.add(message_id)
        for node in [node for node, entry in self.waiting.items() if not entry.ids and entry.error is None]:
            del self.waiting[node]  # nothing of it is on its way: no reply will come

    def replies(self) -> Iterator[Message]:
        """Each device's reply (or its final error) as soon as it is pulled."""
        next_check = time.monotonic() + self.online_check_s
        while self.waiting:
            arrived = deque(self.grid.pull_messages(self._ids()))
            while arrived:  # popped, so a reply folded in is not held here while the next one is
                if (passed := self._take(arrived.popleft())) is not None:
                    yield passed
            now = time.monotonic()
            if now >= next_check:
                self._watch_online(now)
                yield from self._revoked()
                next_check = now + self.online_check_s
            yield from self._given_up(now)
            if not self.waiting or now >= self.deadline:
                break
            time.sleep(self.poll_s)
        if self.waiting:
            log.warning("%d of %d devices did not reply within %.0f s; going on without them",
                        len(self.waiting), self.count, self.timeout or 0)
            yield from (entry.error for entry in self.waiting.values() if entry.error is not None)

    def _ids(self) -> set[str]:
        return {message_id for entry in self.waiting.values() for message_id in entry.ids}

    def _take(self, reply: Message) -> Message | None:
        """The reply to pass on, or ``None`` while its device may still come back."""
        node = self.sent_to.get(reply.metadata.reply_to_message_id)
        entry = self.waiting.get(node) if node is not None else None
        if entry is None:
            return None  # an answer to an instruction superseded by a resend
        entry.ids.discard(reply.metadata.reply_to_message_id)
        if reply.has_error() and reply.error.code == NODE_UNAVAILABLE:
            if not entry.ids:  # nothing else outstanding for it: wait for it to come back
                entry.offline_since = entry.offline_since or time.monotonic()
                entry.error = reply
            return None
        del self.waiting[node]  # type: ignore[arg-type]
        return reply

    def _watch_online(self, now: float) -> None:
        """Note devices that went offline; resend to those that are back."""
        online = set(self.grid.get_node_ids())
        back = []
        for node, entry in self.waiting.items():
            if node not in online:
                entry.offline_since = entry.offline_since or now
            elif entry.offline_since is not None:
                back.append(node)
        for node in back:
            entry = self.waiting[node]
            log.warning("node %d went away mid-round and is back (restarted?); sending its instruction again", node)
            entry.offline_since, entry.error = None, None
            self.resent += 1
            self._push([_again(entry.message)])

    def _revoked(self) -> Iterator[Message]:
        """Stop waiting for devices whose key was revoked mid-round (their error reply, if any, is passed on)."""
        for node in revoked_nodes() & set(self.waiting):
            entry = self.waiting.pop(node)
            log.warning("node %d's key was revoked mid-round; going on without it", node)
            if entry.error is not None:
                yield entry.error

    def _given_up(self, now: float) -> Iterator[Message]:
        """Error replies of devices that stayed away longer than :attr:`rejoin_wait_s`."""
        gone = [node for node, entry in self.waiting.items()
                if entry.offline_since is not None and entry.error is not None
                and now - entry.offline_since >= self.rejoin_wait_s]
        for node in gone:
            entry = self.waiting.pop(node)
            assert entry.error is not None
            yield entry.error


def _again(message: Message) -> Message:
    """A new message with ``message``'s content and destination (a message id is sent once)."""
    return Message(message.content, dst_node_id=message.metadata.dst_node_id,
                   message_type=message.metadata.message_type, group_id=message.metadata.group_id)
