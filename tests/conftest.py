"""Shared fixtures: process identity for Flower messages, a fast run config; how `make test` splits the
suite over pytest-xdist workers."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.supercore.task_identity import TaskIdentity

from tests.live_gateway import live, run  # noqa: F401 - the gateway tests' fixtures (a live gateway, its run)

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
logging.getLogger("flwr").setLevel(logging.ERROR)


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    """Messages need a process-wide run/node identity, as in a ServerApp process."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


@pytest.fixture
def fast_config(tmp_path: Path) -> dict[str, Any]:
    """A small, quick simulation config writing into the test's tmp dir."""
    return {
        "fleet": "phone=6,laptop=3,gpu-box=1",
        "clients-per-round": 4,
        "num-rounds": 3,
        "model": "mlp",
        "local-epochs": 2,
        "run-dir": str(tmp_path / "run"),
    }


@pytest.fixture
def umask_zero() -> Iterator[None]:
    """The most permissive umask: every mode bit a call asks for is kept."""
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


# `make test` runs the suite on pytest-xdist workers with --dist loadgroup (tests of one group run on one
# worker, one after another). Each test file is a group of its own, unless its tests name one: a file's
# module-scoped fixtures (a trained run, a live gateway, an exported graph) are then made once, not once per
# worker, and a file's tests keep their order. Tests that share something outside their tmp_path name a
# group with @pytest.mark.xdist_group(...), e.g. "ray": a local Ray instance finds and joins another one
# started on the machine. Ports: simulation/loopback.free_port() hands each worker ports of its own.
#
# The files that take longest are handed out first, so that none starts last and runs alone at the end
# (measured with `--durations=0`; a file missing here only moves back to its place in the collection).
SLOWEST_FIRST: tuple[str, ...] = (
    "test_gateway_deployment.py", "test_deployment.py", "test_resume.py", "test_web_device.py",
    "test_role_installs.py", "test_operator_service.py", "test_web_federation.py", "test_web_secagg.py",
    "test_submodels.py", "test_gateway_secure.py", "test_robust_groups.py", "test_distributed_dp.py",
    "test_lifecycle.py", "test_operator_feedback.py", "test_protocol_device_trust.py", "test_fuzz_parsers.py",
    "test_delivery.py", "test_control_api.py", "test_training_graph.py", "test_flower_dropin.py",
    "test_ray_backend.py", "test_task_deployment.py", "test_new_task.py", "test_fuzz_bundles.py",
    "test_onnx_devices.py", "test_gateway_operator.py", "test_device_rejoin.py",
)
# Long files of independent deployments (no module-scoped fixture): their tests are handed out one by one.
SPREAD = frozenset({"test_gateway_deployment.py", "test_deployment.py", "test_resume.py", "test_operator_service.py",
                    "test_operator_feedback.py"})


@pytest.hookimpl(tryfirst=True)  # before xdist's hook, which appends each test's group to its node id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput") or not config.getvalue("loadgroup"):
        return  # not an xdist worker under --dist loadgroup: the suite runs as collected
    for item in items:
        if item.get_closest_marker("xdist_group") is None and item.path.name not in SPREAD:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    rank = {name: index for index, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as collected
