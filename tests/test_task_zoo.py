"""The built-in ``images``, ``chars`` and ``diabetes`` tasks: registered, checked, deterministic, trainable."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedge.config import RunConfig, resolve_run_config
from fedge.signature import check_inputs
from fedge.task.api import Task, TaskData, seeded_model
from fedge.task.builtin.chars import VOCABULARY_SIZE, by_source, decode, encode
from fedge.task.builtin.diabetes import FEATURES, load_diabetes_arrays
from fedge.task.builtin.images import NUM_CLASSES
from fedge.task.loading import check_task, load_task
from fedge.task.registry import TASKS
from fedge.task.training import evaluate, train_local

NAMES = ("images", "chars", "diabetes")
CPU = torch.device("cpu")


def _config(name: str, **overrides: object) -> RunConfig:
    return resolve_run_config({"task": name, **overrides})


def _fresh(name: str, **overrides: object) -> Task:
    """A new task object (``load_task`` caches one per setting)."""
    return TASKS[name](_config(name, **overrides))


def _rows(data: TaskData) -> np.ndarray:
    """Every example (inputs and target) as one opaque row, sorted: a multiset that ``np.array_equal`` compares."""
    columns = [np.ascontiguousarray(a).reshape(len(a), -1).view(np.uint8).reshape(len(a), -1)
               for a in (*data.inputs, data.targets)]
    joined = np.ascontiguousarray(np.concatenate(columns, axis=1))
    return np.sort(joined.view(np.dtype((np.void, joined.shape[1]))).ravel())


def _seeded_data(name: str, seed: int) -> TaskData:
    """A fresh task's training data under ``seed``; for ``chars`` (a fixed text) a device's share of it."""
    task = _fresh(name, seed=seed)
    return task.partition(3, 10, _config(name, seed=seed)) if name == "chars" else task.train_data()


def _trained_loss(name: str, examples: int, epochs: int, batch_size: int, learning_rate: float) -> tuple[float, float]:
    """The loss of a fresh model on a few training examples, before and after training on them."""
    task = load_task(_config(name))
    data = task.train_data().take(slice(0, examples))
    model = seeded_model(task, 0)
    before = evaluate(task, model, data, device=CPU)
    train_local(task, model, data, epochs=epochs, batch_size=batch_size, learning_rate=learning_rate, momentum=0.9,
                device=CPU, seed=0)
    after = evaluate(task, model, data, device=CPU)
    key = "mse" if name == "diabetes" else "loss"
    return before[key], after[key]


@pytest.mark.parametrize("name", NAMES)
def test_each_task_is_registered_and_passes_the_start_checks(name: str) -> None:
    # Prepare
    config = _config(name)

    # Execute
    task = load_task(config)
    check_task(task, config)

    # Assert
    assert name in TASKS
    assert task.name == name
    assert task.headline in task.summarize(evaluate(task, seeded_model(task, 1), task.central_data().take(
        slice(0, 8)), device=CPU))


@pytest.mark.parametrize("name", NAMES)
def test_training_and_central_data_match_the_declared_signature(name: str) -> None:
    # Prepare
    task = load_task(_config(name))

    # Execute
    train, central = task.train_data(), task.central_data()

    # Assert
    assert central is not None and len(central) > 0 and len(train) > 0
    for data in (train, central):
        check_inputs(task.inputs, list(data.inputs), source=name)
        assert data.targets.dtype == np.dtype(task.target_dtype)


def test_images_are_8_bit_pixels_of_ten_balanced_classes_for_a_resnet_of_over_a_million_parameters() -> None:
    # Prepare
    task = load_task(_config("images"))

    # Execute
    train, central = task.train_data(), task.central_data()
    model = task.build_model()
    pixels = train.inputs[0][:200] * 255

    # Assert
    assert (len(train), len(central)) == (6000, 1500)  # test-fraction 0.2 of 7500
    assert np.bincount(train.targets).tolist() == [600] * NUM_CLASSES
    assert len(task.labels or ()) == NUM_CLASSES
    assert np.allclose(pixels, np.round(pixels), atol=1e-3) and pixels.min() >= 0 and pixels.max() <= 255
    assert sum(p.numel() for p in model.parameters()) >= 1_000_000
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert any(isinstance(m, torch.nn.GroupNorm) for m in model.modules())


def test_chars_windows_predict_the_next_character_of_stdlib_sources() -> None:
    # Prepare
    task = load_task(_config("chars"))

    # Execute
    train = task.train_data()
    tokens, targets = train.inputs[0], train.targets

    # Assert
    assert tokens.shape[1] == 64 and targets.shape == tokens.shape
    assert np.array_equal(tokens[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one
    assert tokens.min() >= 0 and tokens.max() < VOCABULARY_SIZE
    assert len(task.labels or ()) == VOCABULARY_SIZE
    assert 200_000 < (len(train) + len(task.central_data())) * 64 < 600_000
    assert "def " in decode(tokens[:200])


def test_chars_encoding_maps_characters_outside_the_vocabulary_to_id_zero() -> None:
    # Prepare
    text = "def f(x):\n\treturn x ~ 1  # é"

    # Execute
    ids = encode(text)

    # Assert
    assert decode(ids) == text.replace("é", "\ufffd")
    assert ids[-1] == 0 and (ids[:-1] > 0).all()


def test_diabetes_features_and_target_are_standardised_on_the_training_split() -> None:
    # Prepare
    task = load_task(_config("diabetes"))

    # Execute
    train, central = task.train_data(), task.central_data()

    # Assert
    assert (len(train), len(central)) == (354, 88)
    assert np.allclose(train.inputs[0].mean(axis=0), 0, atol=1e-5)
    assert np.allclose(train.inputs[0].std(axis=0), 1, atol=1e-4)
    assert abs(float(train.targets.mean())) < 1e-5 and abs(float(train.targets.std()) - 1) < 1e-4
    assert task.preprocessing["features"] == list(FEATURES)


@pytest.mark.parametrize("name", NAMES)
def test_the_data_are_a_function_of_the_seed(name: str) -> None:
    # Execute
    first, again, other = _seeded_data(name, 42), _seeded_data(name, 42), _seeded_data(name, 7)

    # Assert
    assert all(np.array_equal(a, b) for a, b in zip((*first.inputs, first.targets), (*again.inputs, again.targets),
                                                    strict=True))
    assert first.inputs[0].shape != other.inputs[0].shape or not np.array_equal(first.inputs[0], other.inputs[0])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("partitioner", "devices"), [("dirichlet", 7), ("iid", 7), ("dirichlet", 100)])
def test_partitions_hold_every_training_example_exactly_once(name: str, partitioner: str, devices: int) -> None:
    # Prepare
    config = _config(name, partitioner=partitioner)
    task = load_task(config)

    # Execute
    parts = [task.partition(index, devices, config) for index in range(devices)]

    # Assert
    assert min(map(len, parts)) > 0
    pooled = TaskData(tuple(np.concatenate([p.inputs[i] for p in parts]) for i in range(len(task.inputs))),
                      np.concatenate([p.targets for p in parts]))
    assert np.array_equal(_rows(pooled), _rows(task.train_data()))


def test_chars_devices_read_contiguous_stretches_of_few_source_files() -> None:
    # Prepare
    sources = load_task(_config("chars")).corpus[1]
    files, devices = int(sources.max()) + 1, 10

    # Execute
    shards = by_source(sources, devices, seed=42)

    # Assert
    per_device = [set(sources[shard].tolist()) for shard in shards]
    assert sum(map(len, per_device)) <= files + devices - 1  # neighbours share at most one file
    assert max(map(len, per_device)) < files // 2
    assert all(len(np.unique(shard)) == len(shard) for shard in shards)


def test_diabetes_dirichlet_partitions_skew_the_target() -> None:
    # Prepare
    skewed, iid = _config("diabetes", **{"dirichlet-alpha": 0.1}), _config("diabetes", partitioner="iid")
    task = load_task(skewed)

    # Execute
    spread = {name: np.std([float(task.partition(i, 10, config).targets.mean()) for i in range(10)])
              for name, config in (("skewed", skewed), ("iid", iid))}

    # Assert
    assert spread["skewed"] > 2 * spread["iid"]


@pytest.mark.parametrize(("name", "examples", "epochs", "batch_size", "learning_rate"), [
    ("images", 64, 3, 16, 0.01), ("chars", 192, 2, 32, 0.1), ("diabetes", 354, 3, 32, 0.01)])
def test_a_few_local_epochs_lower_the_loss(name: str, examples: int, epochs: int, batch_size: int,
                                           learning_rate: float) -> None:
    # Execute
    before, after = _trained_loss(name, examples, epochs, batch_size, learning_rate)

    # Assert
    assert after < before - 0.1


def test_chars_perplexity_is_the_exponential_of_the_mean_loss() -> None:
    # Prepare
    task = load_task(_config("chars"))
    data = task.central_data().take(slice(0, 50))

    # Execute
    metrics = evaluate(task, seeded_model(task, 0), data, device=CPU, batch_size=16)

    # Assert
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["loss"]))
    assert 0 <= metrics["accuracy"] <= 1
    assert 50 < metrics["perplexity"] < 200  # an untrained model is about as unsure as a uniform guess (98)


def test_diabetes_metrics_are_exact_over_any_batching() -> None:
    # Prepare
    task = load_task(_config("diabetes"))
    data, model = task.central_data(), seeded_model(task, 0)
    with torch.no_grad():
        predicted = model(torch.as_tensor(data.inputs[0])).squeeze(-1).double().numpy()
    error, targets = predicted - data.targets, data.targets.astype(np.float64)

    # Execute
    metrics = evaluate(task, model, data, device=CPU, batch_size=7)

    # Assert
    assert set(metrics) == {"mse", "mae", "r2"}
    assert metrics["mse"] == pytest.approx(np.mean(error**2), rel=1e-5)
    assert metrics["mae"] == pytest.approx(np.mean(np.abs(error)), rel=1e-5)
    assert metrics["r2"] == pytest.approx(1 - np.mean(error**2) / np.var(targets), rel=1e-4)
    assert metrics["mae"] ** 2 <= metrics["mse"]


def test_a_real_device_gets_its_text_file_as_windows(tmp_path: Path) -> None:
    # Prepare
    text = "import os\n" * 30
    path = tmp_path / "notes.py"
    path.write_text(text)

    # Execute
    data = load_task(_config("chars")).device_data(str(path))

    # Assert
    assert len(data) == (len(text) - 1) // 64
    assert decode(data.inputs[0][0]) == text[:64] and decode(data.targets[0]) == text[1:65]


def test_a_real_device_gets_its_raw_diabetes_csv_scaled_like_the_training_data(tmp_path: Path) -> None:
    # Prepare
    task = load_task(_config("diabetes"))
    x, y = load_diabetes_arrays()
    path = tmp_path / "clinic.csv"
    np.savetxt(path, np.column_stack([x[:5], y[:5]]), delimiter=",", header=",".join([*FEATURES, "label"]),
               comments="")
    scaling = task.preprocessing

    # Execute
    data = task.device_data(str(path))

    # Assert
    expected = (x[:5] - np.array(scaling["mean"])) / np.array(scaling["std"])
    assert np.allclose(data.inputs[0], expected, atol=1e-5)
    assert np.allclose(data.targets, (y[:5] - scaling["target_mean"]) / scaling["target_std"], atol=1e-5)
