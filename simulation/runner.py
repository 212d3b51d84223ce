"""``fedge simulate``: run the real ServerApp and ClientApp over a simulated fleet.

Two backends run the *same* two apps:

* ``inline`` (default): :class:`~fedge.simulation.grid.InlineGrid`, all in this
  process; fast on 2 cores.
* ``ray``: Flower's simulation engine (``flwr.simulation.run_simulation``), for
  heavier models or more than one machine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from flwr.clientapp import ClientApp

from fedge import knobs
from fedge.clients.app import make_client_app
from fedge.config import RunConfig, Scalar, resolve_run_config
from fedge.errors import ConfigError, FedgeError, RunFailed
from fedge.profiles import fleet_of
from fedge.server.app import behaviour_of, make_server_app, run_coordinator
from fedge.server.report import run_dir_for
from fedge.simulation.byzantine import byzantine_partitions, make_byzantine_client_app
from fedge.simulation.grid import FleetNodes, InlineGrid
from fedge.task.api import Task

log = logging.getLogger("fedge.simulation")

BACKENDS = ("inline", "ray")


def simulate(
    overrides: Mapping[str, Any] | None = None,
    *,
    backend: str = "inline",
    progress: bool = True,
    torch_threads: int | None = 1,
    task: Task | None = None,
    ray_address: str | None = None,
    client_app: ClientApp | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Run a simulated federation; return the run directory and its summary.

    Parameters
    ----------
    overrides : Mapping, optional
        Run-config values that replace fedge's defaults.
    backend : {"inline", "ray"}
        Where the ClientApps run.
    progress : bool
        Show a progress bar over rounds.
    torch_threads : int, optional
        Intra-op threads for torch (1 is fastest for small models on few cores).
    task : Task, optional
        The task to federate, given in Python (default: the one the run config names).
    ray_address : str, optional
        With ``backend="ray"``: join this existing Ray cluster (``HOST:PORT`` of its head,
        or ``"auto"``) instead of starting a local one; devices then run on every node.
    client_app : ClientApp, optional
        With ``backend="ray"``: the device app to run instead of fedge's (e.g. one that wraps
        it to record where it ran).
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend '{backend}'; use one of: {', '.join(BACKENDS)}")
    config = resolve_run_config(overrides)
    fleet = fleet_of(config)
    config[knobs.RUN_DIR] = str(run_dir_for(config))  # fixed now so that both backends agree
    if torch_threads:
        torch.set_num_threads(torch_threads)
    if ray_address and backend != "ray":
        raise ConfigError("--ray-address joins a Ray cluster; it needs --backend ray")
    if backend == "inline":
        grid = InlineGrid(_client_app(config, fleet.size, task=task), FleetNodes(fleet, config.integer(knobs.SEED)),
                          config, behaviour=behaviour_of(config, fleet))
        run_dir = run_coordinator(grid, config, progress=progress, task=task)
    else:
        run_dir = _run_on_ray(config, fleet.size, progress=progress, task=task, ray_address=ray_address,
                              client_app=client_app)
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise FedgeError(f"the run ended without writing {summary_path}; see the log above")
    summary = json.loads(summary_path.read_text())
    if summary.get("failed"):  # Flower's engine kept the ServerApp's RunFailed to itself
        raise RunFailed(f"{summary['failed']}; nothing was signed or published (the run's records are in {run_dir})")
    return run_dir, summary


def _run_on_ray(config: RunConfig, num_nodes: int, *, progress: bool, task: Task | None,
                ray_address: str | None = None, client_app: ClientApp | None = None) -> Path:
    """Flower's simulation engine; its Contexts carry no run config, so bind it here.

    Without ``ray_address`` Flower starts a local Ray instance on 2 CPUs, listening on loopback
    only (:func:`_loopback_only_ray`); with it, Ray joins the cluster at that address and Flower
    spreads its actors over the cluster's CPUs.
    """
    from flwr.simulation import run_simulation

    init_args: dict[str, Any] = {"include_dashboard": False}
    if ray_address:
        init_args["address"] = ray_address
    else:
        init_args["num_cpus"] = 2
    # Flower's Ray backend sets this process's PYTHONPATH to its whole sys.path and leaves it set,
    # so every subprocess started later (another virtualenv's python, say) would import from this
    # one's site-packages: put it back once the run is over.
    pythonpath = os.environ.get("PYTHONPATH")
    local = contextlib.nullcontext() if ray_address else _loopback_only_ray()
    try:
        with local:
            run_simulation(
                server_app=make_server_app(config, progress=progress, task=task),
                client_app=client_app or _client_app(config, num_nodes, defaults=config, task=task),
                num_supernodes=num_nodes,
                backend_name="ray",
                backend_config={"client_resources": {"num_cpus": 1.0}, "init_args": init_args},
            )
    finally:
        if pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = pythonpath
    return Path(config.text(knobs.RUN_DIR))


@contextlib.contextmanager
def _loopback_only_ray() -> Iterator[None]:
    """Within: a Ray instance this process starts listens on 127.0.0.1 only.

    Threat model: Ray has no authentication; anyone who reaches its GCS or raylet port can
    join as a driver and run code as this user. On Linux Ray replaces a loopback node address
    by the machine's own address (``ray._private.services.resolve_ip_for_localhost``), and its
    GCS, raylet and workers then listen on every interface. The exception is Ray's own
    single-machine mode (what it uses on macOS and Windows): with
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` the node address is 127.0.0.1 and every Ray server
    binds loopback only, and no other machine can join. The variable is read when Ray is
    imported, here and in Ray's own processes (they inherit it), so both the environment and
    the already imported constant are set, and both are put back afterwards: a later run in
    this process may join a real cluster.
    """
    from ray._private import ray_constants  # noqa: PLC0415 - Ray is imported only for the Ray backend

    variable = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    before_env, before_constant = os.environ.get(variable), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[variable], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before_constant
        if before_env is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = before_env


def _client_app(config: RunConfig, num_nodes: int,
                defaults: Mapping[str, Scalar] | None = None, task: Task | None = None) -> ClientApp:
    """fedge's ClientApp, with Byzantine devices mixed in when ``byzantine-fraction`` > 0."""
    honest = make_client_app(task, config_defaults=defaults)
    if not config[knobs.BYZANTINE_FRACTION]:
        return honest
    bad = byzantine_partitions(num_nodes, config.number(knobs.BYZANTINE_FRACTION), config.integer(knobs.SEED))
    log.info("byzantine devices (%s): partitions %s", config[knobs.BYZANTINE_ATTACK], sorted(bad))
    return make_byzantine_client_app(honest, bad, config.text(knobs.BYZANTINE_ATTACK),
                                     config.number(knobs.ATTACK_SCALE))
