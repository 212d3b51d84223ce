"""The command line lists what is registered, takes no abbreviations, and names the extra a command
needs when its install lacks it (issue 26, items 1, 2 and 9)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from fedge.cli.main import build_parser, main


def test_simulate_help_lists_every_registered_strategy_policy_and_codec(capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare
    import fedge.strategies  # noqa: F401
    from fedge.codec import QUANTISERS
    from fedge.strategies.registry import REGISTRY

    # Execute
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    # Assert
    for name in [*REGISTRY, *QUANTISERS, "sync", "deadline", "oort", "docs/strategies.md", "docs/compression.md"]:
        assert name in help_text, name


@pytest.mark.parametrize("argv", [
    ["simulate", "--round", "5"],           # --rounds
    ["simulate", "--strat", "fedavg"],       # --strategy
    ["compare", "x", "--ou", "y"],           # --out
])
def test_abbreviated_options_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # Execute
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    # Assert
    assert stop.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_every_subcommand_refuses_abbreviations() -> None:
    # Prepare
    import argparse

    def parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
        found = [parser]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    found += parsers(child)
        return found

    # Execute
    every = parsers(build_parser())
    # Assert: the coordinator's and keys' nested sub-commands included
    assert len(every) > 10 and not any(p.allow_abbrev for p in every)


@pytest.mark.parametrize(("argv", "extra"), [
    (["simulate", "--rounds", "1"], "sim"),
    (["export", "runs/x", "--key", "k", "-o", "out"], "torch"),
])
def test_a_command_whose_extra_is_missing_names_the_extra(tmp_path: Any, argv: list[str], extra: str) -> None:
    # Prepare: a process in which `import torch` fails, as in the `edge` install
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            f"from fedge.cli.main import main\nsys.exit(main({argv!r}))\n")
    # Execute
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    # Assert: one line, exit 2, no traceback
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"pip install 'fedge[{extra}]'" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_new_command_is_one_file_in_the_cli_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: a module beside fedge.cli's own that defines a command
    import fedge.cli

    (tmp_path / "zz_hello.py").write_text(
        "def add_parsers(sub):\n"
        "    hello = sub.add_parser('hello', help='say hello')\n"
        "    hello.set_defaults(handler=lambda args: print('hello from one file') or 0)\n")
    monkeypatch.setattr(fedge.cli, "__path__", [*fedge.cli.__path__, str(tmp_path)])
    # Execute
    code = main(["hello"])
    # Assert
    assert code == 0 and "hello from one file" in capsys.readouterr().out
    sys.modules.pop("fedge.cli.zz_hello", None)
