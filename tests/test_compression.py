"""Per-profile compression in whole runs: bytes per device class, downlink, bad payloads, bad settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, Context, Message
from flwr.clientapp import ClientApp

from fedge import wire
from fedge.cli.main import main
from fedge.clients.app import RESIDUAL, make_default_client_app
from fedge.config import resolve_run_config
from fedge.server.app import run_coordinator
from fedge.server.report import read_jsonl
from fedge.simulation.grid import InlineGrid
from fedge.simulation.runner import simulate

BASE = {"fleet": "phone=4,laptop=4,gpu-box=4", "clients-per-round": 12, "num-rounds": 2, "model": "mlp",
        "local-epochs": 1, "export-onnx": False, "min-train-replies": 1}


def _per_device(row: dict[str, Any], key: str) -> dict[str, float]:
    return {p: row[key][p] / row["participants_by_profile"][p] for p in row[key]}


def test_each_profile_uploads_in_its_own_codec(tmp_path: Path) -> None:
    # Prepare
    policy = {"codec.phone": "topk:0.05+int8", "codec.laptop": "int8", "codec.gpu-box": "fp32"}
    nodes = [{"partition-id": i, "num-partitions": 12, "profile": p}
             for i, p in enumerate(["phone"] * 4 + ["laptop"] * 4 + ["gpu-box"] * 4)]
    config = resolve_run_config({**BASE, **policy, "run-dir": str(tmp_path / "r")})
    grid = InlineGrid(make_default_client_app(), nodes, config)
    # Execute
    run_coordinator(grid, config, progress=False)
    # Assert: per device, int8 sends ~1/4 and top-5% + int8 ~1/27 of fp32's bytes (3 bytes per kept
    # entry: uint16 index + int8); the round used every update; phones keep a top-k residual
    rows = read_jsonl(tmp_path / "r" / "metrics.jsonl")[1:]
    for row in rows:
        up = _per_device(row, "bytes_up_by_profile")
        assert 3.9 < up["gpu-box"] / up["laptop"] < 4.1
        assert 20 < up["gpu-box"] / up["phone"] < 30
        assert row["aggregated"] and row["rejected"] == 0 and row["participants"] == 12
    states = [context.state.array_records.get(RESIDUAL) for context in grid.contexts.values()]
    assert [state is not None for state in states] == [True] * 4 + [False] * 8
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] - 0.05


def test_a_profile_can_ask_for_a_compressed_downlink(tmp_path: Path) -> None:
    # Execute
    run_dir, summary = simulate({**BASE, "downlink.phone": "fp16", "run-dir": str(tmp_path / "r")}, progress=False)
    # Assert: phones download about half the bytes of the others, every round aggregates
    row = read_jsonl(run_dir / "metrics.jsonl")[-1]
    down = _per_device(row, "bytes_down_by_profile")
    assert 1.9 < down["laptop"] / down["phone"] < 2.1 and down["laptop"] == down["gpu-box"]
    assert row["aggregated"]
    assert set(summary["bytes_down_by_profile"]) == {"phone", "laptop", "gpu-box"}


def _tampering(partition: int, corrupt: Any) -> ClientApp:
    """fedge's ClientApp, except that one device's encoded update is corrupted."""
    honest = make_default_client_app()
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = honest(msg, context)
        if int(context.node_config["partition-id"]) == partition:
            arrays = reply.content.array_records[wire.ARRAYS]
            name = next(iter(arrays))
            arrays[name] = corrupt(arrays[name])
        return reply

    return app


@pytest.mark.parametrize(("corrupt", "reason"), [
    (lambda a: Array(dtype=a.dtype, shape=a.shape, stype=a.stype, data=bytes(a.data)[:-3]), "bytes"),
    (lambda a: Array(dtype=a.dtype, shape=a.shape, stype="fedge.delta/lz4", data=bytes(a.data)), "unknown codec"),
    (lambda a: Array(dtype=a.dtype, shape=(3,), stype=a.stype, data=bytes(a.data)), "has shape (3,)"),
])
def test_a_malformed_encoded_update_is_rejected_and_the_round_goes_on(corrupt: Any, reason: str,
                                                                       tmp_path: Path) -> None:
    # Prepare: every device sends int8 deltas; device 0's payload is corrupted
    config = resolve_run_config({**BASE, "fleet": "laptop=4", "clients-per-round": 4, "codec.default": "int8",
                                 "run-dir": str(tmp_path / "r")})
    nodes = [{"partition-id": i, "num-partitions": 4, "profile": "laptop"} for i in range(4)]
    # Execute
    run_coordinator(InlineGrid(_tampering(0, corrupt), nodes, config), config, progress=False)
    # Assert: one rejection per round naming the problem; the other three updates are aggregated
    rows = read_jsonl(tmp_path / "r" / "metrics.jsonl")[1:]
    assert all(row["rejected"] == 1 and row["aggregated"] for row in rows)
    assert reason in rows[0]["rejections"][0]["reason"]


def test_fedbuff_decodes_each_delta_against_the_model_the_device_started_from(tmp_path: Path) -> None:
    # Execute
    run_dir, _ = simulate({**BASE, "strategy": "fedbuff", "concurrency": 6, "buffer-size": 3, "num-rounds": 3,
                           "codec.default": "int8", "run-dir": str(tmp_path / "r")}, progress=False)
    # Assert
    rows = read_jsonl(run_dir / "metrics.jsonl")[1:]
    assert all(row["aggregated"] and row["rejected"] == 0 for row in rows)


@pytest.mark.parametrize(("args", "reason"), [
    ("codec.phone='zstd'", "unknown codec 'zstd'"),
    ("codec.laptop='topk:2'", "fraction must be in (0, 1]"),
    ("codec.default='int8+topk:0.1'", "top-k must come first"),
    ("downlink.phone='topk:0.1'", "top-k cannot compress the downlink"),
    ("codec.tablet='int8'", "names profile 'tablet', which the fleet does not have"),
    ("codec.phone='int8' secure-aggregation=true", "cannot be combined with secure-aggregation"),
    ("codec.phone='int8' dp='server-fixed'", "cannot be combined with dp"),
    ("codec.phone=8", "must be a codec name string"),
])
def test_impossible_codec_settings_are_refused_at_start(args: str, reason: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--quiet", "--fleet", "phone=5,laptop=5", "--run-config", args,
                 "--run-dir", str(tmp_path / "r")])
    assert code == 2 and reason in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_decoded_updates_match_what_the_device_trained(tmp_path: Path) -> None:
    # Prepare: all devices every round, one run fp32 and one fp16 (deltas in half precision)
    runs = {codec: simulate({**BASE, "fleet": "laptop=4", "clients-per-round": 4, "num-rounds": 1,
                             "codec.default": codec, "run-dir": str(tmp_path / codec)}, progress=False)[0]
            for codec in ("fp32", "fp16")}
    # Assert: the same global model up to fp16 rounding of the deltas
    from fedge.server.checkpoint import load_checkpoint

    plain, half = (load_checkpoint(runs[c] / "checkpoint.npz").arrays for c in ("fp32", "fp16"))
    for name, value in plain.items():
        np.testing.assert_allclose(half[name], value, atol=1e-3)


def test_a_device_trained_from_a_lossy_downlink_sends_its_change_not_its_weights() -> None:
    # Prepare: an int8-encoded global model in the instruction, fp32 uplink
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    from fedge.codec import encode_tensor, parse_codec
    from fedge.task.models import build_model, model_arrays

    app = make_default_client_app()
    context = Context(run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 4, "profile": "laptop"},
                      state=RecordDict(), run_config={"fleet": "laptop=4", "model": "mlp", "local-epochs": 1})
    weights = model_arrays(build_model("mlp", 64, 10, seed=0))
    encoded = ArrayRecord({name: encode_tensor(array.numpy(), parse_codec("int8"), np.random.default_rng(0), full=True)
                           for name, array in weights.items()})
    message = Message(RecordDict({"arrays": encoded, "config": ConfigRecord({"server-round": 1})}),
                      dst_node_id=5, message_type="train")
    # Execute
    reply = app(message, context)
    # Assert: an fp32 delta (the coordinator adds it to its exact model, not to the int8 copy)
    assert {str(a.stype) for a in reply.content.array_records["arrays"].values()} == {"fedge.delta/fp32"}
