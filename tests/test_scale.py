"""Fleet scale: idle devices cost a few bytes, selected ones are materialised on demand, reproducibly."""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge import wire
from fedge.behaviour import Behaviour
from fedge.config import resolve_run_config
from fedge.profiles import parse_fleet
from fedge.simulation.grid import FIRST_NODE_ID, FleetNodes, InlineGrid
from fedge.strategies.selection import RandomSelector
from fedge.task.builtin.synthetic import EVALUATION_DEVICES, Synthetic
from fedge.task.data import synthetic_device


def _recording_app(seen: list[dict[str, object]], keep_state_for: set[int]) -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        seen.append(dict(context.node_config))
        calls = int(context.state.config_records.get("calls", ConfigRecord({"n": 0}))["n"]) + 1
        if int(context.node_config["partition-id"]) in keep_state_for:
            context.state["calls"] = ConfigRecord({"n": calls})
        return Message(RecordDict({"m": MetricRecord({"calls": calls, wire.NUM_EXAMPLES: 1})}), reply_to=msg)

    return app


def _round(grid: InlineGrid, selected: list[int]) -> list[Message]:
    content = RecordDict({"config": ConfigRecord({})})
    return list(grid.send_and_receive(
        [Message(content, dst_node_id=n, message_type=MessageType.TRAIN) for n in selected], timeout=1))


def test_only_selected_devices_are_materialised_and_only_state_persists() -> None:
    # Prepare: 200,000 devices, 10 a round; two of them keep state
    fleet = parse_fleet("phone=120000,laptop=60000,gpu-box=20000")
    seen: list[dict[str, object]] = []
    grid = InlineGrid(_recording_app(seen, {3, 150_000}), FleetNodes(fleet, 7), {})
    nodes = list(grid.get_node_ids())
    selector = RandomSelector(7)
    # Execute: three rounds; devices 3 and 150,000 in every one
    for server_round in (1, 2, 3):
        chosen = [*selector.select(server_round, nodes, 8), FIRST_NODE_ID + 3, FIRST_NODE_ID + 150_000]
        replies = _round(grid, chosen)
    # Assert: one context per delivery; state kept for the two devices that have any, counted across rounds
    assert len(nodes) == 200_000 and len(seen) == 30
    assert set(grid.kept) == {FIRST_NODE_ID + 3, FIRST_NODE_ID + 150_000}
    assert [r.content["m"]["calls"] for r in replies][-2:] == [3, 3]
    assignment = fleet.assignment(7)
    assert all(config["profile"] == assignment[int(config["partition-id"])] for config in seen)  # type: ignore[call-overload]
    assert all(config["num-partitions"] == 200_000 for config in seen)


def test_idle_devices_cost_a_few_bytes() -> None:
    # Execute: build the grid of a 300,000-device fleet and ask who is online
    fleet = parse_fleet("phone=200000,laptop=100000")
    behaviour = Behaviour.from_fleet(fleet, seed=1, enabled=True, jitter=0.0)
    tracemalloc.start()
    try:
        names, codes = fleet.profile_codes(11)
        grid = InlineGrid(ClientApp(), FleetNodes(fleet, 11), {}, behaviour=behaviour)
        kept, _ = tracemalloc.get_traced_memory()
        online = grid.get_node_ids()
    finally:
        tracemalloc.stop()
    # Assert: node ids (8 bytes) and profile codes (2 bytes) a device; ~70% of phones, ~90% of laptops online
    assert kept / fleet.size < 16
    share = len(online) / fleet.size  # type: ignore[arg-type]
    assert abs(share - (200_000 * 0.7 + 100_000 * 0.9) / 300_000) < 0.01
    assert names == ("phone", "laptop") and codes.dtype == np.int16


def test_the_fleet_wide_availability_draw_is_the_per_device_one() -> None:
    fleet = parse_fleet("phone=300,laptop=200")
    behaviour = Behaviour.from_fleet(fleet, seed=5, enabled=True, jitter=0.0)
    names, codes = fleet.profile_codes(5)
    nodes = np.arange(FIRST_NODE_ID, FIRST_NODE_ID + fleet.size)
    for now in (0.0, 61.0, 7200.0):
        mask = behaviour.online_mask(nodes, codes, names, now)
        assert mask.tolist() == [behaviour.online(int(n), names[c], now) for n, c in zip(nodes, codes, strict=True)]
    assert 0 < (~behaviour.online_mask(nodes, codes, names, 0.0)).sum() < fleet.size


def test_profile_assignment_is_the_shuffle_it_always_was() -> None:
    fleet = parse_fleet("phone=60,laptop=30,gpu-box=10")
    names = [name for name, count in fleet.mix for _ in range(count)]
    random.Random(3).shuffle(names)
    assert list(fleet.assignment(3)) == names
    assert [fleet.profile_of(i, 3) for i in range(100)] == names


def test_a_devices_synthetic_shard_is_the_same_whenever_and_wherever_it_is_made() -> None:
    # Prepare: the same device in a fleet of 50 and of 1,000,000, from fresh task objects
    small = Synthetic(resolve_run_config({"dataset": "synthetic", "fleet": "phone=50", "seed": 4}))
    huge = Synthetic(resolve_run_config({"dataset": "synthetic", "fleet": "phone=1000000", "seed": 4}))
    again = Synthetic(resolve_run_config({"dataset": "synthetic", "fleet": "phone=50", "seed": 4}))
    other_seed = Synthetic(resolve_run_config({"dataset": "synthetic", "fleet": "phone=50", "seed": 5}))
    # Execute
    shards = [task.partition(17, task.fleet_size, task.config) for task in (small, huge, again, other_seed)]
    # Assert: identical for the same seed, whatever the fleet size; another seed, other data
    for shard in shards[1:3]:
        assert np.array_equal(shards[0].inputs[0], shard.inputs[0])
        assert np.array_equal(shards[0].targets, shard.targets)
    assert not np.array_equal(shards[0].inputs[0][:10], shards[3].inputs[0][:10])
    _, y = synthetic_device(0.0, 0.0, 17, 4)  # a device's example count does not depend on alpha, beta
    assert len(shards[0]) + len(small.device(17)[1]) == len(y)
    # the big fleet's coordinator evaluates on an even spread of devices and generated no others
    assert len(huge.evaluation_devices()) == EVALUATION_DEVICES
    assert huge.evaluation_devices()[0] == 0 and huge.evaluation_devices()[-1] == 999_999
    assert small.evaluation_devices() == list(range(50))
