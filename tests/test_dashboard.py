"""The dashboard: its JSON API on a real run directory, the token rule, partial files, and a real browser."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chromium import start_chromium
from starlette.testclient import TestClient

from fedge.errors import ConfigError
from fedge.server.dashboard import create_app
from fedge.server.report import read_jsonl
from fedge.simulation.runner import simulate

RUN = {"fleet": "phone=6,laptop=3,gpu-box=1", "clients-per-round": 5, "num-rounds": 3, "model": "mlp",
       "local-epochs": 1, "byzantine-fraction": 0.0, "export-every": 3}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real short simulation with DP on (so ε shows) and a signed bundle."""
    run_dir, _ = simulate({**RUN, "dp": "server-fixed", "dp-noise-multiplier": 0.5,
                           "run-dir": str(tmp_path_factory.mktemp("runs") / "run")}, progress=False)
    return run_dir


def _client(run_dir: Path, **kwargs: Any) -> TestClient:
    return TestClient(create_app(run_dir, **kwargs), base_url="http://127.0.0.1:8765")


def test_the_api_describes_a_finished_run(finished_run: Path) -> None:
    # Prepare
    client = _client(finished_run)
    summary = json.loads((finished_run / "summary.json").read_text())
    rows = read_jsonl(finished_run / "metrics.jsonl")
    # Execute
    got = {name: client.get(f"/api/{name}").json() for name in ("summary", "rounds", "devices", "rejections", "bundle")}
    # Assert: the same numbers as the run directory
    assert got["summary"]["status"] == "finished" and got["summary"]["rounds_done"] == 3
    assert got["summary"]["accuracy"] == summary["final_accuracy"]
    assert got["summary"]["dp_epsilon"] == summary["dp"]["epsilon"] > 0
    assert [r["round"] for r in got["rounds"]["rounds"]] == [0, 1, 2, 3]
    assert got["rounds"]["skipped_lines"] == 0
    joined = sum(d["rounds_joined"] for d in got["devices"]["devices"])
    assert joined == sum(row["participants"] for row in rows) == 15
    assert {d["profile"] for d in got["devices"]["devices"]} <= {"phone", "laptop", "gpu-box"}
    assert got["rejections"]["rejections"] == []
    assert got["bundle"]["bundle"] == "bundles/round-0003" and got["bundle"]["has_signature"]
    assert got["bundle"]["manifest"]["round"] == 3


def test_rejected_updates_are_listed_with_their_reasons(finished_run: Path, tmp_path: Path) -> None:
    # Prepare: a copy of the run whose round 2 rejected one update
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    rows = read_jsonl(run / "metrics.jsonl")
    rows[2].update(rejected=1, rejections=[{"node_id": 10004, "reason": "array 'w' contains NaN or Inf"}])
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    # Execute
    rejections = _client(run).get("/api/rejections").json()["rejections"]
    # Assert
    assert rejections == [{"round": 2, "node_id": "10004", "name": "", "reason": "array 'w' contains NaN or Inf"}]


def test_partial_and_garbled_lines_do_not_break_the_api(finished_run: Path, tmp_path: Path) -> None:
    # Prepare: a run still writing (no summary yet, the last line cut off) with one garbled line
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "summary.json").unlink()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:3] + ["{not json", "[1, 2]", lines[3][:40]]))
    with (run / "devices.jsonl").open("a") as stream:
        stream.write('{"node": 1, "rou')
    client = _client(run)
    # Execute
    summary, rounds, devices = (client.get(f"/api/{n}").json() for n in ("summary", "rounds", "devices"))
    # Assert: the complete rows, the bad ones counted, the run shown as running
    assert summary["status"] == "running" and summary["rounds_done"] == 2
    assert [r["round"] for r in rounds["rounds"]] == [0, 1, 2] and rounds["skipped_lines"] == 3
    assert devices["skipped_lines"] == 1 and devices["devices"]
    assert client.get("/").status_code == 200


def test_an_empty_run_directory_is_starting(tmp_path: Path) -> None:
    summary = _client(tmp_path).get("/api/summary").json()
    assert summary["status"] == "starting" and summary["rounds_done"] == 0


@pytest.mark.parametrize(("config", "expected"), [
    ({"task": "houses.task:Houses", "dataset": "digits", "model": "cnn"},
     {"task": "houses.task:Houses", "dataset": None, "model": None}),       # the defaults are not its data
    ({"task": "", "dataset": "synthetic", "model": "logreg"},
     {"task": None, "dataset": "synthetic", "model": "logreg"}),
    ({"task": "digits", "dataset": "synthetic", "model": "mlp"},
     {"task": "digits", "dataset": None, "model": "mlp"}),                  # a registered task takes the model
])
def test_the_summary_names_the_task_that_ran(tmp_path: Path, config: dict[str, Any],
                                             expected: dict[str, Any]) -> None:
    # Prepare: a run that has written its config and nothing else yet
    (tmp_path / "config.json").write_text(json.dumps({"strategy": "fedavg", **config}))
    # Execute
    summary = _client(tmp_path).get("/api/summary").json()
    # Assert
    assert {key: summary[key] for key in expected} == expected


