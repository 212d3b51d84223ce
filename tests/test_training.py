"""Local training: the hand-written SGD matches torch.optim.SGD; budgets and devices."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fedge.errors import ConfigError
from fedge.task.models import build_model
from fedge.task.training import MomentumSGD, as_dataset, evaluate, pick_device, train_local


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
    torch.manual_seed(1)
    x = torch.randn(64, 8)
    y = (x[:, 0] > 0).long()
    data = as_dataset((x.numpy(), y.numpy()))
    model = build_model("logreg", 8, 2, seed=0)
    before, _ = evaluate(model, data, device=torch.device("cpu"))
    stats = train_local(model, data, epochs=3, batch_size=16, learning_rate=0.5, momentum=0.0,
                        device=torch.device("cpu"), seed=0)
    after, accuracy = evaluate(model, data, device=torch.device("cpu"))
    assert (stats.num_examples, stats.samples_processed, stats.steps) == (64, 192, 12)
    assert after < before and accuracy > 0.8


def test_device_choice() -> None:
    assert pick_device("cpu").type == "cpu"
    assert pick_device("auto").type in {"cuda", "mps", "cpu"}
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device 'cuda' is not available"):
            pick_device("cuda")
