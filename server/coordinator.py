"""``fedge coordinator start``: Flower's SuperLink, secured, running fedge's ServerApp.

fedge does not carry messages itself: Flower's SuperLink does. This module starts it
(through :mod:`fedge.server.superlink`, which keeps Flower's Control and runtime APIs off
the address devices use) with TLS and SuperNode authentication on by default, registers
the known device keys, and starts a run of ``fedge.server.app:app`` with ``flwr run``.
Beside it, :class:`fedge.server.publish.BundleService` serves the published bundles
(``STATE_DIR/published``) to authenticated devices, on ``bundle_port`` (default: the device
port + 1), with the same TLS certificate and the same registered device keys.

Threat model: TLS (certificates from ``fedge keys init``) stops eavesdroppers and
impostor coordinators; SuperNode authentication admits only devices whose
public keys the operator registered. The device address serves only the Fleet API;
the Control API (register devices, start runs) answers only on a loopback port and
only to the operator token kept 0600 in the state directory. ``insecure=True`` turns
TLS and device authentication off and is announced on every start (the Control API
stays operator-only). The SuperLink never installs packages at run time (runtime
dependency installation is off) and Flower's telemetry and update checks are off.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import secrets
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from fedge import knobs
from fedge.config import DEFAULTS, Scalar, resolve_run_config
from fedge.edge.graph_cache import GRAPH_CACHE_ENV
from fedge.edge.signing import ensure_private_dir
from fedge.errors import ConfigError, FedgeError
from fedge.files import open_private_append
from fedge.process import (
    COORDINATOR_SUPEREXEC_POLL_S,
    flower_bin,
    flower_env,
    processes_of,
    signal_processes,
    stop_processes,
)
from fedge.server.fleet_link import FleetLink
from fedge.server.pki import CoordinatorKeys
from fedge.server.rejoins import REVOKED_ENV, revoked_nodes

log = logging.getLogger("fedge.server.coordinator")

PRIVATE_UMASK = 0o077  # what the SuperLink and the run create (database, WAL, logs, run files): its user's only
NAMES_ENV = "FEDGE_DEVICE_NAMES"  # the ServerApp finds the node id -> device name map here
# One call to the SuperLink's Control API (loopback, operator token) that lists its nodes and, with
# "sync", makes them follow the allow-list KEYS/devices/*.pub: a key not registered yet is registered,
# a node whose key left the directory is unregistered (revoked). Each node is named by the registered
# key file it matches: names derive from the operator's keys, never from the device.
CONNECTION = "fedge"
CLEAN_STOP = "last-stop.json"  # in STATE_DIR and RUN_DIR: a coordinator stopped by a signal, mid-run, wrote it


def record_clean_stop(directories: list[Path], signal_name: str) -> None:
    """Note in each of ``directories`` that this coordinator stopped on ``signal_name`` with its run unfinished.

    The next start stops that run (its devices would otherwise wait on it) and says it was
    stopped, instead of guessing that the coordinator crashed or was killed. The record goes
    to the state directory and to the run directory, which a backup keeps
    (``docs/operator.md`` backs up the database and ``runs/``, not the whole state).
    """
    from fedge.files import write_bytes_atomic

    record = {"signal": signal_name, "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    for directory in directories:
        if directory.is_dir():
            write_bytes_atomic(directory / CLEAN_STOP, (json.dumps(record) + "\n").encode())


def _previous_stop(directories: list[Path]) -> str:
    """How the previous coordinator ended, for the line about its unfinished run.

    The records are removed as they are read (at every start), so a later crash is not
    taken for this stop.
    """
    how = "it crashed or was killed"
    for path in (directory / CLEAN_STOP for directory in directories):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            path.unlink()
            how = f"it was stopped by {record['signal']} at {record['at']}"
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return how


def allow_list(paths: list[Path], *, warned: set[str]) -> dict[str, str]:
    """``{PEM public key: device name}`` of the device key files at ``paths`` (the SuperLink's allow-list).

    A file removed since ``paths`` was listed (the operator revoking that device right now) is
    left out, as it will be at the next sync: before, Flower's key loader ran in the sync's
    subprocess and the sync failed with its ``ClickException: Public key file ... does not
    exist``. A file that is not an OpenSSH ECDSA key on a NIST curve is left out with one
    warning (once per name, ``warned`` remembers) naming the file and the fix.
    """
    from cryptography.hazmat.primitives.asymmetric import ec
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes, uses_nist_ec_curve

    allowed: dict[str, str] = {}
    for path in paths:
        try:
            key = serialization.load_ssh_public_key(path.read_bytes())
        except FileNotFoundError:
            continue  # revoked while this sync ran
        except (OSError, ValueError, UnsupportedAlgorithm) as exc:
            key, why = None, str(exc) or type(exc).__name__
        else:
            why = "not an ECDSA key on a NIST curve"
        if isinstance(key, ec.EllipticCurvePublicKey) and uses_nist_ec_curve(key):
            allowed[public_key_to_bytes(key).decode()] = path.stem
        elif f"bad:{path.stem}" not in warned:
            warned.add(f"bad:{path.stem}")
            print(f"WARNING: device key file {path} is not a device key ({why}); that device cannot join: "
                  f"replace it with the .pub of `fedge keys add-device {path.stem}`", file=sys.stderr, flush=True)
    return allowed
INSECURE_WARNING = (
    "WARNING: INSECURE MODE. TLS and device authentication are OFF: anyone on the network can read "
    "model updates, impersonate this coordinator, and join as a device. Use only on a trusted test network."
)


def check_coordinator_keys(keys: CoordinatorKeys) -> None:
    """Refuse missing, expired, not-yet-valid or mismatched TLS files, naming the fix."""
    for path in (keys.ca_cert, keys.cert, keys.key):
        if not path.exists():
            raise ConfigError(f"{path} is missing; create keys with `fedge keys init {keys.directory}` "
                              "(or pass --insecure for a throwaway test)")
    ca = x509.load_pem_x509_certificate(keys.ca_cert.read_bytes())
    cert = x509.load_pem_x509_certificate(keys.cert.read_bytes())
    now = dt.datetime.now(dt.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise ConfigError(f"{keys.cert} is valid only from {cert.not_valid_before_utc:%Y-%m-%d} to "
                          f"{cert.not_valid_after_utc:%Y-%m-%d}; renew it with `fedge keys init --force`")
    key = serialization.load_pem_private_key(keys.key.read_bytes(), password=None)
    der, spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(der, spki) != cert.public_key().public_bytes(der, spki):
        raise ConfigError(f"{keys.key} does not belong to {keys.cert}; "
                          "regenerate both with `fedge keys init --force`")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:  # any of these means "not signed by our CA"
        raise ConfigError(f"{keys.cert} is not signed by {keys.ca_cert} ({exc}); regenerate with "
                          "`fedge keys init --force`") from None


@dataclass
class Coordinator:
    """One SuperLink plus the fedge run it serves.

    Attributes
    ----------
    state_dir : Path
        Holds the SuperLink database (registrations survive restarts), Flower's
        home, the generated app description and logs.
    keys : CoordinatorKeys | None
        TLS and device keys; ``None`` only in insecure mode.
    """

    state_dir: Path
    keys: CoordinatorKeys | None
    host: str = "127.0.0.1"
    port: int = 9095
    control_port: int = 0  # the operator's loopback port; 0: a free one, chosen at start
    bundle_port: int | None = None  # the bundle service's port; None: port + 1 (skipped if busy); 0: a free one
    run_dir: Path | None = None  # the run this start goes on with (a stop record of the last coordinator may be there)
    superlink: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    runner: subprocess.Popen[str] | None = field(default=None, repr=False)  # `flwr run --stream`
    bundles: Any = field(default=None, repr=False)  # the running BundleService, if any
    stopped: bool = field(default=False, init=False, repr=False)  # stop() was called: the SuperLink is down on purpose
    fleet: FleetStatus | None = field(default=None, init=False, repr=False)  # the last look at the devices
    fleet_link: FleetLink | None = field(default=None, init=False, repr=False)  # the device looks' helper process
    _warned: set[str] = field(default_factory=set, init=False, repr=False)  # revoked keys already reported

    @property
    def insecure(self) -> bool:  # noqa: D102
        return self.keys is None

    @property
    def address(self) -> str:
        """Where devices connect (Fleet API only)."""
        return f"{self.host}:{self.port}"

    @property
    def control_address(self) -> str:
        """Where the operator's ``flwr`` CLI connects (loopback, token required)."""
        return f"127.0.0.1:{self.control_port}"

    @property
    def published(self) -> Path:
        """Where this coordinator's published bundles live (``STATE_DIR/published``, kept across runs)."""
        from fedge.server.publish import published_dir

        return published_dir(self.state_dir)

    def env(self) -> dict[str, str]:
        """Environment of every Flower process this coordinator starts.

        ``FEDGE_PUBLISH_DIR`` tells the ServerApp (a process the SuperLink starts, which
        inherits this environment) where to publish the bundles it signs; ``FEDGE_GRAPH_CACHE``
        where it keeps the ONNX translations of its training graphs (``STATE_DIR/graph-cache``
        unless the environment names one), so a restart, a resume or the next run does not
        translate the same graph again (:mod:`fedge.edge.graph_cache`).
        """
        from fedge.server.publish import PUBLISH_ENV

        return {**flower_env(self.flwr_home, superexec_poll_s=COORDINATOR_SUPEREXEC_POLL_S),
                PUBLISH_ENV: str(self.published.resolve()), NAMES_ENV: str(self.names_file.resolve()),
                REVOKED_ENV: str(self.revoked_file.resolve()),
                GRAPH_CACHE_ENV: os.environ.get(GRAPH_CACHE_ENV) or str((self.state_dir / "graph-cache").resolve())}

    @property
    def revoked_file(self) -> Path:
        """Node ids of revoked devices (``STATE_DIR/revoked-nodes.json``): a round stops waiting for them."""
        return self.state_dir / "revoked-nodes.json"

    @property
    def names_file(self) -> Path:
        """``{node id: device name}`` of the registered devices (``STATE_DIR/device-names.json``)."""
        return self.state_dir / "device-names.json"

    @property
    def flwr_home(self) -> Path:
        """Flower's home for this coordinator (absolute: every Flower process it starts is found by it)."""
        return (self.state_dir / "flwr-home").resolve()

    def start(self) -> None:
        """Start the SuperLink and wait until it answers; register device keys.

        Threat model: the state directory holds the SuperLink's database (messages in flight,
        registered keys), its WAL, the logs, the operator token and the published bundles.
        It and ``published/`` are made 0700 whatever the umask (an existing one open to others
        is tightened), the logs 0600, and the SuperLink runs under umask 077, so that every file
        it creates (``superlink.db`` and its ``-wal``/``-shm``) is its user's only.
        """
        self._private_state()
        if self.insecure:
            print(INSECURE_WARNING, file=sys.stderr, flush=True)
        else:
            assert self.keys is not None
            check_coordinator_keys(self.keys)
        bundle_port = self.port + 1 if self.bundle_port is None else self.bundle_port
        if not self.control_port:
            self.control_port = _free_loopback_port()
            while self.control_port == bundle_port:
                self.control_port = _free_loopback_port()
        if self.control_port == self.port:
            raise ConfigError(f"--control-port {self.control_port} is the device port; give the operator's "
                              "Control API a port of its own (or 0 for a free one)")
        if bundle_port and bundle_port in (self.port, self.control_port):
            raise ConfigError(f"--bundle-port {bundle_port} is taken by the coordinator's device or control port; "
                              "give the bundle service a port of its own (or 0 for a free one)")
        self._write_flower_config()
        logs = open_private_append(self.state_dir / "superlink.log")
        # A session of its own: a terminal's Ctrl-C reaches fedge only, which stops everything in order
        self.superlink = subprocess.Popen(self._superlink_command(), env=self.env(), umask=PRIVATE_UMASK,
                                          stdout=logs, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_healthy(timeout=60)
        self.register_devices(stop_stale_runs=True)
        self._start_bundles(bundle_port)

    def _private_state(self) -> None:
        """``STATE_DIR`` and ``published/`` 0700 (one an older fedge left readable too), its database 0600."""
        for directory in (self.state_dir, self.published):
            ensure_private_dir(directory)
            os.chmod(directory, 0o700)
        for name in ("superlink.db", "superlink.db-wal", "superlink.db-shm"):
            path = self.state_dir / name
            if path.exists():
                os.chmod(path, 0o600)

    def _start_bundles(self, port: int) -> None:
        """Serve ``STATE_DIR/published`` to registered devices (a busy default port only warns)."""
        from fedge.server.publish import BundleService

        service = BundleService(self.published, self.keys, host=self.host, port=port,
                                revoked=self.fleet.revoked_keys if self.fleet else ())
        try:
            service.start()
        except ConfigError as exc:
            if self.bundle_port is not None:
                raise
            print(f"WARNING: bundles are not served: {exc}", file=sys.stderr, flush=True)
            return
        self.bundles = service

    @property
    def bundles_url(self) -> str | None:
        """Where devices pull bundles (``https://HOST:PORT``), or None when not served."""
        return None if self.bundles is None else str(self.bundles.url)

    def _superlink_command(self) -> list[str]:
        command = [sys.executable, "-m", "fedge.server.superlink", "--operator-port", str(self.control_port),
                   "--operator-token-file", str(self._operator_token().resolve()),
                   "--host", self.host, "--port", str(self.port), "--isolation", "subprocess",
                   "--disable-runtime-dependency-installation",
                   "--database", str((self.state_dir / "superlink.db").resolve())]
        if self.keys is None:
            return [*command, "--insecure"]
        return [*command, "--ssl-ca-certfile", str(self.keys.ca_cert.resolve()),
                "--ssl-certfile", str(self.keys.cert.resolve()),
                "--ssl-keyfile", str(self.keys.key.resolve()), "--enable-supernode-auth"]

    def _operator_token(self) -> Path:
        """The Control API's bearer token (0600, made once per state directory)."""
        path = self.state_dir / "operator-token"
        if not path.exists():
            from fedge.server.pki import write_private

            write_private(path, secrets.token_urlsafe(32).encode(), force=False)
        elif os.name == "posix" and path.stat().st_mode & 0o077:
            raise ConfigError(f"{path} is readable by others (mode {path.stat().st_mode & 0o777:o}): anyone who "
                              "read it controls this coordinator; delete it (a new one is made at start) or chmod 600")
        return path

    def _write_flower_config(self) -> None:
        """Point the operator's ``flwr`` CLI (this FLWR_HOME) at the loopback Control API, with the token."""
        from flwr.cli.constant import ACCESS_TOKEN_STORE_KEY, AUTHN_TYPE_STORE_KEY, REFRESH_TOKEN_STORE_KEY
        from flwr.supercore.credential_store.file_credential_store import FileCredentialStore

        from fedge.server.superlink import AUTHN_TYPE

        home = self.flwr_home
        home.mkdir(parents=True, exist_ok=True)
        os.chmod(home, 0o700)
        entry = [f'[superlink.{CONNECTION}]', f'address = "{self.control_address}"']
        entry.append("insecure = true" if self.keys is None
                     else f'root-certificates = "{self.keys.ca_cert.resolve()}"')
        header = f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        (home / "config.toml").write_text(header + "\n".join(entry) + "\n")
        store, token = FileCredentialStore(home / "credentials.yaml"), self._operator_token().read_bytes().strip()
        store.set(AUTHN_TYPE_STORE_KEY % self.control_address, AUTHN_TYPE.encode())
        store.set(ACCESS_TOKEN_STORE_KEY % self.control_address, token)
        store.set(REFRESH_TOKEN_STORE_KEY % self.control_address, b"none")  # never honoured by the SuperLink

    def _wait_healthy(self, timeout: float) -> None:
        scheme = "http" if self.keys is None else "https"
        context = None if self.keys is None else ssl.create_default_context(cafile=str(self.keys.ca_cert))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.superlink is not None and self.superlink.poll() is not None:
                raise FedgeError(f"the SuperLink exited with status {self.superlink.returncode}; "
                                 f"see {self.state_dir / 'superlink.log'}")
            try:
                with urllib.request.urlopen(f"{scheme}://{self.address}/health", timeout=2,
                                            context=context):
                    return
            except OSError:
                time.sleep(0.3)
        raise FedgeError(f"the SuperLink did not answer on {self.address} within {timeout:.0f} s; "
                         f"see {self.state_dir / 'superlink.log'}")

    def register_devices(self, *, stop_stale_runs: bool = False) -> list[str]:
        """Register every ``devices/*.pub`` with the SuperLink and unregister devices whose key was removed.

        Returns the names of the registered devices (a key revoked before is not one of them).
        ``stop_stale_runs``: see :meth:`sync_devices` (done at start, in insecure mode too).
        """
        if self.keys is None and not stop_stale_runs:
            return []
        fleet = self.sync_devices(stop_stale_runs=stop_stale_runs, announce=False)  # the line below names them all
        if self.keys is None:
            return []
        registered = [p.stem for p in self.keys.device_public_keys() if p.stem not in fleet.revoked_keys]
        log.info("registered devices: %s", ", ".join(registered) or "none")
        return registered

    def sync_devices(self, *, stop_stale_runs: bool = False, announce: bool = True) -> FleetStatus:
        """One look at the SuperLink's devices, which follow the allow-list ``KEYS/devices/*.pub``.

        A key added to the directory is registered, a node whose key left it is unregistered
        (revoked: refused at once, even mid-run), and ``device-names.json`` is rewritten. In
        insecure mode the devices are only listed. Runs at start and, through :class:`FleetWatch`,
        every few seconds while the coordinator runs.

        ``stop_stale_runs`` (at start, before this coordinator's run exists): stop every run the
        SuperLink's database still holds as not finished. Only a coordinator that crashed or was
        killed leaves one; its stored instructions would otherwise be delivered to devices that
        reconnect, which then work on a run nobody serves until Flower's heartbeat ends it
        (about 45 s here), before they take the new run's first round.

        ``announce``: log the keys this look registered (``devices registered: ...``); off at start,
        where :meth:`register_devices` names every registered device in one line.

        Raises
        ------
        FedgeError
            The Control API did not answer, or a key could not be registered.
        """
        allowed = {} if self.keys is None else allow_list(self.keys.device_public_keys(), warned=self._warned)
        mode = ("list" if self.keys is None else "sync") + (",stop-stale" if stop_stale_runs else "")
        if self.fleet_link is None:
            self.fleet_link = FleetLink(self.env, self.state_dir / "fleet-link.log")
        out = self.fleet_link.ask(connection=CONNECTION, modes=mode.split(","), keys=allowed)
        if out["failed"]:
            name, why = next(iter(out["failed"].items()))
            raise FedgeError(f"registering device key {name} failed: {why[-300:]}")
        how = _previous_stop([self.state_dir, *([self.run_dir] if self.run_dir else [])]) if stop_stale_runs else ""
        for run_id in out["stopped_runs"]:
            print(f"stopped run {run_id}, left unfinished by an earlier coordinator ({how}); "
                  "its devices take this coordinator's run at once", flush=True)
        known = self.names()
        for node_id in out["unregistered"]:
            print(f"device {known.get(node_id, '?')} (node {node_id}) unregistered: its key is no longer in "
                  f"{self.keys.devices if self.keys else 'KEYS/devices'}; it is refused from now on", flush=True)
        for name in sorted(set(out["revoked_keys"]) - self._warned):
            print(f"WARNING: device key {name} was revoked (its node is unregistered) and cannot join again; "
                  f"make a new one (`fedge keys add-device NEW_NAME`) and delete this one", file=sys.stderr, flush=True)
        self._warned.update(out["revoked_keys"])
        if out["registered"] and announce:
            log.info("devices registered: %s", ", ".join(out["registered"]))
        names = {**known, **{n["node_id"]: n["name"] for n in out["nodes"] if n["name"]}}
        if names != known or not self.names_file.exists():
            from fedge.files import write_bytes_atomic

            write_bytes_atomic(self.names_file, (json.dumps(names, indent=2, sort_keys=True) + "\n").encode())
        self._write_revoked(sorted(n["node_id"] for n in out["nodes"] if n["status"] == "unregistered"))
        self.fleet = FleetStatus(nodes=out["nodes"], revoked_keys=set(out["revoked_keys"]))
        if self.bundles is not None:  # the bundle service admits the devices the SuperLink admits
            self.bundles.follow(revoked=self.fleet.revoked_keys)
        return self.fleet

    def _write_revoked(self, nodes: list[str]) -> None:
        """Rewrite :attr:`revoked_file` when the SuperLink's unregistered nodes changed."""
        from fedge.files import write_bytes_atomic

        if {str(n) for n in revoked_nodes(str(self.revoked_file))} != set(nodes) or not self.revoked_file.exists():
            write_bytes_atomic(self.revoked_file, (json.dumps(nodes) + "\n").encode())

    def names(self) -> dict[str, str]:
        """``{node id (a string): device name}`` as written at start ({} in insecure mode)."""
        return read_names(self.names_file)

    def run(self, run_config: Mapping[str, Scalar], console: IO[str] | None = None) -> RunOutput:
        """Start fedge's ServerApp on the SuperLink with ``run_config``; stream its log until it ends.

        The log goes whole to ``STATE_DIR/run.log``; the console gets it without tracebacks and
        Flower's exit banners (the error they report is kept in the returned :class:`RunOutput`).
        Until the ServerApp says itself how many devices its round waits for (it starts, builds
        the task and exports the training graph first: tens of seconds on a loaded machine), this
        process says it (:class:`DeviceWait`).
        """
        app_dir = self._app_description()
        overrides = " ".join(f"{key}={_toml(value)}" for key, value in run_config.items())
        command = [flower_bin("flwr"), "run", str(app_dir), CONNECTION, "--run-config", overrides, "--stream"]
        with open_private_append(self.state_dir / "run.log", text=True) as log_file:
            output = RunOutput(console or sys.stdout, log_file)
            waiting = DeviceWait(self, resolve_run_config(dict(run_config)), output).start()
            try:
                self.runner = subprocess.Popen(command, env=self.env(), umask=PRIVATE_UMASK,
                                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                               bufsize=1, start_new_session=True)
                assert self.runner.stdout is not None
                for line in self.runner.stdout:
                    output.feed(line)
                output.returncode = self.runner.wait()
            finally:
                waiting.stop()
        return output

    def run_status(self, run_id: str | None) -> str:
        """How the SuperLink says run ``run_id`` ended (``finished:failed (No heartbeat received ...)``), or ''."""
        if run_id is None:
            return ""
        try:
            done = self._flwr("ls", CONNECTION, "--run-id", run_id, "--format", "json")
            run = json.loads(done.stdout)["runs"][0]
        except (subprocess.TimeoutExpired, OSError, json.JSONDecodeError, KeyError, IndexError, TypeError):
            return ""
        details = str(run.get("status-details") or "")
        return str(run.get("status", "?")) + (f" ({details})" if details and details != "N/A" else "")

    def end_lost_server_app(self, grace_s: float = 5.0) -> int:
        """Stop what is left of a ServerApp whose run the SuperLink ended; returns how many were stopped.

        Its task token is revoked (nothing it sends counts), but a process the machine froze may
        wake up and write to the run directory: it must be gone before the run goes on.
        """
        lost = processes_of(self.flwr_home, "flwr-serverapp")
        if lost:
            signal_processes(self.flwr_home, term_s=grace_s, kill_s=grace_s, program="flwr-serverapp")
        return len(lost)

    def _app_description(self) -> Path:
        """A Flower app directory whose components are the installed fedge's apps.

        ``flwr run`` ships the directory's pyproject (a FAB); the code itself is the
        fedge installed on the coordinator and the devices.
        """
        app_dir = self.state_dir / "app"
        app_dir.mkdir(exist_ok=True)
        config_lines = "\n".join(f"{key} = {_toml(value)}" for key, value in DEFAULTS.items())
        (app_dir / "pyproject.toml").write_text(
            '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n\n'
            '[project]\nname = "fedge-run"\nversion = "1.0.0"\n'
            'description = "A fedge run: fedge\'s ServerApp and ClientApp, as installed on the coordinator '
            'and the devices"\nlicense = "Apache-2.0"\ndependencies = []\n\n'
            '[tool.flwr.app]\npublisher = "fedge"\n\n'
            '[tool.flwr.app.components]\nserverapp = "fedge.server.app:app"\n'
            'clientapp = "fedge.clients.app:app"\n\n'
            f"[tool.flwr.app.config]\n{config_lines}\n")
        return app_dir

    def devices(self) -> list[dict[str, Any]]:
        """The SuperLink's view of devices (``flwr supernode list``)."""
        done = self._flwr("supernode", "list", CONNECTION, "--format", "json")
        try:
            payload = json.loads(done.stdout)
        except json.JSONDecodeError:
            raise FedgeError(f"cannot list devices: {(done.stdout + done.stderr).strip()[-300:]}") from None
        return list(payload.get("nodes", payload if isinstance(payload, list) else []))

    def _flwr(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([flower_bin("flwr"), *args], env=self.env(), capture_output=True,
                              text=True, timeout=120, check=False)

    def stop(self) -> None:
        """Stop the run, the bundle service, the SuperLink and every Flower process they started.

        SIGTERM first (Flower's processes shut down cleanly), SIGKILL what is left after 10 s;
        Flower's helpers run in sessions of their own and are found by their ``FLWR_HOME``.
        Completed rounds are already checkpointed in the run directory.
        """
        self.stopped = True
        if self.bundles is not None:
            self.bundles.stop()
            self.bundles = None
        if self.fleet_link is not None:
            self.fleet_link.close()
        first = [p for p in (self.runner, self.superlink) if p is not None]
        stop_processes(self.flwr_home, first)


@dataclass
class FleetStatus:
    """The SuperLink's devices at one look: ``nodes`` as ``{"node_id", "status", "name"}``."""

    nodes: list[dict[str, str]]
    revoked_keys: set[str] = field(default_factory=set)

    def count(self, *statuses: str) -> int:
        """How many nodes have one of ``statuses`` (``online``, ``offline``, ``registered``, ``unregistered``)."""
        return sum(node["status"] in statuses for node in self.nodes)


class FleetWatch:
    """Keeps the SuperLink's devices in step with ``KEYS/devices`` and their counts fresh for ``/metrics``.

    Every ``interval_s`` seconds (a thread) it calls :meth:`Coordinator.sync_devices`: a key added
    with ``fedge keys add-device`` joins without a restart, a key removed is revoked within one
    interval. :meth:`live` is what the health and metrics endpoint reads (never blocks on the SuperLink).
    """

    def __init__(self, coordinator: Coordinator, interval_s: float = 10.0) -> None:
        self.coordinator, self.interval_s = coordinator, interval_s
        self.outcome = "running"  # "finished" or "failed" once the run is over
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def start(self) -> FleetWatch:  # noqa: D102
        self._thread = threading.Thread(target=self._follow, name="fedge-fleet-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:  # noqa: D102
        self._stop.set()

    def _follow(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        """One sync; a failure is logged once (until the next success) and keeps the last counts.

        A look that fails because the coordinator is stopping (its SuperLink and the look's helper
        are being stopped) is no failure: nothing is logged.
        """
        if self.coordinator.stopped or self.coordinator.superlink is None \
                or self.coordinator.superlink.poll() is not None:
            return
        try:
            self.coordinator.sync_devices()
            self._failing = False
        except (FedgeError, OSError, subprocess.SubprocessError) as exc:
            superlink = self.coordinator.superlink
            if self._stop.is_set() or self.coordinator.stopped or superlink is None or superlink.poll() is not None:
                return  # the coordinator is stopping (it ends the look's helper): nothing to warn about
            if not self._failing:
                log.warning("device list unavailable: %s", exc)
            self._failing = True

    def live(self) -> dict[str, Any]:
        """The coordinator's state for ``/health`` and ``/metrics``.

        ``superlink``: ``starting``, ``up``, ``down`` (exited on its own: unhealthy) or ``stopped``
        (the run is over and the coordinator stopped it); device counts are ``None`` until the
        first look.
        """
        superlink = self.coordinator.superlink
        state = "stopped" if self.coordinator.stopped else "starting" if superlink is None else \
            "up" if superlink.poll() is None else "down"
        status = self.coordinator.fleet
        return {"superlink": state, "run": self.outcome,
                "devices_online": None if status is None else status.count("online"),
                "devices_registered": None if status is None else status.count("online", "offline", "registered")}


class DeviceWait:
    """The coordinator's own ``waiting for devices: K connected of N needed`` lines, from the run's start.

    The ServerApp logs such a line every 10 s while its round waits, but only once it has
    started, built the task and the model and exported the training graph: 15 s on a quiet
    machine, 50 s and more on a loaded one, with nothing on the console meanwhile. This says it
    at once and every ``every_s`` seconds (counts from :attr:`Coordinator.fleet`, which
    :class:`FleetWatch` refreshes) until the ServerApp says it itself, enough are connected, or
    the run ends. With ``gateways = true`` the nodes are gateways, and the line says so.
    """

    every_s = 10.0

    def __init__(self, coordinator: Coordinator, config: Mapping[str, Any], output: RunOutput) -> None:
        self.coordinator, self.output = coordinator, output
        self.needed = int(config[knobs.CLIENTS_PER_ROUND])
        self.noun = "gateways" if config.get(knobs.GATEWAYS) else "devices"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def connected(self) -> int | None:
        """Nodes online at the last look (None before the first)."""
        fleet = self.coordinator.fleet
        return None if fleet is None else fleet.count("online")

    def say(self) -> bool:
        """One line, unless the wait is over; False once it is."""
        connected = self.connected()
        if self.output.waits_itself.is_set() or (connected is not None and connected >= self.needed):
            return False
        count = "?" if connected is None else str(connected)
        self.output.say(f"waiting for {self.noun}: {count} connected of {self.needed} needed; "
                        "rounds start once they have connected\n")
        return True

    def start(self) -> DeviceWait:  # noqa: D102
        if self.say():
            self._thread = threading.Thread(target=self._follow, name="fedge-device-wait", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:  # noqa: D102
        self._stop.set()

    def _follow(self) -> None:
        while not self._stop.wait(self.every_s) and self.say():
            pass


def read_names(path: Path) -> dict[str, str]:
    """A ``device-names.json`` ({} when missing or unreadable)."""
    try:
        names = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {str(k): str(v) for k, v in names.items()} if isinstance(names, dict) else {}


ANSI = re.compile(r"\x1b\[[0-9;]*m")
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Mismatch|Rejected|Refused|Exit"
                            r"|Interrupt))(?::\s*(.*))?$")


class RunOutput:
    """A run's streamed log: all of it to ``log``, to ``console`` without tracebacks and exit banners.

    Attributes
    ----------
    error : str | None
        The last exception the ServerApp reported (``ConfigError: ...``), one line.
    exit_code : int | None
        Flower's exit code for the ServerApp when it reported an error (``Exit Code: 201``).
    """

    def __init__(self, console: IO[str], log: IO[str]) -> None:
        self.console, self.log = console, log
        self.error: str | None = None
        self.exit_code: int | None = None
        self.returncode: int | None = None
        self.run_id: str | None = None  # the SuperLink's id for the run (``flwr run`` names it at start)
        self.waits_itself = threading.Event()  # the ServerApp logged its own "waiting for devices/gateways" line
        self._mode = ""  # "traceback" or "banner" while such lines are held back from the console
        self._lock = threading.Lock()  # the run's lines and :class:`DeviceWait`'s share the console

    def say(self, line: str) -> None:
        """Write one line of fedge's own to the console (not to the run's log)."""
        with self._lock:
            self.console.write(line)
            self.console.flush()

    def feed(self, line: str) -> None:  # noqa: D102
        self.log.write(line)
        self.log.flush()
        text = ANSI.sub("", line).rstrip()
        started = re.match(r"Successfully started run (\d+)\b", text)  # (" in federation X" may follow)
        if started:
            self.run_id = started.group(1)
        if self._mode == "traceback":
            found = EXCEPTION_LINE.match(text)
            if found:
                self.error = f"{found.group(1)}: {found.group(2) or ''}".strip().rstrip(":")
                self._mode = ""
            return
        if "Traceback (most recent call last)" in text:
            self._mode = "traceback"
            return
        code = re.search(r"Exit Code: (\d+)", text)
        if code:
            self.exit_code, self._mode = int(code.group(1)), "banner"
            return
        if self._mode == "banner" or "raised an exception" in text:
            if "For more information, visit" in text:
                self._mode = ""
            return
        if "waiting for devices" in text or "waiting for gateways" in text:  # under gateways = true, the latter
            self.waits_itself.set()
        self.say(line)


def _free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _toml(value: Scalar) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)
