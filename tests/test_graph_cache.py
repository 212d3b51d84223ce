"""The cache of ONNX translations (fedge.edge.graph_cache): a second export of the same training step translates
nothing and gives the same bytes; anything the translation reads makes a new entry; an entry that is damaged or
fails the parity check is never used; the coordinator keeps its cache in its state directory."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from fedge.edge.graph_cache import GRAPH_CACHE_ENV, SUFFIX
from fedge.edge.training_graph import TrainingGraphs, export_training_graphs
from fedge.server.coordinator import Coordinator
from fedge.signature import InputSpec

RNG = np.random.default_rng(0)
X, Y = RNG.random((32, 5), dtype=np.float32), RNG.integers(0, 3, 32)
SPEC = [InputSpec("features", ("batch", 5))]


def small(activation: type[nn.Module] = nn.ReLU, seed: int = 0) -> nn.Module:
    """Two linear layers: the same weights' shapes whatever the activation."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), activation(), nn.Linear(4, 3))


class Translations:
    """Counts calls of torch's ONNX translation."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls, original = 0, torch.onnx.export

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(torch.onnx, "export", counted)


def export(model: nn.Module) -> TrainingGraphs:
    return export_training_graphs(model, nn.functional.cross_entropy, [X], Y, inputs=SPEC, parity_steps=3)


def entries(cache: Path) -> dict[str, Path]:
    """The cache's entries by kind: ``train`` (gradient outputs) and ``eval``."""
    found = {}
    for path in cache.glob(f"*{SUFFIX}"):
        outputs = [value.name for value in onnx.load(path).graph.output]
        found["train" if any(name.startswith("grad:") for name in outputs) else "eval"] = path
    return found


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, TrainingGraphs]]:
    """A cache holding the ReLU model's translations and one holding the Tanh model's (made once for the file)."""
    made = {}
    for name, activation in (("relu", nn.ReLU), ("tanh", nn.Tanh)):
        directory = tmp_path_factory.mktemp(name) / "graph-cache"
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(GRAPH_CACHE_ENV, str(directory))
            made[name] = directory, export(small(activation))
    return made


@pytest.fixture
def cache(prepared: dict[str, tuple[Path, TrainingGraphs]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the ReLU model's cache, the one this process uses."""
    copy = tmp_path / "graph-cache"
    shutil.copytree(prepared["relu"][0], copy)
    monkeypatch.setenv(GRAPH_CACHE_ENV, str(copy))
    return copy


def test_a_second_export_translates_nothing_and_gives_the_same_bytes(
        prepared: dict[str, tuple[Path, TrainingGraphs]], cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the first export made two entries (train, eval) in a folder of its own
    first = prepared["relu"][1]
    translations = Translations(monkeypatch)
    # Execute: the same step again (other weights: they are inputs of the graph, not part of it)
    second = export(small(seed=1))
    # Assert: nothing translated; the same graphs; parity still ran
    assert translations.calls == 0
    assert (second.train_onnx, second.eval_onnx, second.opset) == (first.train_onnx, first.eval_onnx, first.opset)
    assert sorted(entries(cache)) == ["eval", "train"]
    assert oct(prepared["relu"][0].stat().st_mode & 0o777) == "0o700"
    assert 0 <= second.max_abs_diff <= 1e-5


def test_another_layer_with_the_same_weight_shapes_is_translated_anew(cache: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the ReLU model's entries
    translations = Translations(monkeypatch)
    # Execute
    tanh = export(small(nn.Tanh))
    # Assert: both graphs translated, and they compute tanh (four entries now)
    assert translations.calls == 2
    assert len(list(cache.glob(f"*{SUFFIX}"))) == 4
    assert "Tanh" in {node.op_type for node in onnx.load_from_string(tanh.eval_onnx).graph.node}


def test_an_entry_that_fails_the_parity_check_is_removed_and_translated_again(
        prepared: dict[str, tuple[Path, TrainingGraphs]], cache: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: the ReLU model's training entry replaced by the Tanh model's (the same inputs and outputs)
    relu, tanh_train = prepared["relu"][1], prepared["tanh"][1].train_onnx
    entries(cache)["train"].write_bytes(tanh_train)
    translations = Translations(monkeypatch)
    # Execute
    again = export(small(nn.ReLU))
    # Assert: the poisoned entry was caught by parity, both entries dropped and translated again, rightly
    assert translations.calls == 2
    assert again.train_onnx == relu.train_onnx != tanh_train
    assert entries(cache)["train"].read_bytes() == relu.train_onnx
    assert "failed the parity check against torch" in caplog.text


def test_a_damaged_entry_is_a_miss(prepared: dict[str, tuple[Path, TrainingGraphs]], cache: Path,
                                   monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Prepare
    entries(cache)["eval"].write_bytes(b"not an onnx file")
    translations = Translations(monkeypatch)
    # Execute
    again = export(small())
    # Assert: the damaged one translated again and rewritten; the intact one used
    assert translations.calls == 1
    assert again.eval_onnx == prepared["relu"][1].eval_onnx == entries(cache)["eval"].read_bytes()
    assert "cannot be read" in caplog.text


@pytest.mark.parametrize("named", [False, True])
def test_the_coordinator_gives_its_server_app_a_cache_in_its_state_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, named: bool) -> None:
    # Prepare: FEDGE_GRAPH_CACHE set beforehand, or not
    if named:
        monkeypatch.setenv(GRAPH_CACHE_ENV, str(tmp_path / "shared"))
    else:
        monkeypatch.delenv(GRAPH_CACHE_ENV, raising=False)
    # Execute
    env = Coordinator(tmp_path / "state", None).env()
    # Assert
    expected = tmp_path / "shared" if named else (tmp_path / "state" / "graph-cache").resolve()
    assert env[GRAPH_CACHE_ENV] == str(expected)
