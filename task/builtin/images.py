"""The ``images`` task: 3x32x32 colour images of 10 classes, a ResNet with GroupNorm.

Data
----
Generated, not downloaded (fedge runs offline): every image is a Gabor-like patch, a
sinusoidal grating under a Gaussian window, over a noisy background with a distractor
blob. The class fixes the grating's orientation (one of 5, 36 degrees apart) and its
colour family (warm or cool); everything else is random per image: orientation jitter,
spatial frequency, phase, position and size of the patch, the background's colour and
gradient, the distractor's colour, position and size, and pixel noise. A model must
find the patch, read its orientation and tell its colours from the distractor's, so
accuracy far above chance (10 %) is reachable but not free. Pixels are quantised to
8 bits, as a camera's would be, and scaled by 1/255 (``preprocessing``), the scaling
:func:`fedge.task.loaders.load_image_folder` applies to a device's own PNG files.

``POOL_SIZE`` images are generated from the run config's ``seed`` (under a second, 23 MB
of 8-bit pixels while generating, 90 MB as float32); a stratified ``test-fraction`` of
every class (default 0.2: 6000 training, 1500 central test images) is held out for the
coordinator's evaluation. Simulation partitions the rest with the run config's
``partitioner`` (``dirichlet`` label skew works: the targets are class indices).

Model
-----
A ResNet (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016) laid out
like the paper's CIFAR-10 networks (3x3 stem, stages at 32, 16 and 8 pixels, global
average pooling, one linear layer) with a fourth stage at 4 pixels and widths 32, 64,
128, 256, one basic block per stage: 1.2 M parameters. Each convolution is followed by
GroupNorm (Wu and He, "Group Normalization", ECCV 2018), not BatchNorm: BatchNorm keeps
running statistics that are buffers, not weights, and under FedAvg they are either
averaged across devices whose data differ (so the averaged statistics fit no device and
the global model evaluates badly) or kept local (so devices disagree); Hsieh et al. ("The
Non-IID Data Quagmire of Decentralized Machine Learning", ICML 2020) measured that loss
on label-skewed data and showed that GroupNorm removes it. GroupNorm normalises each
example by itself, so training and evaluation behave alike for any batch size, a
phone's batch of 1 included. It uses Wu and He's 32 groups (one channel per group in the
first stage): with 8 groups, momentum SGD sat at the colour-only solution (20 %
accuracy) for more than 8 epochs on this data, where with 32 it reads the orientation
within 3 to 4 epochs (3000 images, batch 32, learning rate 0.05, momentum 0.9).
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from fedge import knobs
from fedge.config import RunConfig
from fedge.signature import InputSpec
from fedge.task.api import Task, TaskData
from fedge.task.data import holdout
from fedge.task.registry import register_task

SIDE = 32
CHANNELS = 3
ORIENTATIONS = 5
FAMILIES = ("warm", "cool")
NUM_CLASSES = ORIENTATIONS * len(FAMILIES)
POOL_SIZE = 7500
CHUNK = 500  # images rendered at once: bounds the float32 scratch memory to ~6 MB per array
WIDTHS = (32, 64, 128, 256)
GROUPS = 32

# Base RGB colours of the two families' grating stripes (bright stripe, dark stripe).
FAMILY_COLOURS = np.array([
    [[0.95, 0.55, 0.15], [0.45, 0.10, 0.05]],  # warm: orange on dark red
    [[0.20, 0.70, 0.95], [0.05, 0.15, 0.45]],  # cool: sky blue on dark blue
], dtype=np.float32)


def class_names() -> tuple[str, ...]:
    """``warm-0deg`` ... ``cool-144deg``: class ``c`` is family ``c // 5``, orientation ``36 * (c % 5)``."""
    return tuple(f"{family}-{orientation * 180 // ORIENTATIONS}deg"
                 for family in FAMILIES for orientation in range(ORIENTATIONS))


def generate_images(count: int, seed: int) -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
    """``count`` 8-bit images ``(count, 3, 32, 32)`` and their classes, balanced, from ``seed``.

    Every per-image random draw is made up front, then images are rendered in chunks of
    :data:`CHUNK`, so the result does not depend on the chunk size and memory stays small.
    """
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(count) % NUM_CLASSES).astype(np.int64)
    params = _draw_parameters(labels, rng)
    noise_seed = int(rng.integers(2**63))
    images = np.empty((count, CHANNELS, SIDE, SIDE), dtype=np.uint8)
    for start in range(0, count, CHUNK):
        stop = min(start + CHUNK, count)
        noise = np.random.default_rng([noise_seed, start]).normal(0.0, 0.08, (stop - start, CHANNELS, SIDE, SIDE))
        picked = {name: value[start:stop] for name, value in params.items()}
        images[start:stop] = _render(picked, noise.astype(np.float32))
    return images, labels


def _draw_parameters(labels: NDArray[np.int64], rng: np.random.Generator) -> dict[str, NDArray[np.float32]]:
    """Per-image random parameters (each array has the images on axis 0)."""
    count = len(labels)
    family = labels // ORIENTATIONS
    stripes = FAMILY_COLOURS[family] + rng.normal(0.0, 0.06, (count, 2, CHANNELS))
    uniform = rng.uniform
    drawn = {
        "theta": (labels % ORIENTATIONS) * math.pi / ORIENTATIONS + rng.normal(0.0, 0.08, count),
        "frequency": uniform(0.12, 0.30, count),  # cycles per pixel
        "phase": uniform(0.0, 2 * math.pi, count),
        "centre": uniform(9.0, 23.0, (count, 2)),
        "radius": uniform(4.0, 7.0, count),
        "bright": stripes[:, 0],
        "dark": stripes[:, 1],
        "background": uniform(0.15, 0.85, (count, CHANNELS)),
        "gradient": uniform(-0.3, 0.3, (count, 2, CHANNELS)),
        "blob_centre": uniform(4.0, 28.0, (count, 2)),
        "blob_radius": uniform(1.5, 3.0, count),
        "blob_colour": uniform(0.0, 1.0, (count, CHANNELS)),
    }
    return {name: np.asarray(value, dtype=np.float32) for name, value in drawn.items()}


