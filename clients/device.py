"""``fedge device``: a Flower SuperNode running fedge's ClientApp on this device's data.

Everything that can be checked before joining is checked here, with one-line
errors: the profile, the data file, the authentication key, the CA, whether the
coordinator is reachable (retrying with exponential backoff) and whether its TLS
certificate verifies against the CA. Then Flower's SuperNode takes over.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key

from fedge import knobs
from fedge.clients.device_session import (
    SUPERNODE_LOG,
    console_line,
    end_previous_session,
    hold_state_dir,
    previous_session,
    remember_session,
)
from fedge.clients.supernode import HEARTBEAT_S, IDLE_PULL_S
from fedge.edge.signing import ensure_private_dir
from fedge.errors import ConfigError, FedgeError, Stopped
from fedge.profiles import RUNTIMES, parse_fleet, runtime
from fedge.task.data import load_local_file

log = logging.getLogger("fedge.clients.device")

TASK_REFERENCE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*(:[A-Za-z_][A-Za-z0-9_.]*)?$")

INSECURE_WARNING = ("WARNING: INSECURE MODE. This device does not verify the coordinator and sends its "
                    "updates unencrypted. Use only on a trusted test network.")


OFFLINE_LIMIT_S = 300.0  # a coordinator gone this long after the device joined: its run is over, or it stopped


@dataclass(frozen=True)
class DeviceOptions:
    """What ``fedge device`` was asked to do."""

    coordinator: str
    profile: str
    data: Path
    key: Path | None
    ca: Path | None
    insecure: bool = False
    fleet_file: str = ""
    max_wait_s: float | None = None
    state_dir: Path | None = None
    task: str = ""  # the task this device runs (a registered name or package.module:object); "" = the run's built-in
    runtime: str = "torch"  # "onnx": train with the coordinator's signed training graph, no torch
    trust: Path | None = None  # the coordinator's bundle signing public key (runtime onnx)
    bundles: str = ""  # the coordinator's bundle service HOST:PORT (default: the coordinator's host, port + 1)
    verbose: bool = False  # Flower's log lines on the console too (else only in STATE_DIR/supernode.log)
    offline_limit_s: float = OFFLINE_LIMIT_S  # stop once a joined coordinator has been unreachable this long
    # a gateway's node (fedge.clients.gateway.service): its loopback control address and token file; no data of its own
    gateway_control: str = ""
    gateway_token: Path | None = None
    idle_pull_s: float = IDLE_PULL_S  # seconds between the SuperNode's pulls while it has no message
    heartbeat_s: int = HEARTBEAT_S  # the heartbeat interval it announces (gone after 2 x that without one)
    warm_clientapps: bool = True  # fork each message's ClientApp from a warm parent (fedge.clients.warm_clientapp)


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port), with a clear error."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"coordinator address '{address}' is not HOST:PORT (e.g. 127.0.0.1:9095)")
    return host.strip("[]"), int(port)


def check_device(options: DeviceOptions) -> None:
    """Validate profile, data, key and CA before contacting anyone."""
    parse_fleet(f"{options.profile}=1", options.fleet_file)  # unknown profile -> ConfigError
    if options.gateway_control:
        _check_credentials(options)
        return
    if not options.data.exists():
        raise ConfigError(f"data file '{options.data}' does not exist")
    if options.task and not TASK_REFERENCE.match(options.task):
        raise ConfigError(f"--task {options.task!r} is not a task name or package.module:object")
    if options.runtime not in RUNTIMES:
        raise ConfigError(f"--runtime {options.runtime!r}: use one of {', '.join(RUNTIMES)}")
    if runtime(options.runtime).needs_training_graph:
        _check_onnx_options(options)  # its data is checked against the training graph once pulled
    elif options.task:  # the device's own task reads its own data: checked now, not at the first round
        from fedge.config import resolve_run_config  # noqa: PLC0415 - torch only when a task is named
        from fedge.task.loading import load_task  # noqa: PLC0415

        task = load_task(resolve_run_config({knobs.TASK: options.task}))
        _check_count(options, len(task.device_data(str(options.data.resolve()))))
    else:
        _check_count(options, len(load_local_file(str(options.data.resolve()))[1]))
    _check_credentials(options)


def _check_credentials(options: DeviceOptions) -> None:
    """The device key and CA (unless insecure): present, and the key an EC OpenSSH key."""
    if options.insecure:
        return
    if options.key is None or options.ca is None:
        raise ConfigError("a device needs --key (from `fedge keys add-device`) and --ca (the coordinator's "
                          "ca.crt), or --insecure for a throwaway test")
    for path, what in ((options.key, "device key"), (options.ca, "CA certificate")):
        if not path.exists():
            raise ConfigError(f"{what} '{path}' does not exist")
    try:
        key = load_ssh_private_key(options.key.read_bytes(), password=None)
    except (ValueError, UnsupportedAlgorithm):
        raise ConfigError(f"'{options.key}' is not an OpenSSH private key; make one with "
                          "`fedge keys add-device NAME`") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"'{options.key}' is a {type(key).__name__}; device keys are EC (NIST P-384)")


def _check_count(options: DeviceOptions, count: int) -> None:
    if count == 0:
        raise ConfigError(f"data file '{options.data}' has no samples")


def _check_onnx_options(options: DeviceOptions) -> None:
    """An onnx device trains the run's signed graph on its own file: it needs the key that signs it."""
    if options.task:
        raise ConfigError("--task loads a Python task, which needs torch; an onnx device trains the "
                          "coordinator's signed training graph: drop --task (or use --runtime torch)")
    if options.trust is None:
        raise ConfigError("--runtime onnx needs --trust KEY.pub: the coordinator's bundle signing public key "
                          "(the operator's `signing-key`), which the training graph must be signed with")
    if not options.trust.is_file():
        raise ConfigError(f"signing public key '{options.trust}' does not exist")
    if options.data.suffix not in (".npz", ".csv"):
        raise ConfigError(f"data file '{options.data}': an onnx device reads .npz (one array per input and "
                          "'y') or .csv")


