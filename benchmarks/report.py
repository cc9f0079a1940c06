"""The performance page, ``docs/performance.md`` (issue 40).

One current table, written by ``manage.py performance_report --write
docs/performance.md``: every figure beside the same work done without the
product (its baseline), their ratio, the target and whether it is met; the
machine it ran on (CPUs, load before and after, versions); and the command
that reproduces each figure. The dated history of earlier sessions is not
kept here.

This module is pure: it turns the benchmarks' result objects
(:class:`benchmarks.audit_writes.BenchResult`, :class:`benchmarks.run_overhead.
RunOverheadResult`, :class:`benchmarks.seal.SealBench`,
:class:`benchmarks.purge.PurgeBench`,
:class:`benchmarks.otel_export.OtelExportBench`,
:class:`benchmarks.metrics_scrape.MetricsBench`, the
:class:`benchmarks.read_paths.Endpoint` list) into :class:`PerformanceRow`
values and renders the page; it runs nothing and touches no database. The
command (:mod:`benchmarks.management.commands.performance_report`) runs the
benchmarks and measures the machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .figures import percentile

#: The command that writes the page; the page says so in its first lines.
GENERATOR = "manage.py performance_report --write docs/performance.md"

#: The table's header and rule, as rendered (the page test looks for it).
TABLE_HEADER = "| figure | product | baseline (same work) | ratio | target | met |"
TABLE_RULE = "|---|---|---|---|---|---|"

#: What each benchmark's baseline is, one line each, keyed by the
#: benchmark command's name (the word after ``manage.py``).
BASELINES = {
    "bench_audit_writes": (
        "a raw psycopg transaction on its own connection doing the write's work (BEGIN; lock the run row and "
        "compare its lease; INSERT one message row; COMMIT); for throughput the same with as many writers; "
        "for the close, the same close without its cost; for the metrics, the write with metrics off."
    ),
    "bench_run_overhead": (
        "the same agent turn (2 model calls, 1 tool, replay model at 0 ms) on the bare graph and on LangGraph's "
        "AsyncPostgresSaver opened per run as LangGraph documents it; the ratio compares the overheads over the "
        "bare graph. Memory: the same process's first sample after warm-up."
    ),
    "bench_seal": "the same terminal transaction (run_finish) on the same kind of run with the seal switched off.",
    "bench_purge": (
        "the same purge done by hand in the cheapest way: per batch of the same size one transaction that locks "
        "the runs, checks each seal with the product's check, empties the same columns with one UPDATE ... FROM "
        "(VALUES ...), re-seals with the product's seal functions and records the reseals (issue 38)."
    ),
    "bench_otel_export": (
        "the same runs and audit rows read with psycopg (one statement per page of runs, one for their rows), "
        "made into spans with the same names, parents, attributes and links by a bare SDK tracer and sent by "
        "the same SDK OTLP/HTTP exporter to the same in-process receiver (issue 38)."
    ),
    "bench_metrics": (
        "prometheus-client's own exposition (generate_latest of its MultiProcessCollector) of the same "
        "directory; a second row compares with it on the directory as written, before the files of ended "
        "processes are compacted (issue 38)."
    ),
    "bench_read_paths": (
        "the best SQL for the same answer (hand-written, or the statements the endpoint ran), its EXPLAIN "
        "ANALYZE execution time (median of 3); the ratio is the endpoint's p50 over HTTP to it. The p95 targets are "
        "set for 1M audit rows: a smaller dataset meets them more easily (--read-rows 1000000 to compare)."
    ),
}


@dataclass(frozen=True)
class Target:
    """A figure's target: ``limit`` with ``at_most`` (``≤``) or not
    (``≥``), on the value named by ``label`` ("" for the ratio column,
    e.g. ``"p95"``), in ``unit`` (``"x"`` for a ratio, ``" ms"``)."""

    limit: float
    at_most: bool = True
    unit: str = "x"
    label: str = ""

    def met(self, value: float) -> bool:
        """Whether ``value`` (in the target's unit) meets the target."""
        return value <= self.limit if self.at_most else value >= self.limit

    def __str__(self) -> str:
        sign = "≤" if self.at_most else "≥"
        # Ratios as the table prints them (1.10x, not 1.1x).
        limit = f"{self.limit:.2f}" if self.unit == "x" else f"{self.limit:g}"
        return f"{self.label + ' ' if self.label else ''}{sign} {limit}{self.unit}"


@dataclass(frozen=True)
class PerformanceRow:
    """One line of the table.

    ``product`` and ``baseline`` are display strings with their units (ms,
    MiB, writes/s); ``ratio`` is product / baseline (None when there is no
    baseline); ``target`` is the target's text ("" for none); ``met`` is
    True/False against the target, None without one; ``reproduce`` is the
    exact ``manage.py …`` command that measures the figure again."""

    figure: str
    product: str
    baseline: str
    ratio: float | None
    target: str
    met: bool | None
    reproduce: str


@dataclass(frozen=True)
class Machine:
    """Where the figures were taken: CPU count, load averages (1, 5, 15
    min) before and after the benchmarks, and versions ("" when unknown)."""

    cpus: int
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    python: str
    postgresql: str
    redis: str = ""


def row(
    figure: str,
    product: str,
    baseline: str,
    ratio: float | None,
    reproduce: str,
    *,
    target: Target | None = None,
    measured: float | None = None,
) -> PerformanceRow:
    """A :class:`PerformanceRow` whose ``met`` is computed: the target is
    checked on ``measured`` when given (e.g. a p95 in ms), else on
    ``ratio``; without a target (or without a value) ``met`` is None."""
    value = ratio if measured is None else measured
    met = None if target is None or value is None else target.met(value)
    return PerformanceRow(figure, product, baseline, ratio, str(target) if target else "", met, reproduce)


def _ms(value: float) -> str:
    return f"{value:.3f} ms" if value < 10 else f"{value:.1f} ms"


def audit_write_rows(result, reproduce: str) -> list[PerformanceRow]:
    """Rows of a :class:`benchmarks.audit_writes.BenchResult`: the write's median and
    p95 against the raw transaction (target ≤ 1.5x on the median of the
    rounds' ratios), writes per second per thread count against the raw
    writers (target ≥ 0.67 at 8 or more writers), the metrics' cost, and the
    model close with its cost against the close without (target ≤ 1.10x)."""
    rows = [
        row(
            "audit write (model_call_start), median",
            _ms(result.service.median_ms),
            f"{_ms(result.raw_sql.median_ms)} raw SQL transaction",
            result.ratio_median,
            reproduce,
            target=Target(1.5),
        ),
        row(
            "audit write (model_call_start), p95",
            _ms(result.service.p95_ms),
            f"{_ms(result.raw_sql.p95_ms)} raw SQL transaction",
            result.ratio_p95,
            reproduce,
        ),
    ]
    for n, per_second in result.writes_per_second.items():
        per_round = result.round_writes_per_second.get(n)
        if per_round:  # as the benchmark's command reports it: the median of the rounds' ratios
            ratio = statistics.median(s / r for s, r in zip(per_round["service"], per_round["raw"], strict=True))
        else:
            ratio = per_second / result.raw_writes_per_second[n]
        rows.append(
            row(
                f"audit writes per second, {n} writer{'s' if n > 1 else ''}",
                f"{per_second:,.0f} writes/s",
                f"{result.raw_writes_per_second[n]:,.0f} writes/s raw",
                ratio,
                reproduce,
                # The target is issue 11's for 8 writers; fewer writers do not contend.
                target=Target(0.67, at_most=False) if n >= 8 else None,
            )
        )
    off = result.service_metrics_off
    rows.append(
        row(
            "audit write with Prometheus metrics, median",
            _ms(result.service.median_ms),
            f"{_ms(off.median_ms)} metrics off",
            result.service.median_ms / off.median_ms,
            reproduce,
        )
    )
    base = result.close.get("without cost")
    for name, summary in result.close.items():
        if name == "without cost":
            continue
        rows.append(
            row(
                f"model close with cost ({name}), median",
                _ms(summary.median_ms),
                f"{_ms(base.median_ms)} without cost",
                result.close_ratio_median[name],
                reproduce,
                target=Target(1.10),
            )
        )
    return rows


def run_overhead_rows(result, reproduce: str, *, warmup: int) -> list[PerformanceRow]:
    """Rows of a :class:`benchmarks.run_overhead.RunOverheadResult`: the run
    path (product overhead / checkpointer overhead, target ≤ 1.0x), the
    audit alone (product − kept checkpointer, no target), and the worker's
    memory (last sample / first sample after the ``warmup`` runs, target
    ≤ 1.05x: this page's reading of "flat after warm-up")."""
    med = statistics.median
    product = med(result.round_median_ms["product"])
    checkpointer = med(result.round_median_ms["checkpointer"])
    plain = med(result.round_median_ms["plain graph"])
    kept = med(result.round_median_ms["kept checkpointer"])
    rows = [
        row(
            "run path overhead over the bare graph (one turn)",
            f"+{med(result.round_product_overhead_ms):.1f} ms (product run {product:.1f} ms)",
            f"+{med(result.round_checkpointer_overhead_ms):.1f} ms LangGraph checkpointer "
            f"({checkpointer:.1f} ms; bare graph {plain:.1f} ms)",
            med(result.round_ratio),
            reproduce,
            target=Target(1.0),
        ),
        row(
            "the audit alone (product − kept checkpointer)",
            f"+{med(result.round_audit_ms):.1f} ms (kept checkpointer {kept:.1f} ms)",
            f"+{med(result.round_checkpointer_overhead_ms):.1f} ms LangGraph checkpointer",
            med(result.round_audit_ratio),
            reproduce,
        ),
    ]
    rows += run_cpu_rows(result, reproduce)
    # Samples taken during the warm-up are not the baseline: the process
    # still grows then (imports, caches, connections).
    settled = [sample for sample in result.rss_mib if sample[0] >= warmup]
    if len(settled) >= 2:
        (first_runs, first), (last_runs, last) = settled[0], settled[-1]
        rows.append(
            row(
                f"worker RSS after {last_runs:,} product runs",
                f"{last:.1f} MiB",
                f"{first:.1f} MiB after {first_runs:,}",
                last / first,
                reproduce,
                target=Target(1.05),
            )
        )
    return rows


def run_cpu_rows(result, reproduce: str) -> list[PerformanceRow]:
    """CPU rows of a :class:`benchmarks.run_overhead.RunOverheadResult`
    (issue 38 item 4): the audit alone (product − kept checkpointer, both
    keeping their connection) against LangGraph's checkpointer (kept
    checkpointer − bare graph), per run, in this process and with the
    local PostgreSQL server's CPU added; target ≤ 1.0x. Wall-time
    differences swing with the machine's load, CPU time much less."""
    if not result.round_cpu_ms.get("product"):
        return []
    rows = []
    for server in (False, True) if result.has_server_cpu else (False,):
        where = "process + PostgreSQL" if server else "process"
        audit = result.cpu_overhead_ms("product", "kept checkpointer", server=server)
        saver = result.cpu_overhead_ms("kept checkpointer", "plain graph", server=server)
        rows.append(
            row(
                f"the audit alone, CPU per run ({where})",
                f"+{audit:.1f} ms CPU (product − kept checkpointer)",
                f"+{saver:.1f} ms CPU LangGraph checkpointer (kept checkpointer − bare graph)",
                audit / saver if saver > 0 else None,
                reproduce,
                target=Target(1.0),
            )
        )
    return rows


def seal_rows(result, reproduce: str) -> list[PerformanceRow]:
    """Rows of a :class:`benchmarks.seal.SealBench`: the terminal
    transaction with the seal against the same without it (no target)."""
    return [
        row(
            f"terminal transaction with the seal ({result.rows_per_run} audit rows), median",
            _ms(result.with_seal.median_ms),
            f"{_ms(result.without_seal.median_ms)} without the seal",
            result.ratio_median,
            reproduce,
        )
    ]


def purge_rows(result, reproduce: str) -> list[PerformanceRow]:
    """Rows of a :class:`benchmarks.purge.PurgeBench`: the payload purge's
    audit rows per second against the same work done by hand, re-seal
    included (target ≥ 0.5x on the median of the rounds' ratios, issue 38)."""
    return [
        row(
            f"payload purge, rows per second ({result.rows_per_run} audit rows per run, batches of "
            f"{result.batch_runs} runs), median",
            f"{result.product_median:,.0f} rows/s",
            f"{result.baseline_median:,.0f} rows/s by hand",
            result.ratio_median,
            reproduce,
            target=Target(0.5, at_most=False),
        )
    ]


def otel_export_rows(result, reproduce: str) -> list[PerformanceRow]:
    """Rows of a :class:`benchmarks.otel_export.OtelExportBench`: the
    export's spans per second against the same work with psycopg (target
    ≥ 0.5x, issue 38)."""
    return [
        row(
            f"OpenTelemetry export, spans per second ({result.rows_per_run} audit rows per run), median",
            f"{result.product_median:.0f} spans/s",
            f"{result.baseline_median:.0f} spans/s",
            result.ratio_median,
            reproduce,
            target=Target(0.5, at_most=False),
        )
    ]


def metrics_rows(result, reproduce: str) -> list[PerformanceRow]:
    """Rows of a :class:`benchmarks.metrics_scrape.MetricsBench`: a
    ``/metrics`` scrape against prometheus-client's own exposition of the
    same directory (target ≤ 1.2x, issue 38), and against it on the files
    as written (no target: what compaction saves)."""
    sets = f"{result.series} series, {result.ended} ended + {result.live} running processes"
    return [
        row(
            f"/metrics scrape ({sets}), median",
            f"{result.product.median_ms:.0f} ms",
            f"{result.baseline.median_ms:.0f} ms",
            result.ratio_median,
            reproduce,
            target=Target(1.2),
        ),
        row(
            f"/metrics scrape against the files as written ({sets}), median",
            f"{result.product.median_ms:.0f} ms",
            f"{result.uncompacted.median_ms:.0f} ms",
            result.product.median_ms / result.uncompacted.median_ms,
            reproduce,
        ),
    ]


#: p95 targets (ms) of the read paths at 1M audit rows (issue 11), by the
#: start of the endpoint's name; the first match wins.
READ_TARGETS_MS = (
    ("run timeline", 30.0),
    ("thread timeline", 30.0),
    ("history", 20.0),
    ("memory", 30.0),
    ("admin run page live refresh", 100.0),
    ("admin run page", 150.0),
    ("admin run list", 100.0),
    ("admin thread list", 100.0),
    ("admin message list", 100.0),
    ("dashboard", 100.0),
)


def read_target(name: str) -> Target | None:
    """The p95 target of the read endpoint called ``name``, or None."""
    for prefix, limit in READ_TARGETS_MS:
        if name.startswith(prefix):
            return Target(limit, unit=" ms", label="p95")
    return None


def read_path_rows(points, reproduce: str, *, audit_rows: int) -> list[PerformanceRow]:
    """Rows of :func:`benchmarks.read_paths.measure`'s endpoints (each with
    ``name``, ``samples_ms``, ``sql_ms``, ``sql_source``) on a dataset of
    ``audit_rows`` rows: p50 / p95 over HTTP against the best SQL's time,
    the ratio p50 / SQL, the p95 target where issue 11 set one (for 1M
    rows: a smaller dataset meets it more easily, so the size is in the
    figure's name)."""
    rows = []
    for p in points:
        p50, p95 = statistics.median(p.samples_ms), percentile(p.samples_ms, 0.95)
        rows.append(
            row(
                f"read ({audit_rows:,} rows): {p.name}",
                f"p50 {p50:.1f} / p95 {p95:.1f} ms",
                f"{p.sql_ms:.2f} ms SQL ({p.sql_source})" if p.sql_ms else "—",
                p50 / p.sql_ms if p.sql_ms else None,
                reproduce,
                target=read_target(p.name),
                measured=p95,
            )
        )
    return rows


#: How much a read's p95 may grow from the smaller dataset to the larger
#: (issue 38: 10 M audit rows at most 1.3x the figure at 1 M).
READ_SCALING_TARGET = Target(1.3)


def read_scaling_rows(small, large, reproduce: str, *, small_rows: int, large_rows: int) -> list[PerformanceRow]:
    """Rows comparing each read endpoint's p95 on the larger dataset
    (``large``, ``large_rows`` audit rows) with its p95 on the smaller
    (``small``): the same endpoints of :func:`benchmarks.read_paths.measure`
    (matched by name; the big run and the long thread are the same size
    from 1 M rows up). The ratio is large / small; an endpoint with a p95
    target must stay flat (:data:`READ_SCALING_TARGET`)."""
    by_name = {p.name: p for p in small}
    rows = []
    for p in large:
        before = by_name.get(p.name)
        if before is None:
            continue
        p95, p95_before = percentile(p.samples_ms, 0.95), percentile(before.samples_ms, 0.95)
        rows.append(
            row(
                f"read p95, {large_rows:,} vs {small_rows:,} rows: {p.name}",
                f"{p95:.1f} ms",
                f"{p95_before:.1f} ms at {small_rows:,} rows",
                p95 / p95_before if p95_before else None,
                reproduce,
                target=READ_SCALING_TARGET if read_target(p.name) else None,
            )
        )
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _load(load: Sequence[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in load)


def _command_name(reproduce: str) -> str:
    words = reproduce.split()
    return words[words.index("manage.py") + 1] if "manage.py" in words else words[0]


def render_markdown(rows: Iterable[PerformanceRow], machine: Machine) -> str:
    """The whole ``docs/performance.md`` page (Markdown, ending in a newline):
    what the page is, the machine, one table of ``rows`` (figure | product |
    baseline (same work) | ratio | target | met), then how to reproduce each
    benchmark (its command with the sizes used, once each in the order of
    the rows) and what its baseline is."""
    rows = list(rows)
    lines = [
        "# Performance",
        "",
        "The product's current performance figures, each beside its baseline: the same work done without the "
        "product (a raw transaction, LangGraph's own checkpointer, the best SQL for the same answer), with "
        "their ratio and the target. This page is generated by "
        f"`{GENERATOR}` (do not edit it by hand; run the command again). Figures move 20–30% with the "
        "machine's load: compare a figure with its baseline, measured beside it, not with another machine's.",
        "",
        "## Machine",
        "",
        f"- CPUs: {machine.cpus}",
        f"- load average (1 / 5 / 15 min): {_load(machine.load_before)} before, {_load(machine.load_after)} after",
        f"- Python {machine.python}",
        f"- PostgreSQL {machine.postgresql or 'unknown'}",
    ]
    if machine.redis:
        lines.append(f"- Redis {machine.redis}")
    lines += ["", "## Figures", "", TABLE_HEADER, TABLE_RULE]
    for r in rows:
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "—"
        met = {True: "✓", False: "✗", None: "—"}[r.met]
        cells = (r.figure, r.product, r.baseline, ratio, r.target or "—", met)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += [
        "",
        "Ratio: product / baseline (for the run path, the product's overhead over the bare graph / the "
        "checkpointer's). Met: ✓ / ✗ against the target, — where there is none.",
        "",
        "## Reproduce",
        "",
    ]
    seen: list[str] = []
    for r in rows:
        if r.reproduce not in seen:
            seen.append(r.reproduce)
    for command in seen:
        lines.append(f"- `{command}`")
        note = BASELINES.get(_command_name(command))
        if note:
            lines.append(f"  Baseline: {note}")
    return "\n".join(lines) + "\n"
