"""The inline Grid and the virtual clock, with a real Flower ClientApp."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge import wire
from fedge.profiles import DeviceProfile, Fleet
from fedge.server.metering import MeteredGrid
from fedge.simulation.grid import InlineGrid
from replies import good_arrays, train_reply


def _counting_app() -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        calls = int(context.state.config_records.get("calls", ConfigRecord({"n": 0}))["n"]) + 1
        context.state["calls"] = ConfigRecord({"n": calls})
        msg.content["config"]["touched"] = True  # must not leak into other nodes' copies
        if msg.content["config"].get("explode"):
            raise RuntimeError("device fell over")
        return Message(RecordDict({"m": MetricRecord({"calls": calls, wire.NUM_EXAMPLES: 1})}),
                       reply_to=msg)

    return app


def _messages(grid: InlineGrid, **config: bool) -> list[Message]:
    shared = RecordDict({"config": ConfigRecord(dict(config))})
    return [Message(shared, dst_node_id=n, message_type=MessageType.TRAIN) for n in grid.get_node_ids()]


def test_node_state_persists_and_messages_are_copied() -> None:
    grid = InlineGrid(_counting_app(), [{"partition-id": 0}, {"partition-id": 1}], {})
    for expected in (1, 2):
        messages = _messages(grid)
        replies = list(grid.send_and_receive(messages, timeout=1))
        assert [r.content["m"]["calls"] for r in replies] == [expected, expected]
        assert "touched" not in messages[0].content["config"]
        assert {r.metadata.reply_to_message_id for r in replies} == {m.metadata.message_id for m in messages}


def test_client_exception_becomes_error_reply_and_state_is_restored() -> None:
    grid = InlineGrid(_counting_app(), [{"partition-id": 0}], {})
    list(grid.send_and_receive(_messages(grid), timeout=1))
    (failed,) = grid.send_and_receive(_messages(grid, explode=True), timeout=1)
    assert failed.has_error() and "device fell over" in failed.error.reason
    (after,) = grid.send_and_receive(_messages(grid), timeout=1)
    assert after.content["m"]["calls"] == 2  # the failed call's state change was undone


def test_pull_returns_each_reply_once() -> None:
    grid = InlineGrid(_counting_app(), [{"partition-id": 0}], {})
    ids = list(grid.push_messages(_messages(grid)))
    assert len(list(grid.pull_messages(ids))) == 1
    assert list(grid.pull_messages(ids)) == []


def test_flowers_own_push_pull_loop_runs_on_the_inline_grid() -> None:
    # Prepare: Flower's grids collect replies by reading a pull's result twice (extend, then ids)
    grid = InlineGrid(_counting_app(), [{"partition-id": 0}, {"partition-id": 1}, {"partition-id": 2}], {})
    waiting, replies = set(grid.push_messages(_messages(grid))), []
    # Execute
    for _ in range(3):
        pulled = grid.pull_messages(waiting)
        replies.extend(pulled)
        waiting -= {reply.metadata.reply_to_message_id for reply in pulled}
    # Assert: every reply once, nothing left waiting, and a device ran only when its reply was pulled
    assert len(replies) == 3 and waiting == set()


def test_a_device_works_when_its_reply_is_pulled() -> None:
    # Prepare
    grid = InlineGrid(_counting_app(), [{"partition-id": 0}, {"partition-id": 1}], {})
    first, second = grid.push_messages(_messages(grid))
    # Execute: pull the first reply only
    (reply,) = grid.pull_messages([first])
    # Assert: the second device has not run yet (no state), then runs when pulled
    assert reply.content["m"]["calls"] == 1
    assert len(grid.kept) == 1
    (later,) = grid.pull_messages([second])
    assert later.content["m"]["calls"] == 1 and len(grid.kept) == 2


class _ScriptedGrid(InlineGrid):
    """Returns prepared replies so the clock's arithmetic can be checked by hand."""

    def __init__(self, replies: list[Message]) -> None:
        super().__init__(ClientApp(), [{}, {}], {})
        self.replies = replies

    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        return [f"scripted-{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, message_ids):  # type: ignore[no-untyped-def]
        return [self.replies[int(message_id.rsplit("-", 1)[1])] for message_id in message_ids]


def test_virtual_clock_charges_the_slowest_device() -> None:
    # Prepare: a profile with round numbers: 8 Mbit/s down, 1 Mbit/s up, 10 samples/s
    slow = DeviceProfile("phone", compute_rate=10.0, uplink_mbps=1.0, downlink_mbps=8.0, memory_mb=1)
    fleet = Fleet(profiles={"phone": slow, "laptop": slow}, mix=(("phone", 2),))
    reply = train_reply(10_000, good_arrays(1.0))  # 2 arrays: 36 B of float32 + 2 npy headers of 128 B
    upload = wire.payload_bytes(reply.content)
    grid = MeteredGrid(_ScriptedGrid([reply]), fleet)
    down_message = Message(reply.content, dst_node_id=10_000, message_type=MessageType.TRAIN)
    # Execute
    grid.send_and_receive([down_message], timeout=1)
    traffic = grid.take_round()
    # Assert: 292 B down at 1 MB/s + 20 samples at 10/s + 292 B up at 125 kB/s
    expected = upload * 8 / 8e6 + 2.0 + upload * 8 / 1e6
    assert upload == 2 * 128 + 36
    assert traffic.sim_seconds == pytest.approx(expected)
    assert (traffic.bytes_up, traffic.bytes_down) == (292, 292)
    assert traffic.participants == {"phone": 1}
    assert grid.take_round().bytes_up == 0
