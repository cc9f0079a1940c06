"""The runner executes runs one after another in one process, as a Celery
worker child does: each run gets its own event loop, and nothing bound to an
earlier loop (HTTP clients, Redis clients) may leak into the next run."""

from __future__ import annotations

import pytest

from audit.execution.runner import run_execute
from audit.models import AgentRun
from conversations.models import Conversation, Message
from tests.conftest import make_run

pytestmark = pytest.mark.django_db(transaction=True)


def test_consecutive_runs_in_one_process_each_complete_R_RUN_3(user, replay_models):
    statuses = []
    for scenario in ("tool_then_answer", "plain_answer", "tool_then_answer"):
        thread = Conversation.objects.create(user=user, agent_id="assistant", model=f"replay:{scenario}")
        run = make_run(thread)
        statuses.append(run_execute(run_id=run.id, owner="in-process"))
        run.refresh_from_db()
        assert run.output_message_id is not None, (run.error_type, run.error_message)
    assert statuses == ["completed", "completed", "completed"]
    assert Message.objects.model_calls().filter(execution_status="running").count() == 0


def test_a_run_already_taken_is_skipped_by_a_second_delivery_R_RUN_3(user, replay_models):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    run = make_run(thread)
    assert run_execute(run_id=run.id, owner="first") == "completed"
    assert run_execute(run_id=run.id, owner="second") == "skipped"
    run.refresh_from_db()
    assert run.status == AgentRun.Status.COMPLETED and run.lease_owner == "first"
    assert Message.objects.model_calls().filter(run=run).count() == 1
