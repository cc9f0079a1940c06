"""The performance page (issue 40): :func:`benchmarks.report.render_markdown`
renders one table with each figure's baseline, ratio, target and whether it
is met; ``manage.py performance_report`` runs the benchmarks at tiny sizes,
prints the page and leaves the database as it was; the committed
``docs/performance.md`` keeps the generated structure (figures are never
asserted)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from audit.models import AgentRun
from benchmarks.report import TABLE_HEADER, TABLE_RULE, Machine, Target, render_markdown, row
from conversations.models import Message

PAGE = Path(__file__).resolve().parents[2] / "docs" / "performance.md"
MACHINE = Machine(
    cpus=2, load_before=(0.5, 0.4, 0.3), load_after=(1.5, 0.9, 0.4), python="3.12.1", postgresql="15.2", redis=""
)


def _table_lines(page: str) -> list[str]:
    lines = page.splitlines()
    start = lines.index(TABLE_HEADER)
    assert lines[start + 1] == TABLE_RULE
    body = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        body.append(line)
    return body


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip("|").split(" | ")]


def test_render_markdown_gives_one_table_line_per_row_and_computes_met():
    write = "manage.py bench_audit_writes --writes 200 --rounds 5"
    rows = [
        row("audit write, median", "0.900 ms", "1.000 ms raw", 0.9, write, target=Target(1.5)),
        row(
            "writes per second, 8 writers",
            "600 writes/s",
            "1,000 writes/s raw",
            0.6,
            write,
            target=Target(0.67, at_most=False),
        ),  # fmt: skip
        row("writes per second, 1 writer", "1,200 writes/s", "1,000 writes/s raw", 1.2, write),
        # The target on a value other than the ratio: a p95 in ms.
        row(
            "read: run timeline",
            "p50 20.0 / p95 31.0 ms",
            "0.20 ms SQL (hand)",
            100.0,
            "manage.py bench_read_paths --rows 1000",
            target=Target(30, unit=" ms", label="p95"),
            measured=31.0,
        ),  # fmt: skip
        row(
            "read: history",
            "p50 9.0 / p95 12.0 ms",
            "—",
            None,
            "manage.py bench_read_paths --rows 1000",
            target=Target(20, unit=" ms", label="p95"),
            measured=12.0,
        ),  # fmt: skip
    ]
    assert [r.met for r in rows] == [True, False, None, False, True]
    assert Target(1.5).met(1.5) and not Target(0.67, at_most=False).met(0.66)

    page = render_markdown(rows, MACHINE)
    table = _table_lines(page)
    assert len(table) == len(rows) == page.count("\n| ") - 1  # header + one line per row, one table
    assert _cells(table[0]) == ["audit write, median", "0.900 ms", "1.000 ms raw", "0.90x", "≤ 1.50x", "✓"]
    assert _cells(table[1])[3:] == ["0.60x", "≥ 0.67x", "✗"]
    assert _cells(table[2])[3:] == ["1.20x", "—", "—"]
    assert _cells(table[3])[4:] == ["p95 ≤ 30 ms", "✗"]
    assert _cells(table[4])[3:] == ["—", "p95 ≤ 20 ms", "✓"]
    # The page says what it is and how it is made, the machine, and each
    # benchmark's command once, with what its baseline is.
    assert "manage.py performance_report --write docs/performance.md" in page.split("## Machine")[0]
    assert "- CPUs: 2" in page and "0.50 / 0.40 / 0.30 before, 1.50 / 0.90 / 0.40 after" in page
    assert "PostgreSQL 15.2" in page and "Redis" not in page.split("## Figures")[0]
    reproduce = page.split("## Reproduce")[1]
    assert reproduce.count(f"`{write}`") == 1 and reproduce.count("`manage.py bench_read_paths --rows 1000`") == 1
    assert reproduce.count("Baseline:") == 2


def test_a_pipe_in_a_figure_does_not_break_the_table():
    r = row("search: a|b", "1.0 ms", "0.5 ms", 2.0, "manage.py bench_read_paths --rows 1000")
    (line,) = _table_lines(render_markdown([r], MACHINE))
    assert "a\\|b" in line


def _rollups() -> dict[str, list[tuple]]:
    """Every row of the dashboard's rollup tables, without their serial id."""
    from dashboard.facts import TABLES

    with connection.cursor() as cursor:
        rows = {}
        for table in TABLES:
            cursor.execute(f"SELECT * FROM {table} ORDER BY 1")
            rows[table] = [r[1:] for r in cursor.fetchall()]
    return rows