def pull_training_graph(options: DeviceOptions, state: Path) -> Path:
    """Fetch (or keep) the coordinator's signed training graph and check this device's data against it."""
    from fedge.clients.onnx_client import device_arrays  # noqa: PLC0415
    from fedge.edge.delivery import DeliveryError, NotPublished, pull  # noqa: PLC0415
    from fedge.edge.training_bundle import read_training_bundle  # noqa: PLC0415

    assert options.trust is not None
    deadline = time.monotonic() + (options.max_wait_s if options.max_wait_s is not None else 60.0)
    delay = 1.0
    while True:  # a coordinator publishes the graph when its run starts, a few seconds after it listens
        try:
            result = pull(url_or_address=options.bundles or bundle_service(options.coordinator), kind="training",
                          directory=state / "bundles", device_key=options.key, ca=options.ca,
                          trusted_keys=[options.trust], freshness_dir=state / "freshness",
                          insecure=options.insecure)
            break
        except DeliveryError as exc:  # not published yet, or the bundle service not listening yet
            if time.monotonic() + delay > deadline:
                if isinstance(exc, NotPublished):
                    raise FedgeError("the coordinator has published no training graph; is its run started, and "
                                     "does its log say why it could not export one?") from None
                raise
            print(f"{exc}; retrying in {delay:.0f} s", file=sys.stderr, flush=True)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
    bundle = read_training_bundle(result.path, trusted_keys=[options.trust])
    if options.gateway_control:  # a gateway serves the graph to its devices; it trains nothing itself
        print(f"training graph for this gateway's devices: task {bundle.manifest['task']}, architecture "
              f"{bundle.architecture[:12]}", flush=True)
        return result.path
    _, targets = device_arrays(options.data.resolve(), bundle.manifest)
    _check_count(options, len(targets))
    state_word = "updated" if result.changed else "unchanged"
    print(f"training graph {state_word}: task {bundle.manifest['task']}, architecture "
          f"{bundle.architecture[:12]} ({result.bytes_downloaded} bytes downloaded); {len(targets)} examples",
          flush=True)
    return result.path


