"""``python manage.py performance_report [--write docs/performance.md]``:
run the benchmarks at short sizes and print (or write) the performance page
with one current table; see :mod:`benchmarks.report`.

Runs, in this order and each inside ``dispatch_held`` (its runs are its
own, no worker may take them): ``bench_audit_writes``,
``bench_run_overhead`` (after ``settle_unless_autovacuum``, as its command
does), ``bench_seal``, ``bench_purge``, ``bench_otel_export``, ``bench_metrics`` and ``bench_read_paths`` (its dataset in a database
of its own, ``<database>_report_bench``, created, migrated and dropped
here; with ``--read-keep``, ``<database>_bench_<rows>``, kept and reused).
With several ``--read-rows`` sizes each is measured and the largest's p95
compared with the smallest's (issue 38: flat, at most 1.3x from 1 M to
10 M audit rows). ``bench_dashboard`` is not run: it empties the rollup tables of the
database it is given and has no library function returning figures; the
dashboard's endpoints are measured by ``bench_read_paths``. Progress goes
to stderr, the page to stdout or ``--write``.
"""

from __future__ import annotations

import io
import os
import platform
import time
from pathlib import Path

from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from audit.management.commands._database import DatabaseCommand
from benchmarks import report

BENCHMARKS = ("audit_writes", "run_overhead", "seal", "purge", "otel_export", "metrics", "read_paths")

# Short defaults, so that the whole report takes a few minutes on a 2-core
# machine: measured on an idle one, bench_audit_writes 24 s,
# bench_run_overhead 44 s, bench_seal 2 s, bench_read_paths at 200,000 rows
# 47 s with 3 rounds (about a minute with 5): about 2.5 minutes in all;
# bench_purge adds about 50 s, most of it driving its 400 sealed runs.
# The first three are the sizes the README's figures were taken with; the
# read paths' targets are for 1M rows (--read-rows 1000000: several minutes
# more, most of it building the dataset and its rollups; 10,000,000: about
# 8 minutes to build and 15 to roll up, once with --read-keep).
DEFAULTS = {
    "writes": 200,
    "rounds": 5,
    "runs": 30,
    "seal_runs": 40,
    "purge_runs": 100,
    "otel_runs": 60,
    "metrics_models": 300,
    "read_rows": 200_000,
    "read_rounds": 5,
    "read_repeat": 10,
}


