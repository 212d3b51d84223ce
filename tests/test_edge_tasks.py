"""Every task's global model ships as a signed ONNX bundle (issue 14).

Four small tasks defined here, each with something the digits task lacks: a 3x8x8 image
conv model, a model of two inputs (float features and int64 token ids through an
embedding), a regression model with an MSE headline, and a token tagger with a dynamic
``sequence`` axis. Each is exported and signed with a real key, loaded by ``EdgeModel``
under onnxruntime, and checked: parity with torch, batch sizes 1 and 7, the manifest,
int8 present or skipped with a reason, and bad inputs refused by name.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from torch import nn

from fedge.cli.main import main
from fedge.config import resolve_run_config
from fedge.edge import EdgeModel
from fedge.edge.build import BuiltBundle, BundleSpec, build_bundle
from fedge.edge.bundle import MANIFEST, SIGNATURE, read_bundle, sign_manifest
from fedge.edge.export import PARITY_TOLERANCE, export_onnx
from fedge.edge.signing import generate_signing_key, load_private_key
from fedge.errors import BundleVerificationError, ConfigError, ExportError
from fedge.server.bundles import export_global_model
from fedge.signature import InputSpec
from fedge.task.api import Task, TaskData, seeded_model

CONFIG = resolve_run_config({})


def _images(n: int, seed: int) -> tuple[np.ndarray, ...]:
    return (np.random.default_rng(seed).random((n, 3, 8, 8), dtype=np.float32),)


def _reviews(n: int, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return rng.random((n, 4), dtype=np.float32), rng.integers(0, 20, (n, 6), dtype=np.int64)


def _prices(n: int, seed: int) -> tuple[np.ndarray, ...]:
    return (np.random.default_rng(seed).random((n, 3), dtype=np.float32),)


def _sentences(n: int, seed: int, length: int = 5) -> tuple[np.ndarray, ...]:
    return (np.random.default_rng(seed).integers(0, 30, (n, length), dtype=np.int64),)


# --------------------------------------------------------------------------- the tasks


class Block(nn.Module):
    """A residual block that halves the resolution: ``relu(shortcut(x) + GN(conv(relu(GN(conv(x))))))``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, stride=2, padding=1, bias=False)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1, self.norm2 = nn.GroupNorm(2, channels), nn.GroupNorm(2, channels)
        self.shortcut = nn.Sequential(nn.Conv2d(channels, channels, 1, stride=2, bias=False), nn.GroupNorm(2, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.shortcut(x) + self.norm2(self.conv2(torch.relu(self.norm1(self.conv1(x))))))


class SmallResNet(nn.Module):
    """Stem, two :class:`Block` s, global average pool, linear: a ResNet in miniature."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.GroupNorm(2, 4), nn.ReLU())
        self.blocks, self.head = nn.Sequential(Block(4), Block(4)), nn.Linear(4, 3)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(image)).mean(dim=(2, 3)))  # type: ignore[no-any-return]


class ImageTask(Task):
    """3x8x8 images, 3 classes, a small ResNet with GroupNorms: static int8. (The exporter shares the
    norms' constant scales between layers, which onnxruntime's quantizer refuses unless norms stay fp32.)"""

    name = "shapes-conv"
    inputs = (InputSpec("image", ("batch", 3, 8, 8)),)
    labels = ("circle", "square", "star")
    preprocessing = {"kind": "affine", "scale": 1 / 255, "offset": 0.0, "description": "RGB bytes / 255"}

    def build_model(self) -> nn.Module:  # noqa: D102
        return SmallResNet()

    def train_data(self) -> TaskData:  # noqa: D102
        return TaskData(_images(48, 1), np.random.default_rng(2).integers(0, 3, 48))

    def central_data(self) -> TaskData:  # noqa: D102
        return TaskData(_images(20, 3), np.random.default_rng(4).integers(0, 3, 20))


class TwoInputs(nn.Module):
    """``head(relu(dense(features) + mean(embedding(tokens))))``."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.dense, self.head = nn.Embedding(20, 8), nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.dense(features) + self.embedding(tokens).mean(dim=1)))  # type: ignore[no-any-return]


class ReviewTask(Task):
    """Float features plus int64 token ids; no central data (held out from the training split)."""

    name = "reviews"
    inputs = (InputSpec("features", ("batch", 4)), InputSpec("tokens", ("batch", 6), "int64"))
    labels = ("negative", "positive")

    def build_model(self) -> nn.Module:  # noqa: D102
        return TwoInputs()

    def train_data(self) -> TaskData:  # noqa: D102
        return TaskData(_reviews(40, 5), np.random.default_rng(6).integers(0, 2, 40))


class WeightedSum(nn.Module):
    """``x @ [1, 2, 3] + 0.5`` by elementwise ops only: nothing for int8 to quantize."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
        self.bias = nn.Parameter(torch.tensor([0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.weight).sum(dim=-1, keepdim=True) + self.bias


class PriceTask(Task):
    """Regression: float targets, MSE headline, no labels."""

    name = "price"
    headline, higher_is_better = "mse", False
    inputs = (InputSpec("x", ("batch", 3)),)
    labels = None
    output = "predicted price in euros"
    target_dtype = "float32"

    def build_model(self) -> nn.Module:  # noqa: D102
        return WeightedSum()

    def train_data(self) -> TaskData:  # noqa: D102
        return TaskData(_prices(32, 7), np.zeros(32, np.float32))

    def central_data(self) -> TaskData:  # noqa: D102
        # the model gives 6.5, 1.5, 2.5, 3.5; every target is 1 more: MSE exactly 1
        x = np.array([[1, 1, 1], [1, 0, 0], [0, 1, 0], [0, 0, 1]], np.float32)
        return TaskData.from_xy(x, np.array([7.5, 2.5, 3.5, 4.5], np.float32))

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return nn.functional.mse_loss(outputs.squeeze(-1), targets)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:  # noqa: D102
        return {"mse": float(self.loss(outputs, targets))}


class Tagger(nn.Module):
    """Per-token class scores, classes on axis 1: (batch, 3, sequence)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = nn.Embedding(30, 8), nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens)).transpose(1, 2)  # type: ignore[no-any-return]