def refresh_settings(options: DeviceOptions, training_bundle: Path) -> str:
    """Node-config entries with which the device's app fetches a new training graph itself when a run
    trains another architecture (:func:`fedge.clients.onnx_client.refresh_training_bundle`): the same
    bundle service, device key, CA and freshness records as the pull at start."""
    entries = {"bundle-service": options.bundles or bundle_service(options.coordinator),
               "freshness-dir": str((training_bundle.parent.parent / "freshness").resolve())}
    if options.insecure:
        entries["bundles-insecure"] = "yes"
    else:
        assert options.key is not None and options.ca is not None
        entries |= {"device-key": str(options.key.resolve()), "ca": str(options.ca.resolve())}
    return "".join(f' {key}="{value}"' for key, value in entries.items())


def bundle_service(coordinator: str) -> str:
    """The coordinator's bundle service, by default (its port + 1)."""
    host, port = split_address(coordinator)
    return f"{host}:{port + 1}"


def wait_reachable(host: str, port: int, max_wait_s: float | None) -> None:
    """Connect by TCP, retrying with exponential backoff (1 s doubling to 30 s)."""
    deadline = None if max_wait_s is None else time.monotonic() + max_wait_s
    delay = 1.0
    while True:
        try:
            with socket.create_connection((host, port), timeout=5):
                return
        except OSError as exc:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise FedgeError(f"coordinator {host}:{port} is unreachable ({exc.strerror or exc}) after "
                                 f"{max_wait_s:.0f} s; check the address, that it is running, "
                                 "and firewalls") from None
            wait = delay if remaining is None else min(delay, remaining)
            print(f"coordinator {host}:{port} unreachable ({exc.strerror or exc}); retrying in {wait:.0f} s",
                  file=sys.stderr, flush=True)
            time.sleep(wait)
            delay = min(delay * 2, 30.0)


def check_tls(host: str, port: int, ca: Path) -> None:
    """Complete a TLS handshake verifying the coordinator against ``ca``."""
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with socket.create_connection((host, port), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname=host):
            return
    except ssl.SSLCertVerificationError as exc:
        raise FedgeError(f"the coordinator's certificate does not verify with {ca}: {exc.verify_message}; "
                         "use the ca.crt of this coordinator's `fedge keys init` "
                         "(or renew an expired one)") from None
    except ssl.SSLError as exc:
        raise FedgeError(f"TLS with {host}:{port} failed ({exc.reason}); "
                         "is the coordinator started with TLS?") from None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def supernode_command(options: DeviceOptions, training_bundle: Path | None = None) -> list[str]:
    """The SuperNode's command line for ``options``: Flower's, paced by :mod:`fedge.clients.supernode`."""
    # The device's runtime, paths and trust anchors, always its own (fedge.clients.common.own_settings)
    data = "" if options.gateway_control else options.data.resolve()
    node_config = f'profile="{options.profile}" data-path="{data}" runtime="{options.runtime}"'
    if options.gateway_control and options.gateway_token is not None:
        node_config += f' gateway-control="{options.gateway_control}" gateway-token="{options.gateway_token.resolve()}"'
    if options.fleet_file:
        node_config += f' fleet-file="{Path(options.fleet_file).resolve()}"'
    if options.task:
        node_config += f' task="{options.task}"'
    if training_bundle is not None and options.trust is not None:
        node_config += (f' training-bundle="{training_bundle.resolve()}" '
                        f'trusted-key="{options.trust.resolve()}"')
        node_config += refresh_settings(options, training_bundle)
    paced = ["--idle-pull-s", str(options.idle_pull_s), "--heartbeat-s", str(options.heartbeat_s)]
    if options.warm_clientapps:  # a gateway's node runs no training runtime
        paced += ["--warm-runtime", "" if options.gateway_control else options.runtime]
    command = [sys.executable, "-m", "fedge.clients.supernode", *paced, "--superlink", options.coordinator,
               "--node-config", node_config, "--port", str(_free_port())]
    if options.insecure:
        return [*command, "--insecure"]
    assert options.key is not None and options.ca is not None
    return [*command, "--root-certificates", str(options.ca.resolve()),
            "--auth-supernode-private-key", str(options.key.resolve())]


