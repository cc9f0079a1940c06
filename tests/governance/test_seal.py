"""Sealed runs (R-GOV-3): the terminal transaction seals the run; verify_audit
is green on untouched runs and names the first row changed, removed or
added behind the application's back; runs from before sealing are unsealed,
not broken."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from audit import ledger
from audit.models import AgentRun
from conversations.models import Message
from governance.seal import audit_row_facts, compute_seal
from tests.conftest import acquire, make_run
from tests.read.builders import tool_turn

from .helpers import behind_the_back, verify

pytestmark = pytest.mark.django_db


def test_terminal_transaction_seals_the_run_over_its_closed_rows_R_GOV_3(thread):
    run = tool_turn(thread)
    run.refresh_from_db()
    rows = Message.objects.audit().filter(run=run)
    assert run.sealed_at is not None and run.seal_row_count == rows.count() == 3
    assert len(run.seal_head) == 64
    assert [entry[0] for entry in run.seal_rows] == list(rows.order_by("sequence", "id").values_list("id", flat=True))
    assert compute_seal(run.pk, audit_row_facts([run.pk])[run.pk]).head == run.seal_head
    status, out, _ = verify()
    assert status == 0 and "1 sealed, 0 unsealed" in out and "0 changed after sealing" in out


def test_every_terminal_path_seals_cancel_and_the_lease_sweeper_R_GOV_3(thread):
    pending = make_run(thread)
    ledger.run_request_cancel(user=thread.user, run_id=pending.id)
    crashed = make_run(thread)
    lease = acquire(crashed, ttl=60)
    ledger.model_call_start(
        lease=lease, operation_id="lc_run--x", sequence=1, started_at=timezone.now(), metadata={"namespace": []}
    )
    AgentRun.objects.filter(pk=crashed.pk).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))
    ledger.run_sweep_expired_leases()
    for run in (pending, crashed):
        run.refresh_from_db()
        assert run.is_terminal and run.sealed_at is not None, run.status
    assert crashed.status == "failed" and crashed.seal_row_count == 1
    assert verify()[0] == 0


def test_a_changed_row_is_named_and_the_exit_status_is_1_R_GOV_3(thread):
    run = tool_turn(thread, prefix="a")
    other = tool_turn(thread, prefix="b")
    tool_row = Message.objects.get(run=run, role="tool")
    behind_the_back("UPDATE conversations_message SET content = 'forged' WHERE id = %s", [tool_row.pk])
    status, out, err = verify()
    assert status == 1
    assert f"run {run.pk}: row {tool_row.pk} changed after sealing (tool call_a, sequence 2)" in out
    assert str(other.pk) not in out
    assert "1 run(s) changed after sealing" in err and "checked 2/2 runs" in err
    # Only that run, by id, and only runs finished since a date.
    assert verify("--run", str(other.pk))[0] == 0
    assert verify("--run", str(run.pk))[0] == 1
    tomorrow = (timezone.now() + dt.timedelta(days=1)).date().isoformat()
    assert verify("--since", tomorrow)[1].startswith("no terminal runs")


def test_a_removed_and_an_added_row_are_named_R_GOV_3(thread):
    removed = tool_turn(thread, prefix="a")
    added = tool_turn(thread, prefix="b")
    first = Message.objects.get(run=removed, role="tool")
    behind_the_back("DELETE FROM conversations_message WHERE id = %s", [first.pk])
    extra = Message.objects.create(
        thread=thread,
        run=added,
        role="tool",
        message_type="tool_audit",
        operation_id="call_smuggled",
        sequence=99,
        execution_status="completed",
        content="smuggled in",
    )
    status, out, _ = verify()
    assert status == 1
    assert f"run {removed.pk}: row {first.pk} removed after sealing" in out
    assert f"run {added.pk}: row {extra.pk} added after sealing (tool call_smuggled, sequence 99)" in out


def test_an_edited_seal_is_caught_too_R_GOV_3(thread):
    run = tool_turn(thread)
    behind_the_back("UPDATE audit_agentrun SET seal_head = repeat('0', 64) WHERE id = %s", [run.pk])
    status, out, _ = verify()
    assert status == 1 and f"run {run.pk}: the stored seal was changed" in out


def test_runs_that_ended_before_sealing_are_reported_unsealed_not_broken_R_GOV_3(thread):
    tool_turn(thread)
    legacy = tool_turn(thread, prefix="old")
    behind_the_back(
        "UPDATE audit_agentrun SET seal_head = '', seal_row_count = NULL, seal_rows = NULL, sealed_at = NULL "
        "WHERE id = %s",
        [legacy.pk],
    )
    status, out, _ = verify()
    assert status == 0 and "1 sealed, 1 unsealed (ended before sealing existed)" in out


def test_bad_arguments_are_refused_R_GOV_3(thread):
    assert verify("--run", "not-a-uuid")[0] == 1
    assert "no run" in verify("--run", "6f1c2a44-0000-4000-8000-000000000000")[2]
    assert "not a date" in verify("--since", "yesterday-ish")[2]
