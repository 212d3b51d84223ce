"""fedge's built-in tasks, and :func:`load_task`, which finds the task a run names.

Each module registers its tasks with :func:`fedge.task.registry.register_task` when
imported; the package imports every module, so a new task file needs no line here.
"""

import importlib
import pkgutil

from fedge.tasks.loading import check_task, load_task, task_reference

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["check_task", "load_task", "task_reference"]
