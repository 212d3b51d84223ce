"""One typed train instruction (issue 40 §2): :class:`fedge.wire.TrainInstruction`, written once by the
coordinator and read once by every runtime (torch, onnx, a gateway, the device protocol's devices)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedge import wire
from fedge.config import codec_policy, resolve_run_config
from fedge.errors import ConfigError
from fedge.wire import TrainInstruction

ROOT = Path(__file__).resolve().parent.parent


class Captured(Exception):
    """Raised by a stand-in trainer with the keyword arguments it was called with."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        super().__init__("captured")
        self.kwargs = kwargs


def _train_message(config: dict[str, Any]) -> Message:
    content = RecordDict({wire.ARRAYS: ArrayRecord({"w": Array(np.zeros(3, np.float32))}),
                          wire.CONFIG: ConfigRecord(config)})
    return Message(content, dst_node_id=5, message_type="train")


def _context() -> Context:
    return Context(run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 4, "profile": "laptop"},
                   state=RecordDict(), run_config={})


# --------------------------------------------------------------------------- the record


def test_the_coordinators_instruction_is_the_run_configs_training_keys_and_codecs() -> None:
    config = resolve_run_config({"local-epochs": 3, "codec.phone": "int8", "learning-rate": 0.1})
    # Execute
    record = TrainInstruction.from_run_config(config).to_record()
    # Assert: exactly what the coordinator sent before the record existed, keys in the same order
    assert dict(record) == {**{key: config[key] for key in wire.TRAIN_KEYS}, **codec_policy(config)}
    assert list(record) == [*wire.TRAIN_KEYS, *codec_policy(config)]
    assert wire.TRAIN_KEYS == ("local-epochs", "batch-size", "learning-rate", "momentum", "local-budget",
                               "time-budget-s")


def test_the_instruction_round_trips_through_its_record() -> None:
    instruction = dataclasses.replace(
        TrainInstruction.from_run_config(resolve_run_config({"local-budget": "time"})),
        dp_client_clipping="fixed", training_graph="abc123", proximal_mu=0.01, model_width=0.5, model_scaler=True)
    # Execute
    read = TrainInstruction.read(instruction.to_record())
    # Assert
    assert read == instruction
    assert read.time_budget == instruction.time_budget_s and read.proximal_term == 0.01


