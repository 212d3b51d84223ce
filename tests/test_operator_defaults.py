"""docs/operator.md states the defaults the CLI and the run config have (issue 39): the page's
option table for `fedge gateway start`, every "`--option` (default N)" and "`knob` (N)" it names,
and every "(default X)" a gateway, coordinator or device option's --help gives, all read from the
real parser and knobs, so the page and `--help` cannot drift apart."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from fedge.cli.main import build_parser
from fedge.knobs import KNOBS

OPERATOR = Path(__file__).resolve().parents[1] / "docs" / "operator.md"
GATEWAY_SECTION = "## Gateways for phones and browsers"
TABLE_HEADING = "### `fedge gateway start` options"
# "`max-update-norm` (10.0", "`min-train-replies` (default 2", "`--offline-limit` seconds (default 300",
# "`--max-in-flight` 512"
MENTION = re.compile(r"`(--[a-z0-9-]+|[a-z][a-z0-9-]*)`(?: [a-z]+)? \(?(?:default )?(\d[\d,]*(?:\.\d+)?)")
HELP_DEFAULT = re.compile(r"\(default ([\w.~/-]+)\)")


def _command(*path: str) -> argparse.ArgumentParser:
    """The parser of ``fedge PATH...`` (e.g. gateway start)."""
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
        parser = sub.choices[name]
    return parser


def _defaults(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """``{--option: default}`` of a parser's options."""
    return {option: action.default for action in parser._actions for option in action.option_strings  # noqa: SLF001
            if option.startswith("--")}


def _same(stated: str, default: Any) -> bool:
    """Whether the page's ``stated`` value is ``default`` (numbers compared as numbers, 10,000 = 10000)."""
    if isinstance(default, bool) or not isinstance(default, int | float):
        return stated == str(default)
    try:
        return float(stated.replace(",", "")) == float(default)
    except ValueError:
        return False


def _gateway_table() -> list[tuple[str, str]]:
    """(option, default cell) of each row of the page's `fedge gateway start` option table."""
    text = OPERATOR.read_text()
    assert TABLE_HEADING in text, f"docs/operator.md lost its '{TABLE_HEADING}' table"
    rows = []
    for line in text.split(TABLE_HEADING, 1)[1].splitlines():
        if line.startswith("| `--"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows.append((cells[0].strip("`"), cells[1]))
        elif rows and not line.startswith("|"):
            break
    return rows


def test_the_gateway_option_table_states_the_parsers_defaults() -> None:
    # Prepare
    defaults, rows = _defaults(_command("gateway", "start")), _gateway_table()
    # Execute: each row's default cell against the parser's (a backticked value, or "none: ..." for an
    # option whose default the gateway works out itself)
    wrong = []
    for option, cell in rows:
        if option not in defaults:
            wrong.append(f"{option}: not an option of `fedge gateway start`")
        elif cell.startswith("`"):
            if not _same(cell.strip("`"), defaults[option]):
                wrong.append(f"{option}: the page says {cell}, --help's default is {defaults[option]!r}")
        elif defaults[option] not in (None, ""):
            wrong.append(f"{option}: the page says '{cell}', --help's default is {defaults[option]!r}")
    # Assert
    assert len(rows) >= 10 and not wrong, wrong


def test_every_default_the_page_names_is_the_parsers_or_the_knobs() -> None:
    # Prepare: the gateway section's options are `fedge gateway start`'s; the rest the coordinator's or a device's
    text = OPERATOR.read_text()
    before, gateway = text.split(GATEWAY_SECTION, 1)
    gateway_options = _defaults(_command("gateway", "start"))
    other_options = {**_defaults(_command("device")), **_defaults(_command("coordinator", "start"))}
    # Execute
    checked, wrong = 0, []
    for section, options in ((before, other_options), (gateway, gateway_options)):
        for name, stated in MENTION.findall(section):
            if name.startswith("--"):
                known, default = name in options, options.get(name)
            else:
                known = name in KNOBS
                default = KNOBS[name].default if known else None
            checked += 1
            if not known:
                wrong.append(f"`{name}` ({stated}): neither an option nor a run-config knob")
            elif not _same(stated, default):
                wrong.append(f"`{name}`: the page says {stated}, the default is {default!r}")
    # Assert
    assert checked >= 7 and not wrong, wrong


@pytest.mark.parametrize("command", [("gateway", "start"), ("coordinator", "start"), ("device",),
                                     ("protocol-device",)], ids=" ".join)
def test_every_default_a_help_text_names_is_the_options_default(command: tuple[str, ...]) -> None:
    wrong = []
    for action in _command(*command)._actions:  # noqa: SLF001
        said = HELP_DEFAULT.search(action.help or "")
        if said and action.default is not None and not _same(said.group(1), action.default):
            wrong.append(f"{action.option_strings[0]}: --help says (default {said.group(1)}), the default is "
                         f"{action.default!r}")
    assert not wrong, wrong
