"""Local training and batched evaluation of a task's torch model on a device's data."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from fedge.batching import batch_order
from fedge.errors import ConfigError
from fedge.wire import LocalWork as TrainStats  # what a train reply reports

if TYPE_CHECKING:
    from fedge.task.api import Task, TaskData


class MomentumSGD:
    """SGD with heavy-ball momentum, the update of ``torch.optim.SGD`` (no dampening).

    ``v <- momentum * v + grad; p <- p - lr * v``. Written here because creating any
    ``torch.optim`` optimizer imports ``torch._dynamo`` (about 2 s per process, paid
    by every simulated-device worker and every SuperNode ClientApp process); the
    update itself is three lines. ``tests/test_training.py`` checks it step for
    step against ``torch.optim.SGD``.
    """

    def __init__(self, params: list[nn.Parameter], *, lr: float, momentum: float = 0.0) -> None:
        self.params, self.lr, self.momentum = params, lr, momentum
        self.velocity: list[torch.Tensor | None] = [None] * len(params)

    @torch.no_grad()
    def step(self) -> None:
        """Apply one update from the parameters' current gradients."""
        for index, param in enumerate(self.params):
            if param.grad is None:
                continue
            velocity = self.velocity[index]
            if self.momentum and velocity is not None:
                velocity.mul_(self.momentum).add_(param.grad)
            elif self.momentum:
                velocity = self.velocity[index] = param.grad.detach().clone()
            else:
                velocity = param.grad
            param.add_(velocity, alpha=-self.lr)


def pick_device(preference: str = "auto") -> torch.device:
    """CUDA, then Apple MPS, then CPU for ``"auto"``; an explicit choice must exist."""
    available = {
        "cuda": torch.cuda.is_available(),
        "mps": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()),
        "cpu": True,
    }
    if preference == "auto":
        return torch.device(next(name for name, ok in available.items() if ok))
    if not available.get(preference, False):
        raise ConfigError(f"device '{preference}' is not available here; use device='auto'")
    return torch.device(preference)


def train_local(
    task: Task,
    model: nn.Module,
    data: TaskData,
    *,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    momentum: float,
    device: torch.device,
    seed: int,
    proximal_mu: float = 0.0,
    max_steps: int | None = None,
) -> TrainStats:
    """Train ``model`` in place with the task's loss and optimiser for ``epochs`` passes over ``data``.

    With ``proximal_mu`` > 0 the loss gets FedProx's ``mu/2 ||w - w_start||^2`` term
    (Li et al., MLSys 2020), ``w_start`` being the weights the call began with.
    With ``max_steps`` the device does exactly that many steps (cycling through its
    data as often as needed) instead of ``epochs`` passes: partial work that fits a
    time budget. Batches come from :func:`fedge.batching.batch_order` (numpy, seeded), the
    order an onnx device draws too, sliced from tensors rather than indexed example by example.
    """
    if len(data) == 0:
        raise ConfigError(f"task '{task.name}': this device has no training examples")
    inputs, targets = data.tensors()
    model.to(device).train()
    optimizer = task.optimizer(list(model.parameters()), lr=learning_rate, momentum=momentum)
    anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else []
    total_loss, seen, steps = 0.0, 0, 0
    for order in batch_order(len(data), batch_size, seed, epochs, max_steps):
        index = torch.from_numpy(order)
        batch = [tensor[index].to(device) for tensor in inputs]
        target = targets[index].to(device)
        model.zero_grad(set_to_none=True)
        loss = task.loss(task.forward(model, batch), target)
        objective = loss + _proximal(model, anchor, proximal_mu) if anchor else loss
        objective.backward()
        optimizer.step()
        total_loss += loss.item() * len(target)
        seen += len(target)
        steps += 1
    model.cpu()
    return TrainStats(loss=total_loss / max(seen, 1), num_examples=len(data), samples_processed=seen, steps=steps)


def _proximal(model: nn.Module, anchor: list[torch.Tensor], mu: float) -> torch.Tensor:
    return (mu / 2) * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True))  # type: ignore[return-value]


@torch.no_grad()
def evaluate(task: Task, model: nn.Module, data: TaskData, *, device: torch.device,
             batch_size: int = 1024, summarize: bool = True) -> dict[str, float]:
    """The task's metrics on ``data``: batch means weighted by batch size, then ``task.summarize``.

    ``summarize=False`` returns the weighted means as they are: what a device sends, so that
    the coordinator averages them over devices first and summarises once (perplexity and R^2
    stay exact under federated evaluation).

    Batches are tensor slices (no per-example Dataset indexing), so evaluating 100,000
    examples costs a few forward passes.
    """
    if len(data) == 0:
        raise ConfigError(f"task '{task.name}': no examples to evaluate on")
    inputs, targets = data.tensors()
    model.to(device).eval()
    sums: dict[str, float] = {}
    for start in range(0, len(data), batch_size):
        batch = [tensor[start:start + batch_size].to(device) for tensor in inputs]
        target = targets[start:start + batch_size].to(device)
        for name, value in task.metrics(task.forward(model, batch), target).items():
            sums[name] = sums.get(name, 0.0) + float(value) * len(target)
    model.cpu()
    means = {name: total / len(data) for name, total in sums.items()}
    return task.summarize(means) if summarize else means
