"""Local SGD with an exported training graph: numpy and onnxruntime only, no torch.

A phone or a browser that cannot ship torch still trains: the coordinator exports the
task model's training step as a plain ONNX graph (:mod:`fedge.edge.training_graph`)
whose inputs are the weights, a batch and its targets and whose outputs are the mean
loss and the gradient of every trainable weight. The optimiser update runs here, in
numpy, so FedProx's proximal term and momentum stay outside the graph and every runtime
(onnxruntime in Python, onnxruntime-web, a native app) does the same three-line update.

Why not onnxruntime-training: its packages are discontinued (last release 2024) and its
graphs need ORT's special training build; ExecuTorch's training extension gave wrong CNN
gradients (see the on-device training notes). A plain graph runs on any onnxruntime.

The semantics are those of :func:`fedge.task.training.train_local` with
:class:`fedge.task.training.MomentumSGD`: velocity ``v = g`` on the first step, then
``v = m v + g``; ``p -= lr v``; FedProx adds ``mu (p - p_start)`` to the gradient while the
reported loss leaves the proximal term out; the reported loss is the example-weighted
mean of the batch losses. This module must not import torch (directly or through fedge's
task modules): ``tests/test_trainer.py`` checks it in a process where torch is blocked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedge.batching import batch_order
from fedge.edge.graph_check import CheckedGraph, check_graph, check_op_list, session_of
from fedge.edge.training_bundle import EVAL_FILE, GRAPH_OPS, TRAIN_FILE
from fedge.errors import ConfigError
from fedge.signature import InputSpec, check_inputs
from fedge.work import LocalWork as LocalTrainStats  # what a train reply reports

log = logging.getLogger("fedge.edge")
__all__ = ["LocalTrainStats", "MomentumUpdate", "NUMPY_METRICS", "OnnxTrainer", "batch_order"]
# batch_order is fedge.batching's: torch's train_local draws the same batches, so both runtimes send one update.

STATE_PREFIX = "state:"
GRAD_PREFIX = "grad:"
TARGETS = "targets"
LOSS = "loss"
OUTPUT = "output"
DEVICE_HINT = "pass arrays shaped as the training bundle's manifest says"


# --------------------------------------------------------------------------- metrics
# Metrics a device computes in numpy from the evaluation graph's output. Each gives the
# batch mean (a float) of one batch; evaluate() weights batches by their number of examples,
# as fedge.task.training.evaluate does with a task's torch metrics.


def _accuracy(output: np.ndarray, targets: np.ndarray) -> float:
    """Top-1 accuracy of class scores ``(n, classes, ...)``, counted exactly like ``classification_metrics``."""
    correct = int(np.count_nonzero(np.argmax(output, axis=1) == targets))
    return correct / max(targets.size, 1)


def _mse(output: np.ndarray, targets: np.ndarray) -> float:
    error = _squeezed(output, targets) - targets.astype(np.float64)
    return float(np.mean(error**2))


def _mae(output: np.ndarray, targets: np.ndarray) -> float:
    return float(np.mean(np.abs(_squeezed(output, targets) - targets.astype(np.float64))))


def _squeezed(output: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """A regression output ``(n, 1)`` as ``(n,)`` against targets ``(n,)`` (``outputs.squeeze(-1)``)."""
    out = output.astype(np.float64)
    return out[..., 0] if out.ndim == targets.ndim + 1 and out.shape[-1] == 1 else out


NUMPY_METRICS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "accuracy": _accuracy,
    "mse": _mse,
    "mae": _mae,
}
"""Metrics a device computes without torch, by the name a manifest lists; ``loss`` comes from the graph."""


@dataclass(frozen=True)
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool


class OnnxTrainer:
    """Runs a training bundle's graphs: local SGD with momentum (and FedProx), and evaluation.

    Parameters
    ----------
    train_onnx, eval_onnx : bytes
        The training and evaluation graphs (as :class:`fedge.edge.training_bundle.TrainingBundle` holds them).
    manifest : mapping
        The training bundle's manifest: ``state`` entries, ``inputs``, ``targets`` and ``metrics``
        are read from it, and weights and data are checked against them.
    threads : int
        onnxruntime's intra-op threads (1 keeps results reproducible and a phone cool).

    Threat model: the graphs are code from the coordinator; a signature says who shipped
    them, not what they do. Before any session exists both are checked
    (:func:`fedge.edge.graph_check.check_graph`): a graph referencing external data (a
    file on the device, returned inside the update) or an op outside the standard ONNX
    domain is refused, and, when the manifest lists each graph's ops (``graph_ops``, as
    every signed training bundle does), a graph whose ops differ from that list is refused.
    What a graph *can* legitimately compute from the device's examples, it can send: only
    secure aggregation and differential privacy bound what one update reveals.

    Raises
    ------
    ConfigError
        When the manifest lacks what training needs or the graphs do not take what it says.
    BundleVerificationError
        When a graph references external data, uses a non-standard op, or differs from the
        manifest's op list (no session is created).
    """

    def __init__(self, train_onnx: bytes, eval_onnx: bytes, manifest: Mapping[str, Any], *, threads: int = 1) -> None:
        self.state, self.inputs, self.target_shape, self.target_dtype = _read_manifest(manifest)
        listed = [str(name) for name in manifest.get("metrics", [])]
        self.metrics = tuple(name for name in listed if name in NUMPY_METRICS)
        skipped = sorted(set(listed) - set(NUMPY_METRICS) - {LOSS})
        if skipped:
            log.info("metrics %s have no numpy version on this device; evaluate() leaves them out", skipped)
        train, evaluation = _checked_graphs(train_onnx, eval_onnx, manifest)
        self._train = session_of(train, threads=threads)
        self._eval = session_of(evaluation, threads=threads)
        self._trainable = tuple(entry for entry in self.state if entry.trainable)
        self._check_graph(self._train, [LOSS, *(GRAD_PREFIX + e.name for e in self._trainable)], "train.onnx")
        self._check_graph(self._eval, [LOSS, OUTPUT], "eval.onnx")

    def _check_graph(self, session: Any, outputs: list[str], what: str) -> None:
        expected_inputs = [*(STATE_PREFIX + e.name for e in self.state), *(s.name for s in self.inputs), TARGETS]
        got_inputs = [value.name for value in session.get_inputs()]
        got_outputs = [value.name for value in session.get_outputs()]
        if got_inputs != expected_inputs or got_outputs != outputs:
            raise ConfigError(f"{what} takes {got_inputs[:6]}... and gives {got_outputs[:6]}...; the manifest "
                              f"says {expected_inputs[:6]}... and {outputs[:6]}...: the bundle is inconsistent, "
                              "re-export it")

    # ------------------------------------------------------------------ checks
    def _checked_weights(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [entry.name for entry in self.state]
        missing, extra = [n for n in names if n not in weights], sorted(set(weights) - set(names))
        if missing or extra:
            raise ConfigError(f"weights do not match the training bundle: missing {missing[:10]}, extra "
                              f"{extra[:10]}; send the arrays of the model the bundle was exported from")
        checked = {}
        for entry in self.state:
            array = np.asarray(weights[entry.name])
            if tuple(array.shape) != entry.shape:
                raise ConfigError(f"weight '{entry.name}' has shape {tuple(array.shape)}; the training bundle "
                                  f"declares {entry.shape}: send the arrays of the model the bundle was exported from")
            checked[entry.name] = np.ascontiguousarray(array, dtype=np.dtype(entry.dtype))
        return checked

    def _checked_data(self, inputs: Sequence[np.ndarray], targets: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        arrays = [np.asarray(array) for array in inputs]
        check_inputs(self.inputs, arrays, source="training data", hint=DEVICE_HINT, declared_by="the training bundle")
        targets = np.asarray(targets)
        if targets.ndim != len(self.target_shape) or np.dtype(targets.dtype) != np.dtype(self.target_dtype) or any(
                not isinstance(size, str) and size != got for size, got in zip(self.target_shape, targets.shape,
                                                                               strict=True)):
            raise ConfigError(f"targets have shape {tuple(targets.shape)} {targets.dtype}; the training bundle "
                              f"declares [{', '.join(map(str, self.target_shape))}] {self.target_dtype}: {DEVICE_HINT}")
        if any(len(array) != len(targets) for array in arrays):
            raise ConfigError(f"inputs hold {[len(a) for a in arrays]} examples and targets {len(targets)}; "
                              "every array needs the same number of examples on axis 0")
        return arrays, targets

    def _feeds(self, weights: Mapping[str, np.ndarray], inputs: Sequence[np.ndarray],
               targets: np.ndarray) -> dict[str, np.ndarray]:
        feeds = {STATE_PREFIX + name: array for name, array in weights.items()}
        feeds.update({spec.name: np.ascontiguousarray(array) for spec, array in zip(self.inputs, inputs, strict=True)})
        feeds[TARGETS] = np.ascontiguousarray(targets)
        return feeds

    # ------------------------------------------------------------------ training
    def gradients(self, weights: Mapping[str, np.ndarray], inputs: Sequence[np.ndarray],
                  targets: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        """The mean loss of one batch and the gradient of every trainable weight (no checks: weights as given)."""
        results = self._train.run(None, self._feeds(weights, inputs, targets))
        return float(results[0]), {entry.name: grad for entry, grad in zip(self._trainable, results[1:], strict=True)}

    def train(self, weights: Mapping[str, np.ndarray], inputs: Sequence[np.ndarray], targets: np.ndarray, *,
              epochs: int, batch_size: int, learning_rate: float, momentum: float, seed: int,
              proximal_mu: float = 0.0, max_steps: int | None = None,
              batches: Iterable[np.ndarray] | None = None) -> tuple[dict[str, np.ndarray], LocalTrainStats]:
        """Local SGD with momentum from ``weights``; returns every state entry (buffers unchanged) and stats.

        ``batches`` (index arrays) replaces :func:`batch_order` (to replay another trainer's
        order); otherwise ``epochs`` passes, or exactly ``max_steps`` batches, seeded by ``seed``.

        Raises
        ------
        ConfigError
            For weights or data that do not match the manifest (naming the entry or input).
        """
        state = self._checked_weights(weights)
        arrays, targets = self._checked_data(inputs, targets)
        order = batches if batches is not None else batch_order(len(targets), batch_size, seed, epochs, max_steps)
        optimizer = MomentumUpdate(learning_rate=learning_rate, momentum=momentum, proximal_mu=proximal_mu,
                                   anchor={e.name: state[e.name].copy() for e in self._trainable})
        total, seen, steps = 0.0, 0, 0
        for index in order:
            batch_targets = targets[index]
            loss, grads = self.gradients(state, [array[index] for array in arrays], batch_targets)
            optimizer.step(state, grads)
            total += loss * len(batch_targets)
            seen += len(batch_targets)
            steps += 1
        stats = LocalTrainStats(loss=total / max(seen, 1), num_examples=len(targets), samples_processed=seen,
                                steps=steps)
        return state, stats

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, weights: Mapping[str, np.ndarray], inputs: Sequence[np.ndarray], targets: np.ndarray, *,
                 batch_size: int = 256) -> dict[str, float]:
        """Example-weighted means of ``loss`` and of the manifest's metrics that have a numpy version."""
        state = self._checked_weights(weights)
        arrays, targets = self._checked_data(inputs, targets)
        if len(targets) == 0:
            raise ConfigError("no examples to evaluate on")
        sums = dict.fromkeys((LOSS, *self.metrics), 0.0)
        for start in range(0, len(targets), batch_size):
            batch_targets = targets[start:start + batch_size]
            loss, output = self._eval.run(None, self._feeds(state, [a[start:start + batch_size] for a in arrays],
                                                            batch_targets))
            sums[LOSS] += float(loss) * len(batch_targets)
            for name in self.metrics:
                sums[name] += NUMPY_METRICS[name](output, batch_targets) * len(batch_targets)
        return {name: total / len(targets) for name, total in sums.items()}


