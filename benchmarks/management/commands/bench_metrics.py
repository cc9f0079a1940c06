"""``python manage.py bench_metrics [--models N] [--tools N] [--processes N]
[--rounds N]``: print what a ``/metrics`` scrape costs against
prometheus-client's own exposition; see :mod:`benchmarks.metrics_scrape`."""

from __future__ import annotations

from django.core.management.base import CommandError

from audit.management.commands._database import DatabaseCommand
from benchmarks.metrics_scrape import bench_metrics


class Command(DatabaseCommand):
    help = (
        "Benchmark the /metrics exposition (R-OPS-1) on a directory of worker files written for it, against "
        "prometheus-client's own MultiProcessCollector on the same directory. Reads the run table for the queue "
        "gauges; writes nothing to the database."
    )

    def add_arguments(self, parser):
        parser.add_argument("--models", type=int, default=300, help="model names in the labels (default 300)")
        parser.add_argument("--tools", type=int, default=100, help="tool names in the labels (default 100)")
        parser.add_argument("--ended", type=int, default=8, help="file sets of processes that ended (default 8)")
        parser.add_argument("--live", type=int, default=2, help="file sets of running processes (default 2)")
        parser.add_argument("--rounds", type=int, default=5, help="scrapes of each kind (default 5)")

    def handle(self, *args, models: int, tools: int, ended: int, live: int, rounds: int, **options) -> None:
        if min(models, tools, rounds) < 1 or min(ended, live) < 0 or ended + live < 1:
            raise CommandError(
                "--models, --tools and --rounds must be at least 1, --ended and --live at least 0, one of them above 0"
            )
        result = bench_metrics(models=models, tools=tools, ended=ended, live=live, rounds=rounds)
        out = self.stdout.write
        out(
            f"/metrics with {result.series} series ({result.samples} samples) per process, file sets of "
            f"{result.ended} ended and {result.live} running processes (ms):"
        )
        out(f"  first scrape (compacts the ended processes' files): {result.first_ms:.1f}")
        for name, s in (
            ("/metrics after it", result.product),
            ("prometheus-client, same directory", result.baseline),
            ("prometheus-client, as written", result.uncompacted),
        ):
            out(f"  {name + ':':<36} median {s.median_ms:.1f}  p95 {s.p95_ms:.1f}  ({s.count} scrapes)")
        out(f"  ratio /metrics / prometheus-client on the same directory: median {result.ratio_median:.2f}x")
