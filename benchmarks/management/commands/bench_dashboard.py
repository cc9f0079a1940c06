"""``python manage.py bench_dashboard [--rows 10000000] [--days 30]
[--users N] [--requests 30]``: fill the configured (bench) database with
the rollups a month of ``--rows`` audit rows leaves, then time the staff
dashboard endpoints over HTTP (in process, through the whole Django and
django-ninja stack) and print p50/p95 per endpoint (R-DASH-1); see :mod:`benchmarks.dashboard`.

It refuses a database that already holds runs unless ``--force``: point
``DATABASE_URL`` at a bench database (e.g. ``yuxi_rollups_bench``, after
``manage.py migrate``).
"""

from __future__ import annotations

import datetime as dt
import time

from django.core.management.base import CommandError
from django.db import connection

from audit.ledger.handover import dispatch_held
from audit.management.commands._database import DatabaseCommand
from audit.models import AgentRun
from benchmarks import dashboard


class Command(DatabaseCommand):
    help = "Fill a bench database with a month of dashboard rollups and time the dashboard endpoints (R-DASH-1)."

    def add_arguments(self, parser):
        parser.add_argument("--rows", type=int, default=10_000_000, help="Audit rows the month stands for.")
        parser.add_argument("--days", type=int, default=30)
        parser.add_argument("--users", type=int, default=None, help="Default: one per 2,000 audit rows.")
        parser.add_argument("--requests", type=int, default=30, help="Timed requests per endpoint.")
        parser.add_argument("--force", action="store_true", help="Use a database that already holds runs.")

    def handle(self, *args, rows: int, days: int, users: int | None, requests: int, force: bool, **options):
        if rows < 1000 or not 1 <= days <= 366 or requests < 2:
            raise CommandError("--rows >= 1000, --days in 1..366, --requests >= 2")
        if AgentRun.objects.exists() and not force:
            raise CommandError(
                f"database {connection.settings_dict['NAME']} holds runs: use a bench database or --force"
            )
        users = users or max(rows // 2000, 10)
        end = dt.datetime.now(dt.UTC).replace(minute=0, second=0, microsecond=0) + dt.timedelta(hours=1)
        start = end - dt.timedelta(days=days)
        started = time.monotonic()
        # Its pending runs are figures, not work for a worker.
        with dispatch_held():
            staff = dashboard.fill(rows=rows, start=start, end=end, users=users)
        self.stdout.write(f"filled in {time.monotonic() - started:.1f} s: {dashboard.table_sizes()}")
        last = (end - dt.timedelta(hours=1)).date()
        first = last - dt.timedelta(days=days - 1)
        self.stdout.write(f"{rows:,} audit rows, window {first}..{last}; {requests} requests per endpoint (ms)")
        self.stdout.write(f"{'endpoint':44} {'p50':>8} {'p95':>8}")
        try:
            for figure in dashboard.measure(staff, first=first, last=last, requests=requests):
                self.stdout.write(f"{figure.endpoint:44} {figure.p50_ms:8.1f} {figure.p95_ms:8.1f}")
        except dashboard.EndpointFailed as exc:
            raise CommandError(str(exc)) from exc
