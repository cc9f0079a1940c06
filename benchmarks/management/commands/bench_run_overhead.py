"""``python manage.py bench_run_overhead [--runs N] [--rounds 5]``: print
what the product's run path costs over the bare graph and over LangGraph's
checkpointer; see :mod:`benchmarks.run_overhead`."""

from __future__ import annotations

from django.core.management.base import CommandError

from audit.ledger.handover import dispatch_held
from audit.management.commands._database import DatabaseCommand
from benchmarks.run_overhead import VARIANTS, bench_run_overhead, settle_unless_autovacuum


class Command(DatabaseCommand):
    help = (
        "Benchmark one run (2 model calls + 1 tool, replay model at 0 ms, in process) four ways, interleaved: "
        "the plain graph, the graph with AsyncPostgresSaver (a connection per run, as LangGraph documents it), "
        "the product's full run path, and the graph with the product's checkpointer (its connection kept from "
        "run to run). Prints the medians, the checkpointer's and the product's overhead and their ratio "
        "(target <= 1.0x), the audit's cost alone (product - kept checkpointer), the CPU per run of each (this "
        "process and the local PostgreSQL servers) with the audit's CPU against the checkpointer's, and the "
        "process's memory every --rss-every product runs. Creates and deletes its own user, threads and runs."
    )

    def add_arguments(self, parser):
        parser.add_argument("--runs", type=int, default=40, help="runs per variant and round")
        parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; figures are their median")
        parser.add_argument("--warmup", type=int, default=5, help="unmeasured runs per variant first")
        parser.add_argument("--rss-every", type=int, default=200, help="sample memory every N product runs")
        parser.add_argument(
            "--memory-runs",
            type=int,
            default=0,
            help="then N more product runs alone (untimed) for the memory samples, e.g. 2000",
        )

    def handle(self, *args, runs: int, rounds: int, warmup: int, rss_every: int, memory_runs: int, **options) -> None:
        if runs < 1 or rounds < 1 or warmup < 0 or rss_every < 1 or memory_runs < 0:
            raise CommandError(
                "--runs, --rounds and --rss-every must be at least 1, --warmup and --memory-runs at least 0"
            )
        settle_unless_autovacuum(self.stdout.write)
        # The benchmark starts its own runs: no worker may take them first.
        with dispatch_held():
            result = bench_run_overhead(
                runs=runs, rounds=rounds, warmup=warmup, rss_every=rss_every, memory_runs=memory_runs
            )
        out = self.stdout.write
        med = result.median
        out(f"one run (2 model calls + 1 tool, replay at 0 ms), {rounds} round(s) of {runs} runs per variant (ms):")
        for i in range(rounds):
            figures = "  ".join(f"{v} {result.round_median_ms[v][i]:.1f}" for v in VARIANTS)
            out(
                f"  round {i + 1}: {figures}  | checkpointer +{result.round_checkpointer_overhead_ms[i]:.1f}"
                f"  product +{result.round_product_overhead_ms[i]:.1f}  ratio {result.round_ratio[i]:.2f}x"
                f"  audit alone +{result.round_audit_ms[i]:.1f} ({result.round_audit_ratio[i]:.2f}x)"
            )
        for v in VARIANTS:
            out(f"  {v + ':':<14} median {med(result.round_median_ms[v]):.1f}")
        out(f"  checkpointer overhead (checkpointer - plain graph): {med(result.round_checkpointer_overhead_ms):.1f}")
        out(f"  product overhead (product - checkpointer):          {med(result.round_product_overhead_ms):.1f}")
        out(
            f"  ratio product / checkpointer overhead: {med(result.round_ratio):.2f}x (median of the rounds; target <= 1.0x)"
        )
        out(
            f"  the audit alone (product - kept checkpointer):      {med(result.round_audit_ms):.1f}"
            f" ({med(result.round_audit_ratio):.2f}x the checkpointer's overhead; the product's run keeps its"
            " checkpointer connection from run to run, LangGraph's opens one per run)"
        )
        out(
            "CPU per run (ms; mean per round, median of the rounds): this process"
            + (" / the local PostgreSQL servers" if result.has_server_cpu else " (the servers' cannot be read here)")
        )
        for v in VARIANTS:
            server = f" / {med(result.round_server_cpu_ms[v]):.1f}" if result.has_server_cpu else ""
            out(f"  {v + ':':<17} {med(result.round_cpu_ms[v]):.1f}{server}")
        for server in (False, True) if result.has_server_cpu else (False,):
            audit = result.cpu_overhead_ms("product", "kept checkpointer", server=server)
            saver = result.cpu_overhead_ms("kept checkpointer", "plain graph", server=server)
            ratio = f"{audit / saver:.2f}x" if saver > 0 else "n/a"
            out(
                f"  the audit alone (product - kept checkpointer), {'process + server' if server else 'process'}:"
                f" +{audit:.1f} against the checkpointer's +{saver:.1f} (kept checkpointer - plain graph):"
                f" {ratio} (target <= 1.0x)"
            )
        out(f"worker memory (RSS) after N product runs (counting the {warmup} warm-up runs):")
        for count, rss in result.rss_mib:
            out(f"  {count:>6} runs: {rss:.1f} MiB")
        out("its runs were deleted and the dashboard's rollups of the days it ran recomputed (rebuild_rollups)")
