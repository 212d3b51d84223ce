"""The virtual clock: what a round would have cost on the fleet's real devices.

Each reply costs its device download + compute + upload time, from the
device's profile (bytes / bandwidth, samples processed / compute rate). A
synchronous exchange lasts as long as its slowest device. :class:`MeteredGrid`
wraps any Flower ``Grid`` (fedge's inline one, Flower's Ray engine, a
SuperLink connection) and charges each ``send_and_receive`` to the clock, so
simulated time, bytes and participants are measured the same way everywhere.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from fedge import wire
from fedge.behaviour import Behaviour
from fedge.errors import UpdateRejected
from fedge.profiles import DeviceProfile, Fleet
from fedge.server.rejoins import Rejoins


@dataclass
class RoundTraffic:
    """What one round moved and cost on the virtual clock."""

    bytes_up: int = 0
    bytes_down: int = 0
    sim_seconds: float = 0.0
    participants: Counter[str] = field(default_factory=Counter)
    bytes_up_by_profile: Counter[str] = field(default_factory=Counter)
    bytes_down_by_profile: Counter[str] = field(default_factory=Counter)
    replies: list[dict[str, object]] = field(default_factory=list)  # one per training reply or device error


def reply_seconds(profile: DeviceProfile, bytes_down: int, bytes_up: int, samples: int) -> float:
    """Virtual seconds for one device to download, train on ``samples`` and upload."""
    return (profile.download_seconds(bytes_down) + profile.compute_seconds(samples)
            + profile.upload_seconds(bytes_up))


class MeteredGrid(Grid):
    """A ``Grid`` wrapper that charges every exchange to a virtual clock.

    Parameters
    ----------
    inner : Grid
        The grid that really moves the messages.
    fleet : Fleet
        Profiles to look devices up in (devices name theirs in each reply).
    fallback_profile : str
        Used for replies that name no known profile.
    """

    def __init__(self, inner: Grid, fleet: Fleet, fallback_profile: str = "laptop",
                 *, poll_interval: float | None = None, behaviour: Behaviour | None = None) -> None:
        self.inner = inner
        self.fleet = fleet
        self.poll_interval = poll_interval
        self.behaviour = behaviour
        self.fallback = fleet.profile(fallback_profile)
        self.sim_time = 0.0
        self.exchanges = 0
        self.last_durations: dict[int, float] = {}
        self.current = RoundTraffic()
        attach = getattr(inner, "attach_clock", None)
        if callable(attach):  # simulated devices go on- and offline on this clock
            attach(lambda: self.sim_time)

    @property
    def virtual(self) -> bool:
        """Whether the inner grid runs devices in-process, so time is the virtual clock's."""
        return bool(getattr(self.inner, "synchronous", False))

    def count_bytes(self, *, up: int = 0, down: int = 0) -> None:
        """Charge traffic that went through the inner grid's push/pull without this wrapper."""
        self.current.bytes_up += up
        self.current.bytes_down += down

    def take_round(self) -> RoundTraffic:
        """Return the traffic since the last call and start a new round's count."""
        done, self.current = self.current, RoundTraffic()
        return done

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """A synchronous exchange: it lasts until the slowest device replies.

        A selected device that never replies (it dropped out) keeps a synchronous
        server waiting until ``timeout``, so the exchange is charged ``timeout``.
        """
        messages = list(messages)
        timed = self.exchange_timed(messages, timeout)
        slowest = max((arrival for _, arrival in timed), default=0.0)
        if len(timed) < len(messages) and timeout is not None:
            slowest = max(slowest, timeout)
        self.advance(slowest)
        replies = [reply for reply, _ in timed]
        self.count_participants(replies)
        return replies

    def exchange_timed(self, messages: list[Message], timeout: float | None) -> list[tuple[Message, float]]:
        """Send and collect replies with each one's simulated arrival time; charges bytes, not time."""
        return list(self.stream_timed(messages, timeout))

    def stream_timed(self, messages: list[Message], timeout: float | None) -> Iterator[tuple[Message, float]]:
        """:meth:`exchange_timed` one reply at a time, as each arrives (or, in-process, is made).

        The caller can fold each reply into an aggregate and let it go before the next one
        exists: server memory stays O(model), not O(replies x model).
        """
        self.exchanges += 1
        down = {m.metadata.dst_node_id: wire.payload_bytes(m.content) for m in messages}
        self.last_durations = {}
        sent_to: dict[str, int] = {}
        for reply in self._replies(messages, timeout, sent_to):
            node = reply.metadata.src_node_id
            if reply.has_error():  # the SuperLink answers for a node it could not reach (as node 1)
                node = sent_to.get(reply.metadata.reply_to_message_id, node)
            self.current.bytes_down += down.get(node, 0)
            seconds = 0.0 if reply.has_error() else self._charge(reply.content, down.get(node, 0), node)
            if self.behaviour is not None:
                seconds *= self.behaviour.slowdown(node, self.exchanges)
            self._note(reply, node, seconds)
            self.last_durations[node] = seconds
            yield reply, seconds

    def _note(self, reply: Message, node: int, seconds: float) -> None:
        """Remember who replied how (the dashboard's device list is built from these)."""
        if reply.has_error():
            self.current.replies.append({"node": node, "profile": str(self.node_profile(node) or ""),
                                         "status": "error", "reason": str(reply.error.reason)[:200]})
            return
        if wire.reply_meta(reply.content) is None:  # a protocol step (secure aggregation's keys, shares)
            return
        try:
            meta = wire.read_reply_meta(reply.content)
        except UpdateRejected as exc:
            self.current.replies.append({"node": node, "profile": str(self.node_profile(node) or ""),
                                         "status": "rejected", "reason": exc.reason[:200]})
            return
        self.current.replies.append({"node": node, "profile": (meta.profile if meta else None) or "",
                                     "status": "ok", "reply_s": round(seconds, 4)})

    def count_participants(self, replies: list[Message]) -> None:
        """Count the replies a round keeps, per profile (training replies: those with reply meta)."""
        for reply in replies:
            meta = None if reply.has_error() else wire.read_reply_meta_or_none(reply.content)
            if not meta or not wire.payload_bytes(reply.content):
                continue
            self.current.participants[self.fleet.profiles.get(meta.profile or "", self.fallback).name] += 1

    def advance(self, seconds: float) -> None:
        """Move the clock on by ``seconds`` (the duration of an exchange)."""
        self.current.sim_seconds += seconds
        self.sim_time += seconds

    def _replies(self, messages: list[Message], timeout: float | None, sent_to: dict[str, int]) -> Iterator[Message]:
        """The inner grid's replies, one at a time; ``sent_to`` learns each message id's node.

        In-process (the inline grid) each reply is made as it is pulled. Otherwise this
        pushes and then pulls every ``poll_interval`` seconds (Flower's own grid sleeps a
        fixed 3 s between pulls and returns only once every reply is in), and a device that
        restarts mid-round gets its instruction again (:class:`Rejoins`).
        """
        if not messages:
            return
        if self.virtual:  # one id a pull: each device works when its reply is taken, one at a time
            ids = list(self.inner.push_messages(messages))
            sent_to.update(zip(ids, (m.metadata.dst_node_id for m in messages)))  # noqa: B905 - a push may store fewer
            for message_id in ids:
                yield from self.inner.pull_messages([message_id])
            return
        if self.poll_interval is None:
            replies = list(self.inner.send_and_receive(messages, timeout=timeout))
            sent_to.update((m.metadata.message_id, m.metadata.dst_node_id) for m in messages)
            yield from replies
            return
        yield from Rejoins(self.inner, messages, timeout, self.poll_interval, sent_to).replies()

    def _charge(self, content: RecordDict, bytes_down: int, node: int) -> float:
        bytes_up = wire.payload_bytes(content)
        self.current.bytes_up += bytes_up
        meta = wire.read_reply_meta_or_none(content)  # malformed: charged as no work, rejected by validation
        name = meta.profile if meta and meta.profile else str(self.node_profile(node) or "")
        profile = self.fleet.profiles.get(name, self.fallback)
        self.current.bytes_up_by_profile[profile.name] += bytes_up
        self.current.bytes_down_by_profile[profile.name] += bytes_down
        samples = meta.samples_processed if meta else 0
        if meta and not samples and callable(local := getattr(self.inner, "node_work", None)):
            samples = local(node) or 0  # a secure masked input: the simulated device's own note of its work
        return reply_seconds(profile, bytes_down, bytes_up, samples)

    def node_profile(self, node: int) -> str | None:
        """The inner grid's idea of ``node``'s profile, if it has one (fedge's simulation does)."""
        lookup = getattr(self.inner, "node_profile", None)
        return lookup(node) if callable(lookup) else None

    # Everything else is the inner grid's.
    def set_run(self, run: Run) -> None:  # noqa: D102
        self.inner.set_run(run)

    @property
    def run(self) -> Run:  # noqa: D102
        return self.inner.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,  # noqa: D102
                       group_id: str, ttl: float | None = None) -> Message:
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return self.inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        return self.inner.pull_messages(message_ids)
