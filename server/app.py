"""The coordinator's ``ServerApp``: one federated run, from run config to run report.

The same app runs in fedge's inline simulator, on Flower's Ray simulation
engine and under a SuperLink. It reads the run config, builds the strategy,
evaluates the global model centrally after every round, checkpoints it, and
writes the run directory (see :mod:`fedge.server.report`).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedge.clients.data import FederatedData, federated_data
from fedge.clients.models import build_model, load_arrays, model_arrays
from fedge.clients.profiles import parse_fleet
from fedge.clients.training import as_dataset, evaluate, pick_device
from fedge.config import Scalar, config_fingerprint, resolve_run_config
from fedge.edge.export import PARITY_TOLERANCE
from fedge.errors import ConfigError
from fedge.server.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fedge.server.progress import RoundProgress
from fedge.server.report import append_jsonl, plot_accuracy, run_dir_for, write_json_atomic
from fedge.server.validation import ReplyValidator
from fedge.simulation.clock import MeteredGrid
from fedge.strategies import STRATEGIES, FedAvg

if TYPE_CHECKING:
    from fedge.edge.build import BuiltBundle

log = logging.getLogger("fedge.server")

TRAIN_KEYS = ("local-epochs", "batch-size", "learning-rate", "momentum")


def make_server_app(
    config_defaults: Mapping[str, Any] | None = None, *, progress: bool = True
) -> ServerApp:
    """A ServerApp whose run config falls back to ``config_defaults`` then fedge's defaults."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_coordinator(grid, resolve_run_config({**(config_defaults or {}),
                                                  **context.run_config}), progress=progress)

    return app


app = make_server_app()


def build_strategy(config: Mapping[str, Scalar], num_nodes: int) -> FedAvg:
    """The strategy named by ``strategy``, sampling ``clients-per-round`` of ``num_nodes``."""
    per_round = int(config["clients-per-round"])
    if per_round > num_nodes:
        raise ConfigError(f"clients-per-round = {per_round} exceeds the fleet's {num_nodes} "
                          "devices; lower clients-per-round or enlarge the fleet")
    return STRATEGIES[str(config["strategy"])](
        validator=ReplyValidator(max_num_examples=int(config["max-num-examples"])),
        min_train_replies=min(int(config["min-train-replies"]), per_round),
        fraction_train=per_round / num_nodes,
        min_train_nodes=per_round,
        min_available_nodes=per_round,
        fraction_evaluate=float(config["fraction-evaluate"]),
        min_evaluate_nodes=0 if not config["fraction-evaluate"] else 1,
    )


def run_coordinator(grid: Grid, config: dict[str, Scalar], *, progress: bool = True) -> Path:
    """Run one federated training job on ``grid``; return the run directory.

    Everything that can be refused (config, fleet, data set, checkpoint) is checked
    before the run directory is created, so a refused run writes nothing.
    """
    fleet = parse_fleet(str(config["fleet"]), str(config["fleet-file"]))
    data = federated_data(config, fleet.size)
    model = build_model(str(config["model"]), data.num_features, data.num_classes,
                        seed=int(config["seed"]))
    if config["init-checkpoint"]:
        saved = load_checkpoint(str(config["init-checkpoint"])).arrays
        load_arrays(model, ArrayRecord({name: Array(value) for name, value in saved.items()}),
                    source=f"checkpoint '{config['init-checkpoint']}'")
    strategy = build_strategy(config, fleet.size)
    run_dir = run_dir_for(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / "config.json", config)
    log.info("effective run config: %s", json.dumps(config, sort_keys=True))
    log.info("run directory: %s", run_dir)

    metered = MeteredGrid(grid, fleet)
    recorder = RoundRecorder(run_dir, config, metered, strategy, data, model, progress=progress)
    random.seed(int(config["seed"]))  # Flower samples nodes with the global `random`
    train_config = ConfigRecord({key: config[key] for key in TRAIN_KEYS})
    with recorder.progress:
        strategy.start(metered, model_arrays(model), int(config["num-rounds"]),
                       timeout=float(config["round-timeout"]), train_config=train_config,
                       evaluate_fn=recorder.on_round_end)
    recorder.finish()
    return run_dir