@pytest.fixture
def finished_run(user):
    """A completed run already in the rollups: figures the report must
    leave as they are."""
    from audit.ledger import run_acquire, run_finish
    from conversations.models import Conversation
    from tests.conftest import make_run

    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    run = make_run(thread)
    run_finish(lease=run_acquire(run_id=run.id, owner="test", ttl_seconds=60), status="completed")
    assert any(_rollups().values())
    return run


TINY = {
    "writes": 3,
    # The pool holds 8 connections and the test's own thread keeps one:
    # two writers show the throughput rows as eight do (as in
    # tests/audit/test_benchmark.py).
    "writers": "1,2",
    "rounds": 1,
    "runs": 1,
    "seal_runs": 4,
    "purge_runs": 2,
    "otel_runs": 2,
    "metrics_models": 2,
    "read_rows": 1000,
    "read_rounds": 1,
    "read_repeat": 1,
}
FIGURES = (
    "audit write (model_call_start), median",
    "audit write (model_call_start), p95",
    "audit writes per second, 1 writer",
    "audit writes per second, 2 writers",
    "audit write with Prometheus metrics, median",
    "model close with cost (replay default prices), median",
    "model close with cost (genai-prices catalogue), median",
    "run path overhead over the bare graph (one turn)",
    "the audit alone (product − kept checkpointer)",
    "worker RSS after",
    "terminal transaction with the seal (10 audit rows), median",
    "payload purge, rows per second (10 audit rows per run, batches of 50 runs), median",
    "OpenTelemetry export, spans per second",
    "/metrics scrape (",
    "/metrics scrape against the files as written",
    "read (1,000 rows): run timeline",
    "read (1,000 rows): thread timeline",
    "read (1,000 rows): history, recent turns",
    "read (1,000 rows): memory with tools",
    "read (1,000 rows): search: q=",
    "read (1,000 rows): dashboard overview",
    "read (1,000 rows): admin run page",
    "read (1,000 rows): admin run list",
)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_performance_report_prints_every_figure_and_leaves_the_database_as_it_was(finished_run):
    before, database = _rollups(), connection.settings_dict["NAME"]
    out = io.StringIO()
    call_command("performance_report", **TINY, stdout=out, stderr=io.StringIO())
    page = out.getvalue()
    figures = [_cells(line)[0] for line in _table_lines(page)]
    for figure in FIGURES:
        assert any(f.startswith(figure) for f in figures), figure
    for command in (
        "bench_audit_writes",
        "bench_run_overhead",
        "bench_seal",
        "bench_purge --runs 2",
        "bench_otel_export",
        "bench_metrics --models 2",
        "bench_read_paths --rows 1000",
    ):
        assert f"`manage.py {command}" in page, command
    assert list(AgentRun.objects.all()) == [finished_run]
    assert not Message.objects.exclude(run=finished_run).exists()
    assert _rollups() == before
    # The read paths' dataset lived in a database of its own, dropped after.
    assert connection.settings_dict["NAME"] == database
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_database(), count(*) FROM pg_database WHERE datname = %s", [f"{database}_report_bench"]
        )
        assert cursor.fetchone() == (database, 0)


@pytest.mark.django_db(transaction=True)
def test_performance_report_writes_the_page_and_skips_benchmarks(tmp_path):
    target = tmp_path / "performance.md"
    out = io.StringIO()
    call_command(
        "performance_report",
        **TINY,
        skip=["run_overhead", "bench_read_paths", "seal", "purge", "otel_export", "metrics"],
        write=str(target),
        stdout=out,
    )
    page = target.read_text(encoding="utf-8")
    figures = [_cells(line)[0] for line in _table_lines(page)]
    assert figures and all(f.startswith(("audit write", "model close")) for f in figures)
    assert out.getvalue() == ""  # the page went to the file
    assert not AgentRun.objects.exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"skip": ["dashboard"]}, "--skip takes"),
        (
            {"skip": ["audit_writes", "run_overhead", "seal", "purge", "otel_export", "metrics", "read_paths"]},
            "no benchmark",
        ),
        ({"purge_runs": 0}, "--purge-runs must be at least 1"),
        ({"otel_runs": 0}, "--otel-runs must be at least 1"),
        ({"metrics_models": 0}, "--metrics-models must be at least 1"),
        ({"writes": 1}, "--writes must be at least 2"),
        ({"read_rows": 10}, "--read-rows must be at least 1000"),
        ({"writers": "1,16"}, "--writers takes"),
        ({"writers": "eight"}, "--writers takes"),
        ({"write": "/no/such/directory/performance.md"}, "no directory"),
    ],
)
def test_performance_report_refuses_bad_arguments(db, options, message):
    with pytest.raises(CommandError, match=message):
        call_command("performance_report", **options, stdout=io.StringIO())