# The SuperLink answers both "key not registered" and "still online" (a previous session of this device
# that died, listed online until its heartbeat lapses, about a minute) with the same code: the device
# tells them apart by its own record of its last session (fedge.clients.device_session).
ACTIVATED = re.compile(r"SuperNode ID: (\d+)")  # Flower 1.42's SuperNode logs it once the coordinator took its key
NOT_ACTIVATED = "[code: 2004]"
REFUSED = {NOT_ACTIVATED: "the coordinator did not activate this device: it does not know this device's key (not "
                          "registered, or revoked)",
           "[code: 2001]": "the coordinator requires device authentication; pass --key"}
# ... unless it was only this device's previous session, still listed online, which could not be ended
NOT_ENDED = ("; if it is this device's previous session (node {node}), still listed online, ending it failed ({why}): "
             "Flower frees it about a minute after its last heartbeat")
# Flower's SuperNode logs these when it loses and regains the coordinator (flwr/supercore/retry)
LOST, REGAINED = "Connection attempt failed", ("Connection successful", "Receiving:", "Sent successfully")


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signum)


def run_device(options: DeviceOptions) -> int:
    """Check everything, then run the SuperNode in the foreground; its exit status is ours.

    A coordinator that has just started may not have registered this device's key yet, so a
    refused activation is retried with backoff for up to ``max_wait_s`` (default 90 s) before
    giving up with a one-line error. A device restarted after its SuperNode died ends that
    session itself and joins at once (:mod:`fedge.clients.device_session`). A coordinator
    that stays unreachable ``offline_limit_s`` after the device joined (its run ended, or it
    stopped) ends the device with one line and status 0. SIGTERM and SIGINT stop the SuperNode
    and every Flower process it started, print one line and exit 0. One ``fedge device`` per
    state directory: a second is refused with the holder's pid.
    """
    previous = {signum: signal.signal(signum, _raise_stopped) for signum in (signal.SIGTERM, signal.SIGINT)}
    _ECHO.clear()
    state = options.state_dir or Path(os.environ.get("FEDGE_DEVICE_HOME", Path.home() / ".fedge-device"))
    try:
        check_device(options)
        ensure_private_dir(state)  # bundles, freshness records, Flower's home: 0700 whatever the umask
        with hold_state_dir(state):
            return _run_held(options, state, previous)
    except Stopped as stop:  # before this device held its state directory: nothing was started
        print(f"device stopped ({stop})", flush=True)
        return 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _run_held(options: DeviceOptions, state: Path, previous: Collection[int]) -> int:
    """Run the device while holding ``state``; a signal stops everything it started."""
    try:
        _stop_supernode(state)  # a SuperNode left by a device of this directory that was killed outright
        return _run_device(options, state)
    except Stopped as stop:
        for signum in previous:
            signal.signal(signum, signal.SIG_IGN)
        _divert_echo(state / "last-stop.log")
        _stop_supernode(state)
        print(f"device stopped ({stop}): the SuperNode and its helpers are stopped; "
              f"their shutdown output is in {state / 'last-stop.log'}", flush=True)
        return 0


