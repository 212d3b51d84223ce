"""An in-process Flower ``Grid``: hands each message straight to the ClientApp.

Flower's own simulation engine runs ClientApps in Ray actors behind an in-memory
SuperLink that is polled every 0.1 s. For hundreds of small simulated devices
on a laptop that overhead dominates (see ``bench/sim_vs_flower.py``), and no
maintained library offers a synchronous in-process Grid, so this one is written
here. It implements the full ``Grid`` contract (push/pull and
send_and_receive), so any Flower ``ServerApp`` and ``ClientApp`` run on it
unchanged.
"""

from __future__ import annotations

import copy
import logging
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, overload
from uuid import uuid4

import numpy as np
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedge import wire
from fedge.behaviour import Behaviour
from fedge.profiles import Fleet

log = logging.getLogger("fedge.simulation")

SUPERLINK_NODE_ID = 1
FIRST_NODE_ID = 10_000
CLIENT_APP_EXCEPTION = 2  # Flower's ErrorCode.CLIENT_APP_RAISED_EXCEPTION


class FleetNodes(Sequence[dict[str, Any]]):
    """Node configs of a simulated fleet, made on demand: no per-device objects for idle devices.

    Entry ``i`` is ``{"partition-id": i, "num-partitions": size, "profile": ...}``; the profiles
    are kept as a two-byte code per device (:meth:`fedge.profiles.Fleet.profile_codes`).
    """

    def __init__(self, fleet: Fleet, seed: int) -> None:
        self.size = fleet.size
        self.names, self.codes = fleet.profile_codes(seed)

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.size))]
        if not -self.size <= index < self.size:
            raise IndexError(index)
        index %= self.size
        return {"partition-id": index, "num-partitions": self.size, "profile": self.names[int(self.codes[index])]}


