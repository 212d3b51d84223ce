"""Strategies come from one registry (issue 13, item 3): adding one is one file plus tests."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from fedge.cli.main import main
from fedge.config import resolve_run_config
from fedge.errors import ConfigError
from fedge.server.app import build_strategy
from fedge.server.privacy import build_privacy
from fedge.strategies import REGISTRY, STRATEGIES, FedProx, Krum, strategy_spec

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("name", "attribute", "key", "value"), [
    ("fedprox", "proximal_mu", "proximal-mu", 0.25),
    ("fednova", "local_momentum", "momentum", 0.5),
    ("trimmed-mean", "trim_fraction", "trim-fraction", 0.3),
    ("krum", "num_byzantine", "num-byzantine", 3),
    ("fedbuff", "buffer_size", "buffer-size", 7),
    ("fedadagrad", "server_learning_rate", "adaptive-learning-rate", 0.2),
    ("bulyan", "num_byzantine", "num-byzantine", 0),  # 5 a round: 4f + 3 <= 5 needs f = 0
    ("qfedavg", "q", "qfedavg-q", 0.5),
])
def test_each_strategy_reads_its_own_options_from_the_run_config(name: str, attribute: str, key: str,
                                                                  value: Any) -> None:
    # Execute
    strategy = build_strategy(resolve_run_config({"strategy": name, key: value, "clients-per-round": 5}), 20)
    # Assert
    assert isinstance(strategy, STRATEGIES[name]) and getattr(strategy, attribute) == value


def test_every_strategy_module_registers_its_class_under_its_name() -> None:
    # Assert: thirteen built-ins, each class found under the name its file gave it
    assert len(REGISTRY) == 13
    assert strategy_spec("fedprox").cls is FedProx and strategy_spec("krum").cls is Krum
    assert {name for name, spec in REGISTRY.items() if spec.dp} == {"fedavg", "fedprox"}


def test_an_unknown_strategy_is_refused_naming_the_registered_ones() -> None:
    # Execute / Assert
    with pytest.raises(ConfigError, match="not a registered strategy; use one of: bulyan, fedadagrad, fedadam, fedavg"):
        build_strategy(resolve_run_config({"strategy": "fedsgd"}), 20)


def test_dp_asks_the_registry_which_strategies_it_combines_with() -> None:
    # Prepare
    config = resolve_run_config({"strategy": "median", "dp": "server-fixed"})
    # Execute / Assert
    with pytest.raises(ConfigError, match="works with strategy fedavg, fedprox"):
        build_privacy(config, 20)


def test_the_cli_refuses_an_unknown_strategy_with_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Execute
    code = main(["simulate", "--run-config", f"strategy='fedsgd' run-dir='{tmp_path / 'r'}'"])
    # Assert
    assert code == 2 and "not a registered strategy" in capsys.readouterr().err


NEW_STRATEGY = '''
"""A toy strategy, written as a new file would be: the plain mean of the accepted updates."""

from fedge.aggregate import WeightedMeanAccumulator
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.registry import register


@register("plain-mean", options=lambda config, nodes: {"step": float(config["server-learning-rate"])})
class PlainMean(FedAvg):
    def __init__(self, *, step=1.0, **kwargs):
        super().__init__(**kwargs)
        self.step = step

    def aggregate_updates(self, updates):
        total = WeightedMeanAccumulator()
        for update in updates:
            total.add(update.arrays, 1.0)
        return total.result() if total.count else None
'''


def _with_one_more_file(tmp_path: Path, package: str, name: str, source: str, then: str) -> list[str]:
    """Run ``then`` in a Python whose ``fedge.<package>`` is a copy of the repository's folder with one
    more file, ``name`` holding ``source`` (nothing else touched); its stdout's words."""
    import shutil

    folder = tmp_path / package
    shutil.copytree(ROOT / package, folder, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / name).write_text(textwrap.dedent(source))
    probe = textwrap.dedent(f"""
        import importlib.util, sys
        import fedge
        spec = importlib.util.spec_from_file_location("fedge.{package}", {str(folder / '__init__.py')!r},
                                                      submodule_search_locations=[{str(folder)!r}])
        module = importlib.util.module_from_spec(spec); sys.modules["fedge.{package}"] = module
        setattr(fedge, "{package}", module)
        spec.loader.exec_module(module)
    """) + textwrap.dedent(then)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_adding_a_strategy_is_one_file(tmp_path: Path) -> None:
    # Prepare: the new strategy's file, and what a coordinator does with the run config naming it
    then = """
        from fedge.config import resolve_run_config
        from fedge.server.app import build_strategy
        config = resolve_run_config({"strategy": "plain-mean", "server-learning-rate": 0.5})
        strategy = build_strategy(config, 20)
        print(type(strategy).__name__, strategy.step)
    """
    # Execute
    printed = _with_one_more_file(tmp_path, "strategies", "plain_mean.py", NEW_STRATEGY, then)
    # Assert: the run config names it and the coordinator builds it
    assert printed == ["PlainMean", "0.5"]


