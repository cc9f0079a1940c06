"""Retention (R-GOV-1): purge_payloads empties the payloads of old runs'
audit rows and their workspace files, keeps the anonymous facts (so the
dashboard does not change), marks the rows, records the purge, re-seals
the runs keeping the previous head, and can be interrupted and resumed."""

from __future__ import annotations

import datetime as dt
import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from audit.models import AgentRun
from conversations.models import Conversation, Message, MessageFeedback
from core.config import get_config
from core.workspace import large_result_path, thread_workspace
from governance.models import GovernanceAction, RunReseal
from governance.services import payloads_purge
from governance.tasks import purge_payloads as purge_task
from tests.conftest import bearer
from tests.read.builders import RunDriver, tool_turn

from .helpers import behind_the_back, verify

pytestmark = pytest.mark.django_db

LATER = timezone.now() + dt.timedelta(days=40)
FACTS = (
    "id",
    "run_id",
    "role",
    "message_type",
    "operation_id",
    "sequence",
    "execution_status",
    "started_at",
    "finished_at",
    "duration_ms",
    "usage",
    "cost_usd",
    "tool_name",
)


@pytest.fixture
def workspace_root(tmp_path, monkeypatch):
    monkeypatch.setattr(get_config(), "WORKSPACE_ROOT", tmp_path)
    return tmp_path


def _dashboard(client: Client) -> dict:
    day = timezone.now().date()
    window = f"from={day - dt.timedelta(days=1)}&to={day + dt.timedelta(days=1)}"
    out = {}
    for name in ("overview", "models", "tools", "timeseries", "feedback", "costs"):
        body = client.get(f"/api/dashboard/{name}?{window}").json()
        # The feedback list quotes the answer: that excerpt is payload.
        for item in body.get("items", []) if name == "feedback" else []:
            item.pop("message_excerpt", None)
        out[name] = body
    return out


def test_purge_empties_payloads_keeps_facts_and_statistics_R_GOV_1(client, staff_user, thread, workspace_root):
    runs = [tool_turn(thread, prefix=p) for p in ("a", "b", "c")]
    answer = Message.objects.get(pk=runs[0].output_message_id)
    MessageFeedback.objects.create(message=answer, user=thread.user, rating="like", reason="kept: not a payload")
    large = workspace_root / str(thread.pk) / large_result_path(run_id=str(runs[0].pk), tool_call_id="call_a")
    large.parent.mkdir(parents=True)
    large.write_text("a large result")
    client.force_login(staff_user)
    before = _dashboard(client)
    facts_before = list(Message.objects.audit().order_by("id").values(*FACTS))
    heads_before = {run.pk: AgentRun.objects.get(pk=run.pk).seal_head for run in runs}

    outcome = payloads_purge(older_than_days=30, actor="tester", now=LATER, batch_runs=2)

    assert (outcome.runs, outcome.rows, outcome.files) == (3, 9, 1) and not large.exists()
    assert list(Message.objects.audit().order_by("id").values(*FACTS)) == facts_before
    assert _dashboard(client) == before
    for row in Message.objects.audit():
        assert row.content == "" and row.tool_input is None
        assert "raw_output" not in row.metadata and row.metadata["payload_purged_at"].startswith(
            LATER.date().isoformat()
        )
        assert all(call["args"] == {} and call["name"] for call in row.tool_calls or [])
    assert MessageFeedback.objects.get().reason == "kept: not a payload"
    # The user's own messages are not audit rows: a purge keeps them.
    assert Message.objects.filter(role="user", content="weather in Paris?").count() == 3

    action = GovernanceAction.objects.get()
    assert (action.kind, action.status, action.actor, action.rows_changed, action.runs_resealed) == (
        "purge",
        "completed",
        "tester",
        9,
        3,
    )
    assert action.criterion["older_than_days"] == 30 and action.finished_at is not None
    reseals = {r.run_id: r for r in RunReseal.objects.filter(action=action)}
    for run in runs:
        run.refresh_from_db()
        assert reseals[run.pk].previous_head == heads_before[run.pk] != run.seal_head == reseals[run.pk].head
    # Green after the purge, and a later change is still caught.
    assert verify()[0] == 0
    row = Message.objects.filter(run=runs[1], role="tool").get()
    behind_the_back("UPDATE conversations_message SET content = 'forged' WHERE id = %s", [row.pk])
    status, out, _ = verify()
    assert status == 1 and f"row {row.pk} changed" in out

    # API and admin say so.
    note = f"payload purged on {LATER.date().isoformat()}"
    timeline = client.get(f"/api/audit/runs/{runs[0].pk}/timeline").json()["items"]
    assert {item["payload_note"] for item in timeline} == {note}
    owner = Client(headers=bearer(thread.user))
    history = owner.get(f"/api/threads/{thread.pk}/history").json()["items"]
    answers = [item for item in history if item["kind"] == "answer"]
    assert answers and {item["payload_note"] for item in answers} == {note}
    assert note in client.get(reverse("admin:audit_agentrun_change", args=[runs[0].pk])).content.decode()
    assert note in client.get(reverse("admin:conversations_message_change", args=[answer.pk])).content.decode()
    assert "purge" in client.get(reverse("admin:governance_governanceaction_changelist")).content.decode()


