"""Local training: the hand-written SGD matches torch.optim.SGD; budgets and devices."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fedge.batching import batch_order
from fedge.errors import ConfigError
from fedge.signature import InputSpec
from fedge.task.api import Task, TaskData
from fedge.task.models import build_model
from fedge.task.training import MomentumSGD, evaluate, pick_device, train_local


class TwoClass(Task):
    """Logistic regression on 8 features, the label the sign of the first one."""

    name = "two-class"
    inputs = (InputSpec("x", ("batch", 8)),)

    def build_model(self) -> nn.Module:
        return build_model("logreg", 8, 2)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_momentum_sgd_matches_torch_optim_step_for_step(momentum: float) -> None:
    # Prepare: two identical models, one per optimiser
    torch.manual_seed(0)
    ours = build_model("mlp", 8, 3)
    theirs = copy.deepcopy(ours)
    opt_ours = MomentumSGD(list(ours.parameters()), lr=0.1, momentum=momentum)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=momentum)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    # Execute: five steps each
    for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
        for _ in range(5):
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    # Assert
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_train_local_counts_work_and_lowers_loss() -> None:
    # Prepare
    torch.manual_seed(1)
    x = torch.randn(64, 8)
    data, task = TaskData.from_xy(x.numpy(), (x[:, 0] > 0).long().numpy()), TwoClass()
    model = build_model("logreg", 8, 2, seed=0)
    before = evaluate(task, model, data, device=torch.device("cpu"))
    # Execute
    stats = train_local(task, model, data, epochs=3, batch_size=16, learning_rate=0.5, momentum=0.0,
                        device=torch.device("cpu"), seed=0)
    after = evaluate(task, model, data, device=torch.device("cpu"))
    # Assert: 3 epochs of 4 batches of 16
    assert (stats.num_examples, stats.samples_processed, stats.steps) == (64, 192, 12)
    assert after["loss"] < before["loss"] and after["accuracy"] > 0.8


@pytest.mark.parametrize(("size", "batch", "epochs", "max_steps"),
                         [(64, 16, 2, None), (70, 16, 1, None), (13, 4, 1, 7)])
def test_train_local_draws_the_batches_every_runtime_draws(size: int, batch: int, epochs: int,
                                                          max_steps: int | None) -> None:
    # Prepare: the same model twice; one trained by train_local, one by hand over fedge.batching.batch_order
    torch.manual_seed(2)
    x = torch.randn(size, 8)
    data, task = TaskData.from_xy(x.numpy(), (x[:, 0] > 0).long().numpy()), TwoClass()
    ours, by_hand = build_model("logreg", 8, 2, seed=0), build_model("logreg", 8, 2, seed=0)
    features, labels = data.tensors()
    # Execute
    stats = train_local(task, ours, data, epochs=epochs, batch_size=batch, learning_rate=0.3, momentum=0.0,
                        device=torch.device("cpu"), seed=5, max_steps=max_steps)
    steps = 0
    for order in batch_order(size, batch, 5, epochs, max_steps):
        index = torch.from_numpy(order)
        by_hand.zero_grad()
        task.loss(by_hand(features[0][index]), labels[index]).backward()
        with torch.no_grad():
            for param in by_hand.parameters():
                param -= 0.3 * param.grad  # type: ignore[operator]
        steps += 1
    # Assert: the same steps in the same order give the same weights
    assert stats.steps == steps
    for a, b in zip(ours.parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_evaluation_weights_each_batch_by_its_size() -> None:
    # Prepare: 3 examples, batches of 2 and 1; the model predicts class 0 everywhere
    model = nn.Linear(8, 2)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor([1.0, 0.0]))
    data = TaskData.from_xy(torch.zeros(3, 8).numpy(), torch.tensor([0, 1, 0]).numpy())
    # Execute
    metrics = evaluate(TwoClass(), model, data, device=torch.device("cpu"), batch_size=2)
    # Assert: 2 of 3 right (not the mean of the batch means 1/2 and 1)
    assert metrics["accuracy"] == pytest.approx(2 / 3)


def test_device_choice() -> None:
    assert pick_device("cpu").type == "cpu"
    assert pick_device("auto").type in {"cuda", "mps", "cpu"}
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device 'cuda' is not available"):
            pick_device("cuda")
