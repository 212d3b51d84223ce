"""A gateway's two listeners in the test process, its allow-list and a digits run's signed training
graph: what the gateway tests (plain and secure rounds) share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from flwr.app import Context, RecordDict

from fedge.clients.gateway.bridge import ask_gateway
from fedge.clients.gateway.service import Gateway, GatewaySettings, Served, add_protocol_device, control_app, device_app
from fedge.clients.protocol_device import ProtocolDevice
from fedge.config import resolve_run_config
from fedge.listeners import ListenerLimits
from fedge.server.bundles import run_signing_key
from fedge.server.pki import add_gateway, init_keys
from fedge.server.training_bundle import (
    SIGNING_PUBLIC_KEY,
    TRAINING_BUNDLE,
    export_training_graph,
    write_run_training_bundle,
)
from fedge.task.api import seeded_model
from fedge.task.loading import load_task
from fedge.task.models import model_arrays

CONFIG = {"local-epochs": 1, "batch-size": 32, "learning-rate": 0.05, "momentum": 0.9, "proximal-mu": 0.0, "seed": 7}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A digits run with its signed training graph; the global weights; the keys of a coordinator."""
    root = tmp_path_factory.mktemp("gateway-run")
    config = resolve_run_config({"fleet": "laptop=4", "model": "mlp", "local-epochs": 1, "run-dir": str(root / "run")})
    task = load_task(config)
    model = seeded_model(task, config.integer("seed"))
    graphs, metrics = export_training_graph(task, model, config)
    run_dir = Path(config.text("run-dir"))
    manifest = write_run_training_bundle(graphs, metrics, task, run_dir, private_key=run_signing_key(config, run_dir))
    weights = {name: array.numpy() for name, array in model_arrays(model).items()}
    shards = [task.partition(index, 4, config) for index in range(4)]
    return {"config": dict(config), "architecture": str(manifest["architecture"]), "weights": weights,
            "bundle": run_dir / TRAINING_BUNDLE, "trust": run_dir / SIGNING_PUBLIC_KEY,
            "keys": (keys := init_keys(root / "keys")),
            "gateway-cert": add_gateway(keys.directory, "gw-test", hosts=[]),  # `fedge keys add-gateway`
            "shards": [(tuple(s.inputs), s.targets) for s in shards]}


class LiveGateway:
    """A gateway's two listeners in this process, an allow-list with devices, and helpers."""

    def __init__(self, root: Path, run: dict[str, Any], settings: GatewaySettings) -> None:
        self.root, self.run, self.allow = root, run, root / "allow"
        self.gateway = Gateway(settings, self._allow_list(), run["bundle"])
        cert = run["gateway-cert"] if settings.name == "gw-test" else \
            add_gateway(run["keys"].directory, settings.name, hosts=[], force=True)  # its certificate names it
        self.devices = Served(device_app(self.gateway), "127.0.0.1", 0, limits=ListenerLimits(per_address=64),
                              cert=cert[0], cert_key=cert[1])
        self.token = "t" * 40
        self.control = Served(control_app(self.gateway, self.token), "127.0.0.1", 0, limits=ListenerLimits())
        self.url = f"https://127.0.0.1:{self.devices.port}"

    def _allow_list(self) -> Path:
        for index in range(4):
            add_protocol_device(self.allow, f"phone{index}")
        private = ed25519.Ed25519PrivateKey.generate()  # a browser's WebCrypto Ed25519 key
        (self.allow / "browser.pub").write_bytes(private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        (self.allow / "browser.key").write_bytes(private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        return self.allow

    def device(self, name: str, shard: int = 0, *, secure: bool = False) -> ProtocolDevice:
        return ProtocolDevice(gateway=self.url, name=name, key=self.allow / f"{name}.key",
                              data=self.run["shards"][shard], trust=self.run["trust"], ca=self.run["keys"].ca_cert,
                              state_dir=self.root / name, secure=secure)

    def round(self, kind: str = "train", *, server_round: int = 1, secure: dict[str, Any] | None = None,
              config: dict[str, Any] | None = None, late_exponent: float | None = None
              ) -> tuple[dict[str, Any], dict[str, Any]]:
        """What the gateway's ClientApp does for one instruction: POST it to the control port (``late_exponent``:
        an asynchronous run's)."""
        context = Context(run_id=1, node_id=9, state=RecordDict(), run_config={}, node_config={
            "gateway-control": f"127.0.0.1:{self.control.port}", "gateway-token": str(self.root / "token")})
        (self.root / "token").write_text(self.token)
        header = {"kind": kind, "server-round": server_round, "graph": self.run["architecture"],
                  "config": {**CONFIG, **(config or {})}, "secure": secure,
                  **({} if late_exponent is None else {"late-exponent": late_exponent})}
        return ask_gateway(context, header, self.run["weights"])

    def close(self) -> None:
        self.devices.stop()
        self.control.stop()

    def __enter__(self) -> LiveGateway:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


@pytest.fixture
def live(tmp_path: Path, run: dict[str, Any]) -> Iterator[LiveGateway]:
    with LiveGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=3, round_deadline_s=300,
                                                   idle_poll_s=0.2)) as gateway:
        yield gateway




def recomputed(trainer: Any, run: dict[str, Any], names: list[str], server_round: int
               ) -> tuple[list[dict[str, Any]], list[int]]:
    """Each named device's training recomputed by ``trainer`` (its shard, the round's seed, CONFIG's settings):
    its weights and examples, as a reference device or a tab trains them."""
    from fedge.clients.gateway.pool import device_seed  # noqa: PLC0415

    trained, counts = [], []
    for name in names:
        inputs, targets = run["shards"][int(name[-1])]
        weights, work = trainer.train(run["weights"], inputs, targets, epochs=1, batch_size=32, learning_rate=0.05,
                                      momentum=0.9, seed=device_seed(7, server_round, name))
        trained.append(weights)
        counts.append(work.num_examples)
    return trained, counts
