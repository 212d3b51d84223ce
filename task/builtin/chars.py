"""The ``chars`` task: next-character prediction on Python's own standard library sources.

Data
----
The corpus is :data:`MODULES`, 40 pure-Python modules of the standard library, read from
``sysconfig.get_paths()["stdlib"]`` in that (sorted) order: about 420 KB of text that
ships with every CPython, identical on machines with the same Python version (3.11.7 here;
other patch releases may differ by a few lines, other minor versions more). No download.

Characters are token ids (:data:`VOCABULARY`): 0 for any character outside it (non-ASCII
letters in docstrings, form feeds...), then newline, tab and the 95 printable ASCII
characters. Each file is cut into non-overlapping windows of :data:`SEQUENCE` characters;
a window's targets are the characters one position later (the first 64 of the 65
characters it spans). The last ``test-fraction`` of each file's windows (its tail, so no
held-out character is seen in training) is the coordinator's central test set.

Partitions
----------
Federated text is non-IID by author: in LEAF's Shakespeare benchmark (Caldas et al.,
"LEAF: A Benchmark for Federated Settings", 2018; McMahan et al., AISTATS 2017) each
device is one speaking role. Here a source file plays the role: with ``partitioner =
"dirichlet"`` (fedge's default; ``dirichlet-alpha`` plays no part) the training windows
are laid out file after file, the files in an order drawn from ``seed``, and dealt to
devices as contiguous, near-equal stretches. Each device thus reads one or a few files
(a file's neighbouring devices may share it), which works for any fleet size up to the
number of windows, 100 devices included, without falling back to IID. With ``partitioner
= "iid"`` windows are dealt at random as for any task. Either way every training window
lands on exactly one device.

Model and metrics
-----------------
Embedding (64) -> one LSTM layer (Hochreiter and Schmidhuber, "Long Short-Term Memory",
1997; 256 units) -> a linear layer over the vocabulary at every position, as in the
character LSTMs of Karpathy et al. ("Visualizing and Understanding Recurrent Networks",
2015) and of McMahan et al.'s Shakespeare experiments: 0.36 M parameters. The output is
``(batch, vocabulary, sequence)``, classes on axis 1 as torch's cross-entropy expects, so
the loss is the mean cross-entropy over every position of every window and accuracy is
top-1 next-character accuracy. The headline is perplexity, ``exp(loss)``, derived in
:meth:`Chars.summarize` from the example-weighted mean loss: the standard measure of a
language model, it scores the whole predicted distribution (how surprised the model is by
the actual next character), where accuracy only sees whether the top guess was right; a
uniform guess scores the vocabulary size (98), a perfect model 1. Lower is better.

The labels are the vocabulary's characters, ``"\\ufffd"`` standing for id 0, so a device
decodes predictions with ``"".join(labels[i] for i in ids)``.
"""

from __future__ import annotations

import math
import sysconfig
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from fedge import knobs
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.signature import InputSpec
from fedge.task.api import Task, TaskData
from fedge.task.data import check_partitionable
from fedge.task.registry import register_task

MODULES = (
    "abc", "base64", "bisect", "cmd", "code", "codeop", "colorsys", "copy", "copyreg", "csv", "filecmp", "fileinput",
    "fnmatch", "genericpath", "getopt", "glob", "graphlib", "heapq", "hmac", "keyword", "linecache", "netrc",
    "numbers", "operator", "posixpath", "pprint", "queue", "quopri", "reprlib", "sched", "secrets", "selectors",
    "shelve", "shlex", "string", "textwrap", "timeit", "types", "weakref", "zipapp",
)
VOCABULARY = "\n\t" + "".join(chr(code) for code in range(32, 127))
UNKNOWN = "\ufffd"
VOCABULARY_SIZE = len(VOCABULARY) + 1  # id 0: any other character
SEQUENCE = 64
EMBEDDING, HIDDEN = 64, 256

Tokens = NDArray[np.int64]


def encode(text: str) -> Tokens:
    """Token ids of ``text``: ``VOCABULARY.index(c) + 1``, or 0 for a character outside it."""
    table = np.zeros(128, dtype=np.int64)
    table[[ord(char) for char in VOCABULARY]] = np.arange(1, VOCABULARY_SIZE)
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return np.where(codes < 128, table[np.minimum(codes, 127)], 0)


def decode(ids: Tokens) -> str:
    """The text of token ids (id 0 as ``"\\ufffd"``)."""
    alphabet = UNKNOWN + VOCABULARY
    return "".join(alphabet[int(index)] for index in np.ravel(ids))


def windows(tokens: Tokens, length: int = SEQUENCE) -> TaskData:
    """Non-overlapping windows of ``tokens``: inputs ``(n, length)``, targets the ids one position later."""
    starts = np.arange(0, max(len(tokens) - length, 0), length)
    offsets = starts[:, None] + np.arange(length)[None, :]
    return TaskData.from_xy(tokens[offsets], tokens[offsets + 1])


