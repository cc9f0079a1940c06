"""Tool audit end to end: one fact per tool execution, tool errors, human
approval interrupt and resume, large results (R-TA-1..6).

Real processes (uvicorn, a Celery worker, the replay model server) on the
test database; the tests drive HTTP and read the database."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from audit.models import AgentRun
from conversations.models import Message
from core.config import get_config
from tests.conftest import bearer
from tests.waiting import WAIT_SECONDS

from .stack import TERMINAL_STATUSES as TERMINAL
from .stack import create_thread as _thread
from .stack import wait_for_status

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def _turn(client, thread_id: str, text: str = "go") -> dict:
    submitted = client.post(
        f"/api/threads/{thread_id}/runs", json={"request_id": f"req-{uuid.uuid4().hex}", "input": {"text": text}}
    )
    assert submitted.status_code == 202, submitted.text
    return wait_for_status(client, submitted.json()["run_id"], TERMINAL)


def _resume(client, run_id: str, decisions: list[dict], request_id: str | None = None):
    return client.post(
        f"/api/runs/{run_id}/resume",
        json={"request_id": request_id or f"resume-{uuid.uuid4().hex}", "decisions": decisions},
    )


def _tool_rows(run_id) -> list[Message]:
    return list(Message.objects.filter(run_id=run_id, message_type=Message.Type.TOOL_AUDIT).order_by("id"))


def _checkpoint_messages(thread_id: str) -> list:
    """The messages of the thread's latest checkpoint (the graph State)."""
    from langgraph.checkpoint.postgres import PostgresSaver

    from audit.execution.checkpoint import postgres_conninfo

    with PostgresSaver.from_conn_string(postgres_conninfo()) as saver:
        saved = saver.get_tuple({"configurable": {"thread_id": thread_id}})
    return list(saved.checkpoint["channel_values"].get("messages", []))


def _workspace(thread_id: str, stack) -> Path:
    return Path(stack.env["WORKSPACE_ROOT"]) / thread_id


def test_handled_tool_error_fails_the_row_and_the_run_continues_R_TA_3(stack, user):
    with stack.client(bearer(user)) as client:
        thread_id = _thread(client, "replay:tool_error_handled")
        body = _turn(client, thread_id, "weather in Atlantis?")
    assert body["status"] == "completed", body
    [row] = _tool_rows(body["run_id"])
    assert row.operation_id == "call_weather_atlantis"
    assert row.execution_status == "failed"
    assert row.started_at is not None and row.finished_at is not None and row.duration_ms is not None
    assert "unknown city: Atlantis" in row.content
    assert row.metadata["raw_output"]["status"] == "error"
    assert row.declared_by.run_id == row.run_id
    assert AgentRun.objects.get(pk=body["run_id"]).output_message.content.startswith("Sorry")


def test_unhandled_tool_error_fails_the_row_and_the_run_R_TA_3_R_TA_6(stack, user):
    with stack.client(bearer(user)) as client:
        thread_id = _thread(client, "replay:tool_error_unhandled")
        body = _turn(client, thread_id, "1/0?")
    assert body["status"] == "failed", body
    assert "ZeroDivisionError" in body["error_message"] or "division" in body["error_message"], body
    [row] = _tool_rows(body["run_id"])
    assert row.operation_id == "call_calc_div_zero"
    assert row.execution_status == "failed"
    assert row.started_at is not None and row.finished_at is not None
    assert not Message.objects.filter(run_id=body["run_id"]).running().exists()


def test_bare_tool_error_is_completed_from_the_last_error_tool_message_R_TA_3(stack, user):
    """Invalid arguments: the stream has tool-started and a bare tool-error
    (no tool-finished); the tool node answers with an error ToolMessage. The
    row waits (``awaiting_run_terminal``) and the terminal transaction fails
    it with that ToolMessage's text."""
    with stack.client(bearer(user)) as client:
        thread_id = _thread(client, "replay:tool_invalid_args")
        body = _turn(client, thread_id, "2+2?")
    assert body["status"] == "completed", body
    [row] = _tool_rows(body["run_id"])
    assert row.execution_status == "failed"
    assert row.metadata.get("state_reconciled") is True
    assert "awaiting_run_terminal" not in row.metadata
    assert row.metadata.get("tool_error")
    assert "expression" in row.content  # the validation error names the missing argument
    assert row.started_at is not None and row.finished_at is not None


