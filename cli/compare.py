"""``fedge compare RUN...``: runs side by side (table, plot, JSON)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parsers(sub: Any) -> None:
    """Register ``fedge compare`` on ``sub``."""
    p = sub.add_parser(
        "compare", help="compare runs: a table, the headline vs rounds and vs simulated time (PNG + JSON)",
        description="Put run directories side by side: final and best headline metric, rounds, simulated and "
                    "wall time, bytes, rejected updates; one plot of the headline vs round and vs simulated "
                    "time across runs, and the same numbers as JSON.")
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="run directories (runs/NAME)")
    p.add_argument("--out", type=Path, default=Path("compare"), metavar="PATH",
                   help="writes PATH.png and PATH.json (default: ./compare.png, ./compare.json)")
    p.set_defaults(handler=_compare)


def _compare(args: argparse.Namespace) -> int:
    from fedge.server.compare import compare, format_table

    rows, png, record = compare(args.runs, args.out)
    print(format_table(rows))
    print(f"plot: {png}  record: {record}")
    return 0
