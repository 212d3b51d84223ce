"""Round drivers: how a strategy's rounds reach devices and feed its aggregation rule.

A driver runs rounds over a strategy's :class:`~fedge.strategies.rounds.Rounds` (the
collaborators every driver shares: selector, round policy, reply validator, privacy,
downlink codec, the rule of :mod:`fedge.strategies.rule`; and the run's round state), never
over the strategy itself, and takes its own settings in its constructor. Any strategy runs
under any driver that accepts its rule (:meth:`Driver.bind` refuses with the reason):

* :class:`~fedge.strategies.drivers.sync.SyncDriver`: synchronous rounds (select, exchange
  under the round policy, validate, fold each reply as it arrives);
* :class:`~fedge.strategies.drivers.asynchronous.AsynchronousDriver`: FedBuff's buffered
  asynchronous aggregation over model versions;
* :class:`~fedge.strategies.drivers.secure.SecureAggregation`: synchronous rounds whose
  updates the coordinator sees only as one masked sum (linear rules).

Adding an execution mode is one file here.
"""

from fedge.strategies.drivers.base import Driver, RoundReport

__all__ = ["Driver", "RoundReport"]
