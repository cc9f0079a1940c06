"""``python manage.py bench_audit_writes [--writes N] [--threads 1,8]``:
print the cost of a lease-checked audit write; see :mod:`benchmarks.audit_writes`."""

from __future__ import annotations

import statistics

from django.core.management.base import CommandError

from audit.ledger.handover import dispatch_held
from audit.management.commands._database import DatabaseCommand
from benchmarks.audit_writes import bench_audit_writes


class Command(DatabaseCommand):
    help = (
        "Benchmark one lease-checked audit write (model_call_start) against the equivalent raw SQL "
        "transaction on the configured database: median and p95 latency, their ratio, and writes per "
        "second with 1 and 8 threads; then the close of a model row without and with its cost (R-COST-1). "
        "Creates and deletes its own user, threads and runs."
    )

    def add_arguments(self, parser):
        parser.add_argument("--writes", type=int, default=500, help="measured writes per path and per thread")
        parser.add_argument("--warmup", type=int, default=50, help="unmeasured writes per path first")
        parser.add_argument("--threads", default="1,8", help="comma-separated thread counts (default 1,8)")
        parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; figures are their median")

    def handle(self, *args, writes: int, warmup: int, threads: str, rounds: int, **options) -> None:
        try:
            counts = tuple(int(n) for n in threads.split(",") if n.strip())
        except ValueError as exc:
            raise CommandError(f"--threads must be comma-separated integers, not {threads!r}") from exc
        if writes < 2 or warmup < 0 or not counts or min(counts) < 1 or rounds < 1:
            raise CommandError(
                "--writes must be at least 2, --warmup at least 0, thread counts and --rounds at least 1"
            )
        # The benchmark starts its own runs: no worker may take them first.
        with dispatch_held():
            result = bench_audit_writes(writes=writes, warmup=warmup, thread_counts=counts, rounds=rounds)
        out = self.stdout.write
        per_round = result.round_median_ms
        out(f"lease-checked audit write, {rounds} interleaved round(s) of {writes} writes per path (ms):")
        for i in range(rounds):
            out(
                f"  round {i + 1}: service median {per_round['service'][i]:.3f}  raw median "
                f"{per_round['raw'][i]:.3f}  ratio {per_round['ratio'][i]:.2f}x"
            )
        out(f"  service (model_call_start): median {result.service.median_ms:.3f}  p95 {result.service.p95_ms:.3f}")
        out(f"  raw SQL transaction:        median {result.raw_sql.median_ms:.3f}  p95 {result.raw_sql.p95_ms:.3f}")
        out(
            f"  ratio service / raw:        median {result.ratio_median:.2f}x (median of the rounds; target <= 1.5x)"
            f"  p95 {result.ratio_p95:.2f}x"
        )
        for n, per_second in result.writes_per_second.items():
            raw = result.raw_writes_per_second[n]
            rows = result.round_writes_per_second[n]
            ratios = [svc / base for svc, base in zip(rows["service"], rows["raw"], strict=True)]
            out(
                f"  writes per second with {n} thread(s), one run each: service {per_second:.0f}, "
                f"raw {raw:.0f}, service / raw {statistics.median(ratios):.2f} "
                "(median of the rounds' ratios; target >= 0.67 at 8)"
            )
            out(
                "    per round: service "
                + " ".join(f"{v:.0f}" for v in rows["service"])
                + " / raw "
                + " ".join(f"{v:.0f}" for v in rows["raw"])
            )
        off = result.service_metrics_off
        out(f"Prometheus metrics on a write, {result.metrics_mode} (R-OPS-1):")
        out(f"  service, metrics off:       median {off.median_ms:.3f}  p95 {off.p95_ms:.3f}")
        out(f"  metrics on / off:           median {result.service.median_ms / off.median_ms:.3f}x")
        share = result.metrics_update_us / 1000 / off.median_ms * 100
        out(f"  metric update per write:    {result.metrics_update_us:.2f} us = {share:.2f}% of the median write")
        out(f"model row close (model_call_finish), {writes} samples per variant (ms):")
        for name, summary in result.close.items():
            ratio = result.close_ratio_median[name]
            out(f"  {name + ':':<24} median {summary.median_ms:.3f}  p95 {summary.p95_ms:.3f}  ({ratio:.2f}x)")
