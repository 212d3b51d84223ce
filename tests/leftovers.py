"""Processes an earlier test run left running: a pytest worker killed mid-deployment never tears it down.

Its coordinator, SuperLink, devices and browsers then take CPU from every later run on the machine (seen: a
stopped run's two-gateway deployment ran on for 25 minutes, through the first 14 of the next run). The suite
names them at its start (tests/conftest.py), with the command that ends them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import psutil


def leftover_runs(processes: Iterable[str], *, base: Path, current: str) -> Counter[str]:
    """How many of ``processes`` (each its command line and environment, as one string) belong to each run
    folder ``base/pytest-N`` other than ``current``."""
    pattern = re.compile(re.escape(str(base)) + r"/(pytest-\d+)(?:/|\b)")
    found: Counter[str] = Counter()
    for text in processes:
        runs = {match.group(1) for match in pattern.finditer(text)} - {current}
        found.update(runs)
    return found


def running_processes() -> Iterable[str]:
    """Each process's command line and environment (those this user may read)."""
    for process in psutil.process_iter(["cmdline"]):
        try:
            environ = process.environ()
        except psutil.Error:
            environ = {}
        yield " ".join([*(process.info["cmdline"] or []), *environ.values()])


def leftover_warning(base: Path, current: str) -> str | None:
    """One line naming the earlier runs still running and how to end them, or None."""
    runs = leftover_runs(running_processes(), base=base, current=current)
    if not runs:
        return None
    named = ", ".join(f"{run} ({count} processes)" for run, count in sorted(runs.items()))
    return (f"WARNING: processes of other test runs are running and take CPU from this one: {named}; a run killed "
            f"before it ended leaves its deployments running: end them with `pkill -f {base}/pytest-N/`")