class Command(DatabaseCommand):
    help = (
        "Run the benchmarks (bench_audit_writes, bench_run_overhead, bench_seal, bench_purge, bench_otel_export, bench_metrics, bench_read_paths) at short sizes "
        "and print the performance page: one table of every figure beside its same-work baseline, the ratio, the "
        "target and whether it is met, the machine's load before and after, and the command reproducing each. "
        "With --write PATH the page is written there (docs/performance.md). Leaves the database as it was."
    )

    def add_arguments(self, parser):
        d = DEFAULTS
        parser.add_argument("--writes", type=int, default=d["writes"], help="bench_audit_writes --writes")
        parser.add_argument(
            "--rounds", type=int, default=d["rounds"], help="rounds of bench_audit_writes and bench_run_overhead"
        )
        parser.add_argument(
            "--writers",
            default="1,8",
            help="bench_audit_writes --threads: comma-separated writer counts (default 1,8; at most the pool's 8)",
        )
        parser.add_argument("--runs", type=int, default=d["runs"], help="bench_run_overhead --runs (per round)")
        parser.add_argument("--seal-runs", type=int, default=d["seal_runs"], help="bench_seal --runs")
        parser.add_argument("--purge-runs", type=int, default=d["purge_runs"], help="bench_purge --runs")
        parser.add_argument("--otel-runs", type=int, default=d["otel_runs"], help="bench_otel_export --runs")
        parser.add_argument(
            "--metrics-models", type=int, default=d["metrics_models"], help="bench_metrics --models (100 tools)"
        )
        parser.add_argument(
            "--read-rows",
            default=str(d["read_rows"]),
            help="bench_read_paths --rows: comma-separated sizes (e.g. 1000000,10000000: each measured, and the "
            "largest compared with the smallest)",
        )
        parser.add_argument(
            "--read-keep",
            action="store_true",
            help="keep each read dataset in a database <database>_bench_<rows> and reuse one that holds it "
            "(as bench_read_paths --database <database>_bench_<rows> built it), its rollups as they are",
        )
        parser.add_argument("--read-rounds", type=int, default=d["read_rounds"], help="bench_read_paths --rounds")
        parser.add_argument("--read-repeat", type=int, default=d["read_repeat"], help="bench_read_paths --repeat")
        parser.add_argument(
            "--skip",
            action="append",
            default=[],
            metavar="NAME",
            help=f"leave a benchmark out (repeatable): {', '.join(BENCHMARKS)}",
        )
        parser.add_argument("--write", default="", metavar="PATH", help="write the page to PATH instead of stdout")

    def handle(self, *args, **options) -> None:
        sizes = {k: options[k] for k in DEFAULTS}
        sizes["read_keep"] = options["read_keep"]
        skip = {name.removeprefix("bench_") for name in options["skip"]}
        unknown = skip - set(BENCHMARKS)
        if unknown:
            raise CommandError(f"--skip takes {', '.join(BENCHMARKS)}; not {', '.join(sorted(unknown))}")
        if skip >= set(BENCHMARKS):
            raise CommandError("--skip leaves no benchmark to run")
        too_small = [
            f"--{name.replace('_', '-')} must be at least {least}"
            for name, least in (
                ("writes", 2),
                ("rounds", 1),
                ("runs", 1),
                ("seal_runs", 4),
                ("purge_runs", 1),
                ("otel_runs", 1),
                ("metrics_models", 1),
                ("read_rounds", 1),
                ("read_repeat", 1),
            )
            if sizes[name] < least
        ]
        try:
            read_rows = tuple(int(part) for part in str(sizes["read_rows"]).split(","))
        except ValueError:
            read_rows = ()
        if not read_rows:
            too_small.append(f"--read-rows takes comma-separated row counts, not {sizes['read_rows']!r}")
        elif min(read_rows) < 1000:
            too_small.append("--read-rows must be at least 1000")
        sizes["read_rows"] = tuple(sorted(set(read_rows)))
        try:
            writers = tuple(int(part) for part in options["writers"].split(","))
        except ValueError:
            writers = ()
        if not writers or not all(1 <= n <= 8 for n in writers):
            too_small.append(f"--writers takes comma-separated counts from 1 to 8, not {options['writers']!r}")
        sizes["writers"] = writers
        if too_small:
            raise CommandError("; ".join(too_small))
        if connection.vendor != "postgresql":
            raise CommandError("performance_report needs PostgreSQL (DATABASE_URL=postgres://...)")
        target = Path(options["write"]) if options["write"] else None
        if target is not None and not target.parent.is_dir():
            raise CommandError(f"--write: no directory {target.parent}")

        log = self.stderr.write if options["verbosity"] > 0 else (lambda _line: None)
        load_before = os.getloadavg()
        started = time.monotonic()
        rows: list[report.PerformanceRow] = []
        for name in BENCHMARKS:
            if name in skip:
                continue
            log(f"{name} ...")
            began = time.monotonic()
            rows += getattr(self, f"_{name}")(sizes, log)
            log(f"{name}: {time.monotonic() - began:.0f} s")
        machine = report.Machine(
            cpus=os.cpu_count() or 0,
            load_before=load_before,
            load_after=os.getloadavg(),
            python=platform.python_version(),
            postgresql=_postgresql_version(),
            redis=_redis_version(),
        )
        page = report.render_markdown(rows, machine)
        log(f"all benchmarks: {time.monotonic() - started:.0f} s")
        if target is None:
            self.stdout.write(page, ending="")
        else:
            target.write_text(page, encoding="utf-8")
            log(f"wrote {target}")

    def _audit_writes(self, sizes: dict, log) -> list[report.PerformanceRow]:
        from audit.ledger.handover import dispatch_held
        from benchmarks.audit_writes import bench_audit_writes

        writes, rounds = sizes["writes"], sizes["rounds"]
        # Its warm-up as the command's default, but never more than the measured writes.
        warmup = min(50, writes)
        with dispatch_held():
            result = bench_audit_writes(writes=writes, warmup=warmup, thread_counts=sizes["writers"], rounds=rounds)
        threads = ",".join(str(n) for n in sizes["writers"])
        command = (
            f"manage.py bench_audit_writes --writes {writes} --warmup {warmup} --threads {threads} --rounds {rounds}"
        )
        return report.audit_write_rows(result, command)

    def _run_overhead(self, sizes: dict, log) -> list[report.PerformanceRow]:
        from audit.ledger.handover import dispatch_held
        from benchmarks.run_overhead import bench_run_overhead, settle_unless_autovacuum

        runs, rounds = sizes["runs"], sizes["rounds"]
        warmup = min(5, runs)
        # Memory sampled about five times over the product's runs.
        rss_every = max(1, runs * rounds // 5)
        settle_unless_autovacuum(log)
        with dispatch_held():
            result = bench_run_overhead(runs=runs, rounds=rounds, warmup=warmup, rss_every=rss_every)
        command = (
            f"manage.py bench_run_overhead --runs {runs} --rounds {rounds} --warmup {warmup} --rss-every {rss_every}"
        )
        return report.run_overhead_rows(result, command, warmup=warmup)

    def _seal(self, sizes: dict, log) -> list[report.PerformanceRow]:
        from audit.ledger.handover import dispatch_held
        from benchmarks.seal import bench_seal

        runs, rows = sizes["seal_runs"], 10
        with dispatch_held():
            result = bench_seal(runs=runs, rows=rows)
        return report.seal_rows(result, f"manage.py bench_seal --runs {runs} --rows {rows}")

    def _purge(self, sizes: dict, log) -> list[report.PerformanceRow]:
        from audit.ledger.handover import dispatch_held
        from benchmarks.purge import bench_purge

        runs, rows, batch_runs, rounds = sizes["purge_runs"], 10, 50, 2
        with dispatch_held():
            result = bench_purge(runs=runs, rows=rows, batch_runs=batch_runs, rounds=rounds)
        return report.purge_rows(
            result, f"manage.py bench_purge --runs {runs} --rows {rows} --batch-runs {batch_runs} --rounds {rounds}"
        )

    def _otel_export(self, sizes: dict, log) -> list[report.PerformanceRow]:
        from audit.ledger.handover import dispatch_held
        from benchmarks.otel_export import bench_otel_export

        runs, rows, rounds = sizes["otel_runs"], 10, 3
        with dispatch_held():
            result = bench_otel_export(runs=runs, rows=rows, rounds=rounds)
        return report.otel_export_rows(
            result, f"manage.py bench_otel_export --runs {runs} --rows {rows} --rounds {rounds}"
        )

    def _metrics(self, sizes: dict, log) -> list[report.PerformanceRow]:
        from benchmarks.metrics_scrape import bench_metrics

        models, tools, ended, live, rounds = sizes["metrics_models"], 100, 8, 2, 3
        result = bench_metrics(models=models, tools=tools, ended=ended, live=live, rounds=rounds)
        return report.metrics_rows(
            result,
            f"manage.py bench_metrics --models {models} --tools {tools} --ended {ended} --live {live} --rounds {rounds}",
        )

    def _read_paths(self, sizes: dict, log) -> list[report.PerformanceRow]:
        rows: list[report.PerformanceRow] = []
        measured = {}
        for size in sizes["read_rows"]:
            dataset, points, command = self._read_paths_at(size, sizes, log)
            rows += report.read_path_rows(points, command, audit_rows=dataset.audit_rows)
            measured[dataset.audit_rows] = (points, command)
        if len(measured) > 1:
            small, large = min(measured), max(measured)
            rows += report.read_scaling_rows(
                measured[small][0], measured[large][0], measured[large][1], small_rows=small, large_rows=large
            )
        return rows

    def _read_paths_at(self, size: int, sizes: dict, log):
        # The database helpers of bench_read_paths' command: its dataset
        # lives in a database of its own, never the configured one.
        from benchmarks import read_paths
        from benchmarks.databases import create_database, drop_database, use_database

        rounds, repeat, keep = sizes["read_rounds"], sizes["read_repeat"], sizes["read_keep"]
        original = connection.settings_dict["NAME"]
        # Not bench_read_paths' own <database>_bench, which may hold a large
        # dataset someone built on purpose: this one is dropped at the end,
        # unless kept (then one database per size).
        name = f"{original}_bench_{size}" if keep else f"{original}_report_bench"
        created = create_database(name, drop_first=not keep)
        use_database(name)
        try:
            call_command("migrate", verbosity=0, stdout=io.StringIO())
            dataset = None if created else read_paths.stored_dataset(size)
            if dataset is None:
                if not created:  # it holds another dataset: start again
                    use_database(original)
                    create_database(name, drop_first=True)
                    use_database(name)
                    call_command("migrate", verbosity=0, stdout=io.StringIO())
                log(f"building {size:,} audit rows in database {name} ...")
                dataset = read_paths.build_dataset(rows=size, log=lambda _line: None)
                call_command("rebuild_rollups", stdout=io.StringIO())
                if keep:
                    read_paths.store_dataset(dataset, size)
            else:
                log(f"reusing the {size:,}-row dataset in database {name}")
            read_paths.settle(log=lambda _line: None)
            points = read_paths.measure(dataset, rounds=rounds, repeat=repeat, log=log)
        finally:
            use_database(original)
            if not keep:
                drop_database(name)
        command = f"manage.py bench_read_paths --rows {size} --rounds {rounds} --repeat {repeat}"
        if keep:
            command += f" --database {name}"
        return dataset, points, command


def _postgresql_version() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        return cursor.fetchone()[0].split()[0]


def _redis_version() -> str:
    """The Redis server's version, or "" without Redis (embedded mode) or
    when it does not answer within a second."""
    from core.config import get_config

    url = get_config().REDIS_URL
    if not url:
        return ""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
        try:
            return str(client.info("server").get("redis_version", ""))
        finally:
            client.close()
    except redis.RedisError:
        return ""