def _render(params: dict[str, NDArray[np.float32]], noise: NDArray[np.float32]) -> NDArray[np.uint8]:
    """Images ``(n, 3, 32, 32)`` from per-image parameters: background, distractor, grating patch, noise."""
    grid = (np.arange(SIDE, dtype=np.float32) - (SIDE - 1) / 2) / SIDE
    ys, xs = grid[None, :, None], grid[None, None, :]
    image = (params["background"][:, :, None, None]
             + params["gradient"][:, 0, :, None, None] * xs[:, None]
             + params["gradient"][:, 1, :, None, None] * ys[:, None])
    blob = _gaussian(params["blob_centre"], params["blob_radius"])[:, None]
    image = image * (1 - blob) + params["blob_colour"][:, :, None, None] * blob
    window = _gaussian(params["centre"], params["radius"])[:, None]
    theta = params["theta"][:, None, None]
    along = ((np.arange(SIDE, dtype=np.float32)[None, None, :] - params["centre"][:, 0, None, None]) * np.cos(theta)
             + (np.arange(SIDE, dtype=np.float32)[None, :, None] - params["centre"][:, 1, None, None])
             * np.sin(theta))
    wave = (0.5 + 0.5 * np.cos(2 * math.pi * params["frequency"][:, None, None] * along
                               + params["phase"][:, None, None]))[:, None]
    stripes = params["bright"][:, :, None, None] * wave + params["dark"][:, :, None, None] * (1 - wave)
    image = image * (1 - window) + stripes * window + noise
    return np.round(np.clip(image, 0.0, 1.0) * 255).astype(np.uint8)


def _gaussian(centre: NDArray[np.float32], radius: NDArray[np.float32]) -> NDArray[np.float32]:
    """Gaussian windows ``(n, 32, 32)`` peaking at 1 at ``centre`` (x, y pixels), standard deviation ``radius``."""
    pixels = np.arange(SIDE, dtype=np.float32)
    dx = pixels[None, None, :] - centre[:, 0, None, None]
    dy = pixels[None, :, None] - centre[:, 1, None, None]
    spread = 2 * radius[:, None, None] ** 2
    return np.exp(-(dx**2 + dy**2) / spread).astype(np.float32)


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(GROUPS, channels), channels)


class BasicBlock(nn.Module):
    """``relu(x' + F(x))`` with ``F`` = conv3x3-GN-ReLU-conv3x3-GN (He et al. 2016, fig. 2).

    ``x'`` is ``x``, or a strided 1x1 convolution and GroupNorm of it where the block
    changes the width or the resolution (the paper's projection shortcut, option B).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = _norm(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          _norm(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        residual = self.norm2(self.conv2(torch.relu(self.norm1(self.conv1(x)))))
        return torch.relu(self.shortcut(x) + residual)


class ResNet(nn.Module):
    """3x3 stem, one :class:`BasicBlock` per width (stride 2 from the second on), average pool, linear."""

    def __init__(self, num_classes: int = NUM_CLASSES, widths: tuple[int, ...] = WIDTHS) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(CHANNELS, widths[0], 3, padding=1, bias=False), _norm(widths[0]),
                                  nn.ReLU())
        blocks, previous = [], widths[0]
        for index, width in enumerate(widths):
            blocks.append(BasicBlock(previous, width, stride=1 if index == 0 else 2))
            previous = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(previous, num_classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:  # noqa: D102
        features = self.blocks(self.stem(image))
        return self.head(features.mean(dim=(2, 3)))  # type: ignore[no-any-return]


@register_task("images")
class Images(Task):
    """Ten classes of generated 3x32x32 colour images (see the module docstring), ResNet with GroupNorm."""

    name = "images"
    headline, higher_is_better = "accuracy", True
    inputs = (InputSpec("image", ("batch", CHANNELS, SIDE, SIDE)),)
    labels = class_names()
    preprocessing: dict[str, Any] = {"kind": "affine", "scale": 1.0 / 255.0, "offset": 0.0, "raw-range": [0, 255],
                                     "description": "8-bit RGB pixels, channels first (3, 32, 32), times 1/255"}
    output = "unnormalised scores of the 10 classes (labels); softmax gives probabilities"

    def __init__(self, config: RunConfig) -> None:
        self.seed = config.integer(knobs.SEED)
        self.test_fraction = config.number(knobs.TEST_FRACTION)

    @cached_property
    def split(self) -> tuple[TaskData, TaskData]:
        """(training images, held-out images): ``test-fraction`` of every class held out."""
        pixels, labels = generate_images(POOL_SIZE, self.seed)
        scaled = pixels.astype(np.float32) * np.float32(self.preprocessing["scale"])
        x_train, y_train, (x_test, y_test) = holdout(scaled, labels, self.test_fraction, self.seed)
        return TaskData.from_xy(x_train, y_train), TaskData.from_xy(x_test, y_test)

    def build_model(self) -> nn.Module:  # noqa: D102
        return ResNet()

    def train_data(self) -> TaskData:  # noqa: D102
        return self.split[0]

    def central_data(self) -> TaskData:  # noqa: D102
        return self.split[1]
