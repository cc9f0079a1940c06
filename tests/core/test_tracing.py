"""Optional Langfuse tracing never affects the run or its audit (R-TRC-1)."""

from __future__ import annotations

import pytest
from langfuse import Langfuse

from audit.execution.runner import run_execute
from conversations.models import Conversation, Message
from core.config import get_config
from tests.conftest import make_run

pytestmark = pytest.mark.django_db(transaction=True)


def _run(user):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:tool_then_answer")
    run = make_run(thread)
    status = run_execute(run_id=run.id, owner="tracing-test")
    run.refresh_from_db()
    return status, run


def test_without_langfuse_no_trace_id_is_stored_R_TRC_1(user, replay_models):
    status, run = _run(user)
    assert status == "completed" and run.trace_id == ""


@pytest.mark.parametrize(
    "host, secret",
    [
        ("http://127.0.0.1:9", "sk-lf-test"),  # unreachable: nothing listens on the discard port
        ("not a url at all", "sk-lf-test"),  # misconfigured host
    ],
)
def test_langfuse_unreachable_or_misconfigured_keeps_the_run_and_audit_intact_R_TRC_1(
    user, replay_models, monkeypatch, host, secret
):
    config = get_config()
    monkeypatch.setattr(config, "LANGFUSE_PUBLIC_KEY", "pk-lf-test")
    monkeypatch.setattr(config, "LANGFUSE_SECRET_KEY", secret)
    monkeypatch.setattr(config, "LANGFUSE_HOST", host)
    status, run = _run(user)
    assert status == "completed", (run.error_type, run.error_message)
    # The trace id is derived from the run id and stored before the first
    # model call: its row was written while the run was running.
    assert run.trace_id == Langfuse.create_trace_id(seed=str(run.id))
    rows = Message.objects.audit().filter(run=run)
    assert [r.execution_status for r in rows.order_by("sequence")] == ["completed", "completed", "completed"]
    assert run.output_message_id is not None
    # Stop the SDK's background exporter while this test still owns the
    # log capture (its retries against the dead host would log later).
    from langfuse import get_client

    get_client(public_key="pk-lf-test").shutdown()
