"""Per-round bookkeeping of a run: central evaluation, metrics, checkpoints, bundles, summary."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord, MetricRecord

from fedge import knobs
from fedge.config import RunConfig, config_fingerprint, model_keys
from fedge.errors import RunFailed
from fedge.server.checkpoint import Checkpoint, save_checkpoint
from fedge.server.metering import MeteredGrid
from fedge.server.progress import RoundProgress
from fedge.server.report import append_jsonl, plot_headline, run_title, write_json_atomic
from fedge.strategies import FedAvg
from fedge.task.api import Task, best, headline_of
from fedge.task.models import load_arrays
from fedge.task.training import evaluate, pick_device
from fedge.wire import EVAL_PREFIX

if TYPE_CHECKING:
    from fedge.edge.build import BuiltBundle

log = logging.getLogger("fedge.server")


class RoundRecorder:
    """Central evaluation + metrics/checkpoint after each round, summary at the end.

    Passed to ``Strategy.start`` as ``evaluate_fn``: Flower calls it with the
    initial arrays (round 0) and after every round.
    """

    def __init__(self, run_dir: Path, config: RunConfig, grid: MeteredGrid,
                 strategy: FedAvg, task: Task, model: torch.nn.Module,
                 *, progress: bool, history: list[dict[str, Any]] | None = None,
                 widths: Sequence[float] = ()) -> None:
        self.run_dir, self.config, self.grid, self.strategy = run_dir, config, grid, strategy
        self.widths = sorted({float(width) for width in widths if width < 1})  # sub-models: evaluated, bundled
        self.model, self.task = model, task
        self.test_set = task.central_data()  # None: the devices' federated evaluation is recorded instead
        self.device = pick_device(config.text(knobs.DEVICE))
        self.rows: list[dict[str, Any]] = list(history or [])
        done = self.rows[-1] if self.rows else {"round": 0, "sim_time_s": 0.0, "wall_time_s": 0.0}
        self.started = time.perf_counter() - float(done.get("wall_time_s", 0.0))  # a resumed run's clocks go on
        grid.sim_time = float(done.get("sim_time_s", 0.0))
        self.progress = RoundProgress(config.integer(knobs.NUM_ROUNDS), task.headline, enabled=progress)
        self.progress.advance(int(done["round"]), done.get("headline"), grid.sim_time)
        self.bundles: list[BuiltBundle] = []
        self.width_bundles: list[BuiltBundle] = []  # sub-models: one per trained width and exported round
        rows = "".join(json.dumps(row, sort_keys=True) + "\n" for row in self.rows)
        (run_dir / "metrics.jsonl").write_text(rows)
        if not self.rows:
            (run_dir / "devices.jsonl").write_text("")
        (run_dir / "checkpoints").mkdir(exist_ok=True)

    def on_round_end(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Evaluate ``arrays`` on the central data (or take the devices' evaluation) and record the round."""
        load_arrays(self.model, arrays)
        metrics = self._metrics(server_round)
        by_width = self._headline_by_width(metrics)
        traffic = self.grid.take_round()
        report = self.strategy.reports[-1] if server_round and self.strategy.reports else None
        row = {
            "round": server_round,
            **metrics,
            "metric": self.task.headline,
            "metric_names": sorted(metrics),
            "headline": headline_of(metrics, self.task),
            "higher_is_better": self.task.higher_is_better,
            "evaluation": "central" if self.test_set is not None else "federated",
            "sim_time_s": self.grid.sim_time,
            "wall_time_s": time.perf_counter() - self.started,
            "bytes_up": traffic.bytes_up,
            "bytes_down": traffic.bytes_down,
            "participants": sum(traffic.participants.values()),
            "participants_by_profile": dict(traffic.participants),
            "bytes_up_by_profile": dict(traffic.bytes_up_by_profile),
            "bytes_down_by_profile": dict(traffic.bytes_down_by_profile),
            "rejected": len(report.rejected) if report else 0,
            "rejections": [vars(r) for r in report.rejected] if report else [],
            "failed": len(report.failed) if report else 0,
            "late": report.late if report else 0,
            "inputs_raw": report.inputs_raw if report else 0,
            "inputs_outside": report.inputs_outside if report else 0,
            "clipped_gateways": report.clipped_gateways if report else 0,
            "clipped_devices": report.clipped_devices if report else 0,
            "capped_devices": report.capped_devices if report else 0,
            "stale_devices": report.stale_devices if report else 0,
            "secagg_clipped_entries": report.secagg_clipped_entries if report else 0,
            "secagg_clipped_devices": report.secagg_clipped_devices if report else 0,
            "secagg_capped_weights": report.secagg_capped_weights if report else 0,
            "dp_out_of_range": report.dp_out_of_range if report else 0,
            "group_norms": report.group_norms if report else [],
            "gateway_norms": report.gateway_norms if report else [],  # before the coordinator clipped them
            "device_norm_medians": report.device_norm_medians if report else [],  # each plain gateway's devices'
            "device_norm_bound": report.norm_bounds[0] if report and report.norm_bounds else None,
            "gateway_norm_bound": report.norm_bounds[1] if report and report.norm_bounds else None,
            "train_loss": report.train_loss if report else None,
            "aggregated": report.aggregated if report else False,
        }
        if by_width:
            row["headline_by_width"] = by_width
        if self.strategy.privacy is not None:  # cumulative ε after this round, at the run's δ
            row["dp_epsilon"] = self.strategy.privacy.epsilon  # type: ignore[attr-defined]
            row["dp_delta"] = self.strategy.privacy.delta  # type: ignore[attr-defined]
        self.rows.append(row)
        append_jsonl(self.run_dir / "metrics.jsonl", row)
        self._log_devices(server_round, traffic.replies, report, row)
        checkpoint = Checkpoint(server_round=server_round,
                                arrays={name: array.numpy() for name, array in arrays.items()},
                                fingerprint=config_fingerprint(self.config), history=self.rows,
                                model_keys=model_keys(self.config),
                                strategy_state=self.strategy.checkpoint_state())
        save_checkpoint(self.run_dir / "checkpoints" / f"round-{server_round:04d}.npz", checkpoint)
        save_checkpoint(self.run_dir / "checkpoint.npz", checkpoint)
        every = self.config.integer(knobs.EXPORT_EVERY)
        if self.config[knobs.EXPORT_ONNX] and every and server_round and server_round % every == 0:
            if (why := self.unusable()) is None:
                self._export_bundle(server_round)
            else:
                log.warning("round %d: no bundle signed or published: %s", server_round, why)
        self.progress.advance(server_round, row["headline"], self.grid.sim_time)
        return MetricRecord(metrics)  # type: ignore[arg-type]

    def _metrics(self, server_round: int) -> dict[str, float]:
        """The task's metrics of the global model: on the central data, else the devices' weighted
        federated evaluation of this round (none for round 0, before any device saw the model)."""
        if self.test_set is not None:
            return evaluate(self.task, self.model, self.test_set, device=self.device)
        record = self.strategy.evaluated.get(server_round)
        if record is None:
            return {}
        means = {key.removeprefix(EVAL_PREFIX): float(value) for key, value in record.items()  # type: ignore[arg-type]
                 if key.startswith(EVAL_PREFIX)}
        return self.task.summarize(means)  # devices send unsummarised means: derived metrics stay exact

    def _headline_by_width(self, metrics: dict[str, float]) -> dict[str, float | None]:
        """Each trained width's model's headline on the central data (sub-models; empty otherwise)."""
        if not self.widths or self.test_set is None or self.strategy.submodels is None:
            return {}
        from fedge.server.submodels import width_model  # noqa: PLC0415

        plan, scaler = self.strategy.submodels.plan, self.strategy.submodels.scaler
        found = {f"{width:g}": headline_of(evaluate(self.task, width_model(self.task, self.model, plan, width,
                                                                           scaler=scaler),
                                                    self.test_set, device=self.device), self.task)
                 for width in self.widths}
        return {**found, "1": headline_of(metrics, self.task)}

    def _log_devices(self, server_round: int, replies: list[dict[str, Any]], report: Any,
                     row: dict[str, Any]) -> None:
        """Append this round's device replies to ``devices.jsonl`` (rejected ones marked)."""
        rejected = {r.node_id: r.reason for r in report.rejected} if report else {}
        names = self.device_names()
        with (self.run_dir / "devices.jsonl").open("a") as stream:
            for reply in replies:
                event = {"round": server_round, "sim_time_s": row["sim_time_s"], "wall_time_s": row["wall_time_s"],
                         **reply, "node_id": str(reply["node"])}  # ids as strings too: JSON readers lose digits
                if str(reply["node"]) in names:
                    event["name"] = names[str(reply["node"])]
                if reply["node"] in rejected:
                    event.update(status="rejected", reason=rejected[reply["node"]])
                stream.write(json.dumps(event, sort_keys=True) + "\n")

    @staticmethod
    def device_names() -> dict[str, str]:
        """``{node id: device name}`` from the coordinator's registered keys ({} in simulation)."""
        from fedge.server.coordinator import NAMES_ENV, read_names

        path = os.environ.get(NAMES_ENV)
        return read_names(Path(path)) if path else {}

    def finish(self) -> dict[str, Any]:
        """Export the final model, plot, and write ``summary.json``."""
        last = self.rows[-1]
        headline = self.task.headline
        summary: dict[str, Any] = {
            "task": self.task.name,
            "headline": headline,
            "higher_is_better": self.task.higher_is_better,
            "final_headline": last.get("headline"),
            "best_headline": best((row.get("headline") for row in self.rows), self.task),
            **{f"final_{name}": last[name] for name in last.get("metric_names", ())},
            f"final_{headline}": last.get("headline"),
            f"best_{headline}": best((row.get("headline") for row in self.rows), self.task),
            "rounds": last["round"],
            "sim_time_s": last["sim_time_s"],
            "wall_time_s": time.perf_counter() - self.started,
            "bytes_up": sum(row["bytes_up"] for row in self.rows),
            "bytes_down": sum(row["bytes_down"] for row in self.rows),
            "bytes_up_by_profile": _summed(row.get("bytes_up_by_profile", {}) for row in self.rows),
            "bytes_down_by_profile": _summed(row.get("bytes_down_by_profile", {}) for row in self.rows),
            "rejected": sum(row["rejected"] for row in self.rows),
            "failed": sum(row["failed"] for row in self.rows),
            "checkpoint": "checkpoint.npz",
            "config_fingerprint": config_fingerprint(self.config),
        }
        if self.strategy.privacy is not None:
            summary["dp"] = self.strategy.privacy.summary()  # type: ignore[attr-defined]
        if "headline_by_width" in last:  # sub-models: each trained width's model's final headline
            summary["final_headline_by_width"] = last["headline_by_width"]
        plot_headline(self.rows, self.run_dir / "headline.png", run_title(self.config, self.task.name), headline)
        why = self.unusable()
        if why is None and self.config[knobs.EXPORT_ONNX]:
            summary.update(self._final_export(last["round"]))
        if why is not None:
            summary["failure"] = why  # ("failed" counts the run's failed replies)
        write_json_atomic(self.run_dir / "summary.json", summary)
        if why is not None:
            raise RunFailed(f"{why}; nothing was signed or published (the run's records are in {self.run_dir})")
        return summary

    def unusable(self) -> str | None:
        """Why the global model must not be signed, published or called a result (None: it may be).

        No update accepted in any round (the model is the initial one), weights that are not
        finite, or a headline metric that is not finite (the model diverged: its outputs overflow).
        """
        if not any(row.get("aggregated") for row in self.rows if row["round"]):
            left_out: Counter[str] = Counter(r.reason for report in self.strategy.reports
                                             for r in [*report.rejected, *report.failed])
            common = f"; most often: {left_out.most_common(1)[0][0]}" if left_out else ""
            return (f"no device update was accepted in {self.rows[-1]['round']} round(s) "
                    f"({sum(left_out.values())} left out{common})")
        for name, tensor in self.model.state_dict().items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                return f"the global model is not finite ({name} holds NaN or inf)"
        headline = self.rows[-1].get("headline")
        if headline is not None and not math.isfinite(headline):
            return (f"the global model's {self.task.headline} is {headline} after round {self.rows[-1]['round']}: "
                    "it diverged (try a lower learning rate, or scale the data)")
        return None

    def _export_bundle(self, server_round: int) -> BuiltBundle:
        """Sign a bundle of the model as evaluated last (the global model after ``server_round``)."""
        from fedge.server.bundles import export_global_model, run_signing_key

        built = export_global_model(
            self.model, self.run_dir / "bundles" / f"round-{server_round:04d}", config=self.config,
            task=self.task, server_round=server_round, source_run=self.run_dir.name,
            private_key=run_signing_key(self.config, self.run_dir))
        self.bundles.append(built)
        self._export_width_bundles(server_round)
        if self.config[knobs.DEPLOYMENT]:  # under `fedge coordinator start`: hand it to the devices' bundle service
            from fedge.server.publish import publish_from_environment

            publish_from_environment("inference", built.path)
        return built

    def _export_width_bundles(self, server_round: int) -> None:
        """A signed bundle of each trained width's model beside the whole model's (``round-N-w0.25``): the
        model a device of that width can run, in its own lineage (``model_id`` ``<run>/<task>@w0.25``)."""
        if not self.widths or self.strategy.submodels is None:
            return
        from fedge.server.bundles import export_global_model, run_signing_key  # noqa: PLC0415
        from fedge.server.submodels import width_label, width_model  # noqa: PLC0415

        plan = self.strategy.submodels.plan
        for width in self.widths:
            built = export_global_model(
                width_model(self.task, self.model, plan, width, scaler=self.strategy.submodels.scaler),
                self.run_dir / "bundles" / f"round-{server_round:04d}-{width_label(width)}", config=self.config,
                task=self.task, server_round=server_round, source_run=self.run_dir.name,
                private_key=run_signing_key(self.config, self.run_dir), variant=width_label(width))
            self.width_bundles.append(built)
            if self.config[knobs.DEPLOYMENT]:  # devices of that width pull it (`fedge pull --width 0.25`)
                from fedge.edge.delivery import inference_kind  # noqa: PLC0415
                from fedge.server.publish import publish_from_environment  # noqa: PLC0415

                publish_from_environment(inference_kind(width), built.path)

    def _final_export(self, final_round: int) -> dict[str, Any]:
        """The final bundle (unless just made), ``model.onnx`` beside it, and summary fields."""
        from fedge.edge.export import PARITY_TOLERANCE  # onnx loads only for runs that export (0.6 s)

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
            **self._width_summary(final_round),
        }

    def _width_summary(self, final_round: int) -> dict[str, Any]:
        """The final round's bundle of each width and its fp32/int8 scores (sub-models; empty otherwise)."""
        latest = [b for b in self.width_bundles if b.manifest["round"] == final_round]
        if not latest:
            return {}
        return {"width_bundles": {b.manifest["model_name"].rsplit("@", 1)[1]: {
            "path": str(b.path.relative_to(self.run_dir)), **b.manifest["metrics"]} for b in latest}}


def _summed(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """Per-key totals of per-round counts."""
    total: Counter[str] = Counter()
    for count in counts:
        total.update(count)
    return dict(total)
