"""The same apps on Flower's Ray simulation engine (slow: Ray start-up)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fedge.simulation.runner import simulate


@pytest.mark.slow
def test_ray_backend_runs_the_same_apps_for_two_rounds(fast_config: dict[str, Any]) -> None:
    fast_config.update({"num-rounds": 2, "export-onnx": False})
    run_dir, summary = simulate(fast_config, backend="ray", progress=False)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds"] == 2
    assert [row["participants"] for row in rows[1:]] == [4, 4]
    assert rows[-1]["accuracy"] > rows[0]["accuracy"]
    assert rows[-1]["sim_time_s"] > 0  # profiles resolved from the fleet by partition id
