"""Metric updates at each event (R-OPS-1): run ends by status, run and model
durations, tokens, tool executions, audit-write latency and refusals, lease
acquisitions / renewals / expiries / takeovers, queue gauges read at scrape
time, open SSE streams, dispatcher re-enqueues.

Values are read back through :func:`ops.exposition.render` — what ``/metrics``
serves — and compared as deltas, so the tests share the process registry."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import pytest
from django.db.models import Sum
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from audit import ledger
from audit.errors import LeaseLost
from audit.execution.runner import run_execute
from audit.ledger.lease import Lease
from audit.models import AgentRun
from conversations.models import Conversation, Message
from ops import exposition, metrics
from tests.conftest import acquire, make_run

pytestmark = pytest.mark.django_db(transaction=True)


def scrape() -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics``: ``{(name, sorted labels): value}``."""
    samples = {}
    for family in text_string_to_metric_families(exposition.render().decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before, after, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def new_thread(user, scenario: str) -> Conversation:
    return Conversation.objects.create(user=user, agent_id="assistant", model=f"replay:{scenario}")


def test_a_completed_run_counts_its_end_duration_model_calls_tokens_and_tools_as_the_audit_says_R_OPS_1(
    user, replay_models
):
    model = "replay:tool_then_answer"
    before = scrape()
    run = make_run(new_thread(user, "tool_then_answer"))
    assert run_execute(run_id=run.id, owner="metrics-test") == "completed"
    after = scrape()
    run.refresh_from_db()

    assert delta(before, after, "yuxi_runs_finished_total", status="completed", error_type="", model=model) == 1
    assert delta(before, after, "yuxi_run_duration_seconds_count", model=model, status="completed") == 1
    duration = (run.finished_at - run.started_at).total_seconds()
    assert delta(before, after, "yuxi_run_duration_seconds_sum", model=model, status="completed") == pytest.approx(
        duration
    )
    calls = Message.objects.model_calls().filter(run=run)
    assert delta(before, after, "yuxi_model_calls_total", model=model, status="completed") == calls.count() == 2
    assert delta(before, after, "yuxi_model_call_duration_seconds_count", model=model) == 2
    assert delta(before, after, "yuxi_model_call_duration_seconds_sum", model=model) == pytest.approx(
        calls.aggregate(ms=Sum("duration_ms"))["ms"] / 1000
    )
    assert delta(before, after, "yuxi_model_tokens_total", model=model, kind="input") == run.usage["input_tokens"]
    assert delta(before, after, "yuxi_model_tokens_total", model=model, kind="output") == run.usage["output_tokens"]
    tools = Message.objects.tool_executions().filter(run=run)
    tool = tools.get()
    assert delta(before, after, "yuxi_tool_executions_total", tool=tool.tool_name, status="completed") == 1
    assert delta(before, after, "yuxi_tool_execution_duration_seconds_count", tool=tool.tool_name) == 1
    # One lease, no takeover; each audit write kind timed.
    assert delta(before, after, "yuxi_lease_acquisitions_total") == 1
    assert delta(before, after, "yuxi_lease_takeovers_total") == 0
    for kind in ("model_start", "model_finish", "tool_start", "tool_finish", "run_finish"):
        assert delta(before, after, "yuxi_audit_write_duration_seconds_count", kind=kind) >= 1, kind
    assert delta(before, after, "yuxi_audit_write_duration_seconds_count", kind="model_start") == 2


def test_each_token_kind_counts_its_own_figure_R_OPS_1(user, replay_models):
    """Issue 35: ``cache_creation`` reading the cache-read count survived
    the suite, whose runs had no cache details. One call that read 64
    tokens from the cache and wrote 16 to it (and reasoned 8)."""
    model = "replay:usage_delta"
    before = scrape()
    run = make_run(new_thread(user, "usage_delta"))
    assert run_execute(run_id=run.id, owner="metrics-test") == "completed"
    after = scrape()
    usage = Message.objects.model_calls().get(run=run).usage
    figures = {
        "input": usage["input_tokens"],
        "output": usage["output_tokens"],
        "cache_read": usage["input_token_details"]["cache_read"],
        "cache_creation": usage["input_token_details"]["cache_creation"],
        "reasoning": usage["output_token_details"]["reasoning"],
    }
    assert figures == {"input": 120, "output": 30, "cache_read": 64, "cache_creation": 16, "reasoning": 8}
    for kind, tokens in figures.items():
        assert delta(before, after, "yuxi_model_tokens_total", model=model, kind=kind) == tokens, kind


def test_a_failed_run_counts_under_its_error_type_and_its_call_without_usage_R_OPS_1(user, replay_models):
    model = "replay:model_http_error"
    before = scrape()
    run = make_run(new_thread(user, "model_http_error"))
    assert run_execute(run_id=run.id, owner="metrics-test") == "failed"
    after = scrape()
    run.refresh_from_db()
    assert run.error_type == "model_http_error"
    labels = {"status": "failed", "error_type": "model_http_error", "model": model}
    assert delta(before, after, "yuxi_runs_finished_total", **labels) == 1
    assert delta(before, after, "yuxi_runs_finished_total", status="completed", error_type="", model=model) == 0
    unknown = Message.objects.model_calls().filter(run=run, usage__isnull=True).count()
    assert delta(before, after, "yuxi_model_calls_usage_unknown_total", model=model) == unknown


def test_a_pending_run_cancelled_counts_once_without_a_duration_R_OPS_1(user):
    thread = new_thread(user, "plain_answer")
    run = make_run(thread)
    before = scrape()
    ledger.run_request_cancel(user=user, run_id=run.id)
    ledger.run_request_cancel(user=user, run_id=run.id)  # terminal: unchanged, not counted again
    after = scrape()
    labels = {"status": "cancelled", "error_type": "cancelled", "model": "replay:plain_answer"}
    assert delta(before, after, "yuxi_runs_finished_total", **labels) == 1
    assert delta(before, after, "yuxi_run_duration_seconds_count", model="replay:plain_answer", status="cancelled") == 0


@pytest.mark.usefixtures("recovery_fail")
def test_lease_renewal_expiry_and_takeover_are_counted_after_commit_R_OPS_1(user):
    thread = new_thread(user, "plain_answer")
    run = make_run(thread)
    before = scrape()
    lease = acquire(run, ttl=60)
    ledger.lease_renew(lease=lease, ttl_seconds=60)
    ledger.lease_renew(lease=lease, ttl_seconds=60)
    after_renew = scrape()
    assert delta(before, after_renew, "yuxi_lease_acquisitions_total") == 1
    assert delta(before, after_renew, "yuxi_lease_renewals_total") == 2
    assert delta(before, after_renew, "yuxi_audit_write_duration_seconds_count", kind="lease_renew") == 2

    # The sweeper fails it once its lease expired.
    failed = ledger.run_sweep_expired_leases(now=timezone.now() + timedelta(seconds=120))
    assert failed == [run.id]
    after_sweep = scrape()
    assert delta(after_renew, after_sweep, "yuxi_lease_expiries_total") == 1
    labels = {"status": "failed", "error_type": "lease_expired", "model": "replay:plain_answer"}
    assert delta(after_renew, after_sweep, "yuxi_runs_finished_total", **labels) == 1

    # The stale owner's next write is refused, and counted by error class.
    with pytest.raises(Exception) as refused:
        ledger.lease_renew(lease=lease, ttl_seconds=60)
    after_refusal = scrape()
    error = type(refused.value).__name__
    assert delta(after_sweep, after_refusal, "yuxi_audit_write_errors_total", kind="lease_renew", error=error) == 1
    assert delta(after_sweep, after_refusal, "yuxi_lease_renewals_total") == 0

    # A run taken again after an earlier owner (fencing token 2) is a takeover.
    second = make_run(new_thread(user, "plain_answer"))
    AgentRun.objects.filter(pk=second.pk).update(fencing_token=1, lease_owner="dead-worker")
    acquire(second, owner="worker-b")
    after_takeover = scrape()
    assert delta(after_refusal, after_takeover, "yuxi_lease_acquisitions_total") == 1
    assert delta(after_refusal, after_takeover, "yuxi_lease_takeovers_total") == 1


def test_a_run_continued_after_its_worker_died_is_counted_not_expired_R_OPS_1_R_RUN_15(user):
    run = make_run(new_thread(user, "plain_answer"))
    acquire(run, ttl=60)
    before = scrape()
    assert ledger.run_sweep_expired_leases(now=timezone.now() + timedelta(seconds=120)) == [run.id]
    after_sweep = scrape()
    assert delta(before, after_sweep, "yuxi_runs_recovered_total") == 1
    assert delta(before, after_sweep, "yuxi_lease_expiries_total") == 0
    acquire(run, owner="worker-b")
    assert delta(after_sweep, scrape(), "yuxi_lease_takeovers_total") == 1


def test_a_rolled_back_write_counts_nothing_after_commit_R_OPS_1(user):
    from django.db import transaction

    run = make_run(new_thread(user, "plain_answer"))
    before = scrape()
    with pytest.raises(RuntimeError), transaction.atomic():
        acquire(run)
        raise RuntimeError("roll back")
    assert delta(before, scrape(), "yuxi_lease_acquisitions_total") == 0


def test_a_write_under_a_lost_lease_counts_as_a_refusal_not_a_latency_R_OPS_1(user):
    run = make_run(new_thread(user, "plain_answer"))
    lease = acquire(run)
    stale = Lease(lease.run_id, lease.request_id, lease.thread_id, "someone-else", lease.fencing_token)
    before = scrape()
    with pytest.raises(LeaseLost):
        ledger.model_call_start(lease=stale, operation_id="op-1", sequence=1, started_at=timezone.now())
    after = scrape()
    assert delta(before, after, "yuxi_audit_write_errors_total", kind="model_start", error="LeaseLost") == 1
    assert delta(before, after, "yuxi_audit_write_duration_seconds_count", kind="model_start") == 0


def test_queue_gauges_are_read_from_the_database_at_scrape_time_R_OPS_1(user):
    first = make_run(new_thread(user, "plain_answer"))
    AgentRun.objects.filter(pk=first.pk).update(created_at=timezone.now() - timedelta(seconds=300))
    # A second turn of a thread whose first run is running waits on purpose:
    # pending, but not in the oldest-ready age.
    busy = new_thread(user, "plain_answer")
    running = make_run(busy)
    acquire(running)
    waiting = make_run(busy)
    AgentRun.objects.filter(pk=waiting.pk).update(created_at=timezone.now() - timedelta(seconds=900))
    samples = scrape()
    assert value(samples, "yuxi_queue_gauges_up") == 1
    assert value(samples, "yuxi_runs_pending") == AgentRun.objects.filter(status="pending").count() == 2
    assert value(samples, "yuxi_runs_active", status="running") == 1
    assert value(samples, "yuxi_runs_active", status="cancel_requested") == 0
    assert 299 <= value(samples, "yuxi_runs_pending_oldest_age_seconds") < 400

    # The queue empties: the age is 0 again.
    AgentRun.objects.filter(status="pending").update(status="cancelled")
    samples = scrape()
    assert value(samples, "yuxi_runs_pending") == 0 and value(samples, "yuxi_runs_pending_oldest_age_seconds") == 0


def test_open_sse_streams_rise_while_served_and_fall_when_closed_or_cut_R_OPS_1():
    async def frames():
        yield "a"
        await asyncio.sleep(10)
        yield "b"

    async def scenario():
        before = scrape()
        stream = metrics.track_sse(frames())
        assert await stream.__anext__() == "a"
        during = scrape()
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        after = scrape()
        return before, during, after

    before, during, after = asyncio.run(scenario())
    assert delta(before, during, "yuxi_sse_streams_open") == 1
    assert delta(before, during, "yuxi_sse_streams_total") == 1
    assert delta(before, after, "yuxi_sse_streams_open") == 0


def test_dispatcher_reenqueues_are_counted_by_reason_R_OPS_1():
    before = scrape()
    metrics.record_reenqueue("stale")
    metrics.record_reenqueue("stale")
    metrics.record_reenqueue("lost_task")
    after = scrape()
    assert delta(before, after, "yuxi_dispatcher_reenqueues_total", reason="stale") == 2
    assert delta(before, after, "yuxi_dispatcher_reenqueues_total", reason="lost_task") == 1


def test_the_row_roles_run_ended_reads_are_the_models_roles_R_OPS_1():
    # ops.metrics sits below the models and names the roles itself.
    assert metrics.MODEL_ROLE == Message.Role.ASSISTANT
    assert metrics.TOOL_ROLE == Message.Role.TOOL


def test_labels_stay_bounded_R_OPS_1():
    assert metrics.model_label("replay:plain_answer") == "replay:plain_answer"
    assert metrics.model_label(f"openai:made-up-{uuid.uuid4().hex}") == "other"
    assert metrics.model_label("") == "other"
    assert metrics.error_type_label("agent_error:ValueError") == "agent_error"
    assert metrics.error_type_label("x" * 500) == "x" * 100
    # No id is ever a label: every label name of the exposition is one of these.
    allowed = {"status", "error_type", "model", "kind", "tool", "error", "reason", "le"}
    for family in text_string_to_metric_families(exposition.render().decode()):
        if family.name.startswith("yuxi_"):
            for sample in family.samples:
                assert set(sample.labels) <= allowed, (sample.name, sample.labels)


def test_metrics_switched_off_record_nothing_and_never_fail_a_write_R_OPS_1(user, monkeypatch):
    monkeypatch.setattr(metrics, "enabled", False)
    run = make_run(new_thread(user, "plain_answer"))
    before = scrape()
    lease = acquire(run)
    ledger.model_call_start(lease=lease, operation_id="op-1", sequence=1, started_at=timezone.now())
    ledger.run_request_cancel(user=user, run_id=run.id)
    after = scrape()
    assert delta(before, after, "yuxi_lease_acquisitions_total") == 0
    assert delta(before, after, "yuxi_audit_write_duration_seconds_count", kind="model_start") == 0


def test_a_failing_metric_is_logged_and_never_raised_into_the_caller_R_OPS_1(caplog):
    def broken():
        raise RuntimeError("metrics backend broke")

    assert metrics._safely(broken)() is None
    assert "metrics: broken failed" in caplog.text


def test_the_grafana_dashboard_uses_only_metrics_that_are_exposed_R_OPS_1():
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {re.sub(r"_(bucket|total|count|sum)$", "", name) for e in exprs for name in re.findall(r"yuxi_\w+", e)}
    exposed = {
        re.sub(r"_(bucket|total|count|sum)$", "", line.split()[2])
        for line in exposition.render().decode().splitlines()
        if line.startswith("# HELP yuxi_")
    }
    assert used and used <= exposed, used - exposed
