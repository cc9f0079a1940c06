"""Append-only audit in the database (R-GOV-3): triggers refuse UPDATE of a
closed audit row's facts and DELETE of audit rows and runs, unless the
transaction names an open governance action; the admin offers no edit of
audit facts."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction
from django.urls import reverse
from django.utils import timezone

from audit.models import AgentRun, RunRollback
from conversations.models import Conversation, Message
from governance.bypass import audited_bypass, open_bypass
from governance.models import GovernanceAction
from tests.read.builders import RunDriver, tool_turn

pytestmark = pytest.mark.django_db


def _sql(sql: str, params=None) -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params)


def test_raw_sql_update_of_a_closed_rows_facts_fails_R_GOV_3(thread):
    run = tool_turn(thread)
    row = Message.objects.get(run=run, role="tool")
    for column, value in (
        ("content", "forged"),
        ("execution_status", "failed"),
        ("usage", '{"input_tokens": 1}'),
        ("started_at", "2020-01-01T00:00:00Z"),
        ("tool_input", '{"city": "Oslo"}'),
    ):
        with pytest.raises(IntegrityError, match="append-only"):
            _sql(f"UPDATE conversations_message SET {column} = %s WHERE id = %s", [value, row.pk])
    with pytest.raises(IntegrityError, match="sealed run"):
        _sql("""UPDATE conversations_message SET metadata = metadata || '{"x": 1}' WHERE id = %s""", [row.pk])
    with pytest.raises(IntegrityError, match="sealed"):
        _sql("UPDATE audit_agentrun SET status = 'failed' WHERE id = %s", [run.pk])
    # Bookkeeping is not a fact.
    _sql("UPDATE conversations_message SET updated_at = now() WHERE id = %s", [row.pk])
    assert Message.objects.get(pk=row.pk).content == row.content


def test_a_closed_row_of_a_live_run_keeps_its_facts_but_may_be_completed_R_GOV_3(thread):
    driver = RunDriver(thread)
    driver.model("lc_run--m1", content="")
    row = Message.objects.get(run=driver.run, operation_id="lc_run--m1")
    # The terminal reconcile may fill what the stream left empty...
    _sql("UPDATE conversations_message SET content = 'from State' WHERE id = %s", [row.pk])
    # ...but never overwrite it, nor any lifecycle fact.
    with pytest.raises(IntegrityError, match="append-only"):
        _sql("UPDATE conversations_message SET content = 'again' WHERE id = %s", [row.pk])
    with pytest.raises(IntegrityError, match="append-only"):
        _sql("UPDATE conversations_message SET duration_ms = 1 WHERE id = %s", [row.pk])
    # A running row is the lifecycle's to write.
    driver.model("lc_run--m2", finish=False)
    running = Message.objects.get(run=driver.run, operation_id="lc_run--m2")
    _sql("UPDATE conversations_message SET content = 'partial' WHERE id = %s", [running.pk])
    run = driver.finish()
    assert run.status == "completed" and run.sealed_at is not None


def test_delete_of_audit_rows_runs_and_threads_fails_R_GOV_3(thread):
    run = tool_turn(thread)
    row = Message.objects.get(run=run, role="tool")
    with pytest.raises(IntegrityError, match="append-only"):
        _sql("DELETE FROM conversations_message WHERE id = %s", [row.pk])
    with pytest.raises(IntegrityError, match="append-only"):
        with transaction.atomic():
            AgentRun.objects.filter(pk=run.pk).delete()
    with pytest.raises(IntegrityError, match="append-only"):
        with transaction.atomic():
            Conversation.objects.filter(pk=thread.pk).delete()
    assert Message.objects.filter(run=run).count() == 4 and AgentRun.objects.filter(pk=run.pk).exists()


def test_a_rollback_mark_is_append_only_though_its_run_was_sealed_before_R_GOV_3_R_API_2(thread):
    """A sealed run marked rolled back by a later turn (the mark is not in
    its seal): the mark cannot be changed nor removed, except through the
    audited bypass."""
    rolled, later = tool_turn(thread), tool_turn(thread, prefix="b")
    assert AgentRun.objects.get(pk=rolled.pk).sealed_at is not None
    RunRollback.objects.create(run=rolled, by_run=later)
    with pytest.raises(IntegrityError, match="rollback mark of run .* is append-only"):
        _sql("DELETE FROM audit_runrollback WHERE run_id = %s", [rolled.pk])
    with pytest.raises(IntegrityError, match="append-only"):
        _sql("UPDATE audit_runrollback SET by_run_id = %s WHERE run_id = %s", [rolled.pk, rolled.pk])
    with pytest.raises(IntegrityError, match="append-only"):
        _sql("UPDATE audit_runrollback SET created_at = now() WHERE run_id = %s", [rolled.pk])
    assert RunRollback.objects.get(run=rolled).by_run_id == later.pk
    with audited_bypass(reason="test: remove a mark", actor="tester"):
        RunRollback.objects.filter(run=rolled).delete()
    assert not RunRollback.objects.exists()


def test_the_bypass_needs_an_open_recorded_action_R_GOV_3(thread):
    run = tool_turn(thread)
    row = Message.objects.get(run=run, role="tool")
    # A made-up or finished action id opens nothing.
    finished = GovernanceAction.objects.create(kind="manual", actor="t", finished_at=timezone.now())
    for value in (str(finished.pk), "999999"):
        with pytest.raises(IntegrityError):
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SELECT set_config('yuxi.governance_action', %s, true)", [value])
                cursor.execute("DELETE FROM conversations_message WHERE id = %s", [row.pk])
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            open_bypass(finished)
    # The recorded one works, and says who and why.
    with audited_bypass(reason="test: simulate a lost run", actor="tester") as action:
        AgentRun.objects.filter(pk=run.pk).delete()
    action.refresh_from_db()
    assert not AgentRun.objects.filter(pk=run.pk).exists()
    assert action.kind == "manual" and action.status == "completed" and action.finished_at is not None
    assert action.criterion == {"reason": "test: simulate a lost run"} and action.actor == "tester"
    # The setting ended with the transaction.
    other = tool_turn(thread, prefix="b")
    with pytest.raises(IntegrityError):
        _sql("DELETE FROM audit_agentrun WHERE id = %s", [other.pk])


def test_admin_offers_no_edit_of_audit_facts_R_GOV_3(client, staff_user, thread):
    run = tool_turn(thread)
    row = Message.objects.get(run=run, role="tool")
    client.force_login(staff_user)
    page = client.get(reverse("admin:conversations_message_change", args=[row.pk])).content.decode()
    assert 'name="content"' not in page and "_save" not in page
    assert (
        client.post(reverse("admin:conversations_message_change", args=[row.pk]), {"content": "x"}).status_code == 403
    )
    assert client.get(reverse("admin:conversations_message_delete", args=[row.pk])).status_code == 403
    assert client.get(reverse("admin:audit_agentrun_delete", args=[run.pk])).status_code == 403
    run_page = client.get(reverse("admin:audit_agentrun_change", args=[run.pk])).content.decode()
    assert run.seal_head in run_page and "over the run and 4 rows" in run_page
    assert client.get(reverse("admin:conversations_conversation_delete", args=[thread.pk])).status_code == 403
    action = GovernanceAction.objects.create(kind="manual", actor="t")
    assert client.get(reverse("admin:governance_governanceaction_changelist")).status_code == 200
    page = client.get(reverse("admin:governance_governanceaction_change", args=[action.pk])).content.decode()
    assert "_save" not in page
