"""fedge's built-in tasks (digits, synthetic, images, chars, diabetes, npz/csv files), one file each.

Each module registers its tasks with :func:`fedge.task.registry.register_task` when imported;
the package imports every module, so a new task file needs no line here.
:func:`fedge.task.loading.load_task` imports this package before it looks a name up.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
