"""Reply metadata from a hostile device (issue 12, findings 2 and 3).

Replays the review's attacks: a device sends ``samples-processed = "lots"`` or ``inf`` (the
virtual clock, which also runs in deployment, parsed it with ``int()`` and the run died),
the same in a secure-aggregation round, and FedNova ``steps = "many"`` or ``2**62`` (which
crashed the coordinator or, finite, blew the global model up to 7.6e32). Each is now
rejected by one validator (:func:`fedge.wire.read_reply_meta`) with the field named; the
global model stays intact and the round goes on.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict
from hypothesis import given
from hypothesis import strategies as st

from fedge import wire
from fedge.config import resolve_run_config
from fedge.errors import UpdateRejected
from fedge.server.app import local_step_limit, run_coordinator
from fedge.server.checkpoint import load_checkpoint
from fedge.server.report import read_jsonl
from fedge.simulation.grid import InlineGrid
from fuzzing import fuzz
from replies import tampered_app

NODES = [{"partition-id": i, "num-partitions": 5, "profile": "laptop"} for i in range(5)]


def _run(tmp_path: Path, step: str, tamper: Any, **overrides: Any) -> tuple[list[dict[str, Any]], Path]:
    config = resolve_run_config({"fleet": "laptop=5", "clients-per-round": 5, "num-rounds": 2, "model": "mlp",
                                 "local-epochs": 1, "export-onnx": False, "min-train-replies": 2,
                                 "run-dir": str(tmp_path / "run"), **overrides})
    run_coordinator(InlineGrid(tampered_app(1, step, tamper), NODES, config), config, progress=False)
    return read_jsonl(tmp_path / "run" / "metrics.jsonl"), tmp_path / "run"


def _set_meta(key: str, value: Any) -> Any:
    def tamper(content: RecordDict) -> None:
        content.config_records[wire.REPLY_META][key] = value
    return tamper


BAD_META = [
    (wire.SAMPLES_PROCESSED, "lots"),
    (wire.SAMPLES_PROCESSED, math.inf),
    (wire.SAMPLES_PROCESSED, -5),
    (wire.SAMPLES_PROCESSED, 10**15),
    (wire.PROFILE, 7),
    (wire.PROFILE, "../../etc/passwd"),
    (wire.PROFILE, "x" * 200),
    (wire.SERVER_ROUND, "1"),
    (wire.STEPS, "many"),
    (wire.STEPS, 0),
    (wire.STEPS, 2**62),
]


@pytest.mark.parametrize(("key", "value"), BAD_META)
def test_bad_meta_is_rejected_naming_the_field_and_the_round_goes_on(key: str, value: Any, tmp_path: Path) -> None:
    # Execute: device 1 of 5 sends the bad value in every train reply
    rows, run_dir = _run(tmp_path, "train", _set_meta(key, value))
    # Assert: the run completed; each round aggregated the 4 honest devices and rejected device 1 by field
    assert [row["round"] for row in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["aggregated"] and row["participants"] == 4 and row["rejected"] == 1
        assert key in row["rejections"][0]["reason"]
    assert all(np.all(np.isfinite(a)) for a in load_checkpoint(run_dir / "checkpoint.npz").arrays.values())


@pytest.mark.parametrize(("key", "value"), [(wire.STEPS, "many"), (wire.STEPS, 2**62), (wire.STEPS, 10**6)])
def test_fednova_rejects_claimed_work_and_keeps_the_model_bounded(key: str, value: Any, tmp_path: Path) -> None:
    # Prepare / Execute: FedNova; device 1 claims absurd local work with otherwise honest arrays
    rows, run_dir = _run(tmp_path, "train", _set_meta(key, value), strategy="fednova")
    # Assert: rejected (10**6 steps is more than 1 epoch of its data allows); the model stays sane
    assert all(row["aggregated"] and row["rejected"] == 1 for row in rows[1:])
    assert "steps" in rows[1]["rejections"][0]["reason"]
    weights = load_checkpoint(run_dir / "checkpoint.npz").arrays
    assert max(float(np.abs(a).max()) for a in weights.values()) < 100.0
    assert rows[-1]["accuracy"] > rows[0]["accuracy"]


@pytest.mark.parametrize(("step", "value"), [("secagg_setup", math.inf), ("secagg_setup", "lots"),
                                             ("secagg_masked", "lots"), ("secagg_masked", math.inf)])
def test_bad_meta_in_a_secure_round_neither_crashes_nor_fails_the_round(step: str, value: Any,
                                                                         tmp_path: Path) -> None:
    # Prepare: a meta record the secure-aggregation steps do not expect (setup) or a bad value in it (masked)
    def tamper(content: RecordDict) -> None:
        meta = content.config_records.get(wire.REPLY_META) or ConfigRecord()
        meta[wire.SAMPLES_PROCESSED] = value
        content.config_records[wire.REPLY_META] = meta
    # Execute
    rows, _ = _run(tmp_path, step, tamper, **{"secure-aggregation": True})
    # Assert: the run completed and every round aggregated (device 1 only mis-reports its own clock)
    assert [row["round"] for row in rows] == [0, 1, 2]
    assert all(row["aggregated"] for row in rows[1:])


@pytest.mark.parametrize(("config", "examples", "expected"), [
    ({"local-epochs": 5, "batch-size": 16}, 100, 35),     # 5 * ceil(100 / 16) = 5 * 7
    ({"local-epochs": 1, "batch-size": 32}, 32, 1),
    ({"local-epochs": 2, "batch-size": 10}, 1, 2),
    ({"local-budget": "time", "time-budget-s": 2.0, "batch-size": 10, "fleet": "phone=1,gpu-box=1"}, 7, None),
])
def test_the_step_limit_follows_the_instruction(config: dict[str, Any], examples: int, expected: int | None) -> None:
    # Prepare
    resolved = resolve_run_config(config)
    # Execute
    limit = local_step_limit(resolved)(examples)
    # Assert: epochs budget by hand; time budget = what the fastest profile's device computes for itself
    if expected is None:
        from fedge.profiles import parse_fleet

        rate = max(p.compute_rate for p in parse_fleet("phone=1,gpu-box=1", "").profiles.values())
        expected = max(1, int(2.0 * rate) // 10)
    assert limit == expected


@fuzz()
@given(st.dictionaries(st.sampled_from([wire.SERVER_ROUND, wire.PROFILE, wire.SAMPLES_PROCESSED, wire.STEPS,
                                        "other"]),
                       st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=80),
                                 st.booleans(), st.binary(max_size=20), st.lists(st.integers(), max_size=3))))
def test_reading_any_meta_gives_checked_values_or_a_rejection(fields: dict[str, Any]) -> None:
    # Prepare: any record Flower lets a device build
    try:
        content = RecordDict({wire.REPLY_META: ConfigRecord(fields)})
    except (TypeError, ValueError):
        return  # Flower itself refuses to carry it
    # Execute
    try:
        meta = wire.read_reply_meta(content)
    except UpdateRejected as exc:
        assert exc.reason  # Assert: a reason
        return
    # Assert: only exact, bounded types come out
    assert meta is not None
    assert isinstance(meta.samples_processed, int) and 0 <= meta.samples_processed <= wire.MAX_COUNT
    assert meta.steps is None or (type(meta.steps) is int and 1 <= meta.steps <= wire.MAX_COUNT)
    assert meta.server_round is None or type(meta.server_round) is int
    assert meta.profile is None or wire.PROFILE_NAME.match(meta.profile)
