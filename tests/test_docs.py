"""The README is the front door and the manual lives in docs/: links between them resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "bench" / "README.md",
         *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return [target for target in LINK.findall(text) if "://" not in target and not target.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file_that_exists(page: Path) -> None:
    # Execute
    missing = [t for t in _relative_links(page) if not (page.parent / t.split("#", 1)[0]).exists()]
    # Assert
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_readme_is_a_front_door_not_the_manual() -> None:
    # Prepare
    readme = (ROOT / "README.md").read_text()
    # Assert: under 300 lines, the two commands first, and every docs page reachable from it
    assert len(readme.splitlines()) < 300
    assert readme.index("make demo") < readme.index("make test") < readme.index("## What fedge is")
    linked = {Path(t.split("#", 1)[0]).name for t in _relative_links(ROOT / "README.md")}
    assert {p.name for p in (ROOT / "docs").glob("*.md")} <= linked
