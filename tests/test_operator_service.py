"""Issue 17, operating a real fleet: the coordinator's /health and /metrics without the dashboard, and the
operator page's commands (docs/operator.md) run as written: revoke and rotate device keys, back up and
restore the coordinator, the systemd units' command lines."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from fedge.cli.main import build_parser, main
from fedge.errors import ConfigError
from fedge.server.dashboard import create_service_app
from fedge.server.pki import add_device, init_keys
from fedge.simulation.loopback import FEDGE, LoopbackFederation, free_port

DOCS = Path(__file__).resolve().parents[1] / "docs" / "operator.md"
FAST = "model='mlp' local-epochs=1 export-onnx=false round-timeout=900.0 runtime='torch'"
# a device is stopped or revoked mid-run: a round that asked it ends at this timeout
LEAVING = FAST.replace("round-timeout=900.0", "round-timeout=120.0")


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"num-rounds": 5}))
    rows = [{"round": 0, "headline": 0.1, "wall_time_s": 0.0},
            {"round": 1, "headline": 0.5, "participants": 2, "bytes_up": 100, "bytes_down": 300, "wall_time_s": 4.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "devices.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"round": 1, "node_id": "11", "status": "ok"}, {"round": 1, "node_id": "12", "status": "ok"},
        {"round": 1, "node_id": "13", "status": "rejected", "reason": 'array "w" contains NaN'}]))
    return run


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"{name} missing from:\n{text}"
    return float(found.group(1))


def test_the_service_app_serves_health_and_metrics_only_under_the_dashboards_rules(tmp_path: Path) -> None:
    # Prepare: a run directory and a coordinator's live state (SuperLink up, 2 of 3 devices online)
    run = _run_dir(tmp_path)
    live = {"superlink": "up", "run": "running", "devices_online": 2, "devices_registered": 3}
    client = TestClient(create_service_app(run, live=lambda: live), base_url="http://127.0.0.1:9097")
    gated = TestClient(create_service_app(run, host="0.0.0.0", token="s" * 32, live=lambda: live),
                       base_url="http://10.0.0.7:9097")
    # Execute
    metrics = client.get("/metrics").text
    health = client.get("/health")
    # Assert: the run's numbers, devices online from the coordinator, nothing of the dashboard's API
    assert health.status_code == 200
    assert health.json() == {"ok": True, "status": "running", "rounds_done": 1, "superlink": "up",
                             "devices_online": 2}
    assert _metric(metrics, "fedge_rounds_completed") == 1 and _metric(metrics, "fedge_participants") == 2
    assert _metric(metrics, "fedge_devices_online") == 2 and _metric(metrics, "fedge_devices_registered") == 3
    assert _metric(metrics, "fedge_devices_replied_last_round") == 3
    assert _metric(metrics, 'fedge_replies_failed_total{status="rejected",reason="array \\"w\\" contains NaN"}') == 1
    assert _metric(metrics, 'fedge_bytes_total{direction="up"}') == 100
    assert _metric(metrics, "fedge_round_latency_seconds") == 4.0
    assert client.get("/api/summary").status_code == 404 and client.get("/").status_code == 404
    assert client.get("/metrics", headers={"host": "evil.example"}).status_code == 400  # no DNS rebinding
    assert gated.get("/metrics").status_code == 401
    assert gated.get("/metrics", headers={"authorization": "Bearer " + "s" * 32}).status_code == 200
    # Execute: the SuperLink died, then: the run failed
    live["superlink"] = "down"
    down = client.get("/health")
    live.update(superlink="stopped", run="failed")
    failed = client.get("/health")
    # Assert: both unhealthy (503) for a supervisor or load balancer; a stopped SuperLink alone is not
    assert down.status_code == 503 and down.json()["ok"] is False
    assert failed.status_code == 503 and failed.json()["status"] == "failed"
    live["run"] = "finished"
    assert client.get("/health").status_code == 200
    with pytest.raises(ConfigError, match="needs a token: pass --metrics-token-file"):
        create_service_app(run, host="0.0.0.0")


@pytest.fixture
def two_devices(tmp_path: Path) -> Path:
    keys = init_keys(tmp_path / "k")
    for name in ("phone-1", "phone-2"):
        add_device(keys.directory, name)
    return keys.directory


def _start(keys: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["coordinator", "start", "--keys", str(keys), "--state-dir", str(tmp_path / "s"),
            "--port", str(free_port()), "--run-dir", str(tmp_path / "run"), "--clients-per-round", "2", *extra]


@pytest.mark.parametrize(("extra", "message"), [
    (["--metrics-host", "0.0.0.0"], "the metrics endpoint (/health, /metrics) on 0.0.0.0 (not loopback) needs a "
                                    "token: pass --metrics-token-file FILE"),
    (["--metrics-host", "0.0.0.0", "--metrics-token-file", "{short}"], "holds 5 characters; a token needs at least 16"),
    (["--metrics-token-file", "{missing}"], "cannot read --metrics-token-file"),
    (["--metrics-port", "{busy}"], "the metrics endpoint cannot listen on 127.0.0.1:"),
    (["--dashboard", "--dashboard-port", "{busy}"], "the dashboard cannot listen on 127.0.0.1:"),
    (["--restarts", "-1"], "--restarts -1: give how many times a lost run may go on (0: never)"),
])
def test_an_exposed_or_unservable_metrics_endpoint_refuses_the_start(
        two_devices: Path, tmp_path: Path, extra: list[str], message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: a token too short to guess-proof, and a port something else holds
    (tmp_path / "short").write_text("12345\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        values = {"short": str(tmp_path / "short"), "missing": str(tmp_path / "nope"),
                  "busy": str(busy.getsockname()[1])}
        # Execute
        code = main(_start(two_devices, tmp_path, *[a.format(**values) for a in extra]))
    # Assert: exit 2, one line naming the fix, nothing written and no Flower process started
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "s").exists() and not (tmp_path / "run").exists()
    assert not (two_devices / "bundle-signing").exists()


def test_resume_existing_goes_with_a_run_directory(two_devices: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a for a in _start(two_devices, tmp_path) if a not in ("--run-dir", str(tmp_path / "run"))]
    assert main([*argv, "--resume-existing"]) == 2
    assert "--resume-existing goes with --run-dir RUN_DIR" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def _unit_commands() -> list[list[str]]:
    """Every ``ExecStart=`` of the operator page's systemd units, as argv (line continuations joined)."""
    text = DOCS.read_text()
    commands = []
    for block in re.findall(r"```ini\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        commands += [shlex.split(line.split("=", 1)[1]) for line in joined.splitlines()
                     if line.startswith("ExecStart=")]
    return commands