@pytest.mark.parametrize(("credentials", "status"), [
    ({}, 401),
    ({"params": {"token": "wrong"}}, 401),
    ({"headers": {"Authorization": "Bearer wrong"}}, 401),
    ({"params": {"token": "s3cret-token"}}, 200),
    ({"headers": {"Authorization": "Bearer s3cret-token"}}, 200),
])
def test_off_loopback_every_request_needs_the_token(finished_run: Path, credentials: dict[str, Any],
                                                    status: int) -> None:
    client = _client(finished_run, host="0.0.0.0", token="s3cret-token")
    for path in ("/", "/api/summary", "/static/app.js"):
        assert client.get(path, **credentials).status_code == status


def test_the_token_is_remembered_in_a_cookie_after_the_first_visit(finished_run: Path) -> None:
    client = _client(finished_run, host="0.0.0.0", token="s3cret-token")
    assert client.get("/", params={"token": "s3cret-token"}).status_code == 200
    assert client.get("/api/summary").status_code == 200  # the page's own fetches carry the cookie


def test_on_loopback_a_foreign_host_name_is_refused(finished_run: Path) -> None:
    # a DNS-rebinding page would reach 127.0.0.1 under its own host name
    client = _client(finished_run)
    assert client.get("/api/summary", headers={"host": "evil.example:8765"}).status_code == 400
    assert client.get("/api/summary", headers={"host": "localhost:8765"}).status_code == 200


def test_off_loopback_without_a_token_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs a token"):
        create_app(Path("."), host="0.0.0.0")


def test_the_api_is_described_by_openapi(finished_run: Path) -> None:
    spec = _client(finished_run).get("/api/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    assert set(spec["paths"]) == {"/api/summary", "/api/rounds", "/api/devices", "/api/rejections", "/api/bundle"}


# --------------------------------------------------------------------------- in a real browser



def _free_port() -> int:
    from fedge.simulation.loopback import free_port

    return free_port(1)  # a port of this xdist worker's own


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The dashboard on 127.0.0.1 (a real uvicorn server) for a run directory under tmp_path."""
    import uvicorn

    run_dir, port = tmp_path / "run", _free_port()
    run_dir.mkdir()
    server = uvicorn.Server(uvicorn.Config(create_app(run_dir), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/", run_dir
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless Chromium (skipped where it is not installed)."""
    driver = start_chromium()
    yield driver
    driver.quit()


def _text(driver: Any, test_id: str) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.CSS_SELECTOR, f"[data-testid='{test_id}']").text)


def _wait_for(condition: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError("the page did not show it in time")


@pytest.mark.slow
def test_the_page_follows_a_live_run_and_shows_the_final_result(served: tuple[str, Path], browser: Any,
                                                               tmp_path: Path) -> None:
    # Prepare: a simulation writing into the served run directory, in the background
    url, run_dir = served
    config = {**RUN, "num-rounds": 6, "model": "cnn", "local-epochs": 5, "run-dir": str(run_dir)}
    result: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: result.update(summary=simulate(config, progress=False)[1]))
    # Execute: open the page, start the run, watch it advance
    browser.get(url)
    worker.start()
    _wait_for(lambda: _text(browser, "round-count").startswith(("1 /", "2 /", "3 /")))
    seen_first = int(_text(browser, "round-count").split(" /")[0])
    _wait_for(lambda: int(_text(browser, "round-count").split(" /")[0]) > seen_first)
    worker.join(timeout=300)
    _wait_for(lambda: _text(browser, "status") == "finished")
    browser.save_screenshot(str(tmp_path / "dashboard.png"))
    # Assert: the page shows the run's round count and final accuracy; the charts were drawn
    summary = result["summary"]
    assert _text(browser, "round-count") == "6 / 6"
    assert _text(browser, "accuracy") == f"{summary['final_accuracy']:.4f}"
    from selenium.webdriver.common.by import By

    assert len(browser.find_elements(By.CSS_SELECTOR, "#chart-round path")) == 2
    assert len(browser.find_elements(By.CSS_SELECTOR, "#devices tbody tr")) >= 5
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000


