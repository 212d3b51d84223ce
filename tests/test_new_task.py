"""``fedge new NAME`` (issue 14): a scaffolded task package runs both ways, unmodified.

``fedge simulate --task NAME.task:Class`` from inside the new project, and ``flwr run .`` on
Flower's local simulation runtime (slow: a SuperLink, a simulation process and Ray).
Refused names exit 2 with one line and write nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from fedge.cli.main import main
from fedge.cli.new import FLEET, FLEET_SIZE, Names

NAME = "leaf_sorter"
NAMES = Names.of(NAME)
BIN = Path(sys.executable).parent


def _snapshot(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def project(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A freshly scaffolded project in ``tmp_path``."""
    assert main(["new", NAME, "--dir", str(tmp_path)]) == 0
    capsys.readouterr()
    return tmp_path / NAME


# ---------------------------------------------------------------------------- what is written


def test_new_writes_the_package_and_prints_the_files_and_the_commands_to_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Execute
    code = main(["new", NAME, "--dir", str(tmp_path)])
    # Assert: the files, and the output names them and the two commands
    out = capsys.readouterr().out
    root = tmp_path / NAME
    written = {".gitignore", "README.md", "pyproject.toml", f"{NAME}/__init__.py", f"{NAME}/task.py",
               f"{NAME}/server_app.py", f"{NAME}/client_app.py"}
    assert code == 0
    assert {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} == written
    assert all(str(root / relative) in out for relative in written)
    assert f"fedge simulate --task {NAME}.task:LeafSorterTask" in out
    assert 'flwr run . local --federation-config "num-supernodes=10" --stream' in out
    assert "app = make_server_app(" in (root / NAME / "server_app.py").read_text()
    assert "app = make_client_app(" in (root / NAME / "client_app.py").read_text()


def test_the_scaffold_is_a_flower_app_whose_run_config_fedge_accepts(project: Path) -> None:
    # Prepare
    from flwr.cli.build import build_fab_from_disk
    from flwr.common.config import validate_config

    from fedge.config import resolve_run_config
    from fedge.profiles import parse_fleet

    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    # Execute: Flower's own checks (fields, components, FAB build) and fedge's run-config checks
    valid, errors, warnings = validate_config(pyproject, check_module=False)
    fab = build_fab_from_disk(project)
    config = resolve_run_config(pyproject["tool"]["flwr"]["app"]["config"])
    # Assert
    assert valid and not errors and not warnings
    assert pyproject["project"]["name"] == "leaf-sorter" and "fedge" in pyproject["project"]["dependencies"]
    assert pyproject["tool"]["flwr"]["app"]["components"] == {"serverapp": f"{NAME}.server_app:app",
                                                              "clientapp": f"{NAME}.client_app:app"}
    assert config["task"] == NAMES.reference and config["fleet"] == FLEET
    assert parse_fleet(FLEET, "").size == FLEET_SIZE
    assert "federations" not in pyproject["tool"]["flwr"]  # Flower 1.42 keeps them in $FLWR_HOME
    assert len(fab) < 100_000


# ---------------------------------------------------------------------------- runs both ways


def test_the_scaffold_runs_with_fedge_simulate_from_its_directory_and_learns(project: Path, tmp_path: Path) -> None:
    # Prepare
    run_dir = tmp_path / "run"
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    # Execute: as a user would, from inside the new project
    done = subprocess.run(
        [str(BIN / "fedge"), "simulate", "--task", NAMES.reference, "--rounds", "2", "--quiet",
         "--run-dir", str(run_dir), "--fleet", FLEET, "--clients-per-round", "5"],
        cwd=project, env=env, capture_output=True, text=True, timeout=300)
    # Assert: finished, summary written, the headline improved on the initial model
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = _metrics(run_dir)
    assert summary["task"] == NAME and summary["headline"] == "accuracy" and summary["rounds"] == 2
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.2
    assert (run_dir / "model.onnx").exists()


def _free_port() -> int:
    from fedge.simulation.loopback import free_port

    return free_port(1)  # a port of this xdist worker's own


