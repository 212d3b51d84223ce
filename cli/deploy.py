"""``fedge coordinator start|status`` and ``fedge device``."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedge import knobs
from fedge.clients.supernode import HEARTBEAT_S, IDLE_PULL_S
from fedge.config import parse_run_config_args, resolve_run_config
from fedge.errors import ConfigError, FedgeError, Stopped
from fedge.profiles import RUNTIMES
from fedge.server.run_restarts import DEFAULT_RESTARTS


def add_parsers(sub: Any) -> None:
    """Register the deployment subcommands on ``sub``."""
    coordinator = sub.add_parser("coordinator", help="the coordinator service (Flower SuperLink)")
    actions = coordinator.add_subparsers(dest="coordinator_command", required=True)
    start = actions.add_parser("start", help="start the SuperLink and run fedge's ServerApp on it")
    _start_options(start)
    start.set_defaults(handler=_start)
    status = actions.add_parser("status", help="connected devices and the current round")
    status.add_argument("--state-dir", type=Path, default=Path("coordinator-state"))
    status.set_defaults(handler=_status)
    _device_options(sub.add_parser("device", help="join a coordinator as a device (Flower SuperNode)"))


def start_parser() -> argparse.ArgumentParser:
    """A parser of ``fedge coordinator start``'s options alone (for their defaults)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _start_options(parser)
    return parser


def _start_options(start: argparse.ArgumentParser) -> None:
    """``fedge coordinator start``'s options."""
    start.add_argument("--keys", type=Path, default=Path("keys"), help="the `fedge keys init` directory")
    start.add_argument("--insecure", action="store_true",
                       help="NO TLS, NO device authentication (a throwaway test network only)")
    start.add_argument("--host", default="127.0.0.1", help="address to listen on")
    start.add_argument("--port", type=int, default=9095, help="port devices connect to (Fleet API only)")
    start.add_argument("--control-port", type=int, default=0,
                       help="loopback port of the operator's Control API (default: a free one)")
    start.add_argument("--bundle-port", type=int,
                       help="port devices pull signed bundles from (`fedge pull`; default: --port + 1, "
                            "0: a free one)")
    start.add_argument("--state-dir", type=Path, default=Path("coordinator-state"),
                       help="SuperLink database, Flower home, logs and published bundles (keep it across restarts)")
    start.add_argument("--run-dir", type=Path, help="where the run writes (default runs/<name>)")
    start.add_argument("--rounds", type=int)
    start.add_argument("--clients-per-round", type=int)
    start.add_argument("--run-config", default="", help="overrides, Flower style: \"key=value ...\"")
    start.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue RUN_DIR after its last round")
    start.add_argument("--resume-existing", action="store_true",
                       help="with --run-dir: resume it if it already holds a run (checkpointed rounds), else start "
                            "it (one command line for a service that is restarted)")
    start.add_argument("--restarts", type=int, default=DEFAULT_RESTARTS, metavar="N",
                       help="go on after a lost ServerApp (no heartbeat for 60 s: a stalled machine, a killed "
                            f"process) at most N times, from its last checkpointed round (default {DEFAULT_RESTARTS})")
    start.add_argument("--dashboard", action="store_true", help="also serve the dashboard for this run")
    start.add_argument("--dashboard-host", default="127.0.0.1", help="dashboard address (off loopback: token)")
    start.add_argument("--dashboard-port", type=int, default=8765)
    start.add_argument("--dashboard-token", help="dashboard token (default off loopback: random, printed)")
    start.add_argument("--metrics-host", default="127.0.0.1",
                       help="address of the operator endpoint /health and /metrics (default loopback: operator-only; "
                            "any other address needs --metrics-token-file)")
    start.add_argument("--metrics-port", type=int,
                       help="port of /health and /metrics (default: --port + 2, skipped with a warning if busy; "
                            "0: a free one)")
    start.add_argument("--metrics-token-file", type=Path,
                       help="file holding the bearer token scrapers must send (required off loopback)")
    start.add_argument("--no-metrics", action="store_true", help="do not serve /health and /metrics")


