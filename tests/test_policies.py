"""Heterogeneous fleets: round policies on the virtual clock, availability, dropout, time budgets."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Message

from fedge.behaviour import Behaviour
from fedge.cli.main import main
from fedge.profiles import BUILTIN_PROFILES, Fleet, parse_fleet
from fedge.server.metering import MeteredGrid
from fedge.simulation.runner import simulate
from fedge.strategies.policies import DeadlinePolicy, SyncPolicy
from replies import good_arrays, instruction, train_reply


class _Timed(MeteredGrid):
    """A MeteredGrid whose replies arrive at scripted simulated times."""

    def __init__(self, arrivals: list[float]) -> None:
        super().__init__(grid_stub(), parse_fleet("laptop=1"))
        self.arrivals = arrivals

    def stream_timed(self, messages: list[Message], timeout: float | None) -> Iterator[tuple[Message, float]]:
        yield from [(train_reply(100 + i, good_arrays(1.0)), t) for i, t in enumerate(self.arrivals)]


def grid_stub() -> Any:
    from flwr.clientapp import ClientApp

    from fedge.simulation.grid import InlineGrid

    return InlineGrid(ClientApp(), [], {})


def test_deadline_keeps_the_first_k_on_time_replies_by_hand() -> None:
    # arrivals 5, 1, 12, 3 s; deadline 10 s; K = 2 -> keep the replies at 1 s and 3 s, round lasts 3 s
    grid = _Timed([5.0, 1.0, 12.0, 3.0])
    sent = [instruction(100 + i) for i in range(4)]
    exchange = DeadlinePolicy(10.0, over_selection=2.0).exchange(grid, sent, timeout=600, target=2)
    assert sorted(r.metadata.src_node_id for r in exchange.replies) == [101, 103]
    assert exchange.late == 1
    assert grid.sim_time == pytest.approx(3.0)


def test_deadline_round_lasts_the_deadline_when_too_few_arrive() -> None:
    grid = _Timed([11.0, 2.0, 30.0])
    sent = [instruction(100 + i) for i in range(3)]
    exchange = DeadlinePolicy(10.0).exchange(grid, sent, timeout=600, target=2)
    assert len(exchange.replies) == 1 and exchange.late == 2
    assert grid.sim_time == pytest.approx(10.0)


def test_over_selection_sizes() -> None:
    assert DeadlinePolicy(10.0, 1.3).selection_size(10) == 13
    assert DeadlinePolicy(10.0, 1.0).selection_size(10) == 10
    assert SyncPolicy().selection_size(10) == 10


HETERO = {"fleet": "phone=6,laptop=3,gpu-box=1", "clients-per-round": 4, "num-rounds": 4, "model": "mlp",
          "local-epochs": 2, "export-onnx": False}


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sync_waits_for_the_slowest_and_deadline_never_exceeds_it(tmp_path: Path) -> None:
    # Prepare: the same fleet and selection seed under both policies
    _, sync = simulate({**HETERO, "run-dir": str(tmp_path / "sync")}, progress=False)
    _, dead = simulate({**HETERO, "round-policy": "deadline", "deadline-s": 0.5, "over-selection": 1.5,
                        "run-dir": str(tmp_path / "deadline")}, progress=False)
    sync_rows, dead_rows = _rows(tmp_path / "sync"), _rows(tmp_path / "deadline")
    # Assert: every deadline round lasts at most the deadline and keeps at most K on-time replies
    durations = [b["sim_time_s"] - a["sim_time_s"] for a, b in zip(dead_rows, dead_rows[1:], strict=False)]
    assert all(0 < d <= 0.5 + 1e-9 for d in durations)
    assert all(r["participants"] <= 4 for r in dead_rows[1:])
    assert sum(r["late"] for r in dead_rows) > 0  # phones (200 samples/s) miss a 0.5 s deadline
    # sync rounds wait for phones: each lasts longer than the deadline rounds
    sync_durations = [b["sim_time_s"] - a["sim_time_s"] for a, b in zip(sync_rows, sync_rows[1:], strict=False)]
    assert min(sync_durations) > 0.5
    assert all(r["participants"] == 4 for r in sync_rows[1:])


def test_availability_and_dropout_follow_the_seeded_behaviour() -> None:
    fleet = Fleet(profiles=dict(BUILTIN_PROFILES), mix=(("phone", 1),))
    behaviour = Behaviour.from_fleet(fleet, seed=3, enabled=True, jitter=0.0)
    online = [behaviour.online(7, "phone", slot * 60.0) for slot in range(2000)]
    assert sum(online) / len(online) == pytest.approx(BUILTIN_PROFILES["phone"].availability, abs=0.04)
    assert online == [behaviour.online(7, "phone", slot * 60.0) for slot in range(2000)]
    assert all(behaviour.online(7, "gpu-box", t) for t in range(0, 6000, 60))  # availability 1.0
    drops = [behaviour.drops(7, "phone", i) for i in range(2000)]
    assert sum(drops) / len(drops) == pytest.approx(BUILTIN_PROFILES["phone"].dropout, abs=0.03)
    disabled = Behaviour.from_fleet(fleet, seed=3, enabled=False, jitter=0.0)
    assert all(disabled.online(7, "phone", t) for t in range(0, 6000, 60))


def test_behaviour_runs_reproduce_exactly(tmp_path: Path) -> None:
    config = {**HETERO, "device-behaviour": True, "jitter": 0.3, "num-rounds": 5}
    _, first = simulate({**config, "run-dir": str(tmp_path / "a")}, progress=False)
    _, second = simulate({**config, "run-dir": str(tmp_path / "b")}, progress=False)
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert [r["sim_time_s"] for r in a] == [r["sim_time_s"] for r in b]
    assert [r["participants_by_profile"] for r in a] == [r["participants_by_profile"] for r in b]
    assert first["final_accuracy"] == second["final_accuracy"]


def test_dropouts_keep_a_sync_round_waiting_until_the_timeout(tmp_path: Path) -> None:
    config = {**HETERO, "device-behaviour": True, "fleet": "phone=10", "clients-per-round": 6,
              "round-timeout": 100.0, "num-rounds": 6, "run-dir": str(tmp_path / "r")}
    simulate(config, progress=False)
    rows = _rows(tmp_path / "r")
    durations = {round(b["sim_time_s"] - a["sim_time_s"], 6): b for a, b in zip(rows, rows[1:], strict=False)}
    waited = [row for d, row in durations.items() if d >= 100.0]
    assert waited and all(row["participants"] < 6 for row in waited)  # a phone vanished: the round hit 100 s


def test_time_budget_sets_steps_from_the_profile(tmp_path: Path) -> None:
    # phone: 1 s x 200 samples/s / batch 16 = 12 steps; gpu-box: 1 s x 20000 / 16 = 1250 steps
    from flwr.app import ArrayRecord, ConfigRecord, MessageType, RecordDict

    from fedge.clients.app import make_default_client_app
    from fedge.config import resolve_run_config
    from fedge.simulation.grid import InlineGrid
    from fedge.task.models import build_model, model_arrays

    config = resolve_run_config({**HETERO, "local-budget": "time", "time-budget-s": 1.0, "batch-size": 16})
    nodes = [{"partition-id": 0, "num-partitions": 10, "profile": "phone"},
             {"partition-id": 1, "num-partitions": 10, "profile": "gpu-box"}]
    grid = InlineGrid(make_default_client_app(), nodes, config)
    content = RecordDict({"arrays": model_arrays(build_model("mlp", 64, 10)),
                          "config": ConfigRecord({"server-round": 1, "local-budget": "time", "time-budget-s": 1.0,
                                                  "batch-size": 16})})
    messages = [Message(content, dst_node_id=n, message_type=MessageType.TRAIN) for n in grid.get_node_ids()]
    replies = sorted(grid.send_and_receive(messages), key=lambda r: r.metadata.src_node_id)
    assert [int(r.content["fedge"]["steps"]) for r in replies] == [12, 1250]
    assert isinstance(replies[0].content["arrays"], ArrayRecord)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--run-config", "round-policy='deadline' deadline-s=0.0001"], "shorter than any device could finish"),
        (["--run-config", "round-policy='async'"], "'round-policy' = 'async' is not allowed"),
        (["--clients-per-round", "11"], "exceeds the fleet's 10 devices"),
        (["--run-config", "strategy='fedbuff' buffer-size=0"], "'buffer-size' = 0 must be >= 1"),
    ],
)
def test_bad_policy_settings_are_refused_before_training(
    tmp_path: Path, overrides: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["simulate", "--quiet", "--fleet", "phone=6,laptop=3,gpu-box=1", "--clients-per-round", "4",
                 "--run-dir", str(tmp_path / "r"), *overrides])
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_staleness_weights_and_buffer_step_by_hand() -> None:
    from fedge.aggregate import apply_buffer, staleness_weight

    assert staleness_weight(0) == 1.0 and staleness_weight(3) == pytest.approx(0.5)  # 1/sqrt(4)
    # x = 0; deltas 1 (fresh, w = 1) and 1 (3 versions stale, w = 0.5): x = 0 - 1 * (1 + 0.5) / 2
    new = apply_buffer({"x": np.zeros(1, np.float32)}, [{"x": np.ones(1)}, {"x": np.ones(1)}], [1.0, 0.5], 1.0)
    assert float(new["x"][0]) == pytest.approx(-0.75)


def test_fedbuff_flushes_every_buffer_and_learns(tmp_path: Path) -> None:
    config = {**HETERO, "strategy": "fedbuff", "concurrency": 6, "buffer-size": 3, "num-rounds": 8,
              "run-dir": str(tmp_path / "r")}
    _, summary = simulate(config, progress=False)
    rows = _rows(tmp_path / "r")
    assert [r["round"] for r in rows] == list(range(9))
    assert all(r["participants"] == 3 and r["aggregated"] for r in rows[1:])
    assert all(b["sim_time_s"] >= a["sim_time_s"] for a, b in zip(rows, rows[1:], strict=False))
    assert summary["final_accuracy"] > rows[0]["accuracy"] + 0.2


def _loss_reply(node: int, loss: float, count: int) -> Message:
    reply = train_reply(node, good_arrays(1.0), count)
    reply.content["metrics"]["train-loss"] = loss
    return reply


def test_oort_prefers_fast_devices_at_equal_utility() -> None:
    from fedge.strategies.selection import OortSelector

    selector = OortSelector(seed=1, preferred_s=10.0, epsilon=0.0, fairness_rounds=1000)
    nodes = list(range(100, 110))
    selector.observe(1, [_loss_reply(n, 1.0, 10) for n in nodes],
                     {n: (100.0 if n < 105 else 1.0) for n in nodes})  # 100..104 slow, 105..109 fast
    assert set(selector.select(2, nodes, 3)) <= set(range(105, 110))
    # the penalty is (10 / 100)^2: a slow device needs 100x the utility to win
    assert selector.score(100) == pytest.approx(10 * 0.01) and selector.score(105) == pytest.approx(10.0)


def test_oort_explores_unseen_devices_and_no_device_starves() -> None:
    from fedge.strategies.selection import OortSelector

    selector = OortSelector(seed=2, epsilon=0.2, fairness_rounds=10)
    nodes = list(range(30))
    picked: set[int] = set()
    for server_round in range(1, 41):
        chosen = selector.select(server_round, nodes, 3)
        assert len(set(chosen)) == 3
        picked.update(chosen)
        # node 0 always looks best: without fairness the same few would be picked forever
        selector.observe(server_round, [_loss_reply(n, 5.0 if n == 0 else 0.1, 10) for n in chosen],
                         {n: 1.0 for n in chosen})
    assert picked == set(nodes)


def test_oort_selection_runs_and_reproduces(tmp_path: Path) -> None:
    config = {**HETERO, "selector": "oort", "num-rounds": 5, "device-behaviour": True}
    _, first = simulate({**config, "run-dir": str(tmp_path / "a")}, progress=False)
    _, second = simulate({**config, "run-dir": str(tmp_path / "b")}, progress=False)
    assert first["final_accuracy"] == second["final_accuracy"]
    assert [r["participants_by_profile"] for r in _rows(tmp_path / "a")] == \
        [r["participants_by_profile"] for r in _rows(tmp_path / "b")]


def test_diurnal_trace_keeps_devices_offline_outside_their_hours(tmp_path: Path) -> None:
    # Prepare: phones that can be online only from 19:00 to 07:00
    path = tmp_path / "fleet.toml"
    path.write_text('[profiles.nightphone]\ncompute-rate = 200\nuplink-mbps = 2\ndownlink-mbps = 10\n'
                    'memory-mb = 2048\navailability = 1.0\nonline-hours = [[0, 7], [19, 24]]\n'
                    '[fleet]\nnightphone = 5\n')
    fleet = parse_fleet("", str(path))
    behaviour = Behaviour.from_fleet(fleet, seed=0, enabled=True, jitter=0.0)
    # Execute / Assert: hour by hour over two days
    for hour in range(48):
        expected = hour % 24 < 7 or hour % 24 >= 19
        assert behaviour.online(3, "nightphone", hour * 3600.0 + 60) is expected, hour


@pytest.mark.parametrize("window", ["[[5, 3]]", "[[0, 25]]", "[[1]]"])
def test_bad_online_hours_are_refused(tmp_path: Path, window: str) -> None:
    from fedge.errors import ConfigError

    path = tmp_path / "fleet.toml"
    path.write_text('[profiles.p]\ncompute-rate = 1\nuplink-mbps = 1\ndownlink-mbps = 1\nmemory-mb = 1\n'
                    f'online-hours = {window}\n[fleet]\np = 1\n')
    with pytest.raises(ConfigError, match="online-hours window"):
        parse_fleet("", str(path))
