"""The lease helper and the audit writes that go through it, on real
PostgreSQL (R-RUN-3, R-RUN-4, R-MA-3, R-MA-4, R-TA-1, R-TA-2)."""

from __future__ import annotations

import dataclasses
import datetime as dt
from datetime import timedelta

import pytest
from django.utils import timezone

from audit import ledger
from audit.errors import AuditConflict, LeaseExpired, LeaseLost, RunIdentityMismatch, RunNotStartable, RunTerminal
from audit.ledger.lease import lock_run
from audit.models import AgentRun
from conversations.models import Message
from tests.conftest import acquire, make_run

pytestmark = pytest.mark.django_db

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def test_acquire_moves_pending_to_running_with_a_new_fencing_token_R_RUN_3(thread):
    run = make_run(thread)
    lease = acquire(run, owner="w1", ttl=30)
    run.refresh_from_db()
    assert run.status == "running" and run.lease_owner == "w1" and run.fencing_token == lease.fencing_token == 1
    assert run.lease_expires_at > timezone.now()


def test_a_second_delivery_cannot_acquire_the_same_run_R_RUN_3(thread):
    run = make_run(thread)
    acquire(run, owner="w1")
    with pytest.raises(RunNotStartable):
        acquire(run, owner="w2")
    run.refresh_from_db()
    assert run.lease_owner == "w1" and run.fencing_token == 1


@pytest.mark.django_db(transaction=True)
def test_lock_run_refuses_outside_a_transaction_R_RUN_4(thread):
    lease = acquire(make_run(thread))
    with pytest.raises(RuntimeError, match="inside transaction.atomic"):
        lock_run(lease)


@pytest.mark.parametrize(
    "change, error",
    [
        ({"request_id": "someone-else"}, RunIdentityMismatch),
        ({"owner": "w2"}, LeaseLost),
        ({"fencing_token": 0}, LeaseLost),
    ],
)
def test_every_write_checks_identity_owner_and_fencing_token_R_RUN_4(thread, change, error):
    run = make_run(thread)
    lease = dataclasses.replace(acquire(run, owner="w1"), **change)
    with pytest.raises(error):
        ledger.model_call_start(lease=lease, operation_id="lc_run--a", sequence=2, started_at=T0)
    assert not Message.objects.audit().exists()


def test_an_expired_lease_writes_nothing_R_RUN_4_R_RUN_7(thread):
    run = make_run(thread)
    lease = acquire(run, owner="w1")
    AgentRun.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(LeaseExpired):
        ledger.model_call_start(lease=lease, operation_id="lc_run--a", sequence=2, started_at=T0)
    assert not Message.objects.audit().exists()


def test_a_terminal_run_accepts_no_write_R_RUN_4(thread):
    run = make_run(thread)
    lease = acquire(run)
    ledger.run_finish(lease=lease, status="failed", error_type="agent_error")
    with pytest.raises(RunTerminal):
        ledger.model_call_start(lease=lease, operation_id="lc_run--a", sequence=2, started_at=T0)


def test_model_call_start_is_idempotent_and_refuses_another_sequence_R_MA_3(thread):
    lease = acquire(make_run(thread))
    first = ledger.model_call_start(lease=lease, operation_id="lc_run--a", sequence=2, started_at=T0)
    again = ledger.model_call_start(
        lease=lease, operation_id="lc_run--a", sequence=2, started_at=T0 + timedelta(seconds=5)
    )
    assert again.pk == first.pk and again.started_at == T0
    with pytest.raises(AuditConflict) as exc:
        ledger.model_call_start(lease=lease, operation_id="lc_run--a", sequence=9, started_at=T0)
    assert exc.value.extra["reason"] == "sequence_conflict"
    assert Message.objects.audit().count() == 1


def test_model_call_finish_sets_result_once_and_never_reopens_R_MA_4_R_MA_5(thread):
    lease = acquire(make_run(thread))
    ledger.model_call_start(lease=lease, operation_id="lc_run--a", sequence=2, started_at=T0)
    usage = {"input_tokens": 10, "output_tokens": 3, "total_tokens": 13}
    finish = dict(
        lease=lease,
        operation_id="lc_run--a",
        content="hi",
        tool_calls=[],
        usage=usage,
        finished_at=T0 + timedelta(seconds=1),
        duration_ms=812,
    )
    row = ledger.model_call_finish(**finish)
    assert (row.execution_status, row.usage, row.duration_ms, row.content) == ("completed", usage, 812, "hi")
    # The same finish again is a no-op; a different result is refused.
    ledger.model_call_finish(**finish)
    with pytest.raises(AuditConflict):
        ledger.model_call_finish(**{**finish, "content": "something else"})
    # A replayed start never turns the completed row back to running.
    ledger.model_call_start(lease=lease, operation_id="lc_run--a", sequence=2, started_at=T0)
    row.refresh_from_db()
    assert row.execution_status == "completed" and row.content == "hi"


