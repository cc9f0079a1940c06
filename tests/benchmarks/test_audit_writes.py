"""The benchmark command runs on PostgreSQL and prints its figures; it is
kept working by this smoke test (it asserts no timings)."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from audit.models import AgentRun
from conversations.models import Message

pytestmark = pytest.mark.django_db(transaction=True)


def _rollups() -> dict[str, list[tuple]]:
    """Every row of the dashboard's rollup tables (R-DASH-1)."""
    from django.db import connection

    from dashboard.facts import TABLES

    with connection.cursor() as cursor:
        rows = {}
        for table in TABLES:
            cursor.execute(f"SELECT * FROM {table} ORDER BY 1")
            rows[table] = [row[1:] for row in cursor.fetchall()]  # without the serial id
    return rows


@pytest.fixture
def finished_run(user):
    """A completed run already in the rollups: the dashboard shows figures
    a benchmark must leave as they are."""
    from audit.ledger import run_finish
    from conversations.models import Conversation
    from tests.conftest import make_run

    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    run = make_run(thread)
    from audit.ledger import run_acquire

    run_finish(lease=run_acquire(run_id=run.id, owner="test", ttl_seconds=60), status="completed")
    assert any(_rollups().values())
    return run


def test_bench_audit_writes_prints_latencies_ratio_and_throughput_and_cleans_up_R_RUN_4_R_RUN_5():
    out = io.StringIO()
    call_command("bench_audit_writes", writes=5, warmup=1, threads="1,2", stdout=out)
    text = out.getvalue()
    assert "service (model_call_start): median" in text and "raw SQL transaction:" in text
    assert "ratio service / raw:" in text
    assert "with 1 thread(s)" in text and "with 2 thread(s)" in text
    assert "service, metrics off:" in text and "metrics on / off:" in text  # R-OPS-1
    assert "metric update per write:" in text
    assert "without cost:" in text and "genai-prices catalogue:" in text  # R-COST-1
    assert not AgentRun.objects.exists() and not Message.objects.exists()


def test_bench_audit_writes_refuses_bad_arguments_R_READ_6():
    with pytest.raises(CommandError):
        call_command("bench_audit_writes", threads="one,eight")


def test_bench_run_overhead_prints_the_variants_the_ratio_and_memory_and_cleans_up(finished_run):
    before = _rollups()
    out = io.StringIO()
    call_command("bench_run_overhead", runs=1, rounds=1, warmup=0, rss_every=1, memory_runs=2, stdout=out)
    text = out.getvalue()
    assert "plain graph:" in text and "checkpointer:" in text and "product:" in text
    assert "kept checkpointer:" in text
    assert "ratio product / checkpointer overhead:" in text
    # Beside the ratio, the audit's own cost: the product's run also keeps
    # its checkpointer connection, which the baseline does not.
    assert "the audit alone (product - kept checkpointer):" in text
    # And CPU per run, beside the wall time (issue 38 item 4).
    assert "CPU per run" in text and "the audit alone (product - kept checkpointer), process:" in text
    assert "worker memory (RSS)" in text and "MiB" in text
    assert "3 runs:" in text  # one timed product run, then two for memory only
    assert "rollups of the days it ran recomputed" in text
    # On a server without autovacuum the tables a run writes are settled
    # first, and the output says so.
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW autovacuum")
        autovacuum = cursor.fetchone()[0]
    assert ("autovacuum is off" in text) == (autovacuum == "off")
    assert ("conversations_message" in text) == (autovacuum == "off")
    assert list(AgentRun.objects.all()) == [finished_run]
    assert not Message.objects.exclude(run=finished_run).exists()
    # Its runs' figures are gone from the dashboard too (found by a newcomer).
    assert _rollups() == before


def test_bench_seal_leaves_the_dashboard_as_it_was(finished_run):
    before = _rollups()
    out = io.StringIO()
    call_command("bench_seal", runs=4, rows=4, stdout=out)
    assert "rollups of the days it ran recomputed" in out.getvalue()
    assert list(AgentRun.objects.all()) == [finished_run]
    assert _rollups() == before


