"""Each run-config key is written out once, where :mod:`fedge.knobs` declares it (issue 40 §2).

Code reads the run config through the key's constant (``config.integer(knobs.LOCAL_EPOCHS)``), never
through the literal ``"local-epochs"``: a renamed or retired key is then one edit, and a typo an
``AttributeError`` at import instead of a ``KeyError`` in round 12. The scan walks the AST of every
package folder of pyproject's ``[tool.setuptools.package-dir]`` and fails on any string constant equal
to a knob key outside core/knobs.py, except :data:`ALLOWED`: the same word naming another thing (a
JSON field, a CLI command, a profile's TOML field), each with its count and why.

Out of scope: tests and docs, bench/ scripts and pyproject.toml's ``[tool.flwr.app.config]`` (run-config
inputs that write keys as a user would, not code reading the config); tests/test_config.py checks the
latter against :data:`fedge.knobs.KNOBS`.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections import Counter
from pathlib import Path

from fedge import knobs
from fedge.knobs import KNOBS

ROOT = Path(__file__).resolve().parents[1]
DECLARATION = "core/knobs.py"

# (file, key) -> (how many times the word stands there, what it names instead of the run-config key)
ALLOWED: dict[tuple[str, str], tuple[int, str]] = {
    ("server/dashboard.py", "strategy"): (1, "a field of the dashboard's run list (JSON)"),
    ("server/dashboard.py", "task"): (2, "a field of the dashboard's run list, filled from summary.json's task"),
    ("server/dashboard.py", "dataset"): (1, "a field of the dashboard's run list (JSON)"),
    ("server/dashboard.py", "model"): (1, "a field of the dashboard's run list (JSON)"),
    ("server/dashboard.py", "dp"): (1, "a field of the dashboard's run list (JSON)"),
    ("server/recorder.py", "task"): (1, "a field of summary.json: the task's name"),
    ("server/recorder.py", "dp"): (1, "a field of summary.json: the privacy accountant's summary"),
    ("cli/main.py", "dp"): (2, "summary.json's dp field, printed after a run"),
    ("server/report.py", "task"): (1, "the run directory name's stand-in for a task name with no safe character"),
    ("server/coordinator.py", "gateways"): (1, "the noun the round lines use for the coordinator's nodes"),
    ("server/pki.py", "gateways"): (1, "the keys folder holding gateways' certificates"),
    ("strategies/rounds.py", "gateways"): (1, "GATEWAY_NODES: the noun a round's lines use for gateway nodes"),
    ("core/profiles.py", "runtime"): (3, "a device profile's TOML field (a fleet file's [profiles.NAME])"),
    ("core/profiles.py", "fleet"): (2, "a fleet file's [fleet] table"),
    ("edge/training_bundle.py", "task"): (1, "a field of a training bundle's manifest"),
    ("edge/training_graph.py", "model"): (1, "the attribute a wrapper module holds its network in"),
    ("cli/catalogue.py", "device"): (2, "the `fedge device` command and the install extra it needs"),
    ("cli/deploy.py", "device"): (1, "the `fedge device` command"),
    ("simulation/loopback.py", "device"): (4, "the `fedge device` command a loopback federation spawns, and the "
                                               "device<N> prefix of its log and state names"),
    ("cli/new.py", "fleet"): (1, "a placeholder of the scaffold's templates"),
    ("task/api.py", "task"): (1, "a Task's default name"),
    ("clients/device.py", "task"): (2, "a training bundle manifest's task field, printed when the graph is fetched"),
    ("clients/protocol_device.py", "task"): (1, "names the task request in the gateway's refusal"),
    ("clients/gateway/protocol.py", "secure-aggregation"): (1, "the capability a device declares at check-in"),
    ("clients/gateway/protocol.py", "device"): (1, "CHECK_IN_DEVICE: a check-in's device name field"),
    ("clients/gateway/protocol.py", "task"): (1, "TASK_ID: a task's id field, echoed by the device's reply"),
    ("clients/gateway/protocol.py", "seed"): (1, "DEVICE_SEED: a task's seed for this device and round"),
    ("clients/gateway/protocol.py", "num-rounds"): (1, "NUM_ROUNDS: the run's last round, in a task's header"),
    ("clients/gateway/protocol.py", "deadline-s"): (1, "DEADLINE_S: a task's seconds left to reply"),
    ("clients/gateway/protocol.py", "asynchronous"): (1, "ASYNCHRONOUS: a task's header says its version may "
                                                         "come again"),
}


def _source_folders(root: Path) -> list[str]:
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    return sorted(pyproject["tool"]["setuptools"]["package-dir"].values())


def knob_literals(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(file, line, key) of every string constant equal to a knob key, outside core/knobs.py."""
    found = []
    for folder in _source_folders(root):
        for path in sorted((root / folder).rglob("*.py")):
            name = path.relative_to(root).as_posix()
            if name == DECLARATION:
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=name)):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in KNOBS:
                    found.append((name, node.lineno, node.value))
    return sorted(found)


def unexplained(found: list[tuple[str, int, str]]) -> list[str]:
    """``file:line: key`` of each literal not allowed; an allowed (file, key) used more often than its
    count has all its lines listed."""
    counts = Counter((name, key) for name, _, key in found)
    return [f"{name}:{line}: {key}" for name, line, key in found
            if counts[name, key] > ALLOWED.get((name, key), (0, ""))[0]]


def test_each_knob_has_a_constant_named_after_its_key() -> None:
    # Prepare / Execute: the constant's name is the key in UPPER_SNAKE (codec.gpu-box: CODEC_GPU_BOX)
    missing = [key for key in KNOBS if getattr(knobs, re.sub(r"[.\-]", "_", key).upper(), None) != key]
    # Assert
    assert not missing, missing


def test_each_knob_key_is_written_only_in_its_declaration() -> None:
    # Prepare / Execute
    stray = unexplained(knob_literals())
    # Assert: use the key's constant (from fedge import knobs; knobs.LOCAL_EPOCHS), or, for another thing
    # with the same name, add it to ALLOWED with why
    assert not stray, "run-config keys written out of fedge.knobs:\n" + "\n".join(stray)


def test_the_allowlist_names_what_is_there() -> None:
    # Prepare
    found = knob_literals()
    counts = Counter((name, key) for name, _, key in found)
    # Execute: an entry whose file no longer writes the word as often is stale
    stale = {entry: (count, counts[entry]) for entry, (count, _) in ALLOWED.items() if counts[entry] != count}
    # Assert
    assert not stale, f"(file, key): (allowed, found) {stale}"


def test_the_scan_catches_a_literal_written_anew(tmp_path: Path) -> None:
    # Prepare: a copy of the tree's layout with one module reading a knob by its literal
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"fedge.task" = "task"\n')
    (tmp_path / "task" / "builtin").mkdir(parents=True)
    (tmp_path / "task" / "builtin" / "mine.py").write_text('def seed(config):\n    return config.integer("seed")\n')
    # Execute
    found = knob_literals(tmp_path)
    # Assert
    assert unexplained(found) == ["task/builtin/mine.py:2: seed"]