class TaggerTask(Task):
    """Token ids of any length (dynamic ``sequence`` axis), a tag per token."""

    name = "tagger"
    inputs = (InputSpec("tokens", ("batch", "sequence"), "int64"),)
    labels = ("O", "B", "I")

    def build_model(self) -> nn.Module:  # noqa: D102
        return Tagger()

    def train_data(self) -> TaskData:  # noqa: D102
        return TaskData(_sentences(24, 8), np.random.default_rng(9).integers(0, 3, (24, 5)))

    def central_data(self) -> TaskData:  # noqa: D102
        return TaskData(_sentences(12, 10), np.random.default_rng(11).integers(0, 3, (12, 5)))


@dataclass(frozen=True)
class Case:
    """A task and what its bundle must say."""

    task: type[Task]
    make: Callable[[int, int], tuple[np.ndarray, ...]]
    outputs: list[list[int | str]]
    metrics: set[str]
    int8: str  # the quantization method, or "skipped"


CASES = {
    "image": Case(ImageTask, _images, [["batch", 3]], {"loss", "accuracy"}, "static-qdq"),
    "two-inputs": Case(ReviewTask, _reviews, [["batch", 2]], {"loss", "accuracy"}, "dynamic"),
    "regression": Case(PriceTask, _prices, [["batch", 1]], {"mse"}, "skipped"),
    "sequence": Case(TaggerTask, _sentences, [["batch", 3, "sequence"]], {"loss", "accuracy"}, "dynamic"),
}


@dataclass(frozen=True)
class Shipped:
    """A task, its torch model, its signed bundle and the public key that verifies it."""

    case: Case
    task: Task
    model: nn.Module
    bundle: BuiltBundle
    public: Path

    def load(self, **kwargs: Any) -> EdgeModel:
        return EdgeModel.load(self.bundle.path, trusted_keys=[self.public], **kwargs)