def _device_options(device: argparse.ArgumentParser) -> None:
    """``fedge device``'s options."""
    device.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    device.add_argument("--profile", default="laptop", help="phone | laptop | gpu-box | a custom profile")
    device.add_argument("--data", required=True, type=Path, help="this device's data (.npz or .csv)")
    device.add_argument("--key", type=Path, help="this device's key (`fedge keys add-device`)")
    device.add_argument("--ca", type=Path, help="the coordinator's ca.crt")
    device.add_argument("--fleet-file", default="", help="TOML defining custom profiles")
    device.add_argument("--task", default="", help="the task this device runs (a registered name or "
                        "package.module:object); it refuses runs of other tasks (default: the run's built-in)")
    device.add_argument("--runtime", default="torch", choices=tuple(RUNTIMES),
                        help="what trains: " + "; ".join(f"{name} ({spec.summary})" for name, spec in RUNTIMES.items()))
    device.add_argument("--trust", type=Path, help="the coordinator's bundle signing public key "
                        "(KEYS/bundle-signing/signing.pub; needed with --runtime onnx)")
    device.add_argument("--bundles", default="", help="HOST:PORT of the coordinator's bundle service "
                        "(default: the coordinator's host, port + 1)")
    device.add_argument("--insecure", action="store_true", help="NO TLS (a throwaway test network only)")
    device.add_argument("--max-wait", type=float, help="give up if the coordinator is unreachable this long")
    device.add_argument("--state-dir", type=Path, help="Flower's working files for this device (one `fedge device` "
                        "at a time; default ~/.fedge-device)")
    device.add_argument("--offline-limit", type=float, default=300.0, metavar="SECONDS",
                        help="once joined, stop (status 0) after the coordinator has been unreachable this long: its "
                             "run is over or it stopped (default 300)")
    device.add_argument("--idle-pull-s", type=float, default=IDLE_PULL_S, metavar="SECONDS",
                        help="seconds between asks for work while idle: sooner starts each round's work sooner, "
                             f"at one request to the coordinator each (default {IDLE_PULL_S:g}, Flower's)")
    device.add_argument("--heartbeat-s", type=int, default=HEARTBEAT_S, metavar="SECONDS",
                        help="the heartbeat interval announced: the coordinator takes this device for gone 2 x "
                             f"that after its last one (10-1800, default {HEARTBEAT_S}, Flower's)")
    device.add_argument("--cold-clientapps", action="store_true",
                        help="start each message's ClientApp as a new process (Flower's way) instead of forking "
                             "it from a parent that imported Flower, fedge and the runtime once")
    device.add_argument("--verbose", action="store_true",
                        help="Flower's own log lines on the console too (default: only in STATE_DIR/supernode.log)")
    device.set_defaults(handler=_device)


def _run_config(args: argparse.Namespace) -> dict[str, Any]:
    if args.resume_existing:
        if args.resume is not None or args.run_dir is None:
            raise ConfigError("--resume-existing goes with --run-dir RUN_DIR (not --resume): it resumes RUN_DIR "
                              "when RUN_DIR holds a run and starts one there otherwise")
        if (args.run_dir / "checkpoint.npz").exists():
            print(f"{args.run_dir} holds a run: resuming it after its last checkpointed round", flush=True)
            args.resume, args.run_dir = args.run_dir, None
    overrides: dict[str, Any] = {}
    if args.resume:
        saved = args.resume / "config.json"
        if not saved.exists():
            raise ConfigError(f"cannot resume '{args.resume}': it has no config.json")
        overrides.update(json.loads(saved.read_text()))
        overrides.update({knobs.RESUME: True, knobs.RUN_DIR: str(args.resume.resolve())})
        if _is_default_signing_key(str(overrides.get(knobs.SIGNING_KEY, ""))):
            # the keys directory of this start, not the saved absolute path (a restored backup moved it)
            overrides[knobs.SIGNING_KEY] = str(_bundle_signing_key_path(args))
    overrides.update(parse_run_config_args(args.run_config))
    flags = {knobs.NUM_ROUNDS: args.rounds, knobs.CLIENTS_PER_ROUND: args.clients_per_round,
             knobs.RUN_DIR: str(args.run_dir.resolve()) if args.run_dir else None}
    overrides.update({k: v for k, v in flags.items() if v is not None})
    overrides[knobs.DEPLOYMENT] = True
    if not overrides.get(knobs.SIGNING_KEY):
        overrides[knobs.SIGNING_KEY] = str(_bundle_signing_key_path(args))  # made in _start, after the checks
    config = resolve_run_config(overrides)  # refuse bad keys before starting anything
    from fedge.server.app import check_deployment

    check_deployment(config, registered=_registered(args))  # refused here, before any Flower process starts
    if not config[knobs.RUN_DIR]:
        from fedge.server.report import run_dir_for

        overrides[knobs.RUN_DIR] = str(run_dir_for(config).resolve())
    return {k: v for k, v in resolve_run_config(overrides).items() if k in overrides}


