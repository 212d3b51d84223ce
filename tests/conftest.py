"""Shared fixtures: process identity for Flower messages, a fast run config."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.supercore.task_identity import TaskIdentity

from tests.live_gateway import live, run  # noqa: F401 - the gateway tests' fixtures (a live gateway, its run)

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
logging.getLogger("flwr").setLevel(logging.ERROR)


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    """Messages need a process-wide run/node identity, as in a ServerApp process."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


@pytest.fixture
def fast_config(tmp_path: Path) -> dict[str, Any]:
    """A small, quick simulation config writing into the test's tmp dir."""
    return {
        "fleet": "phone=6,laptop=3,gpu-box=1",
        "clients-per-round": 4,
        "num-rounds": 3,
        "model": "mlp",
        "local-epochs": 2,
        "run-dir": str(tmp_path / "run"),
    }


@pytest.fixture
def umask_zero() -> Iterator[None]:
    """The most permissive umask: every mode bit a call asks for is kept."""
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)
