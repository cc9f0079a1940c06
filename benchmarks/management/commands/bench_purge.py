"""``python manage.py bench_purge [--runs N] [--rows N] [--batch-runs N]
[--rounds N] [--profile]``: print the payload purge's rows per second beside
the same work done by hand; see :mod:`benchmarks.purge`."""

from __future__ import annotations

import statistics

from django.core.management.base import CommandError

from audit.ledger.handover import dispatch_held
from audit.management.commands._database import DatabaseCommand
from benchmarks.purge import bench_purge


class Command(DatabaseCommand):
    help = (
        "Benchmark purge_payloads (R-GOV-1) against the same work done by hand (lock, seal check, one UPDATE, "
        "re-seal, reseal records) on the configured database. Creates and deletes its own user, threads and runs."
    )

    def add_arguments(self, parser):
        parser.add_argument("--runs", type=int, default=100, help="sealed runs purged per pass (default 100)")
        parser.add_argument("--rows", type=int, default=10, help="audit rows per run (default 10)")
        parser.add_argument("--batch-runs", type=int, default=50, help="runs per transaction (default 50)")
        parser.add_argument("--rounds", type=int, default=2, help="passes each way (default 2)")
        parser.add_argument("--profile", action="store_true", help="print the cProfile top 15 of one more product pass")

    def handle(self, *args, runs: int, rows: int, batch_runs: int, rounds: int, profile: bool, **options) -> None:
        if runs < 1 or rows < 2 or batch_runs < 1 or rounds < 1:
            raise CommandError("--runs, --batch-runs and --rounds must be at least 1, --rows at least 2")
        # The benchmark starts its own runs: no worker may take them first.
        with dispatch_held():
            result = bench_purge(runs=runs, rows=rows, batch_runs=batch_runs, rounds=rounds, profile=profile)
        out = self.stdout.write
        out(
            f"payload purge, {result.runs} sealed runs of {result.rows_per_run} audit rows per pass "
            f"({result.rows_per_pass} rows), batches of {result.batch_runs} runs, {rounds} rounds:"
        )
        for name, per_row, per_run in (
            ("purge_payloads", result.product_rows_per_s, result.product_runs_per_s),
            ("same work by hand", result.baseline_rows_per_s, result.baseline_runs_per_s),
        ):
            rows_s = " ".join(f"{v:,.0f}" for v in per_row)
            out(f"  {name + ':':<19} rows/s {rows_s}  (runs/s median {statistics.median(per_run):,.1f})")
        out(f"  ratio purge / by hand: median {result.ratio_median:.2f}x (target >= 0.50x)")
        if result.profile:
            out("where purge_payloads' time goes (cProfile, one more pass, top 15 by cumulative time):")
            out(result.profile)
        out("its runs were deleted and the dashboard's rollups of the days it ran recomputed (rebuild_rollups)")
