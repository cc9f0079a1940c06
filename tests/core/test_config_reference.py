"""docs/configuration.md is the settings class rendered, never a hand-kept
copy (issue 40): a setting added, removed or changed without regenerating
the page fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from core.config import BASE_DIR, Config
from yuxi_project import config_reference

PAGE = BASE_DIR / "docs" / "configuration.md"


def test_the_committed_page_is_the_settings_class_rendered():
    assert PAGE.read_text(encoding="utf-8") == config_reference.render(), (
        "docs/configuration.md differs from core.config.Config; "
        "run: .venv/bin/python manage.py config_reference --write docs/configuration.md"
    )


def test_every_setting_has_a_description_and_a_row():
    page = config_reference.render()
    for name, field in Config.model_fields.items():
        assert field.description, f"{name} has no description"
        assert page.count(f"| `{name}` |") == 1, name
    # A default made by a factory (an empty list) is rendered as its value.
    assert "Undefined" not in page


def test_a_changed_setting_changes_the_page(monkeypatch):
    before = config_reference.render()
    field = Config.model_fields["LEASE_TTL_SECONDS"]
    monkeypatch.setattr(field, "default", 45.0)
    assert config_reference.render() != before
    assert "| `LEASE_TTL_SECONDS` | number, > 0 | `45` |" in config_reference.render()


def test_defaults_are_shown_without_machine_paths():
    page = config_reference.render()
    assert str(BASE_DIR) not in page
    assert "| `WORKSPACE_ROOT` | path | `var/workspaces` |" in page
    assert "| `RETENTION_DAYS` | integer, ≥ 0 | unset |" in page


def test_a_section_naming_a_missing_setting_is_refused(monkeypatch):
    monkeypatch.setattr(config_reference, "SECTIONS", (("Gone", "NO_SUCH_SETTING"),))
    with pytest.raises(config_reference.SectionsError, match="NO_SUCH_SETTING"):
        config_reference.render()


def test_the_command_checks_writes_and_refuses_a_stale_page(tmp_path: Path):
    call_command("config_reference", check=str(PAGE))
    stale = tmp_path / "configuration.md"
    stale.write_text(PAGE.read_text(encoding="utf-8").replace("`30`", "`31`"), encoding="utf-8")
    with pytest.raises(CommandError, match="config_reference --write"):
        call_command("config_reference", check=str(stale))
    call_command("config_reference", write=str(stale))
    assert stale.read_text(encoding="utf-8") == PAGE.read_text(encoding="utf-8")
