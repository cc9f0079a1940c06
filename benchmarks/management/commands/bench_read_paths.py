"""``python manage.py bench_read_paths [--rows 1000000] [--rounds 5]``:
build a large audit in its own database and time every read path; see
:mod:`benchmarks.read_paths`."""

from __future__ import annotations

from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, connections

from audit.management.commands._database import DatabaseCommand
from benchmarks import read_paths
from benchmarks.databases import create_database, drop_database, use_database


class Command(DatabaseCommand):
    project_tables = False  # it creates and migrates a database of its own
    help = (
        "Build a realistic audit (default 1,000,000 audit rows over 30 days, many users and threads, one "
        "20,000-row run, one 1,000-turn thread) by bulk SQL in its own database (<database>_bench, created "
        "and migrated here; reused while its size matches), then print each read endpoint's p50/p95 over "
        "HTTP (Django test client, in process), the best SQL's EXPLAIN ANALYZE time and their ratio."
    )

    def add_arguments(self, parser):
        parser.add_argument("--rows", type=int, default=1_000_000, help="audit rows (model and tool rows)")
        parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds over every endpoint")
        parser.add_argument("--repeat", type=int, default=10, help="calls per endpoint and round")
        parser.add_argument("--database", default="", help="bench database name (default <current>_bench)")
        parser.add_argument("--rebuild", action="store_true", help="drop and rebuild the dataset")
        parser.add_argument("--only", default="", help="comma-separated words: measure endpoints named so")
        parser.add_argument("--drop", action="store_true", help="drop the bench database at the end")

    def handle(
        self, *args, rows: int, rounds: int, repeat: int, database: str, rebuild: bool, drop: bool, only: str, **options
    ):
        if rows < 1_000 or rounds < 1 or repeat < 1:
            raise CommandError("--rows must be at least 1000, --rounds and --repeat at least 1")
        if connection.vendor != "postgresql":
            raise CommandError("bench_read_paths needs PostgreSQL (DATABASE_URL=postgres://...)")
        name = database or f"{connection.settings_dict['NAME']}_bench"
        out = self.stdout.write
        original = connection.settings_dict["NAME"]
        created = create_database(name, drop_first=rebuild)
        use_database(name)
        try:
            call_command("migrate", verbosity=0)
            dataset = None if created else read_paths.stored_dataset(rows)
            if dataset is None:
                if not created:  # another size: start from an empty database
                    connections["default"].close()
                    create_database(name, drop_first=True)
                    call_command("migrate", verbosity=0)
                out(f"building {rows:,} audit rows in database {name} ...")
                dataset = read_paths.build_dataset(rows=rows, log=out)
                read_paths.store_dataset(dataset, rows)
                out(f"built in {dataset.build_seconds:.0f} s")
            else:
                out(f"reusing the dataset in database {name} (--rebuild to build it again)")
            try:
                call_command("rebuild_rollups")
                out("rollups rebuilt (rebuild_rollups)")
            except CommandError as exc:
                if "Unknown command" not in str(exc):
                    raise
            read_paths.settle(log=out)
            out(
                f"dataset: {dataset.audit_rows:,} audit rows, {dataset.runs:,} runs, {dataset.threads:,} threads, "
                f"{dataset.users:,} users, {dataset.first_day} to {dataset.last_day}"
            )
            out(f"measuring: {rounds} rounds x {repeat} calls per endpoint, over HTTP (Django test client)")
            points = read_paths.measure(
                dataset, rounds=rounds, repeat=repeat, only=tuple(w for w in only.split(",") if w), log=out
            )
            for line in read_paths.report(points):
                out(line)
            out(
                "SQL ms: EXPLAIN ANALYZE execution time, median of 3; 'hand' = one hand-written statement for the "
                "same answer, 'product' = the sum over the statements the endpoint ran (authentication excluded; "
                "memory: its one prepared statement, planned as the endpoint plans it)."
            )
        finally:
            use_database(original)
            if drop:
                drop_database(name)