def _run_device(options: DeviceOptions, state: Path) -> int:
    host, port = split_address(options.coordinator)
    if options.insecure:
        print(INSECURE_WARNING, file=sys.stderr, flush=True)
    wait_reachable(host, port, options.max_wait_s)
    if not options.insecure:
        assert options.ca is not None
        check_tls(host, port, options.ca)
    training_bundle = pull_training_graph(options, state) if runtime(options.runtime).needs_training_graph else None
    if not options.verbose:
        print(f"Flower's own log lines go to {state / SUPERNODE_LOG} (--verbose shows them here)", flush=True)
    started = time.monotonic()
    wait = options.max_wait_s if options.max_wait_s is not None else 90.0
    delay, ended_previous = 1.0, False
    while True:
        began = time.monotonic()
        end = _run_supernode(options, state, training_bundle)
        if end.offline:
            return _coordinator_gone(host, port, options.offline_limit_s)
        if end.refusal is None:
            if not end.activated and time.monotonic() - began < 10:  # it did not get going: its status is the answer
                print(f"the SuperNode ended with status {end.code} before joining the coordinator; its output: "
                      f"{state / SUPERNODE_LOG}", file=sys.stderr, flush=True)
                return end.code
            # A SuperNode that was activated, or ran a while, and ended on its own: the coordinator went away
            # or revoked this device's key (Flower ends it "gracefully" then, however soon after activation).
            # Connect again: a revoked key is refused below.
            print(f"the SuperNode ended on its own (status {end.code}); connecting again", file=sys.stderr, flush=True)
            started, delay, ended_previous = time.monotonic(), 1.0, False  # a stale session of its own may follow
            try:
                wait_reachable(host, port, options.offline_limit_s)
            except FedgeError:
                return _coordinator_gone(host, port, options.offline_limit_s)
            continue
        refusal = end.refusal
        node = previous_session(state, options.key) if end.refusal == REFUSED[NOT_ACTIVATED] else None
        if node is not None and not ended_previous:
            assert options.key is not None and options.ca is not None
            why = end_previous_session(coordinator=options.coordinator, key=options.key, ca=options.ca, node_id=node)
            if why is None:
                ended_previous = True
                print(f"ended this device's previous session (node {node}), which the coordinator still listed "
                      "online (its SuperNode stopped without signing off); joining again", flush=True)
                continue
            refusal += NOT_ENDED.format(node=node, why=why)
        if time.monotonic() + delay > started + wait:
            raise FedgeError(f"{refusal}; if no other `fedge device` runs with this key, the operator must admit it: "
                             "`fedge keys add-device NAME` on the coordinator (admitted within 10 s, no restart); "
                             "a key the operator revoked is never admitted again")
        print(f"{refusal}; retrying in {delay:.0f} s", file=sys.stderr, flush=True)
        time.sleep(delay)
        delay = min(delay * 2, 15.0)


def _coordinator_gone(host: str, port: int, limit_s: float) -> int:
    """One line for a coordinator that stayed away after this device joined; the device ends with 0."""
    print(f"the coordinator {host}:{port} has been unreachable for {limit_s:.0f} s (its run is over, or it stopped); "
          "this device stops. Start it again to join the coordinator's next run (--offline-limit sets the wait)",
          flush=True)
    return 0


_SUPERNODE: list[subprocess.Popen[str]] = []  # the running SuperNode, for a signal's clean stop
_ECHO: list[IO[str]] = []  # where the SuperNode's output goes instead of the console, once a stop began


def _divert_echo(path: Path) -> None:
    """Send the SuperNode's further output to ``path``: the console gets one line for a stop.

    Flower's helpers watch their parent and raise SIGINT in themselves when it is gone; one
    already shutting down after fedge's SIGTERM then prints a KeyboardInterrupt traceback.
    That is noise from an orderly stop, kept in the file for whoever wants it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    _ECHO[:] = [path.open("w", encoding="utf-8")]


@dataclass
class SupernodeEnd:
    """How one SuperNode lifetime ended."""

    code: int  # its exit status
    refusal: str | None  # why the coordinator refused to activate it, if it did
    activated: bool  # the coordinator activated it (Flower logged the node id it was given)
    offline: bool = False  # fedge stopped it: the coordinator was unreachable for offline_limit_s


@dataclass
class _Watch:
    """What the SuperNode's output said so far (written by the echo thread, read by the waiting one)."""

    refusals: list[str]
    activated: threading.Event
    lost_since: float | None = None  # when Flower first failed to reach the coordinator since it last did


