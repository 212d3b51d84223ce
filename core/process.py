"""Starting Flower's processes the same way on both sides (coordinator and device).

Every Flower process fedge starts gets the same environment: Flower's home under the
caller's state directory, telemetry, update checks and runtime dependency installation
off, and the console scripts of the interpreter fedge runs in.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Settable Flower knobs that lower round latency (see bench/deploy_latency.py).
SUPEREXEC_POLL_S = "0.1"


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for every Flower process fedge starts."""
    return {
        **os.environ,
        # Flower starts its helpers (flower-superexec, flwr-serverapp, ...) from PATH.
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "FLWR_HOME": str(flwr_home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": os.environ.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL",
                                                            SUPEREXEC_POLL_S),
    }


def flower_bin(name: str) -> str:
    """A Flower console script next to this interpreter (the same virtualenv)."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name