def _bundle_signing_key_path(args: argparse.Namespace) -> Path:
    """Where the coordinator's Ed25519 bundle signing key lives (``KEYS/bundle-signing/signing.key``).

    Devices trust bundles (inference and training) by this key's public half,
    ``signing.pub``, given to them with ``ca.crt``: a per-run key would change every run.
    """
    from fedge.edge.signing import PRIVATE_NAME

    return ((args.state_dir if args.insecure else args.keys) / "bundle-signing" / PRIVATE_NAME).resolve()


def _is_default_signing_key(path: str) -> bool:
    """Whether ``path`` is where fedge keeps the bundle signing key (``.../bundle-signing/signing.key``)."""
    from fedge.edge.signing import PRIVATE_NAME

    return bool(path) and Path(path).parts[-2:] == ("bundle-signing", PRIVATE_NAME)


def _ensure_bundle_signing_key(path: Path) -> None:
    """Make the bundle signing key at ``path`` once (kept across runs and restarts)."""
    from fedge.edge.signing import generate_signing_key

    if not path.exists():
        generate_signing_key(path.parent)
        print(f"bundle signing key made: {path}; give devices {path.with_name('signing.pub')} "
              "(`fedge pull --trust`, `fedge device --runtime onnx --trust`)", flush=True)


def _registered(args: argparse.Namespace) -> int | None:
    """How many device keys the coordinator will register (None in insecure mode: anyone may join)."""
    if args.insecure:
        return None
    from fedge.server.pki import CoordinatorKeys

    return len(CoordinatorKeys(args.keys).device_public_keys())


def _raise_stopped(signum: int, frame: Any) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGINT into :class:`Stopped` (no traceback); restore the handlers after."""
    previous = {signum: signal.signal(signum, _raise_stopped) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _ignore_signals() -> None:
    """While stopping, a second Ctrl-C or SIGTERM does not interrupt the clean-up."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)


def _metrics_token(args: argparse.Namespace) -> str | None:
    """The operator endpoint's bearer token (from ``--metrics-token-file``); refuse off loopback without one."""
    from fedge.server.dashboard import check_exposure

    token = None
    if args.metrics_token_file is not None:
        try:
            token = args.metrics_token_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --metrics-token-file {args.metrics_token_file}: "
                              f"{exc.strerror or exc}") from None
        if len(token) < 16:
            raise ConfigError(f"--metrics-token-file {args.metrics_token_file} holds {len(token)} characters; "
                              "a token needs at least 16 (e.g. `python -c 'import secrets; "
                              "print(secrets.token_urlsafe(32))' > FILE`)")
    if not args.no_metrics:
        check_exposure(args.metrics_host, token, "the metrics endpoint (/health, /metrics)",
                       "pass --metrics-token-file FILE (scrapers send 'Authorization: Bearer <token>')")
    return token