class RoundRecorder:
    """Central evaluation + metrics/checkpoint after each round, summary at the end.

    Passed to ``Strategy.start`` as ``evaluate_fn``: Flower calls it with the
    initial arrays (round 0) and after every round.
    """

    def __init__(self, run_dir: Path, config: dict[str, Scalar], grid: MeteredGrid,
                 strategy: FedAvg, data: FederatedData, model: torch.nn.Module,
                 *, progress: bool) -> None:
        self.run_dir, self.config, self.grid, self.strategy = run_dir, config, grid, strategy
        self.model = model
        self.test_set = as_dataset(data.test)
        self.device = pick_device(str(config["device"]))
        self.started = time.perf_counter()
        self.rows: list[dict[str, Any]] = []
        self.progress = RoundProgress(int(config["num-rounds"]), enabled=progress)
        self.data = data
        self.bundles: list[BuiltBundle] = []
        (run_dir / "metrics.jsonl").write_text("")
        (run_dir / "checkpoints").mkdir(exist_ok=True)

    def on_round_end(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Evaluate ``arrays`` on the held-out test set and record the round."""
        load_arrays(self.model, arrays)
        loss, accuracy = evaluate(self.model, self.test_set, device=self.device)
        traffic = self.grid.take_round()
        report = self.strategy.reports[-1] if server_round and self.strategy.reports else None
        row = {
            "round": server_round,
            "accuracy": accuracy,
            "loss": loss,
            "sim_time_s": self.grid.sim_time,
            "wall_time_s": time.perf_counter() - self.started,
            "bytes_up": traffic.bytes_up,
            "bytes_down": traffic.bytes_down,
            "participants": sum(traffic.participants.values()),
            "participants_by_profile": dict(traffic.participants),
            "rejected": len(report.rejected) if report else 0,
            "rejections": [vars(r) for r in report.rejected] if report else [],
            "failed": len(report.failed) if report else 0,
            "aggregated": report.aggregated if report else False,
        }
        self.rows.append(row)
        append_jsonl(self.run_dir / "metrics.jsonl", row)
        checkpoint = Checkpoint(server_round=server_round,
                                arrays={name: array.numpy() for name, array in arrays.items()},
                                fingerprint=config_fingerprint(self.config), history=self.rows)
        save_checkpoint(self.run_dir / "checkpoints" / f"round-{server_round:04d}.npz", checkpoint)
        save_checkpoint(self.run_dir / "checkpoint.npz", checkpoint)
        every = int(self.config["export-every"])
        if self.config["export-onnx"] and every and server_round and server_round % every == 0:
            self._export_bundle(server_round)
        self.progress.advance(server_round, accuracy, self.grid.sim_time)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    def finish(self) -> dict[str, Any]:
        """Export the final model, plot, and write ``summary.json``."""
        last = self.rows[-1]
        summary: dict[str, Any] = {
            "final_accuracy": last["accuracy"],
            "final_loss": last["loss"],
            "best_accuracy": max(row["accuracy"] for row in self.rows),
            "rounds": last["round"],
            "sim_time_s": last["sim_time_s"],
            "wall_time_s": time.perf_counter() - self.started,
            "bytes_up": sum(row["bytes_up"] for row in self.rows),
            "bytes_down": sum(row["bytes_down"] for row in self.rows),
            "rejected": sum(row["rejected"] for row in self.rows),
            "failed": sum(row["failed"] for row in self.rows),
            "checkpoint": "checkpoint.npz",
            "config_fingerprint": config_fingerprint(self.config),
        }
        plot_accuracy(self.rows, self.run_dir / "accuracy.png",
                      f"{self.config['strategy']} on {self.config['dataset']}")
        if self.config["export-onnx"]:
            summary.update(self._final_export(last["round"]))
        write_json_atomic(self.run_dir / "summary.json", summary)
        return summary

    def _export_bundle(self, server_round: int) -> BuiltBundle:
        """Sign a bundle of the model as evaluated last (the global model after ``server_round``)."""
        from fedge.server.bundles import export_global_model, run_signing_key

        built = export_global_model(
            self.model, self.run_dir / "bundles" / f"round-{server_round:04d}", config=self.config,
            data=self.data, server_round=server_round, source_run=self.run_dir.name,
            private_key=run_signing_key(self.config, self.run_dir))
        self.bundles.append(built)
        return built

    def _final_export(self, final_round: int) -> dict[str, Any]:
        """The final bundle (unless just made), ``model.onnx`` beside it, and summary fields."""
        if not self.bundles or self.bundles[-1].manifest["round"] != final_round:
            self._export_bundle(final_round)
        latest = self.bundles[-1]
        shutil.copyfile(latest.path / "model.onnx", self.run_dir / "model.onnx")
        metrics = latest.manifest["metrics"]
        parity_ok = metrics["torch_onnx_max_abs_diff"] <= PARITY_TOLERANCE
        if not parity_ok:
            log.warning("ONNX export differs from torch by %.2e (> %.0e)",
                        metrics["torch_onnx_max_abs_diff"], PARITY_TOLERANCE)
        return {
            "onnx": {"path": "model.onnx", "max_abs_diff": metrics["torch_onnx_max_abs_diff"],
                     "parity_ok": parity_ok, "opset": latest.manifest["versions"]["opset"]},
            "latest_bundle": str(latest.path.relative_to(self.run_dir)),
            "bundles": [str(b.path.relative_to(self.run_dir)) for b in self.bundles],
            "edge": {**metrics, "int8_quantization": latest.manifest["variants"]["int8"]["quantization"]},
        }