@pytest.fixture(scope="module")
def key_paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return generate_signing_key(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def shipped(key_paths: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Shipped]:
    """Every case's bundle, exported the coordinator's way (``export_global_model``)."""
    private, public = key_paths
    out: dict[str, Shipped] = {}
    for name, case in CASES.items():
        task = case.task()
        model = seeded_model(task, 0)
        bundle = export_global_model(model, tmp_path_factory.mktemp(name) / "bundle", config=CONFIG, task=task,
                                     server_round=3, source_run="run", private_key=load_private_key(private))
        out[name] = Shipped(case, task, model, bundle, public)
    return out


def _torch(model: nn.Module, arrays: tuple[np.ndarray, ...]) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(*(torch.from_numpy(a) for a in arrays)).numpy()  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("name", CASES)
def test_manifest_declares_the_tasks_signature_labels_and_metrics(shipped: dict[str, Shipped], name: str) -> None:
    # Prepare
    case, task = shipped[name].case, shipped[name].task
    # Execute
    manifest = json.loads(read_bundle(shipped[name].bundle.path)[MANIFEST])
    # Assert: what devices read is what the task declares
    assert manifest["inputs"] == [spec.manifest() for spec in task.inputs]
    assert [entry["shape"] for entry in manifest["outputs"]] == case.outputs
    assert manifest["outputs"][0]["meaning"] == task.output
    assert manifest["labels"] == (list(task.labels) if task.labels is not None else None)
    assert (manifest["headline"], manifest["model_id"], manifest["version"]) == (task.headline, f"run/{task.name}", 3)
    assert manifest["preprocessing"] == task.preprocessing
    metrics = manifest["metrics"]
    assert {f"fp32_{m}" for m in case.metrics} <= set(metrics)
    assert metrics["torch_onnx_max_abs_diff"] <= PARITY_TOLERANCE


def test_held_out_set_is_the_central_data_else_the_training_split(shipped: dict[str, Shipped]) -> None:
    # Prepare: central data of 20, 4 and 12 examples; the review task has none and 40 training examples
    expected = {"image": 20, "two-inputs": 40, "regression": 4, "sequence": 12}
    # Execute
    got = {name: s.bundle.manifest["metrics"]["test_samples"] for name, s in shipped.items()}
    # Assert
    assert got == expected


def test_regression_outputs_and_mse_are_the_hand_computed_ones(shipped: dict[str, Shipped]) -> None:
    # Prepare: x @ [1, 2, 3] + 0.5
    model = shipped["regression"].load()
    x = np.array([[1, 1, 1], [0, 0, 2], [2, 0, 0]], np.float32)
    # Execute
    (out,) = model.run(x)
    # Assert: 6.5, 6.5, 2.5; the held-out targets are each 1 more than the output: MSE 1
    np.testing.assert_allclose(out, [[6.5], [6.5], [2.5]], atol=1e-6)
    assert shipped["regression"].bundle.manifest["metrics"]["fp32_mse"] == pytest.approx(1.0, abs=1e-6)
    assert "int8_top1_agreement" not in shipped["regression"].bundle.manifest["metrics"]


# --------------------------------------------------------------------------- parity, batch sizes, int8


@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("name", CASES)
def test_fp32_matches_torch_at_any_batch_size(shipped: dict[str, Shipped], name: str, batch: int) -> None:
    # Prepare
    item = shipped[name]
    arrays = item.case.make(batch, 100 + batch)
    # Execute
    outputs = item.load(variant="fp32").run(*arrays)
    # Assert
    assert len(outputs) == 1 and outputs[0].shape[0] == batch
    np.testing.assert_allclose(outputs[0], _torch(item.model, arrays), atol=PARITY_TOLERANCE)


@pytest.mark.parametrize("length", [2, 9])
def test_the_sequence_axis_is_dynamic(shipped: dict[str, Shipped], length: int) -> None:
    # Prepare: the model was traced on sentences of 5 tokens
    item = shipped["sequence"]
    tokens = _sentences(3, length, length)
    # Execute
    (scores,) = item.load(variant="fp32").run(*tokens)
    # Assert
    assert scores.shape == (3, 3, length)
    np.testing.assert_allclose(scores, _torch(item.model, tokens), atol=PARITY_TOLERANCE)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.int8 != "skipped"])