def _listeners(args: argparse.Namespace) -> dict[str, Any]:
    """Bind the metrics endpoint and the dashboard before anything starts (a taken port refuses the start).

    The metrics endpoint's default port (``--port`` + 2) only warns when it is taken.
    """
    import socket

    from fedge.server.dashboard import listen

    sockets: dict[str, socket.socket] = {}
    try:
        if not args.no_metrics:
            port = args.port + 2 if args.metrics_port is None else args.metrics_port
            if port and port == args.port:
                raise ConfigError(f"--metrics-port {port} is the device port; give the metrics endpoint a port "
                                  "of its own (or 0 for a free one)")
            try:
                sockets["metrics"] = listen(args.metrics_host, port, "the metrics endpoint", "--metrics-port")
            except ConfigError as exc:
                if args.metrics_port is not None:
                    raise
                print(f"WARNING: /health and /metrics are not served: {exc}", file=sys.stderr, flush=True)
        if args.dashboard:
            sockets["dashboard"] = listen(args.dashboard_host, args.dashboard_port, "the dashboard",
                                          "--dashboard-port")
    except BaseException:
        for sock in sockets.values():
            sock.close()
        raise
    return sockets


def _serve(args: argparse.Namespace, sockets: dict[str, Any], run_dir: Path, token: str | None,
           live: Any) -> list[Any]:
    """Serve the operator endpoint and the dashboard on their bound sockets; returns the servers."""
    from fedge.server.dashboard import (
        create_app,
        create_service_app,
        is_loopback,
        new_token,
        serve_in_background,
        url_of,
    )

    servers = []
    if "metrics" in sockets:
        app = create_service_app(run_dir, host=args.metrics_host, token=token, state_dir=args.state_dir, live=live)
        servers.append(serve_in_background(app, sockets["metrics"], "fedge-metrics"))
        url = url_of(sockets["metrics"])
        print(f"health {url}/health, Prometheus metrics {url}/metrics ("
              + ("operator-only: loopback)" if token is None else "bearer token required)"), flush=True)
    if "dashboard" in sockets:
        run_dir.mkdir(parents=True, exist_ok=True)
        dashboard_token = args.dashboard_token or (None if is_loopback(args.dashboard_host) else new_token())
        app = create_app(run_dir, host=args.dashboard_host, token=dashboard_token, state_dir=args.state_dir,
                         live=live)
        servers.append(serve_in_background(app, sockets["dashboard"], "fedge-dashboard"))
        url = url_of(sockets["dashboard"])
        print(f"dashboard: {url}/" + (f"?token={dashboard_token}" if dashboard_token else ""), flush=True)
    return servers


def _start(args: argparse.Namespace) -> int:
    from fedge.server.coordinator import check_coordinator_keys
    from fedge.server.pki import CoordinatorKeys

    if args.restarts < 0:
        raise ConfigError(f"--restarts {args.restarts}: give how many times a lost run may go on (0: never)")
    keys = None if args.insecure else CoordinatorKeys(args.keys)
    if keys is not None:
        check_coordinator_keys(keys)  # TLS files first, then the run against the registered devices
    token = _metrics_token(args)
    run_config = _run_config(args)
    sockets = _listeners(args)
    try:
        return _start_coordinator(args, keys, run_config, sockets, token)
    finally:
        for sock in sockets.values():
            sock.close()


