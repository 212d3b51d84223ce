"""Devices without torch: the onnx runtime trains with the run's signed training graph (issue 15).

Real parts: the training graph exported from the task, signed with Ed25519, verified by
the device, run by onnxruntime; the same ClientApp the torch devices run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedge import wire
from fedge.clients.app import make_default_client_app
from fedge.config import resolve_run_config
from fedge.errors import BundleVerificationError, ConfigError
from fedge.server.bundles import run_signing_key
from fedge.server.training_bundle import (
    SIGNING_PUBLIC_KEY,
    TRAINING_BUNDLE,
    export_training_graph,
    wants_training_graph,
    write_run_training_bundle,
)
from fedge.simulation.runner import simulate
from fedge.task.api import seeded_model
from fedge.task.loading import load_task
from fedge.task.models import model_arrays

FLEET_TOML = """
[profiles.phone-onnx]
compute-rate = 200.0
uplink-mbps = 2.0
downlink-mbps = 10.0
memory-mb = 2048
runtime = "onnx"

[fleet]
phone-onnx = 4
laptop = 4
"""


def _run_with_training_bundle(tmp_path: Path, **overrides: Any) -> tuple[dict[str, Any], str]:
    """A run config whose run directory holds a signed training bundle; its architecture hash."""
    config = resolve_run_config({"fleet": "laptop=4", "model": "mlp", "local-epochs": 1,
                                 "run-dir": str(tmp_path / "run"), **overrides})
    task = load_task(config)
    model = seeded_model(task, config.integer("seed"))
    graphs, metrics = export_training_graph(task, model, config)
    run_dir = Path(config.text("run-dir"))
    manifest = write_run_training_bundle(graphs, metrics, task, run_dir,
                                         private_key=run_signing_key(config, run_dir))
    return dict(config), str(manifest["architecture"])


def _instruction(config: dict[str, Any], architecture: str, **extra: Any) -> Message:
    task = load_task(resolve_run_config(config))
    weights = model_arrays(seeded_model(task, int(config["seed"])))
    settings = ConfigRecord({wire.SERVER_ROUND: 1, wire.TRAINING_GRAPH: architecture, **extra})
    return Message(RecordDict({wire.ARRAYS: weights, wire.CONFIG: settings}), dst_node_id=5, message_type="train")


def _context(config: dict[str, Any], runtime: str) -> Context:
    return Context(run_id=1, node_id=5, state=RecordDict(), run_config=config,
                   node_config={"partition-id": 1, "num-partitions": 4, "profile": "laptop", "runtime": runtime})


def _arrays(reply: Message) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in reply.content[wire.ARRAYS].items()}


@pytest.mark.parametrize("extra", [{}, {"proximal-mu": 0.1}, {"local-budget": "time", "time-budget-s": 0.5}],
                         ids=["sgd-momentum", "fedprox", "time-budget"])
def test_an_onnx_device_sends_the_update_a_torch_device_sends(extra: dict[str, Any], tmp_path: Path) -> None:
    # Prepare: one device, one round, one instruction; the run's signed training graph
    config, architecture = _run_with_training_bundle(tmp_path)
    app = make_default_client_app()
    # Execute: the same device (same partition, same seed) once on torch, once on onnx
    by_torch = app(_instruction(config, architecture, **extra), _context(config, "torch"))
    by_onnx = app(_instruction(config, architecture, **extra), _context(config, "onnx"))
    # Assert: the same weights within 1e-5, the same counts and loss
    torch_arrays, onnx_arrays = _arrays(by_torch), _arrays(by_onnx)
    assert torch_arrays.keys() == onnx_arrays.keys()
    assert max(float(np.max(np.abs(torch_arrays[k] - onnx_arrays[k]))) for k in torch_arrays) <= 1e-5
    torch_meta, onnx_meta = by_torch.content[wire.REPLY_META], by_onnx.content[wire.REPLY_META]
    assert onnx_meta[wire.STEPS] == torch_meta[wire.STEPS] > 0
    assert onnx_meta[wire.SAMPLES_PROCESSED] == torch_meta[wire.SAMPLES_PROCESSED]
    torch_loss = by_torch.content[wire.METRICS][wire.TRAIN_LOSS]
    assert abs(by_onnx.content[wire.METRICS][wire.TRAIN_LOSS] - torch_loss) <= 1e-5  # type: ignore[operator]


def test_an_onnx_device_evaluates_as_a_torch_device_does(tmp_path: Path) -> None:
    # Prepare
    config, architecture = _run_with_training_bundle(tmp_path)
    app = make_default_client_app()
    message = _instruction(config, architecture)
    evaluate = Message(RecordDict({wire.ARRAYS: message.content[wire.ARRAYS]}), dst_node_id=5,
                       message_type="evaluate")
    # Execute
    by_torch = app(evaluate, _context(config, "torch")).content[wire.METRICS]
    by_onnx = app(Message(evaluate.content, dst_node_id=5, message_type="evaluate"),
                  _context(config, "onnx")).content[wire.METRICS]
    # Assert: loss and accuracy (what the digits task measures) agree; the same example count
    for name in ("eval-loss", "eval-accuracy"):
        assert abs(float(by_onnx[name]) - float(by_torch[name])) <= 1e-5  # type: ignore[arg-type]
    assert by_onnx[wire.NUM_EXAMPLES] == by_torch[wire.NUM_EXAMPLES]


def test_an_onnx_device_refuses_a_graph_of_another_architecture(tmp_path: Path) -> None:
    # Prepare: the instruction names another architecture than the device holds
    config, _ = _run_with_training_bundle(tmp_path)
    app = make_default_client_app()
    # Execute / Assert: the round is refused with what to do, nothing is trained
    with pytest.raises(ConfigError, match="fedge pull --kind training"):
        app(_instruction(config, "0" * 64), _context(config, "onnx"))


def test_an_onnx_device_refuses_a_tampered_graph(tmp_path: Path) -> None:
    # Prepare: an attacker with write access to the bundle swaps in another graph (a replayed eval graph)
    config, architecture = _run_with_training_bundle(tmp_path)
    path = Path(config["run-dir"]) / TRAINING_BUNDLE
    with zipfile.ZipFile(path) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    entries["train.onnx"] = entries["eval.onnx"]
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    # Execute / Assert: the signature's hashes catch it before onnxruntime sees the graph
    with pytest.raises(BundleVerificationError):
        make_default_client_app()(_instruction(config, architecture), _context(config, "onnx"))


def test_a_simulated_fleet_mixes_torch_and_onnx_devices(tmp_path: Path) -> None:
    # Prepare: 4 onnx phones and 4 torch laptops, every device every round
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET_TOML)
    overrides = {"fleet-file": str(fleet), "clients-per-round": 8, "num-rounds": 2, "model": "mlp",
                 "local-epochs": 1, "run-dir": str(tmp_path / "run")}
    # Execute
    run_dir, summary = simulate(overrides, progress=False)
    # Assert: both runtimes' updates were accepted every round, and the model learned
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows[1:]:  # rows[0]: the initial model, before any training
        assert set(row["bytes_up_by_profile"]) == {"phone-onnx", "laptop"}
        assert row["rejected"] == 0 and row["failed"] == 0
    assert summary["final_accuracy"] > 0.5  # 10 classes: chance is 0.1
    assert (run_dir / TRAINING_BUNDLE).is_file() and (run_dir / SIGNING_PUBLIC_KEY).is_file()


def test_a_fleet_of_onnx_devices_learns_what_a_torch_fleet_learns(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the same run twice; in the onnx one, torch's local training raises if any device calls it
    import fedge.clients.torch_client as torch_client

    overrides = {"fleet": "phone=4,laptop=2", "clients-per-round": 4, "num-rounds": 2, "model": "mlp",
                 "local-epochs": 1}
    _, on_torch = simulate({**overrides, "runtime": "torch", "run-dir": str(tmp_path / "torch")}, progress=False)

    def forbidden(*_: Any, **__: Any) -> Any:
        raise AssertionError("an onnx device trained with torch")

    monkeypatch.setattr(torch_client, "train_local", forbidden)
    # Execute
    _, on_onnx = simulate({**overrides, "runtime": "onnx", "run-dir": str(tmp_path / "onnx")}, progress=False)
    # Assert: every round completed without torch, to the torch fleet's accuracy (same devices, same batches)
    assert on_onnx["rounds"] == 2 and on_onnx["failed"] == 0 and on_onnx["rejected"] == 0
    assert abs(on_onnx["final_accuracy"] - on_torch["final_accuracy"]) <= 0.005


@pytest.mark.parametrize(("runtime", "fleet", "simulated", "expected"), [
    ("profile", "phone=2", True, False),   # built-in profiles train with torch
    ("onnx", "phone=2", True, True),
    ("torch", "phone=2", False, False),    # the operator said every device runs torch
    ("profile", "phone=2", False, True),   # deployed devices choose their runtime
])
def test_the_training_graph_is_made_when_some_device_may_need_it(runtime: str, fleet: str, simulated: bool,
                                                                 expected: bool) -> None:
    from fedge.profiles import parse_fleet

    config = resolve_run_config({"runtime": runtime, "fleet": fleet})
    assert wants_training_graph(config, parse_fleet(fleet), simulated=simulated) is expected


def test_a_custom_profile_runtime_is_checked() -> None:
    from fedge.profiles import DeviceProfile

    with pytest.raises(ConfigError, match="runtime must be one of torch, onnx"):
        DeviceProfile("watch", compute_rate=1.0, uplink_mbps=1.0, downlink_mbps=1.0, memory_mb=1, runtime="tflite")


def test_the_onnx_device_modules_import_without_torch() -> None:
    # Execute: a process in which `import torch` fails loads everything an onnx device runs
    code = ("import sys; sys.modules['torch'] = None\n"
            "import fedge.clients.app, fedge.clients.onnx_client, fedge.edge.trainer, fedge.edge.delivery\n"
            "print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    # Assert
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
