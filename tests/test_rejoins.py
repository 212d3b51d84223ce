"""Issue 17: a round does not wait on a device that restarted mid-round; it sends the instruction again.

A scripted grid plays the SuperLink: which devices are online at each pull, which messages
get answered, and the "node unavailable" error it makes for an offline device.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Error, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from fedge.server.rejoins import NODE_UNAVAILABLE, REVOKED_ENV, Rejoins, revoked_nodes

CLIENT_ERROR = 2


class ScriptedLink(Grid):
    """A SuperLink in miniature. ``offline[node]`` = (first pull offline, first pull back online);
    ``dead_ids``: messages whose device took them and died; ``unavailable``: the link answers
    a dead message with NODE_UNAVAILABLE once its device is offline; ``errors``: devices whose
    app fails (error code 2)."""

    def __init__(self, offline: dict[int, tuple[int, int]], *, unavailable: bool = False,
                 errors: Iterable[int] = (), both_answer: bool = False, refused: Iterable[int] = ()) -> None:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
        self.offline, self.unavailable, self.errors = offline, unavailable, set(errors)
        self.both_answer = both_answer  # a restarted device also answers its first, undelivered message
        self.refused = set(refused)  # the link does not store messages to these (Flower returns None ids)
        self.pulls = 0
        self.pushed: list[tuple[str, int]] = []
        self.messages: dict[str, Message] = {}
        self.answered: set[str] = set()

    def is_online(self, node: int) -> bool:
        start, back = self.offline.get(node, (10**9, 10**9))
        return not start <= self.pulls < back

    def first_id(self, node: int) -> str:
        return next(message_id for message_id, to in self.pushed if to == node)

    def get_node_ids(self) -> Iterable[int]:
        return [node for node in {to for _, to in self.pushed} if self.is_online(node)]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # type: ignore[override]
        ids: list[str | None] = []
        for message in messages:
            if message.metadata.dst_node_id in self.refused:
                ids.append(None)
                continue
            message_id = f"m{len(self.pushed)}"
            self.pushed.append((message_id, message.metadata.dst_node_id))
            message.metadata.__dict__["_message_id"] = message_id
            self.messages[message_id] = message
            ids.append(message_id)
        return ids  # type: ignore[return-value]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterator[Message]:
        self.pulls += 1
        for message_id in list(message_ids):
            reply = self._answer(message_id)
            if reply is not None and message_id not in self.answered:
                self.answered.add(message_id)
                yield reply

    def _answer(self, message_id: str) -> Message | None:
        message = self.messages[message_id]
        node = message.metadata.dst_node_id
        if not self.is_online(node):
            if self.unavailable:
                return Message(Error(code=NODE_UNAVAILABLE, reason="node unavailable"), reply_to=message)
            return None
        first_session = node in self.offline and message_id == self.first_id(node)
        if first_session and not self.both_answer:
            return None  # its device took it and died: nobody will ever answer it
        if node in self.errors:
            return Message(Error(code=CLIENT_ERROR, reason="dtype error"), reply_to=message)
        return Message(RecordDict(), reply_to=message)

    # unused parts of the Grid contract
    def create_message(self, *args: Any, **kwargs: Any) -> Message:  # noqa: D102
        raise NotImplementedError

    def send_and_receive(self, *args: Any, **kwargs: Any) -> Iterable[Message]:  # noqa: D102
        raise NotImplementedError

    def set_run(self, run: Any) -> None:  # noqa: D102
        raise NotImplementedError

    @property
    def run(self) -> Any:  # noqa: D102
        raise NotImplementedError


def exchange(link: ScriptedLink, nodes: list[int], timeout: float = 30.0) -> tuple[list[Message], Rejoins, float]:
    messages = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN) for node in nodes]
    rejoins = Rejoins(link, messages, timeout, 0.0, {})
    rejoins.online_check_s, rejoins.rejoin_wait_s = 0.0, 0.2
    started = time.monotonic()
    replies = list(rejoins.replies())
    return replies, rejoins, time.monotonic() - started


def replied_nodes(link: ScriptedLink, replies: list[Message], *, errors: bool = False) -> list[int]:
    to = dict(link.pushed)
    return sorted(to[r.metadata.reply_to_message_id] for r in replies if r.has_error() == errors)


@pytest.mark.parametrize("unavailable", [False, True], ids=["seen offline", "reported unavailable"])
def test_a_device_back_after_a_restart_gets_its_instruction_again(unavailable: bool) -> None:
    # Prepare: device 12 takes its message and dies at pull 2, is offline until pull 5, then back
    link = ScriptedLink({12: (2, 5)}, unavailable=unavailable)
    # Execute
    replies, rejoins, seconds = exchange(link, [11, 12])
    # Assert: both devices replied, 12 through a second push; no waiting for the timeout
    assert replied_nodes(link, replies) == [11, 12]
    assert [to for _, to in link.pushed] == [11, 12, 12]
    assert rejoins.resent == 1
    assert seconds < 5


def test_a_device_that_stays_away_is_given_up_after_the_rejoin_wait() -> None:
    # Prepare: device 12 dies at pull 2 and never comes back; the link reports it unavailable
    link = ScriptedLink({12: (2, 10**9)}, unavailable=True)
    # Execute
    replies, rejoins, seconds = exchange(link, [11, 12], timeout=30.0)
    # Assert: 11's reply, then 12's error after the 0.2 s rejoin wait (not the 30 s timeout)
    assert replied_nodes(link, replies) == [11]
    assert replied_nodes(link, replies, errors=True) == [12]
    assert rejoins.resent == 0
    assert 0.2 <= seconds < 5


def test_an_app_error_is_passed_on_at_once() -> None:
    # Prepare: device 12 is online and its app fails
    link = ScriptedLink({}, errors=[12])
    # Execute
    replies, rejoins, _ = exchange(link, [11, 12])
    # Assert: its error reply goes to the strategy; nothing is sent again
    assert replied_nodes(link, replies, errors=True) == [12]
    assert len(link.pushed) == 2 and rejoins.resent == 0


def test_one_reply_per_device_when_both_instructions_are_answered() -> None:
    # Prepare: 12 went offline before taking its message; after the restart it answers both
    link = ScriptedLink({12: (1, 3)}, both_answer=True)
    # Execute
    replies, _, _ = exchange(link, [11, 12])
    # Assert: one reply from each device
    assert replied_nodes(link, replies) == [11, 12]


def test_an_instruction_the_link_did_not_store_is_not_waited_for() -> None:
    # Prepare: the SuperLink refuses to store device 12's message (Flower answers None for its id)
    link = ScriptedLink({}, refused=[12])
    # Execute
    replies, _, seconds = exchange(link, [11, 12], timeout=30.0)
    # Assert: 11's reply, and the exchange does not wait 30 s for 12
    assert replied_nodes(link, replies) == [11]
    assert seconds < 5


@pytest.mark.parametrize("unavailable", [False, True], ids=["seen offline", "reported unavailable"])
def test_a_device_revoked_mid_round_is_not_waited_for(unavailable: bool, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: device 12 dies at pull 2 and never comes back, and the operator revoked its key
    (tmp_path / "revoked-nodes.json").write_text(json.dumps(["12"]))
    monkeypatch.setenv(REVOKED_ENV, str(tmp_path / "revoked-nodes.json"))
    link = ScriptedLink({12: (2, 10**9)}, unavailable=unavailable)
    messages = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN) for node in (11, 12)]
    rejoins = Rejoins(link, messages, 30.0, 0.01, {})
    rejoins.online_check_s = 0.0  # rejoin_wait_s stays 30 s: only the revocation can end the wait early
    # Execute
    started = time.monotonic()
    replies = list(rejoins.replies())
    seconds = time.monotonic() - started
    # Assert: 11's reply; 12 is dropped at the first look (its node can no longer reply), not after 30 s
    assert replied_nodes(link, replies) == [11]
    assert replied_nodes(link, replies, errors=True) == []
    assert rejoins.resent == 0 and seconds < 5


@pytest.mark.parametrize(("content", "expected"), [
    ('["12", "7"]', {12, 7}),
    ("[]", set()),
    ('{"12": 1}', set()),        # not a list
    ('["x", "3"]', {3}),         # a non-id is skipped
    ("not json", set()),
])
def test_the_revoked_list_is_read_leniently(content: str, expected: set[int], tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "revoked-nodes.json"
    path.write_text(content)
    # Execute / Assert
    assert revoked_nodes(str(path)) == expected
    assert revoked_nodes(str(tmp_path / "missing.json")) == set()