def test_a_model_is_one_registered_class(tmp_path: Path) -> None:
    # Prepare: a model defined outside fedge, registered by name
    import torch
    from torch import nn

    from fedge.task.models import MODELS, build_model, register_model

    @register_model("tiny-linear-test")
    class TinyLinear(nn.Module):
        def __init__(self, num_features: int, num_classes: int) -> None:
            super().__init__()
            self.linear = nn.Linear(num_features, num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x)  # type: ignore[no-any-return]

    try:
        # Execute
        model = build_model("tiny-linear-test", 64, 10, seed=3)
        again = build_model("tiny-linear-test", 64, 10, seed=3)
        # Assert: built by name, seeded
        assert isinstance(model, TinyLinear)
        assert torch.equal(model.linear.weight, again.linear.weight)
    finally:
        MODELS.pop("tiny-linear-test")


@pytest.mark.parametrize(("key", "value", "message"), [
    ("strategy", "fedsgd", "not a registered strategy"),
    ("model", "resnet", "not a registered model; use one of: logreg, mlp, cnn"),
])
def test_coordinator_start_refuses_unregistered_names_before_starting_anything(
        key: str, value: str, message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Execute
    code = main(["coordinator", "start", "--insecure", "--state-dir", str(tmp_path / "state"),
                 "--run-config", f"{key}='{value}'"])
    # Assert: one line, exit 2, no state written
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


LINEAR = {"fedavg", "fedprox", "fednova", "fedavgm", "fedadam", "fedyogi", "fedadagrad"}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_secure_aggregation_is_a_driver_any_linear_rule_takes(name: str) -> None:
    # Prepare: the run config of each registered strategy with secure aggregation on
    config = resolve_run_config({"strategy": name, "secure-aggregation": True, "clients-per-round": 11})
    # Execute / Assert: linear rules compose with the secure driver; the others are refused by name
    if name in LINEAR:
        strategy = build_strategy(config, 20)
        assert type(strategy.driver).__name__ == "SecureAggregation" and strategy.rule.linear
    else:
        with pytest.raises(ConfigError, match="secure-aggregation works with linear rules|FedBuff is asynchronous"):
            build_strategy(config, 20)


def test_no_strategy_or_driver_is_a_mixin() -> None:
    # Prepare: every class the strategies package defines
    import inspect

    import fedge.strategies
    import fedge.strategies.drivers.asynchronous
    import fedge.strategies.drivers.secure  # noqa: F401

    classes = {cls for module in list(sys.modules.values()) if module and module.__name__.startswith("fedge.strategies")
               for _, cls in inspect.getmembers(module, inspect.isclass) if cls.__module__.startswith("fedge.")}
    # Assert: no class has two fedge bases (composition, not multiple inheritance)
    assert classes and all(sum(base.__module__.startswith("fedge.") for base in cls.__bases__) <= 1 for cls in classes)
