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


# Codes of the error family that no API endpoint answers: raised inside a
# worker, a task or a management command, where they name a run's
# error_type or a command's failure, never an HTTP body.
NOT_ANSWERED_BY_THE_API = {
    "application_error": "the family's base",
    "conflict": "the 409 family's base",
    "lease_error": "worker: lease checks",
    "run_identity_mismatch": "worker: lease checks",
    "lease_lost": "worker: lease checks",
    "lease_expired": "worker: lease checks",
    "run_terminal": "worker: lease checks",
    "run_not_startable": "worker: lease checks",
    "audit_conflict": "worker: audit writes",
    "tool_result_conflict": "worker: audit writes",
    "audit_write_failed": "worker: audit writes",
    "audit_write_rejected": "worker: audit writes",
    "database_unavailable": "worker: the task is retried",
    "unknown_user": "governance commands",
    "run_still_active": "governance commands",
    "governance_busy": "governance commands",
}


def _error_table() -> dict[str, int]:
    """``code -> status`` of docs/api.md's "Errors" table."""
    text = (BASE_DIR / "docs" / "api.md").read_text(encoding="utf-8")
    section = text.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    table = {}
    for status, code_cell, when in re.findall(r"^\| (\d{3}) \| ([^|]*) \| ([^|]*)", section, flags=re.MULTILINE):
        # The 402's flat body has no error.code: its "when" names it.
        for code in re.findall(r"`([a-z_]+)`", when if code_cell.strip() == "—" else code_cell)[:1]:
            table.setdefault(code, int(status))
    return table


def _error_classes(base: type) -> list[type]:
    found = []
    for sub in base.__subclasses__():
        found += [sub, *_error_classes(sub)]
    return found


def test_every_error_code_the_api_answers_is_in_the_error_table():
    """A client switches on ``error.code``: every code of the error family
    that an endpoint can answer is in docs/api.md's table with its status
    (a newcomer met ``thread_interrupted``, ``unknown_agent`` and
    ``unknown_model`` in answers and nowhere in the docs)."""
    import audit.catalogue  # noqa: F401
    import governance.errors  # noqa: F401
    import yuxi_project.api  # noqa: F401  (imports every router and its errors)
    from core.errors import ApplicationError

    table = _error_table()
    codes = {cls.code: cls.http_status for cls in [ApplicationError, *_error_classes(ApplicationError)]}
    missing = {
        code: status for code, status in codes.items() if code not in table and code not in NOT_ANSWERED_BY_THE_API
    }
    assert not missing, f"error codes the API answers but docs/api.md's table does not list: {missing}"
    wrong = {code: (table[code], status) for code, status in codes.items() if code in table and table[code] != status}
    assert not wrong, f"docs/api.md gives another status (table, code): {wrong}"
