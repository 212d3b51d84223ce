"""A running onnx device fetches the new training graph when a run trains another architecture
(issue 25 item 5): before, it failed every round with 'fetch the current one'.

Real parts: two signed training graphs exported from the digits task (an MLP, then logistic
regression), the coordinator's bundle service over TLS on 127.0.0.1 with a registered device
key, onnxruntime, fedge's ClientApp.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedge import wire
from fedge.clients.app import make_default_client_app
from fedge.config import resolve_run_config
from fedge.errors import FedgeError
from fedge.server.pki import CoordinatorKeys, add_device, init_keys
from fedge.server.publish import BundleService, publish_bundle
from fedge.server.training_bundle import (
    SIGNING_PUBLIC_KEY,
    TRAINING_BUNDLE,
    export_training_graph,
    write_run_training_bundle,
)
from fedge.task.api import seeded_model
from fedge.task.loading import load_task
from fedge.task.models import model_arrays

SIGNER = Ed25519PrivateKey.generate()


def _run(root: Path, model: str) -> tuple[dict[str, Any], str]:
    """A digits run of ``model`` with its training graph signed by SIGNER; (config, architecture)."""
    config = resolve_run_config({"fleet": "laptop=4", "model": model, "local-epochs": 1,
                                 "run-dir": str(root / model)})
    task = load_task(config)
    graphs, metrics = export_training_graph(task, seeded_model(task, config.integer("seed")), config)
    manifest = write_run_training_bundle(graphs, metrics, task, Path(config.text("run-dir")), private_key=SIGNER)
    return dict(config), str(manifest["architecture"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], str]]:
    root = tmp_path_factory.mktemp("runs")
    return {"old": _run(root, "mlp"), "new": _run(root, "logreg")}


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[BundleService, CoordinatorKeys]]:
    keys = init_keys(tmp_path / "keys")
    add_device(keys.directory, "phone")
    served = BundleService(tmp_path / "published", keys, host="127.0.0.1", port=0)
    served.start()
    yield served, keys
    served.stop()


def _device(tmp_path: Path, runs: dict[str, Any], service: tuple[BundleService, CoordinatorKeys], *,
            can_refresh: bool) -> Context:
    """A deployed onnx device holding the old run's graph, with the node config `fedge device` writes."""
    old_config, _ = runs["old"]
    bundles = tmp_path / "state" / "bundles"
    bundles.mkdir(parents=True)
    shutil.copy(Path(old_config["run-dir"]) / TRAINING_BUNDLE, bundles / "training.zip")
    task = load_task(resolve_run_config(old_config))
    data = task.partition(1, 4, resolve_run_config(old_config))
    np.savez(tmp_path / "data.npz", x=data.inputs[0], y=data.targets)
    served, keys = service
    node = {"data-path": str(tmp_path / "data.npz"), "profile": "laptop", "runtime": "onnx",
            "training-bundle": str(bundles / "training.zip"),
            "trusted-key": str(Path(old_config["run-dir"]) / SIGNING_PUBLIC_KEY)}
    if can_refresh:
        node |= {"bundle-service": f"127.0.0.1:{served.port}", "device-key": str(keys.devices / "phone.key"),
                 "ca": str(keys.ca_cert), "freshness-dir": str(tmp_path / "state" / "freshness")}
    return Context(run_id=2, node_id=5, state=RecordDict(), run_config=runs["new"][0], node_config=node)


def _instruction(config: dict[str, Any], architecture: str) -> Message:
    task = load_task(resolve_run_config(config))
    settings = ConfigRecord({wire.SERVER_ROUND: 1, wire.TRAINING_GRAPH: architecture})
    return Message(RecordDict({wire.ARRAYS: model_arrays(seeded_model(task, int(config["seed"]))),
                               wire.CONFIG: settings}), dst_node_id=5, message_type="train")


