"""Shared fixtures: process identity for Flower messages, a fast run config; how `make test` splits the
suite over pytest-xdist workers."""

from __future__ import annotations

import logging
import os
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.supercore.task_identity import TaskIdentity

from fedge.edge.graph_cache import GRAPH_CACHE_ENV
from tests.deployment_slots import deployment_slot
from tests.leftovers import leftover_warning
from tests.live_gateway import live, run  # noqa: F401 - the gateway tests' fixtures (a live gateway, its run)

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
logging.getLogger("flwr").setLevel(logging.ERROR)


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    """Messages need a process-wide run/node identity, as in a ServerApp process."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


@pytest.fixture(scope="session", autouse=True)
def _graph_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    """One cache of ONNX translations (fedge.edge.graph_cache) for this run: its workers and every coordinator they
    start. The digits MLP's training step is translated once a run, not in each test and deployment that exports it;
    a new run starts empty (the cache lies in the run's own temporary folder)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if hasattr(request.config, "workerinput") else base  # the workers' run folder
    os.environ.setdefault(GRAPH_CACHE_ENV, str(shared / "graph-cache"))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Name the processes of other test runs still running (tests/leftovers.py): they slow this one down."""
    config = session.config
    if hasattr(config, "workerinput"):
        return
    base = Path(config._tmp_path_factory.getbasetemp())  # type: ignore[attr-defined]
    warning = leftover_warning(base.parent, base.name)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if warning and reporter is not None:
        reporter.write_line(warning, yellow=True)


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


# `make test` runs the suite on pytest-xdist workers with --dist loadgroup: tests are handed out one by one, except
# tests that share something outside their tmp_path, which name a group with @pytest.mark.xdist_group(...) and
# run on one worker, one after another: e.g. "ray" (a local Ray instance finds and joins another one started on
# the machine). Grouping each file instead (its module fixtures made once, not once per worker) was measured
# slower from a fresh clone: 2,252 tests in 2007 s against 1466 s handed out one by one, as the big files' groups
# kept a worker each while deployments waited for their slots. Ports: simulation/loopback.free_port() hands each
# worker ports of its own.
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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput") or not config.getvalue("loadgroup"):
        return  # not an xdist worker under --dist loadgroup: the suite runs as collected
    rank = {name: index for index, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as collected
    items[:] = _interleaved(items)


def pytest_configure(config: pytest.Config) -> None:
    """Refuse --dist loadgroup where it would not group: pytest 9.2 gives a test's node id from a structured id, so
    pytest-xdist 3.8's group suffix (appended to ``item._nodeid``) never reaches its scheduler (the "ray" group's
    tests would run at once)."""
    version = tuple(int(part) for part in pytest.__version__.split(".")[:2] if part.isdigit())
    if config.getoption("dist", "no") == "loadgroup" and version >= (9, 2):
        raise pytest.UsageError(
            f"pytest-xdist's --dist loadgroup does not group tests under pytest {pytest.__version__}: tests that share "
            "state (the 'ray' group) would run at once; install "
            "pyproject's pins (`make setup`: pytest<9.2), or run without workers (TEST_WORKERS=0)")


def _interleaved(items: list[pytest.Item]) -> list[pytest.Item]:
    """The files (and named groups) in order, deployments alternating with the rest, a file's tests together (each
    still handed out on its own): while two deployments hold the slots (below), the other workers have in-process
    tests to run, not a slot to wait for. Alternating test by test instead put a deployment before every other
    test, and the workers waited on the slots (38 tests in a fresh clone's first 20 minutes)."""
    units: list[tuple[str, list[pytest.Item]]] = []
    for item in items:  # a unit: a named group's tests, else a file's
        marker = item.get_closest_marker("xdist_group")
        key = str(marker.args[0]) if marker is not None and marker.args else item.path.name
        if units and units[-1][0] == key:
            units[-1][1].append(item)
        else:
            units.append((key, [item]))
    deployments = [unit for _, unit in units if any(_is_deployment(item) for item in unit)]
    others = [unit for _, unit in units if not any(_is_deployment(item) for item in unit)]
    ordered: list[pytest.Item] = []
    while deployments or others:
        for queue in (deployments, others):
            if queue:
                ordered.extend(queue.pop(0))
    return ordered


# Deployments (a coordinator, a SuperLink, devices or gateways, a ClientApp process per message: processes that each
# import torch and Flower; marked @pytest.mark.deployment) run at most DEPLOYMENT_SLOTS at once across the xdist
# workers (tests/deployment_slots.py); a worker waits for a free slot, so the deployments' own waits stay events.
# (Holding the slot for the test's call only, its fixtures made beside the other deployments, was tried with the
# loopback devices pulling every second: that fresh clone took 1767 s, the next one without either 1704 s, both
# slower than the 1242 s before for reasons not found; no gain was measured, so it was dropped. See bench/README.)
# A test marked @pytest.mark.deployment(slot="call") takes its slot for its call alone: its fixtures build what
# deploys nothing (a role's fresh virtualenv: a pip install) beside the other deployments.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    if _slot(item) != "protocol":
        yield
        return
    with deployment_slot(_shared(item)):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    if _slot(item) != "call":
        yield
        return
    with deployment_slot(_shared(item)):
        yield


def _slot(item: pytest.Item) -> str | None:
    """What a deployment test holds its slot for (``protocol``: setup, call and teardown; ``call``), or None."""
    marker = item.get_closest_marker("deployment")
    if marker is None or not hasattr(item.config, "workerinput"):
        return None
    return str(marker.kwargs.get("slot", "protocol"))


def _shared(item: pytest.Item) -> Path:
    """The folder this run's workers share (the slots' lock files)."""
    return Path(item.config._tmp_path_factory.getbasetemp().parent)  # type: ignore[attr-defined]


def _is_deployment(item: pytest.Item) -> bool:
    return item.get_closest_marker("deployment") is not None