def test_same_tool_call_id_in_two_runs_of_a_thread_stays_two_facts_R_TA_1_R_MA_9(stack, user):
    with stack.client(bearer(user)) as client:
        thread_id = _thread(client, "replay:tool_then_answer")
        first = _turn(client, thread_id, "weather in Paris?")
        second = _turn(client, thread_id, "and again?")
    assert first["status"] == second["status"] == "completed", (first, second)
    rows = list(Message.objects.filter(thread_id=thread_id, message_type=Message.Type.TOOL_AUDIT).order_by("id"))
    assert [r.operation_id for r in rows] == ["call_weather_paris", "call_weather_paris"]
    assert [str(r.run_id) for r in rows] == [first["run_id"], second["run_id"]]
    assert all(r.execution_status == "completed" for r in rows)
    # Each execution is declared by the model call of its own run.
    assert [r.declared_by.run_id for r in rows] == [r.run_id for r in rows]
    assert Message.objects.tool_executions().filter(thread_id=thread_id).count() == 2


def test_approval_interrupt_resume_approve_then_large_result_R_TA_4_R_TA_5(stack, user, other_user):
    """Seed 003: send_email waits for approval, the resume run sends it and
    then lookup_docs returns a result over the threshold."""
    threshold = get_config().LARGE_TOOL_RESULT_CHARS
    with stack.client(bearer(user)) as client:
        thread_id = _thread(client, "replay:approval_then_large_lookup")
        first = _turn(client, thread_id, "send the report, then look up retention")

        # The run stops for approval; the pending action is visible.
        assert first["status"] == "interrupted", first
        [pending] = first["pending_approval"]
        [action] = pending["value"]["action_requests"]
        assert action["name"] == "send_email" and action["args"]["to"] == "ops@example.com"
        assert Message.objects.filter(run_id=first["run_id"], message_type=Message.Type.TOOL_AUDIT).count() == 0
        assert not Message.objects.filter(run_id=first["run_id"]).running().exists()

        # A new turn is refused until the approval is answered.
        refused = client.post(
            f"/api/threads/{thread_id}/runs", json={"request_id": f"req-{uuid.uuid4().hex}", "input": {"text": "hi"}}
        )
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "thread_interrupted"
        assert refused.json()["error"]["run_id"] == first["run_id"]

        # Bad decisions change nothing.
        assert _resume(client, first["run_id"], [{"type": "approve"}, {"type": "approve"}]).status_code == 422
        assert _resume(client, first["run_id"], [{"type": "maybe"}]).status_code == 422
        assert AgentRun.objects.filter(resumed_from_id=first["run_id"]).count() == 0

        resumed = _resume(client, first["run_id"], [{"type": "approve"}], request_id="resume-approve-1")
        assert resumed.status_code == 202, resumed.text
        resume_id = resumed.json()["run_id"]
        assert resumed.json()["resumed_from"] == first["run_id"]
        assert resumed.json()["turn_id"] == first["turn_id"]

        # Idempotent by request_id; a second, different resume is refused.
        again = _resume(client, first["run_id"], [{"type": "approve"}], request_id="resume-approve-1")
        assert again.status_code == 200 and again.json()["run_id"] == resume_id
        other = _resume(client, first["run_id"], [{"type": "approve"}])
        assert other.status_code == 409, other.text
        # Another user's run is not found.
        with stack.client(bearer(other_user)) as stranger:
            assert _resume(stranger, first["run_id"], [{"type": "approve"}]).status_code == 404

        done = wait_for_status(client, resume_id, TERMINAL)
    assert done["status"] == "completed", done

    resume_run = AgentRun.objects.get(pk=resume_id)
    email, lookup = _tool_rows(resume_id)
    # Approve: the tool ran in the resume run, declared by the first run's model call.
    assert email.operation_id == "call_email_1" and email.execution_status == "completed"
    assert email.started_at is not None
    assert email.declared_by.run_id == uuid.UUID(first["run_id"])
    assert (_workspace(thread_id, stack) / "outbox" / resume_id / "call_email_1.json").exists()

    # Large result: the audit keeps the full raw output, the workspace the file,
    # the final State only a path and preview, and the run still completes.
    assert lookup.operation_id == "call_lookup_1" and lookup.execution_status == "completed"
    raw = lookup.metadata["raw_output"]["content"]
    assert len(raw) > threshold and len(lookup.content) > threshold
    assert raw.startswith("Results for 'retention policy'")
    offloaded = _workspace(thread_id, stack) / "outputs" / "large_tool_results" / resume_id / "call_lookup_1"
    assert offloaded.read_text() == raw
    assert lookup.declared_by.run_id == resume_run.id
    [state_message] = [
        m for m in _checkpoint_messages(thread_id) if getattr(m, "tool_call_id", None) == "call_lookup_1"
    ]
    assert f"outputs/large_tool_results/{resume_id}/call_lookup_1" in state_message.content
    assert len(state_message.content) < threshold
    assert resume_run.output_message is not None
    assert resume_run.output_message.content.startswith("The email was sent")
    assert resume_run.output_message.run_id == resume_run.id

    # The interrupted run stays interrupted with no running row; none anywhere.
    first_run = AgentRun.objects.get(pk=first["run_id"])
    assert first_run.status == "interrupted"
    assert not Message.objects.filter(thread_id=thread_id).running().exists()
    model_row = Message.objects.model_calls().get(run=first_run)
    assert model_row.execution_status == "completed"


