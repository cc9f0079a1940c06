"""The front door stays a front door (issue 40): the README fits a few
screens, every relative link in it and in docs/ reaches a file (and an
anchor, where it names one), and neither carries dated work history."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core.config import BASE_DIR

PAGES = [BASE_DIR / "README.md", *sorted((BASE_DIR / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
MONTH = re.compile(
    r"\b\d{1,2} (January|February|March|April|May|June|July|August|September|October|November|December)\b"
)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#{1,6} (.+)$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_the_readme_fits_a_few_screens():
    assert len((BASE_DIR / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_reaches_a_file_and_its_anchor(page: Path):
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_no_dated_work_history_or_machine_paths(page: Path):
    text = page.read_text(encoding="utf-8")
    assert not MONTH.search(text), f"{page.name} dates its text: {MONTH.search(text).group(0)!r}"
    assert "/root/" not in text and "pyenv/versions" not in text, f"{page.name} names one machine's folders"
