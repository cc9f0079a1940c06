"""``python manage.py bench_otel_export [--runs N] [--rows N] [--rounds N]``:
print the OpenTelemetry export's spans per second beside the same work done
with psycopg; see :mod:`benchmarks.otel_export`."""

from __future__ import annotations

from django.core.management.base import CommandError
from django.db import connection

from audit.ledger.handover import dispatch_held
from audit.management.commands._database import DatabaseCommand
from benchmarks.otel_export import bench_otel_export
from core.config import get_config


class Command(DatabaseCommand):
    help = (
        "Benchmark the OpenTelemetry export (R-OTEL-1, issue 38): spans/s of one export pass against the same "
        "runs read with psycopg (one statement per page of runs and one for their rows), made into spans by a "
        "bare SDK tracer and sent by the same SDK exporter to the same in-process receiver. Creates and deletes "
        "its own user, threads and runs."
    )

    def add_arguments(self, parser):
        parser.add_argument("--runs", type=int, default=60, help="runs exported per pass (default 60)")
        parser.add_argument("--rows", type=int, default=10, help="audit rows per run (default 10)")
        parser.add_argument("--rounds", type=int, default=3, help="passes of each, alternating (default 3)")

    def handle(self, *args, runs: int, rows: int, rounds: int, **options) -> None:
        if runs < 1 or rows < 2 or rounds < 1:
            raise CommandError("--runs and --rounds must be at least 1, --rows at least 2")
        if connection.vendor != "postgresql":
            raise CommandError("bench_otel_export needs PostgreSQL (DATABASE_URL=postgres://...)")
        log = self.stderr.write if options["verbosity"] > 1 else (lambda _line: None)
        # The benchmark starts its own runs: no worker may take them first.
        with dispatch_held():
            result = bench_otel_export(runs=runs, rows=rows, rounds=rounds, log=log)
        out = self.stdout.write
        out(
            f"OpenTelemetry export, {result.runs} runs of {result.rows_per_run} audit rows "
            f"({result.spans_per_pass} spans per pass), {rounds} rounds (spans/s, median):"
        )
        out(f"  product (export_closed_runs):            {result.product_median:8.0f}")
        out(f"  baseline (psycopg, one statement/page):  {result.baseline_median:8.0f}")
        out(f"  ratio product / baseline: {result.ratio_median:.2f}x (target >= 0.5x)")
        if get_config().OTEL_EXPORT_CONTENT:
            out(
                "  OTEL_EXPORT_CONTENT is on: the product's spans carry message content and tool payloads, "
                "the baseline's none (the target is set with content off)"
            )
        out("its runs were deleted and the dashboard's rollups of the days it ran recomputed (rebuild_rollups)")