def test_int8_ships_where_the_graph_quantizes(shipped: dict[str, Shipped], name: str) -> None:
    # Prepare
    item = shipped[name]
    arrays = item.case.make(7, 1)
    # Execute
    model = item.load()
    # Assert: int8 is the default, and it agrees in shape with fp32
    assert model.variant == "int8"
    assert item.bundle.manifest["variants"]["int8"] == {"file": "model.int8.onnx", "quantization": item.case.int8}
    assert model.run(*arrays)[0].shape == item.load(variant="fp32").run(*arrays)[0].shape
    metrics = item.bundle.manifest["metrics"]
    assert {f"int8_{m}" for m in item.case.metrics} | {"int8_top1_agreement"} <= set(metrics)
    assert 0.0 <= metrics["int8_top1_agreement"] <= 1.0


def test_a_graph_with_nothing_to_quantize_ships_fp32_and_says_why(
    shipped: dict[str, Shipped], caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare
    item = shipped["regression"]
    # Execute: the default falls back to fp32; asking for int8 is refused
    with caplog.at_level(logging.INFO, logger="fedge.edge"):
        model = item.load()
    with pytest.raises(BundleVerificationError, match="no 'int8' model \\(skipped at export: no op of the graph "
                                                      "quantizes"):
        item.load(variant="int8")
    # Assert
    assert model.variant == "fp32" and "running fp32" in caplog.text
    entry = item.bundle.manifest["variants"]["int8"]
    assert set(entry) == {"skipped", "quantization"} and "no op of the graph quantizes" in entry["skipped"]
    assert not (item.bundle.path / "model.int8.onnx").exists()
    assert not any(key.startswith("int8_") for key in item.bundle.manifest["metrics"])


# --------------------------------------------------------------------------- bad inputs


# (case, call arguments, expected message)
BAD_INPUTS: list[tuple[str, Callable[[], tuple[Any, ...]], str]] = [
    ("image", lambda: (np.zeros((2, 3, 8, 7), np.float32),),
     r"input 'image' has shape \(2, 3, 8, 7\) float32; the model declares image\[batch, 3, 8, 8\] float32: "
     r"pass arrays shaped as the bundle's manifest says"),
    ("image", lambda: (np.zeros((2, 3, 8, 8), np.int64),), r"input 'image' has shape \(2, 3, 8, 8\) int64"),
    ("image", lambda: ({},), r"missing input\(s\) \['image\[batch, 3, 8, 8\] float32'\]"),
    ("image", lambda: (np.zeros((2, 3, 8, 8)), np.zeros((2, 3, 8, 8))), r"2 input arrays for 1 declared inputs"),
    ("two-inputs", lambda: (np.zeros((2, 4)), np.zeros((2, 6), np.float32)),
     r"input 'tokens' has shape \(2, 6\) float32; .*tokens\[batch, 6\] int64"),
    ("two-inputs", lambda: (np.zeros((2, 4)),), r"1 input arrays for 2 declared inputs"),
    ("two-inputs", lambda: ({"features": np.zeros((2, 4))},), r"missing input\(s\) \['tokens\[batch, 6\] int64'\]"),
    ("two-inputs", lambda: ({"features": np.zeros((2, 4)), "tokens": np.zeros((2, 6), int), "token": 1},),
     r"unknown input\(s\) \['token'\]"),
    ("two-inputs", lambda: (np.zeros((2, 4)), np.zeros((3, 6), np.int64)),
     r"inputs 'features' and 'tokens' share axis 'batch' but have sizes 2 and 3"),
    ("two-inputs", lambda: (np.zeros(4), np.zeros(6, np.int64)), r"input 'features' has shape \(4,\)"),
    ("regression", lambda: (np.zeros((2, 4), np.float32),),
     r"input 'x' has shape \(2, 4\) float32; .*x\[batch, 3\] float32.*a single example is \(3,\)"),
    ("regression", lambda: (np.array([["a", "b", "c"]]),), r"input 'x' has shape \(1, 3\) <U1"),
    ("regression", lambda: (np.zeros(4, np.float32),),
     r"input 'x' has shape \(4,\) float32; .*single example is \(3,\)"),
    ("sequence", lambda: (np.zeros((2, 5), np.float32),), r"input 'tokens' has shape \(2, 5\) float32"),
    ("sequence", lambda: (np.zeros((2, 5, 1), np.int64),), r"input 'tokens' has shape \(2, 5, 1\) int64"),
]


@pytest.mark.parametrize(("name", "arguments", "message"), BAD_INPUTS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_INPUTS)])
def test_bad_inputs_are_refused_naming_the_input(
    shipped: dict[str, Shipped], name: str, arguments: Callable[[], tuple[Any, ...]], message: str
) -> None:
    # Prepare
    model = shipped[name].load(variant="fp32")
    # Execute / Assert
    with pytest.raises(ConfigError, match=message):
        model.run(*arguments())


