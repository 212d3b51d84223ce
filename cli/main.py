"""``fedge`` command line; ``fedge --help`` lists every command (simulate, coordinator, device,
gateway, keys, init, export, verify, predict, pull, compare, dashboard, ...), each defined in the
module of its area (:mod:`fedge.cli.deploy`, :mod:`fedge.cli.edge`, :mod:`fedge.cli.keys`, ...):
:func:`command_modules` finds them, so a new command is one file."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys
from collections.abc import Callable, Sequence
from typing import Any

from fedge import knobs
from fedge.cli.catalogue import catalogue, describe, missing_extra, no_abbreviations, strategy_names
from fedge.cli.edge import size_text
from fedge.cli.workdir import importable_here
from fedge.errors import FedgeError, RunFailed

EXIT_USAGE = 2


def _simulate_parser(sub: Any) -> None:
    p = sub.add_parser("simulate", help="run a simulated fleet on this machine",
                       description="Run fedge's ServerApp and ClientApp over a simulated fleet.")
    p.add_argument("--backend", default="inline", choices=["inline", "ray"],
                   help="inline (default, in-process) or ray (Flower's simulation engine)")
    p.add_argument("--ray-address", metavar="ADDRESS",
                   help="with --backend ray: join the Ray cluster whose head is at ADDRESS (HOST:PORT, or "
                   "'auto') instead of starting one; devices run on every node of the cluster")
    p.add_argument("--rounds", type=int, help="run-config num-rounds")
    p.add_argument("--clients-per-round", type=int, help="run-config clients-per-round")
    p.add_argument("--fleet", help="profile mix like phone=60,laptop=30,gpu-box=10, or a TOML file")
    p.add_argument("--task", help="the task: a registered name (digits, images, chars, diabetes, ...) or "
                   "package.module:object (importable from the current directory)")
    p.add_argument("--dataset", help="digits | synthetic | npz | csv")
    p.add_argument("--model", help="mlp | cnn | logreg")
    describe(p.add_argument("--strategy", metavar="NAME",
                            help="aggregation strategy: %(names)s (default fedavg; docs/strategies.md). "
                            "Also: %(more)s"), names=strategy_names, more=catalogue)
    p.add_argument("--seed", type=int, help="run-config seed")
    p.add_argument("--run-dir", help="where to write the run (default runs/<name>)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue RUN_DIR after its last completed round (its config.json, plus overrides)")
    p.add_argument("--run-config", default="",
                   help="more overrides, Flower style: \"key=value key2='text'\"")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no log lines below warnings")
    p.add_argument("--verbose", action="store_true", help="show Flower's own log lines")


def _simulate(args: argparse.Namespace) -> int:
    from fedge.server.report import plotting_process

    with plotting_process():  # matplotlib loads in a helper process while torch loads here
        return _simulate_run(args)


def _simulate_run(args: argparse.Namespace) -> int:
    from fedge.config import parse_run_config_args
    from fedge.simulation.runner import simulate

    overrides: dict[str, Any] = {}
    if args.resume:
        overrides.update(_saved_config(args.resume))
        overrides.update({knobs.RESUME: True, knobs.RUN_DIR: args.resume})
    overrides.update(parse_run_config_args(args.run_config))
    flags = {knobs.NUM_ROUNDS: args.rounds, knobs.CLIENTS_PER_ROUND: args.clients_per_round,
             knobs.TASK: args.task, knobs.DATASET: args.dataset, knobs.MODEL: args.model, knobs.STRATEGY: args.strategy,
             knobs.SEED: args.seed, knobs.RUN_DIR: args.run_dir}
    overrides.update({k: v for k, v in flags.items() if v is not None})
    if ":" in str(overrides.get(knobs.TASK, "")):
        importable_here()
    if args.fleet:
        key = knobs.FLEET_FILE if args.fleet.endswith(".toml") else knobs.FLEET
        overrides[key] = args.fleet
    if not args.verbose:
        quiet_third_party_logs()
    if args.quiet:  # the final lines only (they are printed, not logged)
        logging.getLogger("fedge").setLevel(logging.WARNING)
    run_dir, summary = simulate(overrides, backend=args.backend, progress=not args.quiet,
                                ray_address=args.ray_address)
    onnx = summary.get("onnx", {})
    print(f"run directory: {run_dir}")
    print(f"rounds: {summary['rounds']}  simulated time: {summary['sim_time_s']:.1f} s  "
          f"wall time: {summary['wall_time_s']:.1f} s  uplink: {size_text(summary['bytes_up'])}"
          f"  rejected updates: {summary['rejected']}")
    if onnx:
        print(f"model.onnx parity vs torch: max abs diff {onnx['max_abs_diff']:.1e}")
    if "dp" in summary:
        dp = summary["dp"]
        print(f"differential privacy: epsilon {dp['epsilon']:.2f} at delta {dp['delta']:g} ({dp['mode']})")
    final = summary.get("final_headline")
    print(f"final {summary['headline']}: {'-' if final is None else format(final, '.4f')}")
    return 0


def _dashboard_parser(sub: Any) -> None:
    p = sub.add_parser("dashboard", help="a live web view of a run directory",
                       description="Serve fedge's dashboard for RUN_DIR (live while the run goes, or finished).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a fedge run directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (off loopback a token is required)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--token", help="access token (default off loopback: a random one, printed in the URL)")
    p.set_defaults(handler=_dashboard)


def _dashboard(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fedge.errors import ConfigError
    from fedge.server.dashboard import serve

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"'{run_dir}' is not a directory; pass a run directory (runs/<name>)")
    serve(run_dir, host=args.host, port=args.port, token=args.token)
    return 0


def _saved_config(run_dir: str) -> dict[str, Any]:
    import json
    from pathlib import Path

    from fedge.errors import ConfigError

    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise ConfigError(f"cannot resume '{run_dir}': it has no config.json (not a fedge run directory)")
    return dict(json.loads(path.read_text()))


def quiet_third_party_logs() -> None:
    """Keep Flower's per-round INFO lines and the ONNX exporter's chatter off the console."""
    for name in ("flwr", "onnx_ir", "onnxscript", "torch.onnx", "matplotlib", "alembic"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("flwr").propagate = False


def command_modules() -> list[Callable[[Any], None]]:
    """Every module of ``fedge.cli`` that defines commands (an ``add_parsers(sub)``), by name: a new
    command is one file there."""
    import fedge.cli  # noqa: PLC0415

    found = []
    for module in sorted(pkgutil.iter_modules(fedge.cli.__path__), key=lambda info: info.name):
        loaded = importlib.import_module(f"fedge.cli.{module.name}")
        if callable(getattr(loaded, "add_parsers", None)):
            found.append(loaded.add_parsers)
    return found


def build_parser() -> argparse.ArgumentParser:
    """The ``fedge`` argument parser."""
    parser = argparse.ArgumentParser(prog="fedge", description="Federated learning on edge fleets.")
    sub = parser.add_subparsers(dest="command", required=True)
    _simulate_parser(sub)
    _dashboard_parser(sub)
    for add_parsers in command_modules():
        add_parsers(sub)
    no_abbreviations(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; a refused input prints one line and exits with status 2."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request (a device's Fleet calls)
    args = build_parser().parse_args(argv)
    try:
        handler = _simulate if args.command == "simulate" else args.handler
        code = int(handler(args))
    except RunFailed as exc:  # the run went, and ended without a model worth shipping
        print(f"fedge: error: the run failed: {exc}", file=sys.stderr)
        code = 1
    except FedgeError as exc:
        print(f"fedge: error: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    except ModuleNotFoundError as exc:  # a command of an extra this install does not have
        line = missing_extra(args.command, exc)
        if line is None:
            raise
        print(f"fedge: error: {line}", file=sys.stderr)
        code = EXIT_USAGE
    if argv is None and args.command == "simulate":
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """End the ``fedge`` process now, skipping the interpreter's teardown of torch's modules
    (0.5-1 s of garbage collection that frees nothing the OS would not free anyway).

    Everything an ordinary exit does that matters still happens first: atexit handlers
    (logging's flush, Ray's shutdown, coverage's save), then stdout and stderr are flushed.
    It returns (the ordinary exit follows) while a non-daemon thread is alive, or under a
    profiler or tracer, which write their results after the program ends.
    """
    import atexit
    import contextlib
    import threading

    others = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    if others or sys.getprofile() is not None or sys.gettrace() is not None:
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing left to say
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
