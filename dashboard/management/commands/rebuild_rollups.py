"""``python manage.py rebuild_rollups [--since YYYY-MM-DD]``: recompute the
dashboard rollups from the audit rows, day by day (an hour per
transaction), with progress (R-DASH-1). Safe while the product runs: a run that ends during a
day's batch waits for it and is then counted once."""

from __future__ import annotations

import datetime as dt
import time

from django.core.management.base import CommandError

from audit.management.commands._database import DatabaseCommand
from dashboard.rollups import rollups_rebuild


class Command(DatabaseCommand):
    help = "Recompute the dashboard rollups from the audit rows (R-DASH-1)."

    def add_arguments(self, parser):
        parser.add_argument("--since", help="First UTC day to recompute (YYYY-MM-DD); default: all days.")

    def handle(self, *args, since: str | None = None, **options):
        try:
            first = dt.date.fromisoformat(since) if since else None
        except ValueError:
            raise CommandError(f"--since must be a date (YYYY-MM-DD), not {since!r}") from None
        started = time.monotonic()

        def progress(day: dt.date, done: int, total: int) -> None:
            elapsed = time.monotonic() - started
            self.stdout.write(f"{day} done ({done}/{total}, {elapsed:.1f} s)")

        days = rollups_rebuild(since=first, progress=progress)
        self.stdout.write(self.style.SUCCESS(f"rebuilt {days} days in {time.monotonic() - started:.1f} s"))
