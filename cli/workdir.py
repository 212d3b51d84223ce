"""Tasks named ``package.module:object`` import from the current directory, in every command that loads one."""

from __future__ import annotations

import os
import sys


def importable_here() -> None:
    """Let ``package.module:object`` tasks import from the current directory, as ``python -m`` does,
    in this process and in Ray's workers (which inherit PYTHONPATH).

    ``fedge simulate`` and ``fedge export`` both call it, so a task that one imports from the
    directory it was run in, the other does too (``fedge export`` used to need ``PYTHONPATH=.``).
    """
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH", "")]))
