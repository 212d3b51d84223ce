"""Round policies: how long a round waits, and which replies it keeps.

* ``sync``: wait for every selected device (the baseline; a device that dropped out
  keeps the round waiting until the round timeout);
* ``deadline``: select ``ceil(over_selection * K)`` devices and aggregate the first
  K replies that arrive before ``deadline_s``; later replies are discarded and
  counted (Bonawitz et al., "Towards Federated Learning at Scale", MLSys 2019).

In simulation (a :class:`~fedge.strategies.timing.TimedGrid` on a virtual clock, such as
fedge's metering Grid over the inline grid) arrival times come from the virtual clock;
with real devices the deadline is real time.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from fedge.errors import ConfigError
from fedge.strategies.timing import TimedGrid, timed


@dataclass(frozen=True)
class Exchange:
    """The replies a round keeps, and how many arrived too late."""

    replies: list[Message]
    late: int = 0


class ReplyStream:
    """The replies a round keeps, one at a time; :attr:`late` is final once it is used up.

    Policies produce replies as the grid delivers them, so a strategy folds each into its
    aggregate and lets it go before the next exists (O(model) server memory); a
    strategy that needs every reply at once lists them (:meth:`RoundPolicy.exchange`).
    """

    def __init__(self, produce: Callable[[ReplyStream], Iterator[Message]]) -> None:
        self.late = 0
        self._replies = produce(self)

    def __iter__(self) -> Iterator[Message]:
        return self._replies


def _exchanged(stream: ReplyStream) -> Exchange:
    replies = list(stream)
    return Exchange(replies, late=stream.late)


class SyncPolicy:
    """Wait for every selected device."""

    name = "sync"

    def selection_size(self, target: int) -> int:
        """How many devices to select for ``target`` replies."""
        return target

    def exchange(self, grid: Grid, messages: list[Message], timeout: float, target: int) -> Exchange:
        """Send ``messages`` and keep every reply (all of them at once)."""
        return _exchanged(self.stream(grid, messages, timeout, target))

    def stream(self, grid: Grid, messages: list[Message], timeout: float, target: int) -> ReplyStream:
        """Send ``messages`` and keep every reply, one at a time as they arrive."""
        return ReplyStream(lambda stream: self._replies(grid, messages, timeout))

    def _replies(self, grid: Grid, messages: list[Message], timeout: float) -> Iterator[Message]:
        clock = timed(grid)
        if clock is None:  # a plain Flower Grid returns a round's replies together
            yield from grid.send_and_receive(messages, timeout=timeout)
            return
        slowest, count = 0.0, 0
        for reply, arrival in clock.stream_timed(messages, timeout):
            slowest, count = max(slowest, arrival), count + 1
            clock.count_participants([reply])
            yield reply
        if count < len(messages):  # a device that never replied kept the round waiting until the timeout
            slowest = max(slowest, timeout)
        clock.advance(slowest)


class DeadlinePolicy:
    """Over-select, keep the first ``target`` on-time replies.

    Parameters
    ----------
    deadline_s : float
        Round deadline in seconds (simulated on a virtual-clock TimedGrid).
    over_selection : float
        Select ``ceil(over_selection * target)`` devices (>= 1).

    Raises
    ------
    ConfigError
        ``deadline_s`` not above 0 or ``over_selection`` below 1.

    Notes
    -----
    With real devices replies come in arrival order, so the first ``target`` are kept as
    they come (O(model) memory). On a virtual clock a reply's arrival time is known only
    once its device has worked, so up to ``target`` on-time replies are held until every
    selected device has: O(target x model).
    """

    name = "deadline"

    def __init__(self, deadline_s: float, over_selection: float = 1.3) -> None:
        if not deadline_s > 0:  # `not >` also refuses NaN
            raise ConfigError(f"deadline-s = {deadline_s} cannot end a round: give a deadline of more than 0 "
                              "seconds")
        if not over_selection >= 1:
            raise ConfigError(f"over-selection = {over_selection} would select fewer devices than a round keeps: "
                              "give 1 or more (1.3 selects 30% more than the round aggregates)")
        self.deadline_s, self.over_selection = deadline_s, over_selection

    def selection_size(self, target: int) -> int:
        """``ceil(over_selection * target)``."""
        return math.ceil(self.over_selection * target - 1e-9)

    def exchange(self, grid: Grid, messages: list[Message], timeout: float, target: int) -> Exchange:
        """The first ``target`` replies before the deadline, all at once."""
        return _exchanged(self.stream(grid, messages, timeout, target))

    def stream(self, grid: Grid, messages: list[Message], timeout: float, target: int) -> ReplyStream:
        """The first ``target`` replies before the deadline; the round lasts until the last of them."""
        wait = min(timeout, self.deadline_s)
        clock = timed(grid)
        if clock is None:
            return ReplyStream(lambda stream: self._plain(stream, grid, messages, wait, target))
        if not clock.virtual:
            return ReplyStream(lambda stream: self._in_real_time(stream, clock, messages, wait, target))
        return ReplyStream(lambda stream: self._on_virtual_clock(stream, clock, messages, wait, target))

    def _plain(self, stream: ReplyStream, grid: Grid, messages: list[Message], wait: float,
               target: int) -> Iterator[Message]:
        replies = list(grid.send_and_receive(messages, timeout=wait))
        stream.late = len(messages) - len(replies)
        yield from [reply for reply in replies if not reply.has_error()][:target]

    def _in_real_time(self, stream: ReplyStream, clock: TimedGrid, messages: list[Message], wait: float,
                      target: int) -> Iterator[Message]:
        """Real devices: replies come in arrival order; the first ``target`` are kept as they come."""
        arrived = kept = 0
        for reply, _ in clock.stream_timed(messages, wait):
            arrived += 1
            if kept < target and not reply.has_error():
                kept += 1
                clock.count_participants([reply])
                yield reply
            else:
                let_go(reply)  # surplus to the deadline's K
        stream.late = len(messages) - arrived

    def _on_virtual_clock(self, stream: ReplyStream, grid: TimedGrid, messages: list[Message], wait: float,
                          target: int) -> Iterator[Message]:
        earliest: list[tuple[float, int, Message]] = []  # heap of the `target` earliest: (-arrival, -order, reply)
        arrived = late = 0
        for reply, arrival in grid.stream_timed(messages, wait):
            arrived += 1
            if reply.has_error():
                continue
            if arrival > self.deadline_s:
                late += 1
                let_go(reply)
                continue
            heapq.heappush(earliest, (-arrival, -arrived, reply))
            if len(earliest) > target:  # the latest so far (of equal arrivals, the later one) is surplus
                let_go(heapq.heappop(earliest)[2])
        first = [(-neg_arrival, reply) for neg_arrival, _, reply in sorted(earliest, reverse=True)]
        grid.advance(first[-1][0] if len(first) == target else self.deadline_s)
        stream.late = late + len(messages) - arrived  # never replied: dropped out
        kept = [reply for _, reply in first]
        grid.count_participants(kept)
        yield from kept


def let_go(reply: Message) -> None:
    """Free the arrays of a reply that was folded in or left out, now.

    Reading a Flower ``RecordDict`` through ``array_records``/``metric_records`` makes a
    view that refers to itself (Flower 1.42's ``_SyncedDict`` keeps a bound method of its
    own), so a reply read that way lives on until the garbage collector's next pass, and
    a round's replies could pile up before it came. Emptying the reply's array records
    releases the arrays the moment a strategy is done with them, whatever still refers to the reply.
    """
    if reply.has_error():
        return
    for record in list(reply.content.values()):
        if isinstance(record, ArrayRecord):
            record.clear()


RoundPolicy = SyncPolicy | DeadlinePolicy