def _start_coordinator(args: argparse.Namespace, keys: Any, run_config: dict[str, Any], sockets: dict[str, Any],
                       token: str | None) -> int:
    """Everything is checked and the operator's ports are bound: start the coordinator and its run."""
    from fedge.server.coordinator import Coordinator, FleetWatch

    if Path(str(run_config[knobs.SIGNING_KEY])) == _bundle_signing_key_path(args):
        _ensure_bundle_signing_key(_bundle_signing_key_path(args))
    coordinator = Coordinator(args.state_dir, keys, host=args.host, port=args.port, control_port=args.control_port,
                              bundle_port=args.bundle_port, run_dir=Path(str(run_config[knobs.RUN_DIR])))
    run_dir = Path(str(run_config[knobs.RUN_DIR]))
    watch = FleetWatch(coordinator)
    feed, servers = None, []
    with stop_on_signals():
        try:
            servers = _serve(args, sockets, run_dir, token, watch.live)
            coordinator.start()
            watch.start()
            (args.state_dir / "current-run").write_text(f"{run_dir}\n")
            print(f"coordinator listening on {coordinator.address}; run directory {run_dir}", flush=True)
            if coordinator.bundles_url is not None:
                print(f"bundles: {coordinator.bundles_url}/v1/bundles/{{inference,training}} (devices: `fedge pull "
                      f"--coordinator {coordinator.bundles_url.split('://')[1]}`), published from "
                      f"{coordinator.published}", flush=True)
            from fedge.server.progress import RunFeed
            from fedge.server.run_restarts import run_with_restarts

            feed = RunFeed(run_dir, coordinator.names).start()
            output = run_with_restarts(coordinator, run_config, restarts=args.restarts)
            feed.stop()
            watch.stop()
            coordinator.stop()  # the run is over: Flower's processes go; the dashboard may stay
            code = _run_outcome(run_dir, output, args.state_dir, feed)
            watch.outcome = "finished" if code == 0 else "failed"
            if "dashboard" in sockets:
                print("the run is over; the dashboard (and /health, /metrics) keep serving it until stopped "
                      "(Ctrl-C or SIGTERM)", flush=True)
                while True:
                    time.sleep(3600)
            return code
        except Stopped as stop:
            _ignore_signals()
            watch.stop()
            if feed is not None:
                feed.stop()
            coordinator.stop()
            rounds = feed.rounds_seen if feed is not None else 0
            finished = (run_dir / "summary.json").exists()
            if not finished:
                from fedge.server.coordinator import record_clean_stop

                record_clean_stop([args.state_dir, run_dir], str(stop))
            print(f"coordinator stopped ({stop}): every Flower process it started is stopped; "
                  + ("the run had finished" if finished else
                     f"{rounds} round(s) checkpointed in {run_dir}; continue with "
                     f"`{resume_command(args, run_dir)}`" if rounds else "no round was completed"),
                  flush=True)
            return 0
        finally:
            watch.stop()
            coordinator.stop()
            for server in servers:
                server.should_exit = True


# The operator's start options a resume must repeat, were they given: where the keys and state
# are and where devices connect (the run's own settings come back from RUN_DIR/config.json).
_REPEATED = ("keys", "state_dir", "host", "port", "control_port", "bundle_port", "dashboard_host",
             "dashboard_port", "metrics_host", "metrics_port", "metrics_token_file")
_SWITCHES = ("insecure", "dashboard", "no_metrics")


def resume_command(args: argparse.Namespace, run_dir: Path) -> str:
    """The ``fedge coordinator start --resume RUN_DIR ...`` line that continues this coordinator's run.

    Every operator option this start was given other than its default is repeated, so the
    hinted command listens where devices connect, with the same keys and state.
    """
    import shlex

    defaults = vars(start_parser().parse_args([]))
    words = ["fedge", "coordinator", "start", "--resume", str(run_dir)]
    for name in _REPEATED:
        value = getattr(args, name, None)
        if value is not None and value != defaults.get(name):
            words += [f"--{name.replace('_', '-')}", str(value)]
    words += [f"--{name.replace('_', '-')}" for name in _SWITCHES if getattr(args, name, False)]
    return shlex.join(words)