def test_the_systemd_units_command_lines_parse_with_the_real_cli() -> None:
    commands = _unit_commands()
    assert len(commands) >= 2 and all(Path(argv[0]).name == "fedge" for argv in commands)
    parsed = [build_parser().parse_args(argv[1:]) for argv in commands]  # argparse exits on a bad line
    assert {(a.command, getattr(a, "coordinator_command", None) or getattr(a, "gateway_command", None))
            for a in parsed} == {("coordinator", "start"), ("device", None), ("gateway", "start")}
    coordinator = next(a for a in parsed if a.command == "coordinator")
    assert not coordinator.no_metrics and coordinator.metrics_host == "127.0.0.1"  # /metrics on, operator-only


# --------------------------------------------------------------------------- end to end on 127.0.0.1


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _events(fed: LoopbackFederation) -> list[dict[str, Any]]:
    path = fed.run_dir / "devices.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _names(fed: LoopbackFederation, state: Path | None = None) -> dict[str, str]:
    path = (state or fed.root / "state") / "device-names.json"
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[LoopbackFederation]:
    fed = LoopbackFederation(tmp_path, num_devices=3)
    yield fed
    fed.close()


@pytest.mark.slow
@pytest.mark.deployment
def test_metrics_without_the_dashboard_then_a_revoked_and_a_rotated_key(federation: LoopbackFederation) -> None:
    # Prepare: a long run, three devices, two a round; /health and /metrics on a port of their own, no dashboard.
    # dev2 gives up 10 s after it is refused (90 s by default)
    fed, port = federation, free_port()
    fed.start_coordinator("--rounds", "100", "--clients-per-round", "2", "--run-config", LEAVING,
                          "--metrics-port", str(port))
    fed.wait_for(lambda: "coordinator listening" in fed.log("coordinator"), 900, "the coordinator")
    fed.start_device(0)
    fed.start_device(1)
    fed.start_device(2, None, "--max-wait", "10")
    fed.wait_for(lambda: len(fed.rows()) >= 2 and fed.rows()[-1]["participants"] == 2, 900, "a full round")
    # Execute: scrape while no round completes in between, so that the run's records say the same
    for _ in range(30):
        before = fed.rows()
        metrics, (code, health) = _get(f"http://127.0.0.1:{port}/metrics")[1], _get(f"http://127.0.0.1:{port}/health")
        if fed.rows() == before and "fedge_devices_online 3" in metrics:
            break
        time.sleep(1)
    # Assert: rounds, participants and bytes as metrics.jsonl has them; the SuperLink's devices online
    done = [row for row in before if row["round"] > 0]
    assert _metric(metrics, "fedge_rounds_completed") == len(done) and _metric(metrics, "fedge_rounds_total") == 100
    assert _metric(metrics, "fedge_participants") == done[-1]["participants"]
    assert _metric(metrics, "fedge_participants_total") == sum(row["participants"] for row in done)
    assert _metric(metrics, 'fedge_bytes_total{direction="up"}') == sum(row["bytes_up"] for row in done) > 0
    assert _metric(metrics, "fedge_devices_online") == 3 and _metric(metrics, "fedge_devices_registered") == 3
    assert _metric(metrics, "fedge_superlink_up") == 1
    assert code == 200 and json.loads(health) == {"ok": True, "status": "running", "rounds_done": len(done),
                                                  "superlink": "up", "devices_online": 3}
    # Execute: as docs/operator.md says. Revoke dev2 (running); rotate dev1: a new key under a new name,
    # installed on the device (restarted with it), the old key removed
    devices = fed.keys.directory / "devices"
    old_node = {name: node for node, name in _names(fed).items()}
    (devices / "dev2.pub").unlink()
    subprocess.run([FEDGE, "keys", "add-device", "dev1b", "--dir", str(fed.keys.directory)], check=True,
                   capture_output=True)
    assert fed.stop(fed.devices[1]) == 0
    (devices / "dev1.pub").unlink()
    fed.start_device(1, devices / "dev1b.key")
    shutil.copy(fed.root / "dev1.npz", fed.root / "dev3.npz")
    old_key = fed.start_device(3, devices / "dev1.key", "--max-wait", "5")  # the old key, on another device
    revoked_at = len(fed.rows())

    def rotated_round() -> bool:
        ok: dict[int, set[str]] = {}
        for event in _events(fed):
            if event["status"] == "ok":
                ok.setdefault(event["round"], set()).add(event.get("name", ""))
        return any(names == {"dev0", "dev1b"} for names in ok.values())

    fed.wait_for(rotated_round, 900, "a round of dev0 and dev1b")
    # Assert: the coordinator revoked both removed keys; the revoked dev2 and the old key were refused
    log = fed.log("coordinator")
    assert f"device dev2 (node {old_node['dev2']}) unregistered" in log, log
    assert f"device dev1 (node {old_node['dev1']}) unregistered" in log, log
    assert fed.devices[2].wait(600) == 2 and old_key.wait(600) == 2
    for index in (2, 3):
        assert "fedge: error: the coordinator did not activate this device" in fed.log(f"device{index}")
    assert "the SuperNode ended on its own" in fed.log("device2")
    # Assert: the run went on; after the revocation only dev0 and the rotated dev1b replied
    late = [e for e in _events(fed) if e["round"] > revoked_at + 1]
    assert {e.get("name") for e in late} <= {"dev0", "dev1b"}
    assert [row["round"] for row in fed.rows()] == list(range(len(fed.rows())))
    _, metrics = _get(f"http://127.0.0.1:{port}/metrics")
    assert _metric(metrics, "fedge_devices_registered") == 2
    assert fed.coordinator is not None and fed.stop(fed.coordinator) == 0
    for gone in ("state", "device2", "device3"):  # the refused devices left no Flower helper behind either
        assert fed.leftovers(fed.root / gone) == [], gone
    # Assert: after the stop, `coordinator status` still lists the revoked devices as revoked
    status = subprocess.run([FEDGE, "coordinator", "status", "--state-dir", str(fed.root / "state")],
                            capture_output=True, text=True, check=True).stdout
    assert f"device dev2 (node {old_node['dev2']}): revoked" in status, status
    assert f"device dev0 (node {old_node['dev0']}): registered" in status, status


