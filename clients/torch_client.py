"""The torch device runtime: local training and evaluation of the task's torch model."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Message

from fedge import knobs, wire
from fedge.clients.common import LocalWork, TrainOrder, instructed_scale, received_weights
from fedge.config import RunConfig
from fedge.task.api import Task, TaskData
from fedge.task.models import load_arrays, model_arrays
from fedge.task.submodels import add_scaler, model_for
from fedge.task.training import evaluate, pick_device, train_local


def torch_local_work(msg: Message, config: RunConfig, order: TrainOrder, task: Task,
                     data: TaskData) -> tuple[ArrayRecord, dict[str, np.ndarray], LocalWork]:
    """Train the instruction's weights on ``data`` with torch; the trained arrays and the base weights."""
    base = received_weights(msg.content.array_records[wire.ARRAYS])
    model = model_for(task, {name: value.shape for name, value in base.items()}, seed=config.integer(knobs.SEED))
    load_arrays(model, ArrayRecord({k: Array(v) for k, v in base.items()}), source="global arrays")
    scaler = add_scaler(model, task, instructed_scale(msg))  # HeteroFL's scaler, if the run asks
    instruction = order.instruction
    stats = train_local(
        task, model, data, epochs=instruction.local_epochs, batch_size=instruction.batch_size,
        learning_rate=instruction.learning_rate, momentum=instruction.momentum,
        device=pick_device(config.text(knobs.DEVICE)), seed=order.seed,
        proximal_mu=instruction.proximal_term, max_steps=order.max_steps,
    )
    for hook in scaler:
        hook.remove()
    return model_arrays(model), base, stats


def torch_scores(msg: Message, config: RunConfig, task: Task, data: TaskData) -> dict[str, float]:
    """The task's metrics of the instruction's weights on ``data`` (unsummarised means)."""
    arrays = msg.content.array_records[wire.ARRAYS]
    shapes = {name: tuple(array.shape) for name, array in arrays.items()}
    model = model_for(task, shapes, seed=config.integer(knobs.SEED))
    load_arrays(model, arrays, source="global arrays")
    add_scaler(model, task, instructed_scale(msg))  # evaluated as it trains
    return evaluate(task, model, data, device=pick_device(config.text(knobs.DEVICE)), summarize=False)


__all__ = ["torch_local_work", "torch_scores"]
