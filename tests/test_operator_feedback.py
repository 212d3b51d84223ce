"""Issue 17: what the operator sees: round lines, a final line, device names, one-line errors, metrics."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedge.server.progress import RunFeed
from fedge.simulation.loopback import FEDGE, LoopbackFederation, free_port

FAST = "model='mlp' local-epochs=2 export-onnx=false round-timeout=900.0 runtime='torch'"


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[LoopbackFederation]:
    fed = LoopbackFederation(tmp_path, num_devices=2)
    yield fed
    fed.close()


def _rows(path: Path, rows: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_round_lines_name_devices_and_say_why_a_round_was_skipped(tmp_path: Path) -> None:
    # Prepare: a run directory as a deployed run writes it (round 2 not aggregated, a device failed)
    (tmp_path / "config.json").write_text(json.dumps({"num-rounds": 2, "clients-per-round": 2,
                                                      "min-train-replies": 2}))
    base = {"metric": "accuracy", "participants": 2, "aggregated": True, "rejections": []}
    _rows(tmp_path / "metrics.jsonl", [{**base, "round": 0, "headline": 0.1, "wall_time_s": 0.0},
                                       {**base, "round": 1, "headline": 0.5, "wall_time_s": 3.0},
                                       {**base, "round": 2, "headline": 0.5, "wall_time_s": 4.5,
                                        "participants": 1, "aggregated": False}])
    _rows(tmp_path / "devices.jsonl", [{"round": 2, "node": 8731211016109428095, "status": "error",
                                        "reason": "expected Float but found Double"}])
    (tmp_path / "summary.json").write_text(json.dumps({"rounds": 2, "wall_time_s": 4.5, "headline": "accuracy",
                                                       "final_headline": 0.5, "best_headline": 0.5}))
    lines: list[str] = []

    class Out:
        def write(self, text: str) -> None:
            lines.extend(line for line in text.splitlines() if line)

        def flush(self) -> None:
            pass

    feed = RunFeed(tmp_path, lambda: {"8731211016109428095": "phone-017"}, out=Out())  # type: ignore[arg-type]
    # Execute
    feed.poll()
    final = feed.final_lines()
    # Assert
    assert lines[0] == "round 1/2: 2/2 participants, accuracy 0.5000, 3.0 s"
    assert lines[1].startswith("round 2/2: 1/2 participants, accuracy 0.5000, 1.5 s; skipped: not aggregated")
    assert "phone-017 error: expected Float but found Double" in lines[1]
    assert final[0].startswith("run finished: 2 rounds in 4.5 s; final accuracy 0.5000")
    assert final[1] == "device failures: 1x expected Float but found Double (phone-017)"


@pytest.mark.slow
@pytest.mark.deployment
def test_a_run_reports_rounds_names_and_metrics_and_a_failing_run_one_line(federation: LoopbackFederation) -> None:
    # Prepare: two rounds, two devices, the dashboard on a free port
    port = free_port()
    federation.start_coordinator("--rounds", "2", "--clients-per-round", "2", "--run-config", FAST,
                                 "--dashboard", "--dashboard-port", str(port))
    for index in range(2):
        federation.start_device(index)
    # Execute
    federation.wait_for(lambda: "run finished" in federation.log("coordinator"), 900, "the final line")
    status = subprocess.run([FEDGE, "coordinator", "status", "--state-dir", str(federation.root / "state")],
                            capture_output=True, text=True, timeout=600)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/devices", timeout=10) as response:
        devices = json.loads(response.read())["devices"]
    assert federation.coordinator is not None and federation.coordinator.poll() is None  # still serving
    assert federation.stop(federation.coordinator) == 0
    # Assert: one line per round and a final line; names in status, devices.jsonl, the API
    log = federation.log("coordinator")
    assert "round 1/2: 2/2 participants, accuracy" in log and "round 2/2: 2/2 participants" in log, log
    assert "run finished: 2 rounds" in log
    assert "dev0 (node " in status.stdout and "dev1 (node " in status.stdout, status.stdout
    events = [json.loads(line) for line in (federation.run_dir / "devices.jsonl").read_text().splitlines()]
    assert {e["name"] for e in events} == {"dev0", "dev1"}
    assert all(e["node_id"] == str(e["node"]) for e in events)
    assert {d["name"] for d in devices} == {"dev0", "dev1"} and all(isinstance(d["node"], str) for d in devices)
    assert "fedge_rounds_completed 2" in metrics and 'fedge_bytes_total{direction="up"}' in metrics
    assert federation.leftovers(federation.root / "state") == []
    # Execute: a run that fails inside the ServerApp (its init checkpoint is missing)
    federation.run_dir = federation.root / "failing"
    federation.start_coordinator("--rounds", "1", "--clients-per-round", "2", "--run-config",
                                 FAST + " init-checkpoint='/nonexistent/ckpt.npz'")
    # Assert: exit 1, one line naming the error, no traceback on the console
    assert federation.coordinator is not None and federation.coordinator.wait(600) == 1
    log = federation.log("coordinator").split("run finished")[-1]
    assert "fedge: error: the run failed: CheckpointMismatch: checkpoint '/nonexistent/ckpt.npz' does not exist" in log
    assert "Traceback" not in log and "Exit Code" not in log


@pytest.mark.parametrize("runtime", ["torch", "onnx"])
def test_a_deployed_device_prints_round_samples_loss_and_bytes(runtime: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: a deployed device (its own data file) and a run whose directory holds the signed training graph
    import numpy as np
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from fedge import wire
    from fedge.clients.app import make_default_client_app
    from fedge.config import resolve_run_config
    from fedge.server.bundles import run_signing_key
    from fedge.server.training_bundle import (
        SIGNING_PUBLIC_KEY,
        TRAINING_BUNDLE,
        export_training_graph,
        write_run_training_bundle,
    )
    from fedge.task.api import seeded_model
    from fedge.task.loading import load_task
    from fedge.task.models import model_arrays

    config = resolve_run_config({"model": "logreg", "local-epochs": 1, "batch-size": 10,
                                 "run-dir": str(tmp_path / "run")})
    task = load_task(config)
    model = seeded_model(task, 42)
    run_dir = tmp_path / "run"
    graphs, metrics = export_training_graph(task, model, config)
    write_run_training_bundle(graphs, metrics, task, run_dir, private_key=run_signing_key(config, run_dir))
    shard = task.partition(0, 10, config)
    np.savez(tmp_path / "mine.npz", x=shard.inputs[0][:30], y=shard.targets[:30])
    node = {"data-path": str(tmp_path / "mine.npz"), "profile": "phone", "runtime": runtime,
            "training-bundle": str(run_dir / TRAINING_BUNDLE), "trusted-key": str(run_dir / SIGNING_PUBLIC_KEY)}
    context = Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config=dict(config))
    message = Message(RecordDict({wire.ARRAYS: model_arrays(model), wire.CONFIG: ConfigRecord({wire.SERVER_ROUND: 3})}),
                      dst_node_id=7, message_type="train")
    # Execute
    make_default_client_app()(message, context)
    # Assert: 30 examples in batches of 10 is 3 steps; 64 x 10 + 10 float32 weights travel back (2,600
    # bytes), each of the 2 arrays with its .npy header (at most 256 bytes)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"round 3: trained 30 samples in 3 steps ({runtime}), loss ")
    sent = int(line.removesuffix(" bytes to send").rsplit(", ", 1)[1].replace(",", ""))
    assert (64 * 10 + 10) * 4 < sent <= (64 * 10 + 10) * 4 + 2 * 256
