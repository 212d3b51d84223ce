"""A task's declared preprocessing, applied the same way on every runtime (issue 25 item 5).

A deployed device's own file may hold raw inputs (digits' grey levels 0..16) or inputs already
scaled (0..1, what simulation trains on). Torch devices and onnx devices (the signed training
manifest carries the preprocessing) both scale raw files as the task declares, mark their
replies, and the coordinator counts devices whose inputs fall outside the declared range.
Real parts: the digits task, a signed training graph run by onnxruntime, fedge's ClientApp.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from hypothesis import given
from hypothesis import strategies as st

from fedge import wire
from fedge.clients.app import make_default_client_app
from fedge.config import resolve_run_config
from fedge.errors import ConfigError
from fedge.preprocessing import AS_GIVEN, OUTSIDE, RAW_SCALED, Preprocessing, prepare_device_inputs
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

DIGITS = {"kind": "affine", "scale": 1 / 16, "offset": 0.0, "raw-range": [0, 16]}


# --- the rule, on arrays -------------------------------------------------------------------

@pytest.mark.parametrize(("inputs", "verdict", "first"), [
    (np.array([[0.0, 0.5, 1.0]], np.float32), AS_GIVEN, 0.5),        # scaled already: used as it is
    (np.array([[0, 8, 16]], np.float32), RAW_SCALED, 0.5),            # grey levels (loaders cast to float32): 8 / 16
    (np.array([[0.0, 8.0, 16.5]], np.float32), RAW_SCALED, 0.5),      # a small overshoot is inside
    (np.array([[0.0, 300.0, 16.0]], np.float32), OUTSIDE, 300.0),     # neither: used as it is, reported
    (np.array([[-3.0, 0.5, 1.0]], np.float32), OUTSIDE, 0.5),
])
def test_a_devices_inputs_are_judged_against_the_declared_ranges(inputs: np.ndarray, verdict: str,
                                                                  first: float) -> None:
    # Execute
    (prepared,), got = prepare_device_inputs((inputs,), DIGITS)
    # Assert
    assert got == verdict and float(prepared[0, 1]) == pytest.approx(first)


def test_without_a_declared_range_nothing_is_guessed() -> None:
    # Execute: raw-looking grey levels, but the task declares no raw range
    (prepared,), verdict = prepare_device_inputs((np.array([[0, 8, 16]]),), {"kind": "affine", "scale": 1 / 16})
    # Assert
    assert verdict == AS_GIVEN and prepared.tolist() == [[0, 8, 16]]


@pytest.mark.parametrize(("spec", "match"), [
    ({"kind": "affine", "scale": "1/16"}, "'scale' must be a finite number"),
    ({"kind": "affine", "scale": float("nan")}, "'scale' must be a finite number"),
    ({"kind": "affine", "scale": 0}, "'scale' is 0"),
    ({"kind": "affine", "scale": 0.5, "raw-range": [16, 0]}, r"'raw-range' must be \[low, high\] with low < high"),
    ({"kind": "affine", "raw-range": [0]}, "'raw-range' must be"),
    ({"kind": 3}, "'kind' must be a string"),
])
def test_a_malformed_preprocessing_entry_is_refused_by_field(spec: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Preprocessing.of(spec)


def test_a_tasks_own_kind_keeps_its_own_fields() -> None:
    # Prepare: diabetes-like per-feature statistics (lists where affine has numbers)
    spec = {"kind": "standardize", "mean": [1.0, 2.0], "std": [0.5, 0.5]}
    # Execute / Assert: read without complaint, never applied by fedge, nothing judged
    assert Preprocessing.of(spec).kind == "standardize"
    assert prepare_device_inputs((np.array([[9.0, 9.0]]),), spec)[1] == AS_GIVEN


@given(st.lists(st.integers(0, 16), min_size=1, max_size=64))
def test_raw_values_in_the_raw_range_land_in_the_model_range(values: list[int]) -> None:
    # Execute
    scaled = Preprocessing.of(DIGITS).apply(np.array(values))
    # Assert: float32, within [0, 1], exactly value / 16
    assert scaled.dtype == np.float32 and float(scaled.min()) >= 0 and float(scaled.max()) <= 1
    np.testing.assert_array_equal(scaled, np.array(values, np.float32) / np.float32(16))


# --- on devices --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A digits run with its signed training graph, and one device's partition as three files:
    scaled (as simulation trains), raw grey levels 0..16, and values far outside both ranges."""
    root = tmp_path_factory.mktemp("device")
    config = resolve_run_config({"fleet": "laptop=4", "model": "mlp", "local-epochs": 1,
                                 "run-dir": str(root / "run")})
    task = load_task(config)
    model = seeded_model(task, config.integer("seed"))
    graphs, metrics = export_training_graph(task, model, config)
    run_dir = Path(config.text("run-dir"))
    manifest = write_run_training_bundle(graphs, metrics, task, run_dir, private_key=run_signing_key(config, run_dir))
    data = task.partition(1, 4, config)
    (x,), y = data.inputs, data.targets
    files = {"scaled": x, "raw": np.round(x * 16).astype(np.int64), "outside": x * 1000}
    for name, inputs in files.items():
        np.savez(root / f"{name}.npz", x=inputs, y=y)
    return {"config": dict(config), "architecture": manifest["architecture"], "root": root, "run_dir": run_dir}


