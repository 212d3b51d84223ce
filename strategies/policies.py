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

import math
from dataclasses import dataclass

from flwr.app import Message
from flwr.serverapp import Grid

from fedge.errors import ConfigError
from fedge.strategies.timing import TimedGrid, timed


@dataclass(frozen=True)
class Exchange:
    """The replies a round keeps, and how many arrived too late."""

    replies: list[Message]
    late: int = 0


class SyncPolicy:
    """Wait for every selected device."""

    name = "sync"

    def selection_size(self, target: int) -> int:
        """How many devices to select for ``target`` replies."""
        return target

    def exchange(self, grid: Grid, messages: list[Message], timeout: float, target: int) -> Exchange:
        """Send ``messages`` and keep every reply."""
        return Exchange(list(grid.send_and_receive(messages, timeout=timeout)))


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
        """The first ``target`` replies before the deadline; the round lasts until the last of them."""
        wait = min(timeout, self.deadline_s)
        clock = timed(grid)
        if clock is None:
            replies = list(grid.send_and_receive(messages, timeout=wait))
            return Exchange([r for r in replies if not r.has_error()][:target], late=len(messages) - len(replies))
        if not clock.virtual:
            # real devices: the deadline is real time and replies come in arrival order
            replies = [reply for reply, _ in clock.exchange_timed(messages, wait)]
            kept = [reply for reply in replies if not reply.has_error()][:target]
            clock.count_participants(kept)
            return Exchange(kept, late=len(messages) - len(replies))
        return self._on_virtual_clock(clock, messages, wait, target)

    def _on_virtual_clock(self, grid: TimedGrid, messages: list[Message], wait: float, target: int) -> Exchange:
        timed = grid.exchange_timed(messages, wait)
        on_time = sorted(((arrival, reply) for reply, arrival in timed
                          if arrival <= self.deadline_s and not reply.has_error()), key=lambda pair: pair[0])
        first = on_time[:target]
        grid.advance(first[-1][0] if len(first) == target else self.deadline_s)
        late = sum(1 for reply, arrival in timed if arrival > self.deadline_s and not reply.has_error())
        late += len(messages) - len(timed)  # never replied: dropped out
        kept = [reply for _, reply in first]
        grid.count_participants(kept)
        return Exchange(kept, late=late)


RoundPolicy = SyncPolicy | DeadlinePolicy
