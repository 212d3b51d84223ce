"""A runtime is one file: registered once, it trains in a run and every list of runtimes offers it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, Message, RecordDict

from fedge.clients.common import TrainOrder
from fedge.clients.runtimes import HANDLERS, RuntimeHandlers, handlers_for, register_handlers
from fedge.config import RunConfig, resolve_run_config
from fedge.errors import ConfigError
from fedge.profiles import RUNTIMES, Runtime, register_runtime
from fedge.simulation.runner import simulate
from fedge.task.api import Task

CALLS: list[str] = []


def _counted_train(msg: Message, context: Context, config: RunConfig, order: TrainOrder,
                   task: Task | None) -> RecordDict:
    CALLS.append("train")
    return handlers_for("torch").train(msg, context, config, order, task)


def _counted_evaluate(msg: Message, context: Context, config: RunConfig, task: Task | None) -> RecordDict:
    CALLS.append("evaluate")
    return handlers_for("torch").evaluate(msg, context, config, task)


@pytest.fixture
def counted() -> Iterator[str]:
    """A runtime a user's file registers: torch's handlers, counted."""
    register_runtime(Runtime("counted", False, "torch, counted"))
    register_handlers(RuntimeHandlers("counted", _counted_train, _counted_evaluate))
    CALLS.clear()
    yield "counted"
    RUNTIMES.pop("counted")
    HANDLERS.pop("counted")


def test_a_registered_runtime_trains_in_a_run(counted: str, fast_config: dict[str, Any]) -> None:
    # Execute
    _, summary = simulate({**fast_config, "runtime": counted, "num-rounds": 2}, progress=False)
    # Assert: every device of both rounds trained through it (4 a round)
    assert CALLS.count("train") == 8
    assert summary["rounds"] == 2


def test_a_registered_runtime_is_offered_by_the_knob_and_a_profile(counted: str) -> None:
    # Execute
    resolve_run_config({"runtime": counted})
    with pytest.raises(ConfigError) as unknown:
        resolve_run_config({"runtime": "tflite"})
    # Assert
    assert "use one of: profile, torch, onnx, counted" in str(unknown.value)


def test_the_built_in_runtimes_each_have_handlers_and_a_help_line() -> None:
    # Execute
    shown = subprocess.run([sys.executable, "-m", "fedge.cli.main", "device", "--help"], capture_output=True,
                           text=True, check=True, cwd=Path(__file__).parent).stdout
    # Assert
    assert set(HANDLERS) >= set(RUNTIMES) == {"torch", "onnx"}
    assert "--runtime {torch,onnx}" in shown and "no torch: phones, browsers" in " ".join(shown.split())


def test_handlers_for_a_runtime_nobody_declared_are_refused_saying_where_to_declare_it() -> None:
    # Execute / Assert
    with pytest.raises(ConfigError, match=r"runtime 'tflite' has handlers but no fedge.profiles.register_runtime"):
        register_handlers(RuntimeHandlers("tflite", _counted_train, _counted_evaluate))
