"""tests/leftovers.py: the processes an earlier test run left running are counted per run, this run's never."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.leftovers import leftover_runs

BASE = Path("/tmp/pytest-of-me")


@pytest.mark.parametrize(("processes", "expected"), [
    ([], {}),
    (["python -m fedge.server.superlink --database /tmp/pytest-of-me/pytest-7/popen-gw1/t0/state/superlink.db"],
     {"pytest-7": 1}),
    (["python -m fedge.clients.warm_clientapp --warm-parent FLWR_HOME=/tmp/pytest-of-me/pytest-7/gw0/flwr-home",
      "chromium --user-data-dir=/tmp/x PWD=/tmp/pytest-of-me/pytest-12/t1"], {"pytest-7": 1, "pytest-12": 1}),
    (["python fedge coordinator start --keys /tmp/pytest-of-me/pytest-9/t0/keys"], {}),  # this run's own
    (["python fedge coordinator start --keys /tmp/pytest-of-you/pytest-7/t0/keys"], {}),  # another user's folder
    (["sleep 60 /tmp/pytest-of-me/pytest-70"], {"pytest-70": 1}),
    (["sleep 60 /tmp/pytest-of-me/pytest-90x"], {}),  # not a run folder
])
def test_processes_of_other_runs_are_counted_per_run(processes: list[str], expected: dict[str, int]) -> None:
    # Execute / Assert
    assert dict(leftover_runs(processes, base=BASE, current="pytest-9")) == expected