def test_inputs_may_come_by_name_and_in_a_wider_dtype_of_the_same_kind(shipped: dict[str, Shipped]) -> None:
    # Prepare: float64 features and int32 tokens, as numpy makes them by default on some platforms
    model = shipped["two-inputs"].load(variant="fp32")
    features, tokens = _reviews(3, 0)
    # Execute
    by_position = model.run(features, tokens)[0]
    by_name = model.run({"tokens": tokens.astype(np.int32), "features": features.astype(np.float64)})[0]
    by_keyword = model.run(features=features, tokens=tokens)[0]
    # Assert
    np.testing.assert_array_equal(by_position, by_name)
    np.testing.assert_array_equal(by_position, by_keyword)
    with pytest.raises(ConfigError, match=r"not both"):
        model.run(features, tokens=tokens)


def test_one_unbatched_example_runs_as_a_batch_of_one(shipped: dict[str, Shipped]) -> None:
    # Prepare
    model = shipped["sequence"].load(variant="fp32")
    tokens = np.array([1, 2, 3, 4], np.int64)
    # Execute
    (one,) = model.run(tokens)
    # Assert
    np.testing.assert_array_equal(one, model.run(tokens[None, :])[0])
    assert one.shape == (1, 3, 4)


class DoubledPriceTask(PriceTask):
    """A task whose forward is not ``model(*inputs)``: the model sees the inputs doubled."""

    name = "doubled-price"

    def forward(self, model: nn.Module, inputs: Sequence[torch.Tensor]) -> torch.Tensor:  # noqa: D102
        return model(inputs[0] * 2)  # type: ignore[no-any-return]


def test_a_tasks_own_forward_is_what_the_bundle_runs(key_paths: tuple[Path, Path], tmp_path: Path) -> None:
    # Prepare: (2x) @ [1, 2, 3] + 0.5
    task = DoubledPriceTask()
    built = export_global_model(seeded_model(task, 0), tmp_path / "b", config=CONFIG, task=task, server_round=1,
                                source_run="run", private_key=_key(key_paths))
    # Execute
    (out,) = EdgeModel.load(built.path, trusted_keys=[key_paths[1]]).run(np.array([[1, 1, 1]], np.float32))
    # Assert: 2 + 4 + 6 + 0.5; held out: outputs 12.5, 2.5, 4.5, 6.5 for targets 7.5, 2.5, 3.5, 4.5
    np.testing.assert_allclose(out, [[12.5]], atol=1e-6)
    assert built.manifest["metrics"]["fp32_mse"] == pytest.approx((5**2 + 0 + 1**2 + 2**2) / 4, abs=1e-5)


