"""Loaders for a user's own data (issue 14): .npz with one array per input, .csv, image folders and
torch Datasets become TaskData checked against the task's input signature."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from fedge.errors import ConfigError
from fedge.signature import InputSpec
from fedge.task.api import Task
from fedge.task.data import load_npz
from fedge.task.loaders import from_dataset, load_file


class Pictures(Task):
    name = "pictures"
    inputs = (InputSpec("image", ("batch", 3, 4, 5)),)
    labels = ("cat", "dog")


class FeaturesAndTokens(Task):
    name = "two-inputs"
    inputs = (InputSpec("features", ("batch", 3)), InputSpec("token", ("batch",), "int64"))


class Flat(Task):
    name = "flat"
    inputs = (InputSpec("x", ("batch", 2)),)


def test_an_image_folder_gives_channels_first_pixels_in_0_1_by_class_folder(tmp_path: Path) -> None:
    # Prepare: 2 cats and 1 dog, 4x5 RGB PNGs; the dog is all white
    from matplotlib.image import imsave

    rng = np.random.default_rng(0)
    for label, count in (("cat", 2), ("dog", 1)):
        (tmp_path / label).mkdir()
        for index in range(count):
            pixels = np.ones((4, 5, 3)) if label == "dog" else rng.random((4, 5, 3))
            imsave(tmp_path / label / f"{index}.png", pixels)
    # Execute
    data = load_file(tmp_path, Pictures())
    # Assert: RGBA from PNG dropped to RGB, NCHW, labels by the task's class order
    assert data.inputs[0].shape == (3, 3, 4, 5) and data.inputs[0].dtype == np.float32
    assert data.targets.tolist() == [0, 0, 1]
    np.testing.assert_allclose(data.inputs[0][2], 1.0)


def test_an_npz_holds_one_array_per_input_name(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "mine.npz"
    np.savez(path, features=np.ones((4, 3), np.float64), token=np.arange(4, dtype=np.int32), y=np.array([0, 1, 1, 0]))
    # Execute
    data = load_file(path, FeaturesAndTokens())
    # Assert: cast to the declared dtypes
    assert [a.dtype for a in data.inputs] == [np.float32, np.int64] and data.targets.tolist() == [0, 1, 1, 0]


def test_a_csv_is_features_and_a_label_column(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "mine.csv"
    path.write_text("a,label,b\n1,0,2\n3,1,4\n")
    # Execute
    data = load_file(path, Flat())
    # Assert
    assert data.inputs[0].tolist() == [[1.0, 2.0], [3.0, 4.0]] and data.targets.tolist() == [0, 1]


def test_a_torch_dataset_is_materialised_as_arrays() -> None:
    # Prepare
    dataset = TensorDataset(torch.ones(5, 3), torch.arange(5), torch.tensor([0, 1, 0, 1, 0]))
    # Execute
    data = from_dataset(dataset, FeaturesAndTokens())
    # Assert
    assert data.inputs[0].shape == (5, 3) and data.inputs[1].tolist() == [0, 1, 2, 3, 4] and len(data) == 5


@pytest.mark.parametrize(("content", "task", "message"), [
    ({"x": np.ones((3, 5)), "y": np.zeros(3)}, Flat(), "input 'x' has shape \\(3, 5\\) float32; the task declares"),
    ({"features": np.ones((3, 3))}, FeaturesAndTokens(), "it needs \\['token', 'y'\\]"),
    ({"x": np.ones((3, 2)), "y": np.array([0, -1, 2])}, Flat(), "labels must be integers >= 0"),
    ({"x": np.full((3, 2), np.nan), "y": np.zeros(3)}, Flat(), "inputs contain NaN or Inf"),
    ({"image": np.ones((2, 3, 4, 5)), "y": np.array([0, 2])}, Pictures(), "label 2 is beyond the task's 2 classes"),
])
def test_a_file_that_does_not_fit_the_task_is_refused_naming_the_problem(
        content: dict[str, np.ndarray], task: Task, message: str, tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "bad.npz"
    np.savez(path, **content)
    # Execute / Assert
    with pytest.raises(ConfigError, match=message):
        load_file(path, task)


def test_an_unknown_file_kind_is_refused(tmp_path: Path) -> None:
    # Execute / Assert
    with pytest.raises(ConfigError, match="must be a .npz"):
        load_file(tmp_path / "data.parquet", Flat())


def _npz_bytes_with(old: bytes, new: bytes) -> bytes:
    """An uncompressed .npz of x (3, 2) float32 and y, with ``old`` replaced by ``new`` in its bytes."""
    buffer = io.BytesIO()
    np.savez(buffer, x=np.ones((3, 2), np.float32), y=np.zeros(3, np.int64))
    content = buffer.getvalue()
    assert old in content
    return content.replace(old, new)


DAMAGED_FILES: list[tuple[str, Callable[[], bytes]]] = [
    ("dtype ',' (numpy's parser raises SyntaxError)", lambda: _npz_bytes_with(b"'descr': '<f4'", b"'descr': ','  ")),
    ("header cut off (Python 2 fallback raises TokenError)", lambda: _npz_bytes_with(b"{'descr':", b"{'descr'{")),
    ("truncated zip", lambda: _npz_bytes_with(b"", b"")[:200]),
    ("not numpy at all", lambda: b"PK\x03\x04 not really a zip"),
]


@pytest.mark.parametrize("make", [case[1] for case in DAMAGED_FILES], ids=[case[0] for case in DAMAGED_FILES])
def test_a_damaged_npz_is_refused_naming_the_file(make: Callable[[], bytes], tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "data.npz"
    path.write_bytes(make())
    # Execute / Assert: a ConfigError naming the file for both npz readers, not numpy's own exception
    with pytest.raises(ConfigError, match="cannot read '.*data.npz'"):
        load_file(path, Flat())
    with pytest.raises(ConfigError, match="cannot read '.*data.npz'"):
        load_npz(path)