def test_bench_purge_prints_both_ways_purges_its_own_runs_only_and_cleans_up_R_GOV_1(finished_run):
    from governance.models import GovernanceAction

    before = _rollups()
    kept = list(Message.objects.filter(run=finished_run).order_by("id").values("id", "content", "metadata"))
    seal = AgentRun.objects.values_list("seal_head", flat=True).get(pk=finished_run.pk)
    out = io.StringIO()
    call_command("bench_purge", runs=2, rows=4, batch_runs=1, rounds=1, profile=True, stdout=out)
    text = out.getvalue()
    assert "purge_payloads:" in text and "same work by hand:" in text and "(8 rows)" in text
    assert "ratio purge / by hand:" in text and "(target >= 0.50x)" in text
    # The profile reaches into the product's purge. Which of its frames rank
    # in the top 15 is cProfile's to decide: under load it has listed
    # _purge_batch without payloads_purge above it (the pass counted as a
    # recursive call), so the test names the module, not one function.
    assert "cumulative" in text and "_product_pass" in text, text
    assert "governance/services.py" in text and "_purge_batch" in text, text
    assert "rollups of the days it ran recomputed" in text
    # Only its own runs were old enough: the finished run keeps its payload and seal.
    assert list(AgentRun.objects.all()) == [finished_run]
    assert list(Message.objects.order_by("id").values("id", "content", "metadata")) == kept
    assert AgentRun.objects.values_list("seal_head", flat=True).get(pk=finished_run.pk) == seal
    assert _rollups() == before
    # Each pass is a recorded, completed purge (two measured, one profiled).
    purges = GovernanceAction.objects.filter(kind=GovernanceAction.Kind.PURGE)
    assert purges.count() == 3 and not purges.exclude(status=GovernanceAction.Status.COMPLETED).exists()
    assert sorted(purges.values_list("rows_changed", flat=True)) == [8, 8, 8]


def test_bench_purge_baseline_leaves_runs_as_the_purge_does_R_GOV_3(user):
    """The baseline does the purge's work: the same rows emptied and marked,
    every run re-sealed so that it verifies, a reseal recorded per run."""
    from benchmarks.purge import _age, _baseline_pass, _sealed_runs
    from governance.models import RunReseal
    from governance.payloads import payload_note
    from tests.governance.helpers import verify

    run_ids = _sealed_runs(user, runs=3, rows=4)
    _age(run_ids)
    assert _baseline_pass(batch_runs=2) == (12, 3)
    audit = Message.objects.audit().filter(run__in=run_ids)
    assert audit.count() == 12 and all(payload_note(m) for m in audit.values_list("metadata", flat=True))
    assert not audit.exclude(content="").exists() and not audit.filter(tool_input__isnull=False).exists()
    assert not audit.filter(metadata__has_key="raw_output").exists()
    assert RunReseal.objects.filter(run_id__in=run_ids).count() == 3
    status, stdout, stderr = verify()
    assert status == 0, stdout + stderr


def test_benchmarks_start_their_own_runs_even_beside_a_worker(settings, user):
    """A running worker — here the embedded one, which starts a run in a
    thread the moment its submission commits — must not take a benchmark's
    runs first (found by a newcomer: RunNotStartable, and the benchmark's
    runs left running). Inside ``dispatch_held`` nothing is handed over;
    the run stays pending for whoever submitted it."""
    import threading

    from audit.ledger.handover import dispatch_held, enqueue_run
    from conversations.models import Conversation
    from tests.conftest import make_run

    settings.CELERY_TASK_ALWAYS_EAGER = True
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    with dispatch_held():
        run = make_run(thread)
        assert enqueue_run(run.id) is False
        assert not [t for t in threading.enumerate() if t.name == f"run-{run.id}"]
        run.refresh_from_db()
        assert run.status == "pending"
    # The command holds dispatch itself.
    call_command("bench_audit_writes", writes=3, warmup=1, threads="1", rounds=1, stdout=io.StringIO())
    assert list(AgentRun.objects.values_list("status", flat=True)) == ["pending"]


def test_the_benchmarks_close_without_cost_skips_its_pricing_and_nothing_else_R_COST_1(user):
    """bench_audit_writes compares a model row's close with and without its
    cost: the close without cost must skip the pricing step (the row keeps
    no cost) and write the same row otherwise."""
    import datetime as dt

    from audit import ledger
    from benchmarks.audit_writes import _close
    from conversations.models import Conversation
    from tests.conftest import acquire, make_run

    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    lease = acquire(make_run(thread))
    for op in ("lc_run--priced", "lc_run--unpriced"):
        ledger.model_call_open(lease=lease, operation_id=op, sequence=1, started_at=dt.datetime.now(dt.UTC))
    _close(lease, "lc_run--priced", with_cost=True)
    _close(lease, "lc_run--unpriced", with_cost=False)
    priced = Message.objects.get(operation_id="lc_run--priced")
    unpriced = Message.objects.get(operation_id="lc_run--unpriced")
    assert priced.cost_usd is not None and priced.price_source
    assert (unpriced.cost_usd, unpriced.price_source, unpriced.execution_status) == (None, "", "completed")
    assert "cost_unknown" not in unpriced.metadata and unpriced.usage == priced.usage