def _run_supernode(options: DeviceOptions, state: Path, training_bundle: Path | None) -> SupernodeEnd:
    """Run the SuperNode, echoing fedge's lines of its output (all of it to ``STATE_DIR/supernode.log``)."""
    from fedge.files import open_private_append
    from fedge.process import flower_env

    # A session of its own: a terminal's Ctrl-C reaches fedge only, which stops everything in order
    process = subprocess.Popen(supernode_command(options, training_bundle),
                               env=flower_env((state / "flwr-home").resolve()), umask=0o077,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                               start_new_session=True)
    _SUPERNODE[:] = [process]
    watch = _Watch(refusals=[], activated=threading.Event())
    assert process.stdout is not None
    flower_log = open_private_append(state / SUPERNODE_LOG, text=True)  # closed by _echo at the output's end
    threading.Thread(target=_echo, args=(process.stdout, flower_log, options, state, watch), daemon=True).start()
    offline = _wait_supernode(process, options, state, watch)
    time.sleep(0.2)  # let the last lines through
    _stop_supernode(state)  # a SuperNode that ended (gave up, or was cut off) leaves no helper behind
    code = process.returncode
    return SupernodeEnd(code, watch.refusals[0] if watch.refusals else None, watch.activated.is_set(), offline)


def _echo(stream: IO[str], flower_log: IO[str], options: DeviceOptions, state: Path, watch: _Watch) -> None:
    """Every line to the log; fedge's to the console; refusals, activation and lost connections to ``watch``.

    Helpers the SuperNode spawns (its SuperExec) may hold the pipe open after it exits, so
    this runs beside the wait instead of reading to end-of-file.
    """
    with flower_log:
        for line in stream:
            _echo_line(line, flower_log, options, state, watch)


def _echo_line(line: str, flower_log: IO[str], options: DeviceOptions, state: Path, watch: _Watch) -> None:
    """One line of the SuperNode's output: see :func:`_echo`."""
    flower_log.write(line)
    flower_log.flush()
    shown = console_line(line, verbose=options.verbose)
    if shown is not None:
        sink = _ECHO[0] if _ECHO else sys.stdout
        sink.write(shown)
        sink.flush()
    watch.refusals.extend(why for code, why in REFUSED.items() if code in line)
    if activated := ACTIVATED.search(line):
        remember_session(state, options.key, int(activated.group(1)))
        watch.activated.set()
        if not _ECHO:
            print(f"joined the coordinator as node {activated.group(1)}", flush=True)
    if LOST in line:
        watch.lost_since = watch.lost_since or time.monotonic()
    elif any(sign in line for sign in REGAINED):
        watch.lost_since = None


def _wait_supernode(process: subprocess.Popen[str], options: DeviceOptions, state: Path, watch: _Watch) -> bool:
    """Wait for the SuperNode to end; stop it once the coordinator stayed unreachable ``offline_limit_s``.

    Returns True when fedge stopped it for that reason. Flower's SuperNode itself retries a
    lost coordinator forever; its "Connection attempt failed" lines start the clock and a
    TCP connection that fails at the limit confirms it.
    """
    host, port = split_address(options.coordinator)
    while True:
        try:
            process.wait(timeout=1.0)
            return False
        except subprocess.TimeoutExpired:
            pass
        lost = watch.lost_since
        if lost is not None and time.monotonic() - lost > options.offline_limit_s and not _reachable(host, port):
            _divert_echo(state / "last-stop.log")  # its shutdown output is noise from an orderly stop
            process.terminate()
            process.wait()
            return True


def _reachable(host: str, port: int) -> bool:
    """Whether a TCP connection to ``host:port`` opens now."""
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def _stop_supernode(state: Path, grace_s: float = 10.0) -> None:
    """SIGTERM the SuperNode and every Flower process of this device's ``FLWR_HOME``; SIGKILL after ``grace_s``."""
    from fedge.process import stop_processes  # noqa: PLC0415

    stop_processes((state / "flwr-home").resolve(), list(_SUPERNODE), grace_s)