def test_model_and_tool_rows_may_share_an_operation_id_R_MA_1(thread):
    lease = acquire(make_run(thread))
    ledger.model_call_start(lease=lease, operation_id="same-id", sequence=2, started_at=T0)
    ledger.tool_call_start(
        lease=lease,
        tool_call_id="same-id",
        tool_name="calculator",
        tool_input={"expression": "1+1"},
        sequence=5,
        started_at=T0,
        declared_by_operation_id="same-id",
    )
    assert Message.objects.audit().filter(operation_id="same-id").count() == 2


def test_tool_row_lifecycle_and_closed_row_immutability_R_TA_1_R_TA_2(thread):
    lease = acquire(make_run(thread))
    ledger.model_call_start(lease=lease, operation_id="lc_run--a", sequence=2, started_at=T0)
    ledger.model_call_finish(
        lease=lease,
        operation_id="lc_run--a",
        content="",
        usage=None,
        finished_at=T0,
        duration_ms=5,
        tool_calls=[{"id": "call_1", "name": "get_weather", "args": {"city": "Paris"}}],
    )
    start = dict(
        lease=lease,
        tool_call_id="call_1",
        tool_name="get_weather",
        tool_input={"city": "Paris"},
        sequence=7,
        started_at=T0,
        declared_by_operation_id="lc_run--a",
    )
    row = ledger.tool_call_start(**start)
    assert row.execution_status == "running" and row.declared_by.operation_id == "lc_run--a"
    finish = dict(
        lease=lease,
        tool_call_id="call_1",
        status="completed",
        content="sunny",
        raw_output={"content": "sunny", "tool_call_id": "call_1"},
        finished_at=T0,
        duration_ms=3,
    )
    ledger.tool_call_finish(**finish)
    ledger.tool_call_finish(**finish)  # the same result again: no-op
    with pytest.raises(AuditConflict):
        ledger.tool_call_finish(**{**finish, "status": "failed"})
    again = ledger.tool_call_start(**start)  # a replayed start does not reopen
    assert again.execution_status == "completed" and again.content == "sunny"
    assert again.metadata["raw_output"]["content"] == "sunny"


def test_terminal_transaction_closes_running_rows_and_binds_only_this_runs_last_answer_R_MA_7_R_MA_8(thread):
    lease = acquire(make_run(thread))
    ledger.model_call_start(lease=lease, operation_id="lc_run--a", sequence=2, started_at=T0)
    ledger.model_call_finish(
        lease=lease,
        operation_id="lc_run--a",
        content="answer",
        tool_calls=[],
        usage={"input_tokens": 1, "output_tokens": 1, "total_tokens": 2},
        finished_at=T0,
        duration_ms=1,
    )
    ledger.model_call_start(lease=lease, operation_id="lc_run--cut", sequence=9, started_at=T0)
    state = [
        ledger.StateMessage(kind="human", id="h1", content="q"),
        ledger.StateMessage(kind="ai", id="lc_run--old", content="from an earlier run"),
        ledger.StateMessage(kind="ai", id="lc_run--a", content="answer"),
    ]
    run = ledger.run_finish(lease=lease, status="completed", final_state=state, prior_message_ids={"h0", "lc_run--old"})
    rows = {m.operation_id: m for m in Message.objects.audit().filter(run=run)}
    assert run.status == "completed" and run.output_message_id == rows["lc_run--a"].id
    assert rows["lc_run--a"].message_type == "text" and rows["lc_run--a"].metadata["state_reconciled"] is True
    assert rows["lc_run--cut"].execution_status == "abandoned"
    assert rows["lc_run--cut"].usage is None and rows["lc_run--cut"].metadata["usage_unknown"] is True
    assert "lc_run--old" not in rows
    assert run.usage == {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2, "unknown_calls": 1}
    assert run.lease_expires_at is None