def _run_outcome(run_dir: Path, output: Any, state_dir: Path, feed: Any) -> int:
    """Print the run's final lines and return 0, or one line saying why it failed and return 1.

    A run refused at start exits 2 (before any Flower process starts); a run that fails
    later, inside the ServerApp, exits 1; a coordinator stopped by SIGTERM or SIGINT exits 0.
    """
    log = state_dir / "run.log"
    failed = _summary_failure(run_dir)
    if (run_dir / "summary.json").exists() and failed is None:
        for line in feed.final_lines():
            print(line, flush=True)
        return 0
    for line in feed.final_lines():  # device failure reasons, if any, help explain a failed run
        print(line, file=sys.stderr, flush=True)
    if failed is not None:
        why = f"{failed}; nothing was signed or published"
    elif output.error:
        why = output.error
    elif output.exit_code is not None:
        why = f"Flower reported exit code {output.exit_code}"
    else:
        why = f"`flwr run` exited {output.returncode} before the run wrote {run_dir / 'summary.json'}"
    print(f"fedge: error: the run failed: {why} (full log: {log})", file=sys.stderr, flush=True)
    return 1


def _summary_failure(run_dir: Path) -> str | None:
    """Why the run's ``summary.json`` says it failed (no update accepted, a model not finite), or None.

    Its ``failure`` key; ``failed`` is the count of replies that failed, which a run that finished may have."""
    try:
        failure = json.loads((run_dir / "summary.json").read_text()).get("failure")
    except (OSError, ValueError, AttributeError):
        return None
    return str(failure) if failure else None


def _status(args: argparse.Namespace) -> int:
    from fedge.server.coordinator import Coordinator
    from fedge.server.rejoins import revoked_nodes
    from fedge.server.report import read_jsonl

    if not (args.state_dir / "flwr-home" / "config.toml").exists():
        raise ConfigError(f"'{args.state_dir}' holds no coordinator state; "
                          "start one with `fedge coordinator start`")
    coordinator = Coordinator(args.state_dir, None)
    names = coordinator.names()
    try:
        nodes = coordinator.devices()
    except FedgeError:
        nodes = []
    if not nodes:  # the SuperLink is not running: the devices as its last device sync left them
        nodes = stopped_fleet(names, revoked_nodes(str(coordinator.revoked_file)))
    for node in nodes:
        node_id = str(node.get("node-id", node.get("node_id", "?")))
        shown = f"{names[node_id]} (node {node_id})" if node_id in names else f"node {node_id}"
        print(f"device {shown}: {node.get('status', '?')}")
    from fedge.server.publish import describe, published_dir

    for line in describe(published_dir(args.state_dir)):
        print(f"published {line}")
    pointer = args.state_dir / "current-run"
    if pointer.exists():
        run_dir = Path(pointer.read_text().strip())
        rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
        if rows:
            last = rows[-1]
            value = "-" if last.get("headline") is None else f"{last['headline']:.4f}"
            print(f"run {run_dir}: round {last['round']} done, {last.get('metric', 'accuracy')} {value}, "
                  f"{last['participants']} participants, {last['rejected']} rejected")
        else:
            print(f"run {run_dir}: no round completed yet")
    return 0


def stopped_fleet(names: dict[str, str], revoked: set[int]) -> list[dict[str, str]]:
    """The devices of a coordinator that is not running, as its last device sync left them.

    ``names``: ``{node id: name}`` of every device it registered; ``revoked``: the node ids
    it unregistered (their key left ``KEYS/devices``), which stay refused.
    """
    return [{"node-id": node_id,
             "status": "revoked (refused; the coordinator is not running)" if int(node_id) in revoked
             else "registered (the coordinator is not running)"} for node_id in names]


def _device(args: argparse.Namespace) -> int:
    from fedge.clients.device import DeviceOptions, run_device

    return run_device(DeviceOptions(coordinator=args.coordinator, profile=args.profile, data=args.data,
                                    key=args.key, ca=args.ca, insecure=args.insecure,
                                    fleet_file=args.fleet_file, max_wait_s=args.max_wait,
                                    state_dir=args.state_dir, task=args.task, runtime=args.runtime,
                                    trust=args.trust, bundles=args.bundles, verbose=args.verbose,
                                    offline_limit_s=args.offline_limit, idle_pull_s=args.idle_pull_s,
                                    heartbeat_s=args.heartbeat_s, warm_clientapps=not args.cold_clientapps))