# --------------------------------------------------------------------------- predict


def test_predict_names_the_tasks_labels(shipped: dict[str, Shipped]) -> None:
    # Prepare
    model = shipped["two-inputs"].load()
    arrays = _reviews(5, 0)
    # Execute
    prediction = model.predict(*arrays)
    # Assert
    np.testing.assert_allclose(prediction.probabilities.sum(axis=1), 1.0, rtol=1e-5)
    assert prediction.label_names == [("negative", "positive")[i] for i in prediction.labels]


@pytest.mark.parametrize(("name", "message"), [
    ("regression", r"bundle 'run/price' is not a classifier \(no labels; its output: predicted price in euros\); "
                   r".*use run\(\)"),
    ("sequence", r"gives class scores of shape \(2, 3, 5\); predict\(\) handles \(batch, classes\) only, use run\(\)"),
])
def test_predict_refuses_what_is_not_batch_by_classes_pointing_at_run(
    shipped: dict[str, Shipped], name: str, message: str
) -> None:
    # Prepare
    model = shipped[name].load(variant="fp32")
    # Execute / Assert
    with pytest.raises(ConfigError, match=message):
        model.predict(*shipped[name].case.make(2, 0))


def test_preprocess_applies_the_tasks_affine_transform(shipped: dict[str, Shipped]) -> None:
    # Prepare: RGB bytes / 255
    model = shipped["image"].load()
    raw = np.full((1, 3, 8, 8), 51, np.uint8)
    # Execute
    x = model.preprocess(raw)
    # Assert
    assert x.dtype == np.float32
    np.testing.assert_allclose(x, 0.2, rtol=1e-6)


# --------------------------------------------------------------------------- the model must be what the manifest says


def _resigned(shipped: Shipped, private: Path, change: Callable[[dict[str, Any]], None]) -> dict[str, bytes]:
    files = read_bundle(shipped.bundle.path)
    manifest = json.loads(files[MANIFEST])
    change(manifest)
    files[MANIFEST] = json.dumps(manifest).encode()
    files[SIGNATURE] = sign_manifest(files[MANIFEST], load_private_key(private))
    return files


# (case, what the signed manifest claims, expected reason)
MISMATCHES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("two-inputs", lambda m: m["inputs"][1].update(dtype="float32"),
     "input 'tokens' is int64 in the model, float32 in the manifest"),
    ("two-inputs", lambda m: m["inputs"][0].update(shape=["batch", "width"]),
     "input 'features' axis 1 is fixed at 4 in the model but dynamic \\('width'\\)"),
    ("two-inputs", lambda m: m["inputs"][1].update(name="words"), "model inputs \\['features', 'tokens'\\]"),
    ("two-inputs", lambda m: m["inputs"].pop(), "model inputs \\['features', 'tokens'\\], manifest \\['features'\\]"),
    ("image", lambda m: m["inputs"][0].update(shape=["batch", 3, 8]), "input 'image' has shape"),
    ("sequence", lambda m: m["outputs"][0].update(shape=["batch", 4, "sequence"]),
     "output 'logits' axis 1 is 3 in the model, 4 in the manifest"),
    ("sequence", lambda m: m.update(labels=["O", "B"]), "names 2 labels for a model of 3 classes"),
    ("regression", lambda m: m["outputs"][0].update(name="price"), "model outputs \\['output'\\]"),
]


@pytest.mark.parametrize(("name", "change", "reason"), MISMATCHES,
                         ids=[f"{m[0]}-{i}" for i, m in enumerate(MISMATCHES)])
def test_a_signed_manifest_that_misdescribes_the_model_is_refused(
    shipped: dict[str, Shipped], key_paths: tuple[Path, Path], name: str,
    change: Callable[[dict[str, Any]], None], reason: str,
) -> None:
    # Prepare: signed by the trusted key, so only the model/manifest comparison can catch it
    files = _resigned(shipped[name], key_paths[0], change)
    # Execute / Assert
    with pytest.raises(BundleVerificationError, match=reason):
        EdgeModel.from_files(files, trusted_keys=[key_paths[1]], variant="fp32")