def test_approval_reject_records_a_rejected_row_that_is_no_execution_R_TA_5_R_READ_4(stack, user):
    with stack.client(bearer(user)) as client:
        thread_id = _thread(client, "replay:approval_send_email")
        first = _turn(client, thread_id, "send the report")
        assert first["status"] == "interrupted", first
        resumed = _resume(client, first["run_id"], [{"type": "reject", "message": "not today"}])
        assert resumed.status_code == 202, resumed.text
        done = wait_for_status(client, resumed.json()["run_id"], TERMINAL)
    assert done["status"] == "completed", done

    [row] = _tool_rows(done["run_id"])
    assert row.operation_id == "call_email_1"
    assert row.execution_status == "rejected"
    assert row.started_at is None and row.duration_ms is None
    assert row.metadata["source"] == "approval_decision"
    assert row.metadata["decision"] == {"type": "reject", "message": "not today"}
    assert "not today" in row.content
    assert row.tool_name == "send_email" and row.tool_input["to"] == "ops@example.com"
    assert row.declared_by.run_id == uuid.UUID(first["run_id"])
    # A rejected call is no execution: nothing was sent, nothing counted.
    assert not (_workspace(thread_id, stack) / "outbox").exists()
    assert Message.objects.tool_executions().filter(thread_id=thread_id).count() == 0
    assert Message.objects.filter(thread_id=thread_id, message_type=Message.Type.TOOL_AUDIT).count() == 1
    # The resume run answers and binds its own output, which does not say
    # the email was sent (issue 37).
    resume_run = AgentRun.objects.get(pk=done["run_id"])
    assert resume_run.output_message.run_id == resume_run.id
    assert resume_run.output_message.content.startswith("The email was not sent")


