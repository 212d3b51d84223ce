"""The virtual clock: what a round would have cost on the fleet's real devices.

Each reply costs its device download + compute + upload time, from the
device's profile (bytes / bandwidth, samples processed / compute rate). A
synchronous exchange lasts as long as its slowest device. :class:`MeteredGrid`
wraps any Flower ``Grid`` (fedge's inline one, Flower's Ray engine, a
SuperLink connection) and charges each ``send_and_receive`` to the clock, so
simulated time, bytes and participants are measured the same way everywhere.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from fedge import wire
from fedge.clients.profiles import DeviceProfile, Fleet

log = logging.getLogger("fedge.simulation")


@dataclass
class RoundTraffic:
    """What one round moved and cost on the virtual clock."""

    bytes_up: int = 0
    bytes_down: int = 0
    sim_seconds: float = 0.0
    participants: Counter[str] = field(default_factory=Counter)


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
                 *, poll_interval: float | None = None) -> None:
        self.inner = inner
        self.fleet = fleet
        self.poll_interval = poll_interval
        self.fallback = fleet.profile(fallback_profile)
        self.sim_time = 0.0
        self.current = RoundTraffic()

    def take_round(self) -> RoundTraffic:
        """Return the traffic since the last call and start a new round's count."""
        done, self.current = self.current, RoundTraffic()
        return done

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send, wait as the inner grid does, then charge the exchange to the clock."""
        messages = list(messages)
        down = {m.metadata.dst_node_id: wire.payload_bytes(m.content) for m in messages}
        replies = self._exchange(messages, timeout)
        slowest = 0.0
        for reply in replies:
            node_down = down.get(reply.metadata.src_node_id, 0)
            self.current.bytes_down += node_down
            if reply.has_error():
                continue
            slowest = max(slowest, self._charge(reply.content, node_down))
        self.current.sim_seconds += slowest
        self.sim_time += slowest
        return replies

    def _exchange(self, messages: list[Message], timeout: float | None) -> list[Message]:
        """The inner grid's send_and_receive, or push + pull every ``poll_interval`` seconds.

        Flower's HTTP grid sleeps a fixed 3 s between pulls; polling the same
        push/pull API every 0.1 s returns each reply as soon as the SuperLink has it.
        """
        if self.poll_interval is None or not messages:
            return list(self.inner.send_and_receive(messages, timeout=timeout))
        waiting = set(self.inner.push_messages(messages))
        deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
        replies: list[Message] = []
        while waiting:
            arrived = list(self.inner.pull_messages(waiting))
            replies.extend(arrived)
            waiting -= {reply.metadata.reply_to_message_id for reply in arrived}
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(self.poll_interval)
        if waiting:
            log.warning("%d of %d devices did not reply within %.0f s; going on without them",
                        len(waiting), len(messages), timeout or 0)
        return replies

    def _charge(self, content: RecordDict, bytes_down: int) -> float:
        bytes_up = wire.payload_bytes(content)
        self.current.bytes_up += bytes_up
        meta = wire.reply_meta(content)
        name = str(meta.get(wire.PROFILE, "")) if meta else ""
        profile = self.fleet.profiles.get(name, self.fallback)
        samples = int(meta.get(wire.SAMPLES_PROCESSED, 0)) if meta else 0  # type: ignore[arg-type]
        if bytes_up:
            self.current.participants[profile.name] += 1
        return reply_seconds(profile, bytes_down, bytes_up, samples)

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
