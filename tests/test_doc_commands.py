"""Every ``fedge`` command line in README.md and docs/ parses with the real CLI, as written.

Shell examples that start a coordinator or a fleet cannot all run here; what makes one fail
as written is a flag, subcommand, run-config key or fleet that does not exist (issue 26 item
11). Each command line of a ```bash or ```ini block (continuations joined, ``[optional]``
parts included) is parsed by ``fedge``'s own parser; its ``--run-config`` overrides go through
the run config's checks and its ``--fleet`` through the fleet parser. The ```toml fleet file is
parsed too. The commands that do run elsewhere: the demo (``tests/test_cli.py``), the systemd
lines and the backup (``tests/test_operator_service.py``), the scaffold (``tests/test_new_task.py``).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fedge.cli.main import build_parser
from fedge.config import parse_run_config_args, resolve_run_config
from fedge.profiles import parse_fleet

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FEDGE = re.compile(r"^(?:ExecStart=)?(?:\S*/)?fedge (?=[a-z])")  # fedge, .venv/bin/fedge, ExecStart=.../fedge


def command_lines() -> list[tuple[str, str]]:
    """(page, command) of every ``fedge`` command in a shell or unit-file block."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```(?:bash|ini)\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                for part in line.split(" #", 1)[0].split("&&"):  # `cd houses && ../.venv/bin/fedge ...`
                    if match := _FEDGE.match(part.strip()):
                        found.append((str(page.relative_to(ROOT)), part.strip()[match.end():]))
    return found


def _argv(command: str) -> list[str]:
    """The arguments as a user types them: ``[--flag VALUE]`` included, ``a|b`` as ``a``, ``...`` dropped."""
    command = re.sub(r"\[([^\]]*)\]", r"\1", command)
    command = re.sub(r"([^\s|]+)(?:\|[^\s|]+)+", r"\1", command)
    return [word for word in shlex.split(command) if word != "..."]


COMMANDS = command_lines()


def test_the_docs_have_fedge_commands_on_every_page_that_shows_one() -> None:
    # Assert: the extraction finds them (a broken pattern would make the test below vacuous)
    pages = {page for page, _ in COMMANDS}
    assert {"README.md", "docs/coordinator.md", "docs/edge-bundles.md", "docs/operator.md"} <= pages
    assert len(COMMANDS) >= 30


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[f"{p}: {c[:60]}" for p, c in COMMANDS])
def test_every_fedge_command_in_the_docs_parses(page: str, command: str) -> None:
    # Execute: fedge's own parser (argparse exits 2 on an unknown flag or subcommand)
    try:
        args = build_parser().parse_args(_argv(command))
    except SystemExit as exc:
        raise AssertionError(f"{page}: `fedge {command}` does not parse (exit {exc.code})") from None
    # Assert: its run-config overrides and fleet are ones fedge accepts
    overrides = parse_run_config_args(getattr(args, "run_config", "") or "")
    resolve_run_config(overrides)
    fleet = getattr(args, "fleet", None)
    if fleet and not fleet.endswith(".toml"):
        assert parse_fleet(fleet).size > 0


def test_the_fleet_file_in_the_docs_parses(tmp_path: Path) -> None:
    # Prepare: the page's TOML as a fleet file
    blocks = re.findall(r"```toml\n(.*?)```", (ROOT / "docs" / "simulation.md").read_text(), flags=re.S)
    assert len(blocks) == 1
    path = tmp_path / "my-fleet.toml"
    path.write_text(blocks[0])
    # Execute
    fleet = parse_fleet("", str(path))
    # Assert: 40 watches and 60 phones, the watch as the page defines it
    assert fleet.size == 100
    assert fleet.profiles["watch"].memory_mb == 512