def test_approval_edit_runs_the_tool_with_the_reviewed_arguments_R_TA_5(stack, user):
    edited = {"to": "boss@example.com", "subject": "Report", "body": "Reviewed"}
    with stack.client(bearer(user)) as client:
        thread_id = _thread(client, "replay:approval_send_email")
        first = _turn(client, thread_id, "send the report")
        assert first["status"] == "interrupted", first
        resumed = _resume(client, first["run_id"], [{"type": "edit", "args": edited}])
        assert resumed.status_code == 202, resumed.text
        done = wait_for_status(client, resumed.json()["run_id"], TERMINAL)
    assert done["status"] == "completed", done
    [row] = _tool_rows(done["run_id"])
    assert row.execution_status == "completed" and row.started_at is not None
    assert row.tool_input == edited
    sent = _workspace(thread_id, stack) / "outbox" / done["run_id"] / "call_email_1.json"
    assert '"boss@example.com"' in sent.read_text()


def test_large_result_on_a_normal_run_R_TA_4(stack, user):
    threshold = get_config().LARGE_TOOL_RESULT_CHARS
    with stack.client(bearer(user)) as client:
        thread_id = _thread(client, "replay:large_lookup")
        body = _turn(client, thread_id, "retention?")
    assert body["status"] == "completed", body
    [row] = _tool_rows(body["run_id"])
    raw = row.metadata["raw_output"]["content"]
    assert row.execution_status == "completed" and len(raw) > threshold
    offloaded = _workspace(thread_id, stack) / "outputs" / "large_tool_results" / body["run_id"] / "call_lookup_1"
    assert offloaded.read_text() == raw
    run = AgentRun.objects.get(pk=body["run_id"])
    assert run.output_message.content.startswith("The retention policy")


def test_cancel_an_interrupted_run_releases_the_thread_R_TA_5_R_RUN_6(stack, user):
    with stack.client(bearer(user)) as client:
        thread_id = _thread(client, "replay:approval_send_email")
        first = _turn(client, thread_id, "send the report")
        assert first["status"] == "interrupted", first
        cancelled = client.post(f"/api/runs/{first['run_id']}/cancel")
        assert cancelled.status_code == 202, cancelled.text
        assert cancelled.json()["status"] == "cancelled"
        assert cancelled.json()["pending_approval"] is None
        # Resuming a cancelled run is refused; a new turn is accepted.
        assert _resume(client, first["run_id"], [{"type": "approve"}]).status_code == 409
        accepted = client.post(
            f"/api/threads/{thread_id}/runs", json={"request_id": f"req-{uuid.uuid4().hex}", "input": {"text": "hi"}}
        )
        assert accepted.status_code == 202, accepted.text
        # The scenario asks for the email again: the new turn runs (the
        # cancelled call is answered in the State, not executed) and stops
        # for approval again.
        again = wait_for_status(client, accepted.json()["run_id"], TERMINAL)
    assert again["status"] == "interrupted", again
    assert not Message.objects.filter(thread_id=thread_id).running().exists()
    assert Message.objects.filter(thread_id=thread_id, message_type=Message.Type.TOOL_AUDIT).count() == 0


def test_cancel_during_a_tool_leaves_no_running_tool_row_R_TA_6_R_RUN_6(stack, user):
    with stack.client(bearer(user)) as client:
        thread_id = _thread(client, "replay:slow_lookup")
        submitted = client.post(
            f"/api/threads/{thread_id}/runs", json={"request_id": f"req-{uuid.uuid4().hex}", "input": {"text": "?"}}
        )
        assert submitted.status_code == 202, submitted.text
        run_id = submitted.json()["run_id"]
        deadline = time.monotonic() + WAIT_SECONDS
        while not Message.objects.filter(run_id=run_id, operation_id="call_lookup_slow").running().exists():
            assert time.monotonic() < deadline, "the tool never started"
            time.sleep(0.05)
        assert client.post(f"/api/runs/{run_id}/cancel").status_code == 202
        body = wait_for_status(client, run_id, TERMINAL)
    assert body["status"] == "cancelled", body
    [row] = _tool_rows(run_id)
    assert row.execution_status == "interrupted"
    assert row.finished_at is not None and row.metadata["closed_by"] == "run_terminal"
    assert not Message.objects.filter(run_id=run_id).running().exists()
