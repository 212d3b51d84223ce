"""``fedge export``: a signed bundle of any checkpointed round of a finished (or running) run."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from flwr.app import Array, ArrayRecord

from fedge import knobs
from fedge.config import resolve_run_config
from fedge.edge.build import BuiltBundle
from fedge.edge.signing import load_private_key
from fedge.errors import ConfigError
from fedge.server.bundles import export_global_model
from fedge.server.checkpoint import load_checkpoint
from fedge.task.api import seeded_model
from fedge.task.loading import load_task
from fedge.task.models import load_arrays


def export_run_round(
    run_dir: Path, *, server_round: int | None, key_path: Path, out_dir: Path, make_zip: bool,
    valid_for: dt.timedelta | None = None,
) -> BuiltBundle:
    """Rebuild the run's task and model from ``config.json`` and a checkpoint, then sign a bundle.

    The bundle carries the same ``model_id`` as the coordinator's bundles of the run
    and the checkpoint's round as ``version`` (see :func:`export_global_model`).
    """
    if not (run_dir / "config.json").exists():
        raise ConfigError(f"'{run_dir}' is not a fedge run directory (no config.json)")
    config = resolve_run_config(json.loads((run_dir / "config.json").read_text()))
    checkpoint = load_checkpoint(_checkpoint_path(run_dir, server_round))
    private_key = load_private_key(key_path)
    task = load_task(config)
    model = seeded_model(task, config.integer(knobs.SEED))
    load_arrays(model, ArrayRecord({k: Array(v) for k, v in checkpoint.arrays.items()}),
                source=f"checkpoint of round {checkpoint.server_round}")
    return export_global_model(model, out_dir, config=config, task=task,
                               server_round=checkpoint.server_round, source_run=run_dir.name,
                               private_key=private_key, make_zip=make_zip, valid_for=valid_for)


def _checkpoint_path(run_dir: Path, server_round: int | None) -> Path:
    if server_round is None:
        return run_dir / "checkpoint.npz"
    path = run_dir / "checkpoints" / f"round-{server_round:04d}.npz"
    if not path.exists():
        have = sorted(int(p.stem.split("-")[1]) for p in (run_dir / "checkpoints").glob("round-*.npz"))
        span = f"{have[0]}..{have[-1]}" if have else "none"
        raise ConfigError(f"run '{run_dir}' has no checkpoint for round {server_round}; rounds: {span}")
    return path
