"""A deployed device takes its runtime, trust anchors, fleet file and paths from itself (issue 23, items 9, 10).

The coordinator's run config and instructions are the coordinator's word; a device under a
SuperNode (``fedge device``) decides what trains, which graph and key it trusts, which
files it reads. Its failures reach the coordinator as one generic reason, so that error
replies cannot tell the coordinator which paths exist on the device.

Real parts: a signed training graph exported from the task, fedge's ClientApp, the node
config string ``fedge device`` hands its SuperNode, parsed as Flower parses it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.config import parse_config_args

from fedge import wire
from fedge.clients import onnx_client
from fedge.clients.app import PRIVATE_FAILURE, make_default_client_app
from fedge.clients.device import DeviceOptions, supernode_command
from fedge.config import resolve_run_config
from fedge.errors import ConfigError, FedgeError
from fedge.profiles import BUILTIN_PROFILES, parse_fleet, time_budget_steps
from fedge.server.bundles import run_signing_key
from fedge.server.training_bundle import export_training_graph, write_run_training_bundle
from fedge.task.api import seeded_model
from fedge.task.loading import load_task
from fedge.task.models import model_arrays

RUN = {"fleet": "laptop=4", "model": "mlp", "local-epochs": 1, "batch-size": 32}


def _device_node_config(tmp_path: Path, **options: Any) -> dict[str, Any]:
    """The node config ``fedge device`` gives its SuperNode, for a torch device with its own data file."""
    config = resolve_run_config(RUN)
    data = load_task(config).partition(1, 4, config)
    path = tmp_path / "device" / "mine.npz"
    path.parent.mkdir()
    np.savez(path, x=data.inputs[0].reshape(len(data.targets), -1), y=data.targets)
    device = DeviceOptions(coordinator="127.0.0.1:9092", profile="laptop", data=path, key=None, ca=None,
                           insecure=True, **options)
    command = supernode_command(device)
    return dict(parse_config_args([command[command.index("--node-config") + 1]]))


def _instruction(config: dict[str, Any], **extra: Any) -> Message:
    run = resolve_run_config(config)
    weights = model_arrays(seeded_model(load_task(run), run.integer("seed")))
    settings = ConfigRecord({wire.SERVER_ROUND: 1, **extra})
    return Message(RecordDict({wire.ARRAYS: weights, wire.CONFIG: settings}), dst_node_id=5, message_type="train")


def _context(run_config: dict[str, Any], node_config: dict[str, Any]) -> Context:
    return Context(run_id=1, node_id=5, state=RecordDict(), run_config=run_config, node_config=node_config)


@pytest.mark.slow  # exports and signs a training graph (about 12 s on 2 cores)
def test_a_coordinator_cannot_switch_a_torch_device_to_its_own_graph_and_key(tmp_path: Path) -> None:
    # Prepare: the attacker's run directory holds its own signed training graph and the key that verifies it
    attacker = tmp_path / "attacker"
    run = resolve_run_config({**RUN, "run-dir": str(attacker)})
    task = load_task(run)
    graphs, metrics = export_training_graph(task, seeded_model(task, run.integer("seed")), run)
    manifest = write_run_training_bundle(graphs, metrics, task, attacker, private_key=run_signing_key(run, attacker))
    node_config = _device_node_config(tmp_path)
    hostile = {**RUN, "runtime": "onnx", "run-dir": str(attacker)}
    onnx_client._loaded.clear()
    # Execute: the coordinator's run config and instruction both ask for onnx from its directory
    reply = make_default_client_app()(
        _instruction(dict(resolve_run_config(hostile)), **{wire.TRAINING_GRAPH: str(manifest["architecture"]),
                                                          "runtime": "onnx", "run-dir": str(attacker)}),
        _context(hostile, node_config))
    # Assert: the device trained with torch, as its owner chose, and loaded nothing from the attacker's directory
    assert node_config["runtime"] == "torch"
    assert reply.content[wire.REPLY_META][wire.STEPS] > 0  # type: ignore[operator]
    assert [key for key in onnx_client._loaded if str(attacker) in key[0] or str(attacker) in key[3]] == []


def test_a_deployed_onnx_device_never_takes_its_graph_from_the_run_directory(tmp_path: Path) -> None:
    # Prepare: an onnx device whose node config names no graph (a SuperNode started by hand)
    node_config = {**_device_node_config(tmp_path), "runtime": "onnx"}
    hostile = {**RUN, "run-dir": str(tmp_path / "attacker")}
    # Execute / Assert: refused with the generic reason, never looking in the run directory
    with pytest.raises(FedgeError) as refused:
        make_default_client_app()(_instruction(dict(resolve_run_config(hostile))), _context(hostile, node_config))
    assert str(refused.value) == PRIVATE_FAILURE and "attacker" not in str(refused.value.__cause__)


@pytest.mark.parametrize("where", ["missing", "directory", "not-toml", "dev-zero"])
def test_a_coordinator_named_fleet_file_is_never_read_by_a_deployed_device(where: str, tmp_path: Path) -> None:
    # Prepare: the coordinator names a fleet file on the device (time budgets read profiles)
    paths = {"missing": tmp_path / "nope.toml", "directory": tmp_path, "not-toml": tmp_path / "x.toml",
             "dev-zero": Path("/dev/zero")}
    (tmp_path / "x.toml").write_text("[[[ not toml")
    hostile = {**RUN, "fleet-file": str(paths[where]), "local-budget": "time", "time-budget-s": 0.2}
    # Execute: the run config and the instruction both name it
    reply = make_default_client_app()(_instruction(RUN, **{"fleet-file": str(paths[where]), "local-budget": "time"}),
                                      _context(hostile, _device_node_config(tmp_path)))
    # Assert: the device trained its own (built-in) profile's time budget, never reading that path
    laptop = BUILTIN_PROFILES["laptop"].compute_rate
    assert reply.content[wire.REPLY_META][wire.STEPS] == time_budget_steps(0.2, laptop, 32)


def test_a_deployed_device_uses_its_own_fleet_file_for_its_profile(tmp_path: Path) -> None:
    # Prepare: a custom profile, defined in the device's own --fleet-file only
    own = tmp_path / "own.toml"
    own.write_text('[profiles.slow]\ncompute-rate = 100.0\nuplink-mbps = 1.0\ndownlink-mbps = 1.0\n'
                   'memory-mb = 512\n')
    node_config = {**_device_node_config(tmp_path, fleet_file=str(own)), "profile": "slow"}
    budget = {**RUN, "local-budget": "time", "time-budget-s": 1.0}
    # Execute
    reply = make_default_client_app()(_instruction(budget), _context(budget, node_config))
    # Assert: 1 s at 100 samples/s in batches of 32: 3 steps, from the device's own profile
    assert node_config["fleet-file"] == str(own.resolve())
    assert reply.content[wire.REPLY_META][wire.STEPS] == 3


def test_failures_reach_the_coordinator_as_one_reason_whatever_the_path(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: the device's own fleet file, missing, a directory, or not TOML (each a different local error)
    (tmp_path / "x.toml").write_text("[[[ not toml")
    reasons, local = set(), []
    for path in (tmp_path / "nope.toml", tmp_path, tmp_path / "x.toml"):
        where = tmp_path / f"case-{len(local)}"
        where.mkdir()
        node_config = _device_node_config(where, fleet_file=str(path))
        budget = {**RUN, "fleet-file": str(path), "local-budget": "time", "time-budget-s": 1.0}
        # Execute
        with pytest.raises(FedgeError) as refused:
            make_default_client_app()(_instruction(budget), _context(budget, node_config))
        reasons.add(str(refused.value))  # what Flower sends the coordinator: the exception's text
        local.append(capsys.readouterr().err)
    # Assert: one reason for all three; the device's own console says what was wrong
    assert reasons == {PRIVATE_FAILURE}
    assert "does not exist" in local[0] and "not a regular file" in local[1] and "not valid TOML" in local[2]


def test_a_simulated_device_keeps_the_detailed_error(tmp_path: Path) -> None:
    # Prepare: a simulated device (no data-path: one trusted process with the coordinator)
    node_config = {"partition-id": 1, "num-partitions": 4, "profile": "laptop"}
    budget = {**RUN, "fleet-file": str(tmp_path / "nope.toml"), "local-budget": "time", "time-budget-s": 1.0}
    # Execute / Assert
    with pytest.raises(ConfigError, match="does not exist"):
        make_default_client_app()(_instruction(RUN), _context(budget, node_config))


def test_dev_zero_as_a_fleet_file_is_refused_at_once() -> None:
    # Execute / Assert: refused without reading (it used to read until memory ran out)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="not a regular file"):
        parse_fleet("phone=1", "/dev/zero")
    assert time.monotonic() - started < 5


def test_a_fleet_file_larger_than_the_cap_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    big.write_bytes(b"# padding\n" * 200_000)
    with pytest.raises(ConfigError, match="larger than"):
        parse_fleet("phone=1", str(big))