class MomentumUpdate:
    """``fedge.task.training.MomentumSGD``'s update in numpy, plus FedProx's proximal gradient.

    ``v = g`` on the first step, then ``v = momentum * v + g``; ``p -= lr * v``, all in
    the weights' own dtype (float32), as torch does in place. With ``proximal_mu`` > 0 the
    gradient gets ``mu * (p - anchor)`` (the gradient of ``mu/2 ||p - anchor||^2``).
    """

    def __init__(self, *, learning_rate: float, momentum: float, proximal_mu: float = 0.0,
                 anchor: Mapping[str, np.ndarray] | None = None) -> None:
        self.learning_rate, self.momentum, self.proximal_mu = learning_rate, momentum, proximal_mu
        self.anchor = dict(anchor or {})
        self.velocity: dict[str, np.ndarray] = {}

    def step(self, state: dict[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> None:
        """Update ``state`` in place from ``grads`` (names of trainable entries)."""
        for name, grad in grads.items():
            param = state[name]
            grad = grad.astype(param.dtype, copy=False)
            if self.proximal_mu > 0:
                grad = grad + param.dtype.type(self.proximal_mu) * (param - self.anchor[name])
            if self.momentum and name in self.velocity:
                velocity = self.velocity[name]
                velocity *= param.dtype.type(self.momentum)
                velocity += grad
            elif self.momentum:
                velocity = self.velocity[name] = np.array(grad, copy=True)
            else:
                velocity = grad
            state[name] = param - param.dtype.type(self.learning_rate) * velocity


def _checked_graphs(train_onnx: bytes, eval_onnx: bytes,
                    manifest: Mapping[str, Any]) -> tuple[CheckedGraph, CheckedGraph]:
    """Both graphs checked (no external data, standard ops) and, when listed, against the manifest's op lists."""
    checked = (check_graph(train_onnx, what=TRAIN_FILE), check_graph(eval_onnx, what=EVAL_FILE))
    declared = manifest.get(GRAPH_OPS)
    if declared is not None:
        listed = declared if isinstance(declared, Mapping) else {}
        for graph, name in zip(checked, (TRAIN_FILE, EVAL_FILE), strict=True):
            check_op_list(graph, listed.get(name), what=name)
    return checked


def _read_manifest(manifest: Mapping[str, Any]) -> tuple[tuple[_Entry, ...], tuple[InputSpec, ...],
                                                          tuple[int | str, ...], str]:
    """(state entries, input specs, target shape, target dtype) from a training manifest."""
    try:
        state = tuple(_Entry(str(e["name"]), tuple(int(s) for s in e["shape"]), str(e["dtype"]), bool(e["trainable"]))
                      for e in manifest["state"])
        inputs = tuple(InputSpec.from_manifest(dict(entry)) for entry in manifest["inputs"])
        target_shape = tuple(manifest["targets"]["shape"])
        target_dtype = str(manifest["targets"]["dtype"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"the training manifest lacks or mangles {exc}: it needs state, inputs and targets; "
                          "re-export the training bundle") from None
    if not state or not inputs:
        raise ConfigError("the training manifest lists no state or no inputs; re-export the training bundle")
    return state, inputs, target_shape, target_dtype
