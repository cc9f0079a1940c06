"""Counting rules shared by every reader (R-READ-4): message counts and
feedback statistics exclude audit rows; tool statistics count executions
(rows with ``started_at``), never declarations."""

from __future__ import annotations

import pytest

from conversations.models import Message, MessageFeedback

from .builders import RunDriver, tool_turn

pytestmark = pytest.mark.django_db


def test_counts_exclude_audit_rows_and_declarations_R_READ_4(thread, user):
    run = tool_turn(thread)
    pending = RunDriver(thread, text="mail bob")
    pending.model("lc_run--mail", tool_calls=[{"id": "call_mail", "name": "send_email", "args": {}}])
    pending.finish("interrupted", interrupts=[{"action_requests": [{"name": "send_email"}]}])

    messages = Message.objects.filter(thread=thread)
    # Two user messages, one final answer of the completed run, and the
    # interrupted run's last model call bound as its output (R-MA-8).
    assert messages.ordinary().count() == 4
    # Three model calls (two of them bound as outputs) and one tool row.
    assert messages.audit().count() == 4
    assert messages.model_calls().count() == 3
    assert messages.filter(message_type="model_audit").count() == 1  # the carrier only
    # One execution; the declared send_email call never ran and counts nothing.
    assert messages.tool_executions().count() == 1

    carrier = messages.get(operation_id="lc_run--a1")
    MessageFeedback.objects.create(message=run.output_message, user=user, rating="like")
    MessageFeedback.objects.create(message=carrier, user=user, rating="dislike")  # bad legacy data
    assert MessageFeedback.objects.ordinary().count() == 1
    assert MessageFeedback.objects.ordinary().get().rating == "like"
