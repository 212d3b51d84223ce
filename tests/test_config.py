"""Run config: embedded defaults agree with pyproject, bad keys and values are refused."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from fedge.config import DEFAULTS, parse_run_config_args, resolve_run_config
from fedge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_flower_config_matches_embedded_defaults() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["tool"]["flwr"]["app"]["config"] == DEFAULTS
    components = pyproject["tool"]["flwr"]["app"]["components"]
    assert components == {"serverapp": "fedge.server.app:app", "clientapp": "fedge.clients.app:app"}


def test_pyproject_is_a_valid_flower_app() -> None:
    from flwr.common.config import validate_config

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    valid, errors, _ = validate_config(pyproject, check_module=True, project_dir=ROOT)
    assert valid, errors


def test_overrides_merge_over_defaults() -> None:
    config = resolve_run_config({"num-rounds": 3, "learning-rate": 1})
    assert config["num-rounds"] == 3 and config["learning-rate"] == 1.0
    assert config["dataset"] == DEFAULTS["dataset"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num-round": 3}, "unknown run-config key 'num-round' \\(did you mean 'num-rounds'\\?\\)"),
        ({"num-rounds": "ten"}, "must be a int"),
        ({"num-rounds": 0}, "must be >= 1"),
        ({"export-onnx": 1}, "must be a bool"),
        ({"num-rounds": True}, "must be a int"),
        ({"model": "resnet"}, "use one of: mlp, cnn, logreg"),
        ({"test-fraction": 1.0}, "in \\(0, 1\\)"),
        ({"secagg-threshold": 0.3}, "in \\[0.5, 1\\]"),
    ],
)
def test_bad_config_is_refused_with_the_key_named(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_run_config(overrides)


def test_flower_style_override_parsing() -> None:
    parsed = parse_run_config_args("num-rounds=5 model='cnn' learning-rate=0.1 fleet=phone=3,laptop=2")
    assert parsed == {"num-rounds": 5, "model": "cnn", "learning-rate": 0.1, "fleet": "phone=3,laptop=2"}
    with pytest.raises(ConfigError, match="not key=value"):
        parse_run_config_args("oops")
