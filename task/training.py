"""Local training and evaluation of a torch model on a device's data."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fedge.errors import ConfigError


@dataclass(frozen=True)
class TrainStats:
    """What one local training job did."""

    loss: float
    num_examples: int
    samples_processed: int
    steps: int


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


def as_dataset(data: Dataset | tuple[np.ndarray, np.ndarray]) -> Dataset:  # type: ignore[type-arg]
    """Accept a torch Dataset or an ``(x, y)`` pair of numpy arrays."""
    if isinstance(data, Dataset):
        return data
    x, y = data
    return TensorDataset(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.int64))


def train_local(
    model: nn.Module,
    data: Dataset,  # type: ignore[type-arg]
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
    """Train ``model`` in place with SGD for ``epochs`` passes over ``data``.

    With ``proximal_mu`` > 0 the loss gets FedProx's ``mu/2 ||w - w_start||^2`` term
    (Li et al., MLSys 2020), ``w_start`` being the weights the call began with.
    With ``max_steps`` the device does exactly that many SGD steps (cycling through
    its data as often as needed) instead of ``epochs`` passes: partial work that fits
    a time budget.
    """
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(data, batch_size=batch_size, shuffle=True, generator=generator)
    model.to(device).train()
    optimizer = MomentumSGD(list(model.parameters()), lr=learning_rate, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else []
    total_loss, seen, steps = 0.0, 0, 0
    for x, y in _batches(loader, epochs, max_steps):
        x, y = x.to(device), y.to(device)
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        objective = loss + _proximal(model, anchor, proximal_mu) if anchor else loss
        objective.backward()
        optimizer.step()
        total_loss += loss.item() * len(y)
        seen += len(y)
        steps += 1
    model.cpu()
    return TrainStats(loss=total_loss / max(seen, 1), num_examples=len(data),  # type: ignore[arg-type]
                      samples_processed=seen, steps=steps)


def _batches(loader: DataLoader, epochs: int, max_steps: int | None) -> Iterator[Any]:  # type: ignore[type-arg]
    """``epochs`` passes over ``loader``, or exactly ``max_steps`` batches when given."""
    if max_steps is None:
        for _ in range(epochs):
            yield from loader
        return
    done = 0
    while done < max_steps:
        for batch in loader:
            yield batch
            done += 1
            if done == max_steps:
                return


def _proximal(model: nn.Module, anchor: list[torch.Tensor], mu: float) -> torch.Tensor:
    return (mu / 2) * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True))  # type: ignore[return-value]


@torch.no_grad()
def evaluate(
    model: nn.Module, data: Dataset, *, device: torch.device, batch_size: int = 512  # type: ignore[type-arg]
) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of ``model`` on ``data``."""
    model.to(device).eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    total_loss, correct, seen = 0.0, 0, 0
    for x, y in DataLoader(data, batch_size=batch_size):
        x, y = x.to(device), y.to(device)
        logits = model(x)
        total_loss += loss_fn(logits, y).item()
        correct += int((logits.argmax(dim=1) == y).sum())
        seen += len(y)
    model.cpu()
    return total_loss / max(seen, 1), correct / max(seen, 1)