def test_the_committed_page_keeps_the_generated_structure():
    """docs/performance.md is written by the command: a hand edit of its
    opening or its table's columns fails here (its figures may be any)."""
    page = PAGE.read_text(encoding="utf-8")
    opening = render_markdown([], MACHINE).split("## Machine")[0]
    assert page.startswith(opening)
    assert f"\n{TABLE_HEADER}\n{TABLE_RULE}\n" in page
    table = _table_lines(page)
    assert table and all(len(_cells(line)) == 6 for line in table)
    assert page.count(TABLE_HEADER) == 1  # one table, no dated history
    for heading in ("## Machine", "## Figures", "## Reproduce"):
        assert f"\n{heading}\n" in page


def test_the_purge_row_compares_rows_per_second_with_the_same_work_by_hand():
    from benchmarks.purge import PurgeBench
    from benchmarks.report import purge_rows

    result = PurgeBench(
        runs=100,
        rows_per_run=10,
        batch_runs=50,
        rows_per_pass=1000,
        product_rows_per_s=[600.0, 800.0],
        baseline_rows_per_s=[1500.0, 1400.0],
        product_runs_per_s=[60.0, 80.0],
        baseline_runs_per_s=[150.0, 140.0],
    )
    (r,) = purge_rows(result, "manage.py bench_purge --runs 100")
    assert (r.product, r.baseline, r.target) == ("700 rows/s", "1,450 rows/s by hand", "≥ 0.50x")
    # The median of the rounds' ratios (0.40 and 0.57), not of the medians' ratio.
    assert r.ratio == pytest.approx((600 / 1500 + 800 / 1400) / 2) and r.met is False


def test_reads_on_two_datasets_are_compared_endpoint_by_endpoint_R_SCALE_1():
    from types import SimpleNamespace

    from benchmarks.report import read_scaling_rows

    def point(name, p95):
        return SimpleNamespace(name=name, samples_ms=[p95] * 20)

    small = [point("history, recent turns", 10.0), point("search: q=Paris (1 row in 50)", 20.0)]
    large = [point("history, recent turns", 14.0), point("search: q=Paris (1 row in 50)", 60.0), point("new", 1.0)]
    rows = read_scaling_rows(
        small, large, "manage.py bench_read_paths --rows 10000000", small_rows=1000, large_rows=10000
    )
    assert [(r.figure, r.ratio, r.target, r.met) for r in rows] == [
        ("read p95, 10,000 vs 1,000 rows: history, recent turns", pytest.approx(1.4), "≤ 1.30x", False),
        # A search gathering every match grows with them: no target.
        ("read p95, 10,000 vs 1,000 rows: search: q=Paris (1 row in 50)", pytest.approx(3.0), "", None),
    ]
    assert rows[0].product == "14.0 ms" and rows[0].baseline == "10.0 ms at 1,000 rows"


@pytest.mark.parametrize("value", ["1000,many", "", "999,2000"])
def test_performance_report_refuses_bad_read_sizes(db, value):
    with pytest.raises(CommandError, match="--read-rows"):
        call_command("performance_report", read_rows=value, stdout=io.StringIO())


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_performance_report_keeps_its_read_datasets_and_compares_two_sizes_R_SCALE_1():
    from benchmarks.databases import drop_database

    database = connection.settings_dict["NAME"]
    kept = [f"{database}_bench_1000", f"{database}_bench_2000"]
    only_reads = ["audit_writes", "run_overhead", "seal", "purge", "otel_export", "metrics"]
    options = {**TINY, "read_rows": "2000,1000", "read_keep": True, "skip": only_reads}
    try:
        first, progress = io.StringIO(), io.StringIO()
        call_command("performance_report", **options, stdout=first, stderr=io.StringIO())
        call_command("performance_report", **options, stdout=io.StringIO(), stderr=progress)
        figures = [_cells(line)[0] for line in _table_lines(first.getvalue())]
        assert any(f.startswith("read (1,000 rows): history") for f in figures), figures
        assert any(f.startswith("read (2,002 rows): history") for f in figures), figures
        assert any(f.startswith("read p95, 2,002 vs 1,000 rows: history, recent turns") for f in figures), figures
        assert (
            f"`manage.py bench_read_paths --rows 2000 --rounds 1 --repeat 1 --database {kept[1]}`" in first.getvalue()
        )
        # The second report measured the datasets the first one built.
        assert "reusing the 1,000-row dataset" in progress.getvalue()
        assert "reusing the 2,000-row dataset" in progress.getvalue()
        assert "building" not in progress.getvalue()
        assert connection.settings_dict["NAME"] == database
    finally:
        for name in kept:
            drop_database(name)