def test_a_device_fetches_the_graph_of_the_run_it_is_asked_to_train(
        runs: dict[str, Any], service: tuple[BundleService, CoordinatorKeys], tmp_path: Path) -> None:
    # Prepare: the coordinator now publishes the logistic-regression graph; the device holds the MLP's
    new_config, new_architecture = runs["new"]
    publish_bundle("training", Path(new_config["run-dir"]) / TRAINING_BUNDLE, service[0].published)
    context = _device(tmp_path, runs, service, can_refresh=True)
    # Execute: the first round of the new run
    reply = make_default_client_app()(_instruction(new_config, new_architecture), context)
    # Assert: trained with the new graph (logistic regression's arrays), which replaced the old one on disk
    assert not reply.has_error()
    assert sorted(reply.content[wire.ARRAYS]) == sorted(_instruction(new_config, new_architecture)
                                                        .content[wire.ARRAYS])
    assert reply.content[wire.REPLY_META][wire.STEPS] > 0
    held = (tmp_path / "state" / "bundles" / "training.zip").read_bytes()
    assert held == (Path(new_config["run-dir"]) / TRAINING_BUNDLE).read_bytes()


def test_a_device_refuses_when_the_service_has_no_graph_of_that_architecture(
        runs: dict[str, Any], service: tuple[BundleService, CoordinatorKeys], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: the service still publishes the old graph, but the instruction names the new architecture
    old_config, _ = runs["old"]
    publish_bundle("training", Path(old_config["run-dir"]) / TRAINING_BUNDLE, service[0].published)
    context = _device(tmp_path, runs, service, can_refresh=True)
    # Execute: nothing to train with
    with pytest.raises(FedgeError, match="the reason is in the device's own log"):
        make_default_client_app()(_instruction(runs["new"][0], runs["new"][1]), context)
    # Assert: the device's console names the mismatch and the fix; the coordinator learns nothing more
    assert "fetch the current one with `fedge pull --kind training`" in capsys.readouterr().err


@pytest.mark.parametrize(("insecure", "expected"), [
    (False, {"bundle-service": "127.0.0.1:9096", "device-key": "phone.key", "ca": "ca.crt"}),
    (True, {"bundle-service": "127.0.0.1:9096", "bundles-insecure": "yes"}),
])
def test_fedge_device_gives_its_app_what_the_pull_at_start_used(tmp_path: Path, insecure: bool,
                                                                expected: dict[str, str]) -> None:
    # Prepare: an onnx device of a coordinator at 127.0.0.1:9095 (its bundle service: port + 1)
    from flwr.common.config import parse_config_args

    from fedge.clients.device import DeviceOptions, supernode_command
    for name in ("phone.key", "ca.crt", "signing.pub", "data.npz"):
        (tmp_path / name).write_text("")
    key, ca = (None, None) if insecure else (tmp_path / "phone.key", tmp_path / "ca.crt")
    device = DeviceOptions(coordinator="127.0.0.1:9095", profile="phone", data=tmp_path / "data.npz", key=key, ca=ca,
                           insecure=insecure, runtime="onnx", trust=tmp_path / "signing.pub")
    # Execute
    command = supernode_command(device, tmp_path / "state" / "bundles" / "training.zip")
    node = dict(parse_config_args([command[command.index("--node-config") + 1]]))
    # Assert: the same service, key and CA (paths resolved), and the freshness records beside its bundles
    got = {key: Path(str(node[key])).name if key in ("device-key", "ca") else node[key] for key in expected}
    assert got == expected and not {"device-key", "ca"} & set(node) - set(expected)
    assert node["freshness-dir"] == str((tmp_path / "state" / "freshness").resolve())


def test_a_device_asked_only_to_evaluate_fetches_the_graph_too(
        runs: dict[str, Any], service: tuple[BundleService, CoordinatorKeys], tmp_path: Path) -> None:
    # Prepare: the new run's evaluate instruction (the coordinator names its graph there too)
    new_config, new_architecture = runs["new"]
    publish_bundle("training", Path(new_config["run-dir"]) / TRAINING_BUNDLE, service[0].published)
    context = _device(tmp_path, runs, service, can_refresh=True)
    task = load_task(resolve_run_config(new_config))
    instruction = Message(RecordDict({wire.ARRAYS: model_arrays(seeded_model(task, int(new_config["seed"]))),
                                      wire.CONFIG: ConfigRecord({wire.TRAINING_GRAPH: new_architecture})}),
                          dst_node_id=5, message_type="evaluate")
    # Execute
    reply = make_default_client_app()(instruction, context)
    # Assert: evaluated with the new graph
    assert not reply.has_error() and reply.content[wire.METRICS][wire.NUM_EXAMPLES] > 0
    assert (tmp_path / "state" / "bundles" / "training.zip").read_bytes() == \
        (Path(new_config["run-dir"]) / TRAINING_BUNDLE).read_bytes()