def _mentions(process: psutil.Process, flwr_home: Path) -> bool:
    """Whether ``process`` belongs to this test's Flower runtime (its FLWR_HOME or a path inside)."""
    try:
        return (str(flwr_home) in " ".join(process.cmdline())
                or process.environ().get("FLWR_HOME") == str(flwr_home))
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _ours(flwr_home: Path) -> list[psutil.Process]:
    return [p for p in psutil.process_iter() if p.pid != os.getpid() and _mentions(p, flwr_home)]


@pytest.fixture
def flower_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """An environment for ``flwr`` with its own FLWR_HOME and local SuperLink ports; afterwards
    the SuperLink that ``flwr run`` spawned (detached) and everything it started is stopped."""
    flwr_home = tmp_path / "flwr-home"
    env = {**os.environ, "FLWR_HOME": str(flwr_home), "FLWR_TELEMETRY_ENABLED": "0",
           "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port()),
           "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")])}
    yield env
    spawned = _ours(flwr_home)
    family = {p.pid: p for p in spawned}
    for process in spawned:
        with contextlib.suppress(psutil.NoSuchProcess):
            family.update({child.pid: child for child in process.children(recursive=True)})
    for process in spawned:  # the SuperLink stops the SuperExec and simulation it started
        with contextlib.suppress(psutil.NoSuchProcess):
            if "flower-superlink" in " ".join(process.cmdline()):
                process.terminate()
    _, alive = psutil.wait_procs(list(family.values()), timeout=20)
    for process in alive:
        process.kill()
    psutil.wait_procs(alive, timeout=10)
    assert not _ours(flwr_home), "processes of this test's Flower runtime outlived it"


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # Flower's local simulation runtime starts a Ray instance
def test_the_scaffold_runs_with_flwr_run_on_a_local_simulation(project: Path, tmp_path: Path,
                                                              flower_env: dict[str, str]) -> None:
    # Prepare: Flower's default config (created on first use) has the `local` connection
    run_dir = tmp_path / "flwr-run"
    overrides = f"run-dir='{run_dir}' num-rounds=2 export-onnx=false"
    # Execute: `flwr run .` unmodified, sized to the scaffold's fleet
    done = subprocess.run(
        [str(BIN / "flwr"), "run", ".", "local", "--federation-config",
         f"num-supernodes={FLEET_SIZE} client-resources-num-cpus=1", "--run-config", overrides, "--stream"],
        cwd=project, env=flower_env, capture_output=True, text=True, timeout=400)
    # Assert: the run finished (flwr exits 0 even for a failed run: the run directory tells)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert (run_dir / "summary.json").exists(), output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = _metrics(run_dir)
    assert summary["task"] == NAME and summary["rounds"] == 2
    assert [row["participants"] for row in rows[1:]] == [5, 5] and rows[-1]["accuracy"] > rows[0]["accuracy"]
    assert "[tool.flwr.federations]" not in (project / "pyproject.toml").read_text()  # nothing migrated


# ---------------------------------------------------------------------------- refused names


@pytest.mark.parametrize(("name", "message"), [
    ("My-Task", "must be a lower-case Python identifier"),
    ("1abc", "must be a lower-case Python identifier"),
    ("class", "is a Python keyword"),
    ("existing", "already exists"),
    ("fedge", "already an importable module"),
    ("a" * 33, "longer than 32 characters"),
])
def test_a_bad_name_is_refused_with_exit_2_and_nothing_written(
        name: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "keep.txt").write_text("mine")
    before = _snapshot(tmp_path)
    # Execute
    code = main(["new", name, "--dir", str(tmp_path)])
    # Assert
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("fedge: error: ") and len(err.splitlines()) == 1 and message in err
    assert _snapshot(tmp_path) == before


def test_a_missing_parent_directory_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Execute
    code = main(["new", NAME, "--dir", str(tmp_path / "nowhere")])
    # Assert
    assert code == 2 and "is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()