def test_a_straggler_gets_fewer_epochs_and_nothing_else_changes() -> None:
    # Prepare: a round's config (with keys the instruction does not own), as a FedProx strategy sends it
    config = ConfigRecord({**TrainInstruction.from_run_config(resolve_run_config({"local-epochs": 5})).to_config(),
                           wire.SERVER_ROUND: 3, wire.PROXIMAL_MU: 0})
    # Execute: what strategies call for a straggler
    instruction = TrainInstruction.read(config)
    rewritten = instruction.with_epochs(2).written_over(config)
    # Assert: local-epochs changed in place; every other key and type as it was (secure aggregation's digest)
    assert list(rewritten) == list(config)
    assert {key: (type(value), value) for key, value in rewritten.items() if key != wire.LOCAL_EPOCHS} == \
        {key: (type(value), value) for key, value in config.items() if key != wire.LOCAL_EPOCHS}
    assert rewritten[wire.LOCAL_EPOCHS] == 2 and instruction.local_epochs == 5
    with pytest.raises(ConfigError, match="'local-epochs' must be a whole number"):
        instruction.with_epochs(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(("key", "value", "says"), [
    ("batch-size", "32", "'batch-size' must be a finite number"),
    ("local-epochs", 2.5, "'local-epochs' must be a whole number"),
    ("local-epochs", 0, "'local-epochs' = 0 must be >= 1"),
    ("learning-rate", float("nan"), "'learning-rate' must be a finite number"),
    ("momentum", 1.0, "'momentum' = 1.0 must be in [0, 1)"),
    ("local-budget", "hours", "'local-budget' = 'hours' is not one of epochs, time"),
    ("model-scaler", 1, "'model-scaler' must be true or false"),
    ("codec.phone", 8, "'codec.phone' must be a codec name"),
])
def test_a_bad_instruction_field_is_refused_naming_it_and_the_fix(key: str, value: object, says: str) -> None:
    record = {**TrainInstruction.from_run_config(resolve_run_config({})).to_config(), key: value}
    with pytest.raises(ConfigError, match=re.escape(says)) as refused:
        TrainInstruction.read(record)
    assert "--run-config" in str(refused.value) or key.startswith("codec.")


def test_a_missing_training_key_is_named_and_the_run_config_fills_it_on_a_device() -> None:
    config = resolve_run_config({"batch-size": 8})
    with pytest.raises(ConfigError, match="has no 'batch-size'.*--run-config 'batch-size=...'"):
        TrainInstruction.read({wire.LOCAL_EPOCHS: 1, "learning-rate": 0.1, "momentum": 0.0})
    # A device's run config fills the training keys, never FedProx's term (only FedProx sends it)
    read = TrainInstruction.read({wire.LOCAL_EPOCHS: 1}, defaults=config)
    assert (read.local_epochs, read.batch_size, read.proximal_mu, read.proximal_term) == (1, 8, None, 0.0)


def test_the_training_keys_are_named_by_the_instruction_and_the_knobs_only() -> None:
    # Each training key's literal appears, outside tests and docs, in core/knobs.py alone (the instruction
    # derives its keys from its field names)
    from fedge import secagg  # noqa: PLC0415
    from fedge.server import app  # noqa: PLC0415

    assert app.TRAIN_KEYS is wire.TRAIN_KEYS and {wire.LOCAL_EPOCHS} == secagg.PER_DEVICE_CONFIG
    folders = ["core", "clients", "edge", "task", "simulation", "strategies"]
    for key in (*wire.TRAIN_KEYS, wire.PROXIMAL_MU):
        found = [path.relative_to(ROOT).as_posix() for folder in folders for path in (ROOT / folder).rglob("*.py")
                 if re.search(rf"[\"']{re.escape(key)}[\"']", path.read_text())]
        assert found == ["core/knobs.py"], key
    assert '"local-epochs"' not in (ROOT / "server" / "app.py").read_text()


# --------------------------------------------------------------------------- every runtime reads it


def test_a_device_reads_the_instruction_once_over_its_run_config() -> None:
    from fedge.clients.common import train_order  # noqa: PLC0415

    config = resolve_run_config({"local-epochs": 5, "codec.laptop": "int8"})
    msg = _train_message({wire.LOCAL_EPOCHS: 2, "batch-size": 4, wire.SERVER_ROUND: 7, wire.PROXIMAL_MU: 0.5,
                          "codec.laptop": "fp16"})
    # Execute
    order = train_order(msg, _context(), config)
    # Assert: the instruction wins, the run config fills the rest
    assert (order.instruction.local_epochs, order.instruction.batch_size, order.instruction.learning_rate) == \
        (2, 4, config["learning-rate"])
    assert order.instruction.proximal_term == 0.5 and order.server_round == 7
    assert order.instruction.codecs["codec.laptop"] == "fp16" and order.max_steps is None
    # A bad field fails the device's round with the field named
    with pytest.raises(ConfigError, match="'batch-size'"):
        train_order(_train_message({"batch-size": "four"}), _context(), config)


def _order() -> Any:
    from fedge.clients.common import train_order  # noqa: PLC0415

    config = resolve_run_config({})
    msg = _train_message({wire.LOCAL_EPOCHS: 3, "batch-size": 2, "learning-rate": 0.125, "momentum": 0.5,
                          wire.PROXIMAL_MU: 0.25})
    return msg, config, train_order(msg, _context(), config)


EXPECTED = {"epochs": 3, "batch_size": 2, "learning_rate": 0.125, "momentum": 0.5, "proximal_mu": 0.25}


def test_the_torch_runtime_trains_what_the_instruction_says(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedge.clients import torch_client  # noqa: PLC0415

    msg, config, order = _order()

    def capture(*args: Any, **kwargs: Any) -> Any:
        raise Captured(kwargs)

    monkeypatch.setattr(torch_client, "model_for", lambda *args, **kwargs: object())
    monkeypatch.setattr(torch_client, "load_arrays", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch_client, "add_scaler", lambda *args, **kwargs: [])
    monkeypatch.setattr(torch_client, "train_local", capture)
    with pytest.raises(Captured) as called:
        torch_client.torch_local_work(msg, config, order, object(), object())  # type: ignore[arg-type]
    assert {key: called.value.kwargs[key] for key in EXPECTED} == EXPECTED
    assert called.value.kwargs["seed"] == order.seed


def test_the_onnx_runtime_trains_what_the_instruction_says(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedge.clients import onnx_client  # noqa: PLC0415

    msg, config, order = _order()

    class Trainer:
        def train(self, *args: Any, **kwargs: Any) -> Any:
            raise Captured(kwargs)

    monkeypatch.setattr(onnx_client, "current_trainer", lambda *args: (None, Trainer()))
    with pytest.raises(Captured) as called:
        onnx_client.onnx_local_work(msg, _context(), config, order, ((np.zeros((2, 3)),), np.zeros(2)))
    assert {key: called.value.kwargs[key] for key in EXPECTED} == EXPECTED


def test_a_gateway_hands_its_devices_the_instructions_protocol_form() -> None:
    from fedge.clients.gateway.bridge import _config_of  # noqa: PLC0415

    msg, config, _ = _order()
    # Execute
    sent = _config_of(msg, _context(), config, "train")
    # Assert: the device protocol's task config (docs/device-protocol.md), in its documented order
    assert list(sent)[:5] == ["local-epochs", "batch-size", "learning-rate", "momentum", "proximal-mu"]
    assert [sent[key] for key in list(sent)[:5]] == [3, 2, 0.125, 0.5, 0.25]
    assert TrainInstruction.read(sent).protocol_config() == {key: sent[key] for key in list(sent)[:5]}


def test_the_protocol_device_trains_what_the_tasks_config_says() -> None:
    from fedge.clients.protocol_device import ProtocolDevice  # noqa: PLC0415

    class Trainer:
        def train(self, *args: Any, **kwargs: Any) -> Any:
            raise Captured(kwargs)

    task = {"task": "t", "seed": 11, "uplink": "fp32",
            "config": {"local-epochs": 3, "batch-size": 2, "learning-rate": 0.125, "momentum": 0.5,
                       "proximal-mu": 0.25, "seed": 42}}
    with pytest.raises(Captured) as called:
        ProtocolDevice.train(None, task, {"w": np.zeros(3)}, Trainer(), (np.zeros((2, 3)),),  # type: ignore[arg-type]
                             np.zeros(2))
    assert {key: called.value.kwargs[key] for key in EXPECTED} == EXPECTED and called.value.kwargs["seed"] == 11
    # A malformed task's config is refused naming the key (the device skips the task)
    task["config"] = {**task["config"], "momentum": "high"}  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="'momentum' must be a finite number"):
        ProtocolDevice.train(None, task, {"w": np.zeros(3)}, Trainer(), (np.zeros((2, 3)),),  # type: ignore[arg-type]
                             np.zeros(2))