def _train(deployment: dict[str, Any], runtime: str, file: str) -> Message:
    config = deployment["config"]
    task = load_task(resolve_run_config(config))
    settings = ConfigRecord({wire.SERVER_ROUND: 1, wire.TRAINING_GRAPH: deployment["architecture"]})
    instruction = Message(RecordDict({wire.ARRAYS: model_arrays(seeded_model(task, int(config["seed"]))),
                                      wire.CONFIG: settings}), dst_node_id=5, message_type="train")
    node = {"data-path": str(deployment["root"] / f"{file}.npz"), "profile": "laptop", "runtime": runtime,
            "training-bundle": str(deployment["run_dir"] / TRAINING_BUNDLE),
            "trusted-key": str(deployment["run_dir"] / SIGNING_PUBLIC_KEY)}
    context = Context(run_id=1, node_id=5, state=RecordDict(), run_config=config, node_config=node)
    return make_default_client_app()(instruction, context)


@pytest.mark.parametrize("runtime", ["torch", "onnx"])
def test_a_device_with_raw_files_trains_as_one_with_scaled_files(deployment: dict[str, Any], runtime: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    # Execute: the same device and round, from the scaled file and from the raw grey levels
    with caplog.at_level(logging.INFO, logger="fedge.clients"):
        scaled, raw = _train(deployment, runtime, "scaled"), _train(deployment, runtime, "raw")
    # Assert: the same update (the raw file scaled by 1/16 on the device), the raw one marked and logged once
    for name, array in scaled.content[wire.ARRAYS].items():
        np.testing.assert_allclose(raw.content[wire.ARRAYS][name].numpy(), array.numpy(), atol=1e-6)
    assert wire.INPUTS not in scaled.content[wire.REPLY_META]
    assert raw.content[wire.REPLY_META][wire.INPUTS] == RAW_SCALED
    assert "holds raw inputs (raw 0..16, 0..1 after x * 0.0625 + 0)" in caplog.text


@pytest.mark.parametrize("runtime", ["torch", "onnx"])
def test_a_device_whose_inputs_fall_outside_warns_and_says_so(deployment: dict[str, Any], runtime: str,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedge.clients"):
        reply = _train(deployment, runtime, "outside")
    # Assert: trained as given, marked, warned naming the file
    assert reply.content[wire.REPLY_META][wire.INPUTS] == OUTSIDE
    assert "outside.npz': inputs fall outside the task's declared range" in caplog.text


# --- on the coordinator ------------------------------------------------------------------

@pytest.mark.parametrize(("said", "raw", "outside"), [(None, 0, 0), (RAW_SCALED, 1, 0), (OUTSIDE, 0, 1)])
def test_the_coordinator_counts_what_devices_say_of_their_inputs(said: str | None, raw: int, outside: int,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: two honest replies, the second saying what its device's inputs looked like
    from fedge.strategies import FedAvg
    from fedge.strategies.validation import ReplyValidator
    from replies import global_arrays, good_arrays, train_reply
    strategy = FedAvg(validator=ReplyValidator())
    strategy.global_arrays = global_arrays()
    marked = train_reply(12, good_arrays(2.0))
    if said is not None:
        marked.content[wire.REPLY_META][wire.INPUTS] = said
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedge.strategies"):
        arrays, _ = strategy.aggregate_train(1, [train_reply(11, good_arrays(1.0)), marked])
    # Assert: both used; counted; a warning only for inputs outside the range
    report = strategy.reports[-1]
    assert arrays is not None and report.accepted == 2
    assert (report.inputs_raw, report.inputs_outside) == (raw, outside)
    assert ("1 of 2 accepted updates come from devices whose inputs fall outside" in caplog.text) == bool(outside)


def test_a_reply_naming_an_unknown_input_verdict_is_rejected() -> None:
    # Prepare
    from fedge.strategies import FedAvg
    from fedge.strategies.validation import ReplyValidator
    from replies import global_arrays, good_arrays, train_reply
    strategy = FedAvg(validator=ReplyValidator())
    strategy.global_arrays = global_arrays()
    odd = train_reply(12, good_arrays(2.0))
    odd.content[wire.REPLY_META][wire.INPUTS] = "x" * 1000
    # Execute
    strategy.aggregate_train(1, [train_reply(11, good_arrays(1.0)), odd])
    # Assert: left out, named, the value cut short
    (rejection,) = strategy.reports[-1].rejected
    assert rejection.reason.startswith("reply meta 'inputs' must be one of raw, outside")
    assert len(rejection.reason) < 120


def test_each_input_is_judged_on_its_own_and_integer_inputs_are_left_alone() -> None:
    # Prepare: images already scaled (0..0.95) beside token ids 0..700 (a two-input task), then raw images
    scaled = np.linspace(0, 0.95, 8, dtype=np.float32).reshape(2, 4)
    raw = np.array([[0, 4, 8, 16], [2, 2, 2, 2]], np.float32)
    ids = np.array([[0, 9], [700, 3]], np.int64)
    # Execute
    (same_images, same_ids), first = prepare_device_inputs((scaled, ids), DIGITS)
    (scaled_images, kept_ids), second = prepare_device_inputs((raw, ids), DIGITS)
    # Assert: scaled images untouched (ids neither judged nor scaled); raw images scaled by 1/16, ids kept
    assert first == AS_GIVEN and same_images is scaled and same_ids is ids
    assert second == RAW_SCALED and kept_ids is ids
    np.testing.assert_array_equal(scaled_images, raw / np.float32(16))