@pytest.mark.slow
def test_the_page_fits_a_phone_screen(served: tuple[str, Path], browser: Any, finished_run: Path,
                                      tmp_path: Path) -> None:
    # Prepare: a finished run in the served directory, a 390 px wide window
    url, run_dir = served
    shutil.copytree(finished_run, run_dir, dirs_exist_ok=True)
    browser.set_window_size(390, 844)
    # Execute
    browser.get(url)
    _wait_for(lambda: _text(browser, "status") == "finished")
    browser.save_screenshot(str(tmp_path / "phone.png"))
    # Assert: nothing wider than the screen (no sideways scrolling)
    width = browser.execute_script("return document.documentElement.scrollWidth")
    viewport = browser.execute_script("return window.innerWidth")
    assert width <= viewport
    assert _text(browser, "round-count") == "3 / 3"


def test_the_coordinator_serves_the_dashboard_beside_a_run(finished_run: Path) -> None:
    # Prepare: what `fedge coordinator start --dashboard` starts, on a free loopback port
    import urllib.request

    from fedge.server.dashboard import listen, serve_in_background

    sock = listen("127.0.0.1", 0, "the dashboard", "--dashboard-port")
    port = sock.getsockname()[1]
    # Execute
    server = serve_in_background(create_app(finished_run), sock, "fedge-dashboard")
    try:
        _wait_for(lambda: server.started, timeout=10)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/summary", timeout=5) as response:
            summary = json.loads(response.read())
    finally:
        server.should_exit = True
    # Assert
    assert summary["status"] == "finished" and summary["rounds_done"] == 3


def test_the_cli_refuses_a_missing_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedge.cli.main import main

    assert main(["dashboard", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


# --------------------------------------------------------------------------- issue 23 item 14: /metrics


@pytest.fixture
def metrics_url(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The coordinator's metrics endpoint, served for real on 127.0.0.1 over an empty run directory."""
    from fedge.server.dashboard import create_service_app, listen, serve_in_background, url_of

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sock = listen("127.0.0.1", 0, "the metrics endpoint", "--metrics-port")
    server = serve_in_background(create_service_app(run_dir), sock, "test-metrics")
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield url_of(sock) + "/metrics", run_dir
    server.should_exit = True


def _scrape(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as reply:
        return bytes(reply.read()).decode()


def _failed(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.split("\n")
            if line.startswith("fedge_replies_failed_total{")}


def test_a_device_sent_carriage_return_cannot_forge_a_metric(metrics_url: tuple[str, Path]) -> None:
    from fedge.server.dashboard import MAX_REASONS

    # Prepare: replies whose reasons a device chose: line breaks, a forged sample, quotes; then 150 distinct ones
    url, run_dir = metrics_url
    forged = 'bad\rfedge_participants 1e9\r\nfedge_run_finished 1\n"\\'
    events = [{"round": 1, "node_id": 7, "status": "error", "reason": forged}]
    events += [{"round": 1, "node_id": 8 + i, "status": "rejected", "reason": f"reason {i}"} for i in range(150)]
    (run_dir / "devices.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    # Execute
    text = _scrape(url)
    # Assert: no raw control character; every sample line is one well-formed sample; labels bounded
    assert "\r" not in text
    sample = re.compile(r'^fedge_[a-z_]+(\{([a-z_]+="([^"\\\n]|\\[\\"n])*",?)*\})? [-+0-9.e]+$')
    for line in text.rstrip("\n").split("\n"):
        assert line.startswith("# ") or sample.match(line), repr(line)
    failed = _failed(text)
    assert 'fedge_replies_failed_total{status="error",reason="bad\ufffdfedge_participants 1e9\ufffd\\n' \
           'fedge_run_finished 1\\n\\"\\\\"}' in failed
    assert len(failed) <= MAX_REASONS + 1 and sum(failed.values()) == 151


def test_a_scrape_reads_only_what_devices_jsonl_gained(metrics_url: tuple[str, Path]) -> None:
    # Prepare: 1,000 rejected replies, scraped once
    url, run_dir = metrics_url
    path = run_dir / "devices.jsonl"
    line = json.dumps({"round": 1, "node_id": 7, "status": "rejected", "reason": "norm"}) + "\n"
    path.write_text(line * 1000)
    first = _failed(_scrape(url))
    # Execute: the first 500 lines blanked in place (same file, same size: a scrape that re-reads them sees 500
    # fewer), one line appended
    with path.open("r+b") as stream:
        stream.write(b" " * (len(line) - 1) + b"\n")
        stream.write((b" " * (len(line) - 1) + b"\n") * 499)
    with path.open("a") as stream:
        stream.write(line)
    second = _failed(_scrape(url))
    # Assert: the second scrape folded in the new line only (O(new lines), not O(device replies))
    key = 'fedge_replies_failed_total{status="rejected",reason="norm"}'
    assert first[key] == 1000 and second[key] == 1001
