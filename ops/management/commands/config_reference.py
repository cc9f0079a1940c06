"""Print or write ``docs/configuration.md`` from the settings class."""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from yuxi_project.config_reference import render


class Command(BaseCommand):
    requires_system_checks = []  # needs no database: the checks would create an empty SQLite file
    help = (
        "Render the configuration reference (docs/configuration.md) from core.config.Config: "
        "print it, --write it to a file, or --check that a file matches it (exit 1 when it does not)."
    )

    def add_arguments(self, parser):
        group = parser.add_mutually_exclusive_group()
        group.add_argument("--write", metavar="PATH", help="write the page to PATH")
        group.add_argument("--check", metavar="PATH", help="exit 1 when PATH differs from the rendered page")

    def handle(self, *args, write: str | None, check: str | None, **options) -> None:
        page = render()
        if write:
            Path(write).write_text(page, encoding="utf-8")
            self.stdout.write(f"wrote {write}")
        elif check:
            path = Path(check)
            if not path.is_file() or path.read_text(encoding="utf-8") != page:
                raise CommandError(
                    f"{check} is not the rendered configuration reference; "
                    f"run: manage.py config_reference --write {check}"
                )
            self.stdout.write(f"{check} is up to date")
        else:
            self.stdout.write(page, ending="")
