"""Tool rows against the lease-checked services on real PostgreSQL:
a closed row is immutable (R-TA-2), a terminal run leaves no running tool
row (R-TA-6), a tool without a terminal lifecycle is never successful from
State (R-TA-3)."""

from __future__ import annotations

import datetime as dt

import pytest

from audit import ledger
from audit.errors import ToolResultConflict
from audit.ledger import StateMessage
from conversations.models import Message
from tests.conftest import acquire, make_run

pytestmark = pytest.mark.django_db

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _start(lease, tool_call_id="call_1", sequence=3):
    return ledger.tool_call_start(
        lease=lease,
        tool_call_id=tool_call_id,
        tool_name="get_weather",
        tool_input={"city": "Paris"},
        sequence=sequence,
        started_at=T0,
        declared_by_operation_id=None,
    )


def _finish(lease, *, content="sunny", status="completed", tool_call_id="call_1"):
    return ledger.tool_call_finish(
        lease=lease,
        tool_call_id=tool_call_id,
        status=status,
        content=content,
        raw_output={"type": "tool", "content": content, "tool_call_id": tool_call_id},
        finished_at=T0 + dt.timedelta(seconds=1),
        duration_ms=1000,
    )


def test_same_tool_finished_again_is_a_noop_and_a_different_one_is_rejected_R_TA_2(thread):
    run = make_run(thread)
    lease = acquire(run)
    _start(lease)
    first = _finish(lease)
    assert first.execution_status == "completed" and first.duration_ms == 1000

    again = _finish(lease)
    assert again.pk == first.pk and again.updated_at == first.updated_at

    with pytest.raises(ToolResultConflict) as caught:
        _finish(lease, content="rainy")
    assert caught.value.code == "tool_result_conflict"
    with pytest.raises(ToolResultConflict):
        _finish(lease, status="failed")
    row = Message.objects.get(pk=first.pk)
    assert (row.content, row.execution_status, row.metadata["raw_output"]["content"]) == (
        "sunny",
        "completed",
        "sunny",
    )
    # A replayed start never reopens the closed row.
    assert _start(lease).execution_status == "completed"


def test_final_state_never_resubmits_a_closed_row_R_TA_3(thread):
    """The State's (shortened) ToolMessage differs from the closed row: the
    terminal transaction leaves the row as the lifecycle closed it."""
    run = make_run(thread)
    lease = acquire(run)
    _start(lease)
    _finish(lease, content="x" * 5000)
    ledger.run_finish(
        lease=lease,
        status="completed",
        final_state=[StateMessage(kind="tool", id="tm-1", content="saved to outputs/…", tool_call_id="call_1")],
    )
    row = Message.objects.get(run=run, operation_id="call_1")
    assert row.content == "x" * 5000 and row.execution_status == "completed"
    assert "state_reconciled" not in row.metadata


def test_tool_without_terminal_event_is_not_successful_from_state_R_TA_3_R_TA_6(thread):
    """A successful ToolMessage in State is no proof for a row the stream
    left running: the terminal transaction closes it (fail closed)."""
    run = make_run(thread)
    lease = acquire(run)
    _start(lease)
    ledger.run_finish(
        lease=lease,
        status="completed",
        final_state=[StateMessage(kind="tool", id="tm-1", content="sunny", tool_call_id="call_1", status="success")],
    )
    row = Message.objects.get(run=run, operation_id="call_1")
    assert row.execution_status == "abandoned"
    assert row.content == ""
    assert not Message.objects.filter(run=run).running().exists()


@pytest.mark.parametrize(("run_status", "row_status"), [("failed", "failed"), ("cancelled", "interrupted")])
def test_failure_or_cancel_during_a_tool_leaves_no_running_row_R_TA_6(thread, run_status, row_status):
    run = make_run(thread)
    lease = acquire(run)
    _start(lease)
    ledger.tool_call_error(lease=lease, tool_call_id="call_1", error="boom")
    ledger.run_finish(lease=lease, status=run_status, final_state=[], error_type="agent_error")
    row = Message.objects.get(run=run, operation_id="call_1")
    assert row.execution_status == row_status
    assert "awaiting_run_terminal" not in row.metadata
    assert not Message.objects.filter(run=run).running().exists()


def test_bare_tool_error_takes_the_last_error_tool_message_R_TA_3(thread):
    run = make_run(thread)
    lease = acquire(run)
    _start(lease)
    ledger.tool_call_error(lease=lease, tool_call_id="call_1", error="bad args")
    assert Message.objects.get(run=run, operation_id="call_1").metadata["awaiting_run_terminal"] is True
    ledger.run_finish(
        lease=lease,
        status="completed",
        final_state=[
            StateMessage(kind="tool", id="tm-1", content="first error", tool_call_id="call_1", status="error"),
            StateMessage(kind="tool", id="tm-2", content="last error", tool_call_id="call_1", status="error"),
            StateMessage(kind="tool", id="tm-3", content="other call", tool_call_id="call_2", status="error"),
        ],
    )
    row = Message.objects.get(run=run, operation_id="call_1")
    assert (row.execution_status, row.content) == ("failed", "last error")
    assert row.metadata["state_reconciled"] is True and "awaiting_run_terminal" not in row.metadata


def test_an_unmarked_running_row_is_abandoned_even_with_an_error_tool_message_in_state_R_TA_3(thread):
    """Only a row the stream left with ``awaiting_run_terminal`` (a bare
    tool-error) takes its content from an error ToolMessage of the State; a
    row without that mark had no terminal lifecycle event at all and is
    closed by the run's end: abandoned, no content, no ``state_reconciled``."""
    run = make_run(thread)
    lease = acquire(run)
    _start(lease)
    ledger.run_finish(
        lease=lease,
        status="completed",
        final_state=[StateMessage(kind="tool", id="tm-1", content="it broke", tool_call_id="call_1", status="error")],
    )
    row = Message.objects.get(run=run, operation_id="call_1")
    assert (row.execution_status, row.content) == ("abandoned", "")
    assert "state_reconciled" not in row.metadata
    assert row.metadata["closed_by"] == "run_terminal"
