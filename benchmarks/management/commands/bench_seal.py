"""``python manage.py bench_seal [--runs N] [--rows N]``: print what sealing
adds to the terminal transaction; see :mod:`benchmarks.seal`."""

from __future__ import annotations

from django.core.management.base import CommandError

from audit.ledger.handover import dispatch_held
from audit.management.commands._database import DatabaseCommand
from benchmarks.seal import bench_seal


class Command(DatabaseCommand):
    help = (
        "Benchmark the terminal transaction (run_finish) with and without the seal (R-GOV-3) on the configured "
        "database. Creates and deletes its own user, threads and runs."
    )

    def add_arguments(self, parser):
        parser.add_argument("--runs", type=int, default=40, help="runs in all, half with the seal (default 40)")
        parser.add_argument("--rows", type=int, default=10, help="audit rows per run (default 10)")

    def handle(self, *args, runs: int, rows: int, **options) -> None:
        if runs < 4 or rows < 2:
            raise CommandError("--runs must be at least 4 and --rows at least 2")
        # The benchmark starts its own runs: no worker may take them first.
        with dispatch_held():
            result = bench_seal(runs=runs, rows=rows)
        out = self.stdout.write
        out(f"terminal transaction (run_finish), {result.rows_per_run} audit rows per run (ms):")
        for name, s in (("with the seal", result.with_seal), ("without the seal", result.without_seal)):
            out(f"  {name + ':':<20} median {s.median_ms:.3f}  p95 {s.p95_ms:.3f}  ({s.count} runs)")
        out(f"  ratio with / without: median {result.ratio_median:.2f}x")
        s = result.seal_alone
        out(f"  the seal alone (read rows + hash): median {s.median_ms:.3f}  p95 {s.p95_ms:.3f}")
        out("its runs were deleted and the dashboard's rollups of the days it ran recomputed (rebuild_rollups)")