class InlineGrid(Grid):
    """Deliver messages to ``client_app`` in this process, one node at a time.

    Parameters
    ----------
    client_app : ClientApp
        The device app every simulated node runs.
    node_configs : sequence of mappings
        One ``node_config`` per node (``partition-id``, ``num-partitions``, ``profile``): a
        list, or :class:`FleetNodes` for a large fleet (configs made on demand).
    run_config : Mapping
        The run config every node's ``Context`` carries.
    run_id : int
        The run's id.

    Notes
    -----
    A node's ``Context`` exists only while the node works: it is made when a message
    reaches the node and dropped after its reply, unless its ``state`` holds something
    (a codec residual, secure-aggregation keys), which then persists across rounds as a
    SuperNode's does (:attr:`kept`). Availability is one array operation over the fleet's
    node ids and profile codes, so an idle device costs a few bytes. Each delivery
    deep-copies the message (Flower strategies share one RecordDict across a round's
    messages). If the ClientApp raises, the reply is an error message (as Flower's
    engines do) and the node's state is restored to what it was before the call.
    """

    synchronous = True  # a reply is made the moment it is pulled: nothing to wait for

    def __init__(
        self,
        client_app: ClientApp,
        node_configs: Sequence[Mapping[str, Any]],
        run_config: Mapping[str, Any],
        *,
        run_id: int = 1,
        behaviour: Behaviour | None = None,
    ) -> None:
        self.client_app = client_app
        self.behaviour = behaviour
        self.now: Callable[[], float] = lambda: 0.0
        self._work: dict[int, int] = {}
        self._run = Run.create_empty(run_id)
        self._run_id = run_id
        self._run_config = dict(run_config)
        self._nodes = node_configs
        self._ids = np.arange(FIRST_NODE_ID, FIRST_NODE_ID + len(node_configs), dtype=np.int64)
        if isinstance(node_configs, FleetNodes):
            self._names, self._codes = node_configs.names, node_configs.codes
        else:
            profiles = [str(config.get("profile", "")) for config in node_configs]
            self._names = tuple(dict.fromkeys(profiles))
            self._codes = np.array([self._names.index(name) for name in profiles], dtype=np.int16)
        self.kept: dict[int, Context] = {}  # nodes whose state holds something, by node id
        self._pending: dict[str, Message] = {}  # pushed, delivered when pulled
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = SUPERLINK_NODE_ID
        TaskIdentity.task_id = 1

    @property
    def num_nodes(self) -> int:
        """How many simulated nodes the grid serves (online or not)."""
        return len(self._ids)

    def _index(self, node: int) -> int | None:
        index = node - FIRST_NODE_ID
        return index if 0 <= index < len(self._ids) else None

    def context(self, node: int) -> Context | None:
        """``node``'s Context: the kept one, else a fresh one with empty state (None: unknown node)."""
        if node in self.kept:
            return self.kept[node]
        index = self._index(node)
        if index is None:
            return None
        return Context(run_id=self._run_id, node_id=node, node_config=dict(self._nodes[index]),
                       state=RecordDict(), run_config=dict(self._run_config))

    @property
    def contexts(self) -> dict[int, Context]:
        """Every node's Context (fresh ones for nodes without state): for small fleets and tests."""
        return {node: context for node in self._ids.tolist() if (context := self.context(node)) is not None}

    def node_profile(self, node: int) -> str | None:
        """The simulated device's profile (from its node config)."""
        index = self._index(node)
        if index is None:
            return None
        if isinstance(self._nodes, FleetNodes):
            return self._names[int(self._codes[index])]
        return str(self._nodes[index]["profile"]) if "profile" in self._nodes[index] else None

    def node_work(self, node: int) -> int | None:
        """Samples the simulated device's last secure masked input trained on, from its own state
        (:data:`fedge.wire.LOCAL_WORK`; the reply does not carry them): for the virtual clock only."""
        context = self.kept.get(node)
        record = context.state.config_records.get(wire.LOCAL_WORK) if context is not None else None
        return int(record[wire.SAMPLES_PROCESSED]) if record is not None else None  # type: ignore[arg-type]

    def set_run(self, run: Run) -> None:
        """Adopt ``run``'s identity."""
        self._run = run

    @property
    def run(self) -> Run:
        """The run this grid serves."""
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """Deprecated in Flower; kept because ``Grid`` declares it abstract."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def attach_clock(self, now: Callable[[], float]) -> None:
        """Use ``now()`` (simulated seconds) to decide which devices are online."""
        self.now = now

    def get_node_ids(self) -> Iterable[int]:
        """The simulated nodes online now (all of them without a :class:`Behaviour`)."""
        if self.behaviour is None:
            return self._ids.tolist()  # type: ignore[no-any-return]
        online = self.behaviour.online_mask(self._ids, self._codes, self._names, self.now())
        return self._ids[online].tolist()  # type: ignore[no-any-return]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Queue each message; its ClientApp call runs when :meth:`pull_messages` asks for the reply.

        Whether a device drops out mid-round is decided here, in push order, so a run's
        dropouts do not depend on when (or whether) replies are pulled.
        """
        ids = []
        for message in messages:
            message_id = uuid4().hex
            message.metadata.__dict__["_message_id"] = message_id
            ids.append(message_id)
            if not self._drops_out(message.metadata.dst_node_id):
                self._pending[message_id] = message
        return ids

    def _drops_out(self, node: int) -> bool:
        """Whether this node vanishes mid-round (it then never replies)."""
        index = self._index(node)
        if self.behaviour is None or index is None:
            return False
        self._work[node] = self._work.get(node, 0) + 1
        return self.behaviour.drops(node, self._names[int(self._codes[index])], self._work[node])

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Replies for ``message_ids`` not pulled yet (each once); each device works when its reply is pulled.

        Pulling one id at a time runs one device at a time, so a caller that folds replies
        into an aggregate as they come (fedge's metering Grid and strategies) holds one
        reply at a time, O(model) memory, not a round's worth of replies.
        """
        replies = []
        for message_id in list(message_ids):
            message = self._pending.pop(message_id, None)
            if message is not None:
                replies.append(self._deliver(message))
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Deliver every message and return every reply (``timeout`` cannot pass here)."""
        return self.pull_messages(self.push_messages(messages))

    def _deliver(self, message: Message) -> Message:
        context = self.context(message.metadata.dst_node_id)
        delivered = copy.deepcopy(message)
        if context is None:
            return Message(Error(code=CLIENT_APP_EXCEPTION, reason="unknown node"), reply_to=delivered)
        saved_state = copy.deepcopy(context.state)
        try:
            reply = self.client_app(message=delivered, context=context)
        except Exception as exc:  # noqa: BLE001 - a device failure must not stop the run
            log.debug("node %d raised:\n%s", context.node_id, traceback.format_exc())
            context.state = saved_state
            reason = f"{type(exc).__name__}: {exc}"
            return Message(Error(code=CLIENT_APP_EXCEPTION, reason=reason), reply_to=delivered)
        finally:
            self._keep_or_drop(context)
        reply.metadata.__dict__["_message_id"] = uuid4().hex
        return reply

    def _keep_or_drop(self, context: Context) -> None:
        """Keep a node's Context while its state holds something; otherwise let it go."""
        if len(context.state):
            self.kept[context.node_id] = context
        else:
            self.kept.pop(context.node_id, None)