@pytest.mark.slow
@pytest.mark.deployment
def test_backup_and_restore_into_a_fresh_directory_resumes_the_run(tmp_path: Path) -> None:
    # Prepare: a run two devices have completed a round of
    fed = LoopbackFederation(tmp_path / "old", num_devices=2)
    try:
        fed.start_coordinator("--rounds", "100", "--clients-per-round", "2", "--run-config", FAST)
        for index in range(2):
            fed.start_device(index)
        fed.wait_for(lambda: len(fed.rows()) >= 2, 900, "round 1")
        names = _names(fed)
        # Execute: stop the coordinator and back up with the page's command (its paths are this federation's)
        assert fed.coordinator is not None and fed.stop(fed.coordinator) == 0
        backed_up = fed.rows()
        stopped = fed.log("coordinator")  # the hint repeats where the keys and state are and the device port
        assert (f"--resume {fed.run_dir} --keys {fed.keys.directory} --state-dir {fed.root / 'state'} "
                f"--port {fed.port}`") in stopped, stopped
        command = _doc_command("tar czf").replace("fedge-backup-$(date +%F).tgz", str(tmp_path / "backup.tgz"))
        command = command.replace("coordinator-state/", "state/").replace("runs/", "run/")
        subprocess.run(["bash", "-c", command], cwd=fed.root, check=True)
        # Execute: the old host is gone; restore into a fresh directory and start as the systemd unit does
        for name in ("keys", "state", "run"):
            shutil.rmtree(fed.root / name)
        new = tmp_path / "new"
        new.mkdir()
        subprocess.run(["tar", "xzf", str(tmp_path / "backup.tgz")], cwd=new, check=True)
        fed.coordinator = fed.spawn(
            ["coordinator", "start", "--keys", str(new / "keys"), "--state-dir", str(new / "state"),
             "--port", str(fed.port), "--run-dir", str(new / "run"), "--resume-existing"],  # as the unit
            "coordinator.log")
        fed.run_dir = new / "run"
        for index in range(2):  # as systemd's Restart=always: a device that gave up is started again
            if fed.devices[index].poll() is not None:
                fed.start_device(index)
        fed.wait_for(lambda: len(fed.rows()) >= len(backed_up) + 1, 900, "a round after the restore")
        assert fed.stop(fed.coordinator) == 0
        whole = (fed.root / "coordinator.log").read_text(errors="replace")  # the restart says the run was stopped
        assert "left unfinished by an earlier coordinator (it was stopped by SIGTERM at " in whole, whole[-3000:]
        assert "crashed or was killed" not in whole
    finally:
        fed.close()
    # Assert: the run went on from its last checkpoint (every round once), the same devices by the same
    # node ids (their registrations came back with superlink.db), signed with the restored signing key
    rows = fed.rows()
    assert [row["round"] for row in rows] == list(range(len(rows)))
    assert rows[: len(backed_up)] == backed_up
    assert _names(fed, new / "state") == names
    late = [e for e in _events(fed) if e["round"] > len(backed_up) - 1]
    assert {e["node_id"] for e in late if e["status"] == "ok"} == set(names)
    assert not (tmp_path / "old" / "keys").exists()  # nothing reached back for the old host's paths


def _doc_command(prefix: str) -> str:
    """The operator page's shell line that starts with ``prefix``."""
    lines = [line.strip() for line in DOCS.read_text().splitlines() if line.strip().startswith(prefix)]
    assert len(lines) == 1, lines
    return lines[0]
