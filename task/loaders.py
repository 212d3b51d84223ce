"""Loaders for a user's own data: .npz, .csv, image folders and torch Datasets, as :class:`TaskData`.

Each loader checks what it reads against the task's input signature and target dtype, so a
device with a wrong file fails at load time with the file and the mismatch named.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedge.errors import ConfigError
from fedge.npy import UNREADABLE_FILE_ERRORS
from fedge.signature import check_inputs
from fedge.task.data import load_csv_table

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from fedge.task.api import Task, TaskData

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def load_file(path: str | Path, task: Task) -> TaskData:
    """A device's own examples: ``.npz``, ``.csv`` or a folder of class subfolders of images."""
    path = Path(path)
    if path.is_dir():
        return load_image_folder(path, task)
    if path.suffix == ".npz":
        return load_npz(path, task)
    if path.suffix == ".csv":
        return load_csv(path, task)
    raise ConfigError(f"device data '{path}' must be a .npz (inputs and 'y'), a .csv (header + label column) "
                      "or a folder of class subfolders of images")


def load_npz(path: str | Path, task: Task) -> TaskData:
    """``x`` (or one array per declared input name) and ``y`` from a ``.npz`` file."""
    inputs, targets = npz_arrays(path, [spec.name for spec in task.inputs], task.describe())
    return checked(inputs, targets, task, source=str(path))


def npz_arrays(path: str | Path, names: list[str], what: str = "the task") -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """One array per input name (``x`` or ``X`` for a single input) and ``y`` from a ``.npz`` file.

    numpy only (no torch): a device without torch reads its file with this too.
    """
    try:
        with np.load(path, allow_pickle=False) as data:
            files = set(data.files)
            wanted = names if len(names) != 1 or names[0] in files else ["x" if "x" in files else "X"]
            missing = [name for name in [*wanted, "y"] if name not in files]
            if missing:
                raise ConfigError(f"'{path}' holds arrays {sorted(files)}; it needs {missing} "
                                  f"(one array per input of {what}, and 'y')")
            return tuple(data[name] for name in wanted), data["y"]
    except UNREADABLE_FILE_ERRORS as exc:
        raise ConfigError(f"cannot read '{path}' as .npz: {exc}") from None


def load_csv(path: str | Path, task: Task, label_column: str = "label") -> TaskData:
    """A CSV with a header; ``label_column`` (or the last column) is the target, the rest one input."""
    features, labels = load_csv_table(path, label_column)
    return checked((features,), labels, task, source=str(path))


def load_image_folder(path: Path, task: Task) -> TaskData:
    """``path/<class>/<image>``: class subfolders in ``task.labels`` order (else sorted), images as
    channels-first float32 in [0, 1], shaped like the task's first input."""
    from matplotlib.image import imread  # noqa: PLC0415 - matplotlib reads PNG without Pillow

    classes = list(task.labels) if task.labels else sorted(p.name for p in path.iterdir() if p.is_dir())
    images, targets = [], []
    for index, name in enumerate(classes):
        for file in sorted((path / name).glob("*")) if (path / name).is_dir() else []:
            if file.suffix.lower() in IMAGE_SUFFIXES:
                pixels = np.asarray(imread(file), dtype=np.float32)
                pixels = pixels / 255.0 if pixels.max() > 1.0 else pixels
                images.append(pixels[..., None] if pixels.ndim == 2 else pixels)
                targets.append(index)
    if not images:
        raise ConfigError(f"image folder '{path}' has no {'/'.join(IMAGE_SUFFIXES)} files in class subfolders "
                          f"({', '.join(classes) or 'none found'})")
    shapes = {image.shape for image in images}
    if len(shapes) != 1:
        raise ConfigError(f"images in '{path}' have different sizes {sorted(shapes)}; resize them to the "
                          f"task's input {task.inputs[0].describe()}")
    batch = np.stack(images).transpose(0, 3, 1, 2)  # NHWC -> NCHW
    spec = task.inputs[0]
    if len(spec.shape) == 4 and isinstance(spec.shape[1], int) and batch.shape[1] != spec.shape[1]:
        batch = batch[:, : spec.shape[1]]  # drop an alpha channel (RGBA -> RGB)
    return checked((batch,), np.array(targets), task, source=str(path))


def from_dataset(dataset: Dataset, task: Task) -> TaskData:  # type: ignore[type-arg]
    """Materialise a torch ``Dataset`` of ``(input..., target)`` items as arrays."""
    import torch  # noqa: PLC0415

    items = [dataset[index] for index in range(len(dataset))]  # type: ignore[arg-type]
    if not items:
        raise ConfigError("the Dataset is empty")
    columns = list(zip(*items, strict=True))
    arrays = [np.stack([torch.as_tensor(v).numpy() for v in column]) for column in columns]
    return checked(tuple(arrays[:-1]), arrays[-1], task, source=type(dataset).__name__)


def checked(inputs: tuple[np.ndarray, ...], targets: np.ndarray, task: Task, *, source: str) -> TaskData:
    """``inputs`` cast to the declared dtypes and checked against the signature; targets to the task's dtype."""
    from fedge.task.api import TaskData  # noqa: PLC0415

    if task.inputs:
        inputs = tuple(np.asarray(array).astype(spec.dtype, copy=False)
                       for array, spec in zip(inputs, task.inputs, strict=False))
        check_inputs(task.inputs, inputs, source=source)
    for array in inputs:
        if np.issubdtype(array.dtype, np.floating) and not np.all(np.isfinite(array)):
            raise ConfigError(f"'{source}': inputs contain NaN or Inf")
    targets = np.asarray(targets)
    if np.issubdtype(np.dtype(task.target_dtype), np.integer):
        if not np.all(np.isfinite(targets)) or np.any(targets < 0) or np.any(targets != np.round(targets)):
            raise ConfigError(f"'{source}': labels must be integers >= 0")
        if task.labels and np.any(targets >= len(task.labels)):
            raise ConfigError(f"'{source}': label {int(targets.max())} is beyond the task's "
                              f"{len(task.labels)} classes")
    elif not np.all(np.isfinite(targets)):
        raise ConfigError(f"'{source}': targets contain NaN or Inf")
    return TaskData(inputs, targets.astype(task.target_dtype))
