"""The task registry: built-in and user tasks by run-config name (``task = "<name>"``).

A registered entry is a factory ``(RunConfig) -> Task`` (a :class:`~fedge.task.api.Task`
subclass whose constructor takes the run config qualifies). Adding a task is one file with
``@register_task("name")`` plus tests; :func:`fedge.task.loading.load_task` also accepts
``"package.module:object"`` for tasks that live outside fedge.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from fedge.config import RunConfig
from fedge.errors import ConfigError

if TYPE_CHECKING:
    from fedge.task.api import Task

TaskFactory = Callable[[RunConfig], "Task"]
F = TypeVar("F", bound=Callable[..., object])

TASKS: dict[str, TaskFactory] = {}


def register_task(name: str) -> Callable[[F], F]:
    """Decorator: register a task factory (or Task class taking the run config) as ``name``."""
    def decorate(factory: F) -> F:
        if name in TASKS and TASKS[name] is not factory:
            raise ConfigError(f"two tasks registered as '{name}'; give one another name")
        TASKS[name] = factory  # type: ignore[assignment]
        return factory
    return decorate