# --------------------------------------------------------------------------- export failures


@torch.library.custom_op("fedge_test::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Doubler(nn.Module):
    """A layer whose op has no ONNX translation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _double(x)  # type: ignore[no-any-return]


class WithOddLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.odd = nn.Linear(3, 3), Doubler()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.odd(self.linear(x))  # type: ignore[no-any-return]


class FixedBatch(nn.Module):
    """Writes the traced batch size into a reshape: no bundle can run it on other batches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(2, -1)


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x


X3 = (InputSpec("x", ("batch", 3)),)
TOKENS = (InputSpec("tokens", ("batch", "sequence"), "int64"),)

# (case, model, sample, signature, expected message)
EXPORT_FAILURES: list[tuple[str, nn.Module, tuple[np.ndarray, ...], tuple[InputSpec, ...], str]] = [
    ("unsupported layer", WithOddLayer(), _prices(4, 0), X3,
     r"WithOddLayer: layer 'odd' \(Doubler\), op fedge_test.double.default cannot be translated to ONNX"),
    ("data-dependent control flow", DataDependent(), _prices(4, 0), X3,
     r"torch.export cannot trace DataDependent with dynamic axes \['batch'\] at test_edge_tasks.py:\d+ "
     r"\(`return x if x.sum\(\) > 0 else -x`\)"),
    ("a model that fixes the batch", FixedBatch(), _prices(4, 0), X3,
     r"FixedBatch fixes dynamic axis 'batch' to 2: a bundle runs any batch size"),
    ("sample of the wrong dtype", WeightedSum(), (np.zeros((4, 3)),), X3,
     r"sample input 'x' has shape \(4, 3\) float64; the signature declares x\[batch, 3\] float32"),
    ("one token on the dynamic axis", Tagger(), _sentences(4, 0, 1), TOKENS,
     r"sample input 'tokens' has size < 2 on dynamic axis \['sequence'\]"),
    ("two arrays for one input", WeightedSum(), _reviews(4, 0), X3, r"2 sample arrays for 1 declared inputs"),
    ("no example", WeightedSum(), _prices(0, 0), X3, r"sample input 'x' holds no examples"),
]


@pytest.mark.parametrize(("case", "model", "sample", "specs", "message"), EXPORT_FAILURES,
                         ids=[f[0] for f in EXPORT_FAILURES])
def test_export_failures_say_what_and_where(tmp_path: Path, case: str, model: nn.Module,
                                            sample: tuple[np.ndarray, ...], specs: tuple[InputSpec, ...],
                                            message: str) -> None:
    # Execute / Assert
    with pytest.raises(ExportError, match=message):
        export_onnx(model, sample, tmp_path / "m.onnx", inputs=specs)
    assert not (tmp_path / "m.onnx").exists()


class LSTMTagger(nn.Module):
    """Embedding -> LSTM -> linear, classes on axis 1; torch.export fixes an LSTM's sequence length."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.lstm, self.head = nn.Embedding(30, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        states, _ = self.lstm(self.embedding(tokens))
        return self.head(states).transpose(1, 2)  # type: ignore[no-any-return]


class LSTMTaggerTask(TaggerTask):
    name = "lstm-tagger"

    def build_model(self) -> nn.Module:  # noqa: D102
        return LSTMTagger()


def test_a_sequence_the_model_cannot_vary_ships_at_its_traced_length(
    key_paths: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: the task declares ("batch", "sequence"); its held-out sentences have 5 tokens
    task = LSTMTaggerTask()
    model = seeded_model(task, 0)
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedge.edge"):
        built = export_global_model(model, tmp_path / "b", config=CONFIG, task=task, server_round=1,
                                    source_run="run", private_key=_key(key_paths))
    edge = EdgeModel.load(built.path, trusted_keys=[key_paths[1]], variant="fp32")
    # Assert: the bundle says it takes 5 tokens, runs any batch of them, and refuses 7 by name
    assert built.manifest["inputs"] == [{"name": "tokens", "shape": ["batch", 5], "dtype": "int64"}]
    assert built.manifest["fixed_axes"] == {"sequence": 5}
    assert "LSTMTagger cannot vary axis sequence: the bundle takes sequence = 5 only" in caplog.text
    tokens = _sentences(7, 1)
    np.testing.assert_allclose(edge.run(*tokens)[0], _torch(model, tokens), atol=PARITY_TOLERANCE)
    with pytest.raises(ConfigError, match=r"input 'tokens' has shape \(7, 6\) int64; .*tokens\[batch, 5\] int64"):
        edge.run(*_sentences(7, 1, 6))
    # Assert: the LSTM's int8 kernel (com.microsoft DynamicQuantizeLSTM) would make devices refuse the bundle,
    # so int8 quantizes the matrix products only and keeps the LSTM fp32; the int8 graph runs like the fp32 one
    int8 = EdgeModel.load(built.path, trusted_keys=[key_paths[1]], variant="int8")
    assert {node.domain for node in onnx.load(str(built.path / "model.int8.onnx")).graph.node} <= {"", "ai.onnx"}
    assert int8.run(*tokens)[0].shape == edge.run(*tokens)[0].shape


def test_a_classifier_spec_must_match_the_models_classes(key_paths: tuple[Path, Path], tmp_path: Path) -> None:
    # Prepare: two labels for a model of three classes
    task = ImageTask()
    spec = BundleSpec(model_name="x", source_run="r", server_round=0, preprocessing={}, labels=["a", "b"])
    data = task.central_data()
    # Execute / Assert
    with pytest.raises(ConfigError, match=r"names 2 labels but the model's first output has shape \(2, 3\)"):
        build_bundle(seeded_model(task, 0), tmp_path / "b", spec=spec, private_key=_key(key_paths), inputs=task.inputs,
                     sample=data.inputs, score=None, calibration=data.inputs)
    assert not (tmp_path / "b").exists()


def _key(key_paths: tuple[Path, Path]) -> Ed25519PrivateKey:
    return load_private_key(key_paths[0])


# --------------------------------------------------------------------------- the command line


def test_predict_cli_prints_regression_values_and_takes_npz_for_several_inputs(
    shipped: dict[str, Shipped], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare
    np.save(tmp_path / "x.npy", np.array([[1, 1, 1], [0, 0, 0]], np.float32))
    features, tokens = _reviews(3, 0)
    np.savez(tmp_path / "reviews.npz", features=features, tokens=tokens)
    trusted = ["--trusted", str(shipped["regression"].public)]
    # Execute
    price = main(["predict", str(shipped["regression"].bundle.path), str(tmp_path / "x.npy"), *trusted])
    price_out = capsys.readouterr().out
    reviews = main(["predict", str(shipped["two-inputs"].bundle.path), str(tmp_path / "reviews.npz"), *trusted])
    reviews_out = capsys.readouterr().out
    np.save(tmp_path / "tokens.npy", _sentences(2, 0, 4)[0])
    tags = main(["predict", str(shipped["sequence"].bundle.path), str(tmp_path / "tokens.npy"), *trusted])
    tags_out = capsys.readouterr().out
    # Assert: one value per example (6.5 and 0.5), one "label<TAB>probability" per review, and the
    # tagger's 3 x 4 scores per sentence (not (batch, classes): printed as numbers)
    assert (price, reviews, tags) == (0, 0, 0)
    assert price_out.splitlines() == ["6.5", "0.5"]
    assert [len(line.split("\t")) for line in tags_out.splitlines()] == [12, 12]
    assert len(reviews_out.splitlines()) == 3
    assert all(re.fullmatch(r"(negative|positive)\t0\.\d{4}|(negative|positive)\t1\.0000", line)
               for line in reviews_out.splitlines())