def corpus_files(modules: tuple[str, ...] = MODULES) -> list[Path]:
    """The standard library source files of ``modules``, in order.

    Raises
    ------
    ConfigError
        If some are missing (a Python installed without its ``.py`` sources).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / f"{module}.py" for module in modules]
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise ConfigError(f"task 'chars' reads the standard library's sources from {root}, which lacks "
                          f"{', '.join(missing)}; install Python with its .py sources (e.g. the "
                          "python3-full or libpython3-stdlib package)")
    return files


def load_corpus(test_fraction: float) -> tuple[TaskData, NDArray[np.int64], TaskData]:
    """(training windows, the source file index of each, held-out windows): each file's tail held out."""
    train, sources, test = [], [], []
    for index, file in enumerate(corpus_files()):
        data = windows(encode(file.read_text(encoding="utf-8")))
        cut = len(data) - int(round(len(data) * test_fraction))
        train.append(data.take(slice(0, cut)))
        sources.append(np.full(cut, index, dtype=np.int64))
        test.append(data.take(slice(cut, None)))
    return _joined(train), np.concatenate(sources), _joined(test)


def by_source(sources: NDArray[np.int64], num_partitions: int, seed: int) -> list[NDArray[np.int64]]:
    """Window indices per device: windows file after file (files in a seeded order), cut in contiguous stretches.

    Raises
    ------
    ConfigError
        If there are more devices than windows.
    """
    check_partitionable(len(sources), num_partitions)
    order = np.random.default_rng(seed).permutation(int(sources.max()) + 1)
    laid_out = np.concatenate([np.flatnonzero(sources == file) for file in order])
    return list(np.array_split(laid_out, num_partitions))


class CharLSTM(nn.Module):
    """Embedding -> LSTM -> linear: next-character scores ``(batch, vocabulary, sequence)``."""

    def __init__(self, vocabulary: int = VOCABULARY_SIZE, embedding: int = EMBEDDING, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, embedding)
        self.lstm = nn.LSTM(embedding, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # noqa: D102
        states, _ = self.lstm(self.embedding(tokens))
        return self.head(states).transpose(1, 2)  # type: ignore[no-any-return]


@register_task("chars")
class Chars(Task):
    """Next-character prediction on 40 standard library modules; devices hold their own files (see the module)."""

    name = "chars"
    headline, higher_is_better = "perplexity", False
    inputs = (InputSpec("tokens", ("batch", "sequence"), "int64"),)
    labels = (UNKNOWN, *VOCABULARY)
    preprocessing: dict[str, Any] = {
        "kind": "characters", "vocabulary": VOCABULARY, "unknown": 0,
        "description": "text as token ids: 1 + the character's index in 'vocabulary' (newline, tab, printable "
                       "ASCII), 0 for any other character; windows of any length, 64 in training"}
    output = ("unnormalised next-character scores, (batch, vocabulary, sequence): position t scores the character "
              "after tokens[:, t]; labels name the characters; softmax over axis 1 gives probabilities")

    def __init__(self, config: RunConfig) -> None:
        self.test_fraction = config.number(knobs.TEST_FRACTION)
        self._shards: dict[tuple[int, int], list[NDArray[np.int64]]] = {}

    @cached_property
    def corpus(self) -> tuple[TaskData, NDArray[np.int64], TaskData]:
        """(training windows, their source file indices, held-out windows), read once."""
        return load_corpus(self.test_fraction)

    def build_model(self) -> nn.Module:  # noqa: D102
        return CharLSTM()

    def train_data(self) -> TaskData:  # noqa: D102
        return self.corpus[0]

    def central_data(self) -> TaskData:  # noqa: D102
        return self.corpus[2]

    def partition(self, partition_id: int, num_partitions: int, config: RunConfig) -> TaskData:
        """Device ``partition_id``'s windows: by source file, or IID with ``partitioner = "iid"``."""
        if config.text(knobs.PARTITIONER) == "iid":
            return super().partition(partition_id, num_partitions, config)
        key = (num_partitions, config.integer(knobs.SEED))
        if key not in self._shards:
            self._shards[key] = by_source(self.corpus[1], *key)
        return self.train_data().take(self._shards[key][partition_id])

    def device_data(self, path: str) -> TaskData:
        """A real device's own text: a ``.npz`` of windows (``tokens``, ``y``), or any text file, windowed."""
        if path.endswith(".npz"):
            return super().device_data(path)
        try:
            text = Path(path).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise ConfigError(f"cannot read device text '{path}': {exc}") from None
        data = windows(encode(text))
        if not len(data):
            raise ConfigError(f"device text '{path}' is shorter than one window of {SEQUENCE + 1} characters")
        return data

    def summarize(self, metrics: dict[str, float]) -> dict[str, float]:
        """Adds ``perplexity`` = exp(mean cross-entropy per character)."""
        if "loss" not in metrics:
            return metrics
        return {**metrics, "perplexity": math.exp(min(metrics["loss"], 700.0))}


def _joined(parts: list[TaskData]) -> TaskData:
    return TaskData.from_xy(np.concatenate([part.inputs[0] for part in parts]),
                            np.concatenate([part.targets for part in parts]))