def test_young_runs_and_running_runs_are_not_purged_R_GOV_1(thread):
    run = tool_turn(thread)
    assert payloads_purge(older_than_days=30, actor="t").rows == 0
    assert Message.objects.get(pk=run.output_message_id).content == "It is sunny (a)."


def test_the_age_is_counted_in_days_not_hours_R_GOV_1(thread):
    """Issue 35: ``--older-than-days 3`` applied as hours survived the
    suite, whose runs were either minutes or 40 days old."""
    run = tool_turn(thread)
    day_three = run.finished_at + dt.timedelta(days=3)
    kept = payloads_purge(older_than_days=3, actor="t", now=day_three - dt.timedelta(minutes=5))
    assert kept.rows == 0 and Message.objects.get(pk=run.output_message_id).content == "It is sunny (a)."
    assert payloads_purge(older_than_days=3, actor="t", now=day_three + dt.timedelta(minutes=5)).rows == 3
    assert Message.objects.get(pk=run.output_message_id).content == ""


def test_interrupted_purge_resumes_where_it_stopped_R_GOV_1(thread):
    runs = [tool_turn(thread, prefix=p) for p in ("a", "b", "c")]
    first = payloads_purge(older_than_days=1, actor="t", now=LATER, batch_runs=1, max_batches=1)
    assert first.runs == 1 and first.action.status == "stopped"
    assert Message.objects.audit().filter(metadata__has_key="payload_purged_at").count() == 3
    second = payloads_purge(older_than_days=1, actor="t", now=LATER, batch_runs=1)
    assert second.runs == 2 and second.action.status == "completed"
    assert Message.objects.audit().exclude(metadata__has_key="payload_purged_at").count() == 0
    assert RunReseal.objects.count() == 3 and len({r.run_id for r in RunReseal.objects.all()}) == 3
    assert payloads_purge(older_than_days=1, actor="t", now=LATER).rows == 0
    assert verify()[0] == 0 and runs


def test_a_run_changed_behind_the_back_is_not_laundered_by_a_purge_R_GOV_1(thread):
    good, bad = tool_turn(thread, prefix="a"), tool_turn(thread, prefix="b")
    row = Message.objects.get(run=bad, role="tool")
    behind_the_back("UPDATE conversations_message SET usage = '{\"input_tokens\": 1}' WHERE id = %s", [row.pk])
    outcome = payloads_purge(older_than_days=1, actor="t", now=LATER)
    assert outcome.runs_skipped == [bad.pk] and outcome.runs == 1
    assert Message.objects.get(pk=row.pk).content != ""
    status, out, _ = verify()
    assert status == 1 and f"row {row.pk} changed" in out and str(good.pk) not in out


def test_command_dry_run_and_bad_input_change_nothing_R_GOV_1(thread):
    tool_turn(thread)
    out = io.StringIO()
    call_command("purge_payloads", "--older-than-days", "0", "--dry-run", stdout=out, stderr=io.StringIO())
    assert "would purge 3 rows of 1 runs" in out.getvalue()
    with pytest.raises(CommandError, match="whole number of days"):
        call_command("purge_payloads", "--older-than-days", "-1", stdout=io.StringIO(), stderr=io.StringIO())
    assert not GovernanceAction.objects.exists()
    assert not Message.objects.audit().filter(metadata__has_key="payload_purged_at").exists()
    err = io.StringIO()
    call_command("purge_payloads", "--older-than-days", "0", stdout=out, stderr=err)
    assert "purged 1/1 runs" in err.getvalue() and "3 rows of 1 runs" in out.getvalue()


def test_beat_task_purges_with_the_retention_setting_R_GOV_1(thread, monkeypatch):
    tool_turn(thread)
    assert purge_task() == 0  # RETENTION_DAYS unset: nothing
    monkeypatch.setattr(get_config(), "RETENTION_DAYS", 0)
    assert purge_task() == 3
    assert GovernanceAction.objects.get().actor == "celery-beat"


def test_workspace_of_threads_is_untouched_by_other_runs_purge_R_GOV_1(thread, workspace_root):
    other = Conversation.objects.create(user=thread.user, agent_id="assistant", model=thread.model)
    keep = thread_workspace(other.pk) / "notes.txt"
    keep.parent.mkdir(parents=True)
    keep.write_text("kept")
    tool_turn(thread)
    payloads_purge(older_than_days=0, actor="t")
    assert keep.read_text() == "kept"


def test_a_run_awaiting_approval_keeps_its_declarations_R_GOV_1(thread):
    driver = RunDriver(thread)
    call = {"id": "call_mail", "name": "send_email", "args": {"to": "a@example.com"}}
    driver.model("lc_run--ask", tool_calls=[call])
    driver.finish("interrupted", interrupts=[{"value": {"action_requests": [{"name": "send_email"}]}}])
    assert payloads_purge(older_than_days=1, actor="t", now=LATER).rows == 0
    assert Message.objects.get(operation_id="lc_run--ask").tool_calls == [call]
