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
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedge.behaviour import Behaviour

log = logging.getLogger("fedge.simulation")

SUPERLINK_NODE_ID = 1
FIRST_NODE_ID = 10_000
CLIENT_APP_EXCEPTION = 2  # Flower's ErrorCode.CLIENT_APP_RAISED_EXCEPTION


class InlineGrid(Grid):
    """Deliver messages to ``client_app`` in this process, one node at a time.

    Parameters
    ----------
    client_app : ClientApp
        The device app every simulated node runs.
    node_configs : list of mappings
        One ``node_config`` per node (``partition-id``, ``num-partitions``, ``profile``).
    run_config : Mapping
        The run config every node's ``Context`` carries.
    run_id : int
        The run's id.

    Notes
    -----
    Each node keeps one ``Context`` whose ``state`` persists across rounds, as a
    SuperNode's does. Each delivery deep-copies the message (Flower strategies
    share one RecordDict across a round's messages). If the ClientApp raises, the
    reply is an error message (as Flower's engines do) and the node's state is
    restored to what it was before the call.
    """

    synchronous = True  # every reply exists as soon as push_messages returns

    def __init__(
        self,
        client_app: ClientApp,
        node_configs: list[Mapping[str, Any]],
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
        self.contexts = {
            FIRST_NODE_ID + index: Context(
                run_id=run_id,
                node_id=FIRST_NODE_ID + index,
                node_config=dict(node_config),
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for index, node_config in enumerate(node_configs)
        }
        self._replies: dict[str, Message] = {}
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = SUPERLINK_NODE_ID
        TaskIdentity.task_id = 1

    def node_profile(self, node: int) -> str | None:
        """The simulated device's profile (from its node config)."""
        context = self.contexts.get(node)
        return str(context.node_config["profile"]) if context and "profile" in context.node_config else None

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
            return list(self.contexts)
        now = self.now()
        return [node for node, context in self.contexts.items()
                if self.behaviour.online(node, str(context.node_config.get("profile", "")), now)]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Run each message's ClientApp call now; its reply waits for :meth:`pull_messages`."""
        ids = []
        for message in messages:
            message_id = uuid4().hex
            message.metadata.__dict__["_message_id"] = message_id
            ids.append(message_id)
            if not self._drops_out(message.metadata.dst_node_id):
                self._replies[message_id] = self._deliver(message)
        return ids

    def _drops_out(self, node: int) -> bool:
        """Whether this node vanishes mid-round (it then never replies)."""
        if self.behaviour is None or node not in self.contexts:
            return False
        self._work[node] = self._work.get(node, 0) + 1
        profile = str(self.contexts[node].node_config.get("profile", ""))
        return self.behaviour.drops(node, profile, self._work[node])

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Replies for ``message_ids`` that have not been pulled yet (each once)."""
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Deliver every message and return every reply (``timeout`` cannot pass here)."""
        return self.pull_messages(self.push_messages(messages))

    def _deliver(self, message: Message) -> Message:
        context = self.contexts.get(message.metadata.dst_node_id)
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
        reply.metadata.__dict__["_message_id"] = uuid4().hex
        return reply
