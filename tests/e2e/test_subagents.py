"""The built-in ``researcher`` agent and its subagent end to end, with real
processes (web, Celery worker, replay model server): the subagent's calls
are audited under the ``task`` call that spawned them, counted once, and
a cancel or a killed worker inside the subagent leaves nothing running
(R-SUB-1, R-RUN-6, R-RUN-7).

One stack (the session's) serves every test here."""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest

from audit.models import AgentRun
from conversations.models import Message
from tests.conftest import bearer

from .stack import Process, create_thread, wait_for_status

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TERMINAL = {"completed", "failed", "cancelled", "interrupted"}


def _submit(client, thread_id: str, request_id: str) -> str:
    submitted = client.post(
        f"/api/threads/{thread_id}/runs",
        json={"request_id": request_id, "input": {"text": "How long are records kept, and when are exports made?"}},
    )
    assert submitted.status_code == 202, submitted.text
    return submitted.json()["run_id"]


def _wait_for_subagent_streaming(run_id: str, timeout: float = 60.0) -> Message:
    """Poll PostgreSQL until a subagent model call of the run is running
    after its parallel pair of tool calls ended: its message-start arrived
    (no longer awaiting the first chunk), so it is streaming."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        finished_pair = Message.objects.filter(
            run_id=run_id, role="tool", tool_name="lookup_docs", execution_status="completed"
        ).count()
        row = (
            Message.objects.model_calls()
            .filter(run_id=run_id, execution_status="running", parent_operation_id__isnull=False)
            .exclude(metadata__has_key="awaiting_first_chunk")
            .first()
        )
        if row is not None and finished_pair == 2:
            return row
        time.sleep(0.05)
    raise TimeoutError(f"run {run_id}: the subagent never streamed its answer")


def _owner_worker(stack, run_id: str) -> Process:
    owner = AgentRun.objects.get(pk=run_id).lease_owner
    group = os.getpgid(int(owner.split(":")[1]))
    return next(w for w in stack.workers if w.popen.pid == group)


def _assert_nested(run_id: str, task_call: str) -> list[Message]:
    rows = list(Message.objects.audit().filter(run_id=run_id).order_by("sequence"))
    task = next(r for r in rows if r.operation_id == task_call)
    assert task.namespace == [] and task.parent_operation_id is None and task.usage is None
    children = [r for r in rows if r.namespace]
    assert children and {r.parent_operation_id for r in children} == {task_call}
    assert all(r.sequence > task.sequence for r in children)
    return rows


def test_a_researcher_run_nests_its_subagent_calls_and_counts_them_once_R_SUB_1(stack, user, staff_user):
    with stack.client(bearer(user)) as client, stack.client(bearer(staff_user)) as staff:
        thread_id = create_thread(client, "replay:researcher_fact_check", agent_id="researcher")
        run_id = _submit(client, thread_id, "researcher-1")
        body = wait_for_status(client, run_id, TERMINAL)
        assert body["status"] == "completed", body

        rows = _assert_nested(run_id, "call_task_fact_check")
        model_rows = [r for r in rows if r.role == "assistant"]
        assert len(model_rows) == 4 and len([r for r in model_rows if r.namespace]) == 2
        tools = {r.operation_id: r for r in rows if r.role == "tool"}
        assert set(tools) == {"call_task_fact_check", "call_lookup_retention", "call_lookup_exports"}
        assert all(r.execution_status == "completed" for r in rows)
        assert "retained for 400 days" in tools["call_task_fact_check"].content

        # Usage: the run's total is each model row once (the task row has none).
        summed = sum(r.usage["total_tokens"] for r in model_rows)
        assert body["usage"]["total_tokens"] == summed == 690 and body["usage"]["unknown_calls"] == 0
        run_cost = sum(r.cost_usd for r in model_rows)
        assert body["cost"]["total_usd"] is not None and float(body["cost"]["total_usd"]) == pytest.approx(
            float(run_cost)
        )
        output = Message.objects.get(pk=body["output_message_id"])
        assert output.namespace == [] and output.content.startswith("Records are retained for 400 days")

        # The timeline API nests; the dashboard counts the same figures.
        timeline = staff.get(f"/api/audit/runs/{run_id}/timeline").json()["items"]
        nested = {i["operation_id"]: i["parent_operation_id"] for i in timeline if i["namespace"]}
        assert set(nested.values()) == {"call_task_fact_check"} and len(nested) == 4
        models = staff.get("/api/dashboard/models").json()["tokens_by_model_day"]
        dashboard_tokens = sum(m["total_tokens"] for m in models if m["model"] == "replay:researcher_fact_check")
        assert dashboard_tokens == summed
        costs = staff.get("/api/dashboard/costs", params={"group_by": "user"}).json()["items"]
        (mine,) = [c for c in costs if c["key"] == user.username]
        assert mine["calls"] == 4 and float(mine["total_usd"]) == pytest.approx(float(run_cost))
        tool_counts = {t["tool_name"]: t for t in staff.get("/api/dashboard/tools").json()["by_tool"]}
        assert tool_counts["lookup_docs"]["executions"] >= 2 and tool_counts["task"]["executions"] >= 1

        # History: the task execution with its result; no subagent row.
        history = client.get(f"/api/threads/{thread_id}/history").json()["items"]
        shown_tools = [t["id"] for item in history for t in item.get("tool_executions") or []]
        assert shown_tools == ["call_task_fact_check"]


def test_cancel_while_the_subagent_streams_leaves_nothing_running_R_SUB_1_R_RUN_6(stack, user):
    with stack.client(bearer(user)) as client:
        thread_id = create_thread(client, "replay:researcher_slow_subagent", agent_id="researcher")
        run_id = _submit(client, thread_id, "researcher-cancel-1")
        streaming = _wait_for_subagent_streaming(run_id)
        cancelled = client.post(f"/api/runs/{run_id}/cancel")
        assert cancelled.status_code == 202, cancelled.text
        body = wait_for_status(client, run_id, TERMINAL)

    assert body["status"] == "cancelled", body
    assert not Message.objects.filter(run_id=run_id, execution_status="running").exists()
    rows = _assert_nested(run_id, "call_task_slow_check")
    by_op = {(r.role, r.operation_id): r for r in rows}
    assert by_op[("tool", "call_task_slow_check")].execution_status == "interrupted"
    cut = by_op[("assistant", streaming.operation_id)]
    assert cut.execution_status == "interrupted" and cut.usage is None and cut.metadata["usage_unknown"] is True
    assert body["usage"]["unknown_calls"] == 1, "the cut subagent call, once"
    assert body["output_message_id"] is None
    # The main agent never made its second call.
    assert len([r for r in rows if r.role == "assistant" and not r.namespace]) == 1


def test_a_worker_killed_inside_the_subagent_leaves_the_run_to_another_worker_R_SUB_1_R_RUN_15_R_EFF_1(stack, user):
    stack.start_worker(name="doomed-researcher")
    with stack.client(bearer(user)) as client:
        thread_id = create_thread(client, "replay:researcher_slow_subagent", agent_id="researcher")
        run_id = _submit(client, thread_id, "researcher-kill-1")
        _wait_for_subagent_streaming(run_id)
        victim = _owner_worker(stack, run_id)
        victim.kill()  # SIGKILL the worker's whole process group inside the subagent
        stack.workers.remove(victim)
        assert stack.workers, "another worker (with the sweeper) stays up"
        # Continued by the other worker (RUN_RECOVERY=resume, the default).
        body = wait_for_status(client, run_id, TERMINAL)

    assert (body["status"], body["error_type"], body["attempt"]) == ("completed", "", 2), body
    assert not Message.objects.filter(run_id=run_id, execution_status="running").exists()
    rows = list(Message.objects.audit().filter(run_id=run_id).order_by("sequence", "id"))
    cut_task, task = [r for r in rows if r.operation_id == "call_task_slow_check"]
    # The task call the dead worker was running: its outcome unknown; the
    # task is idempotent, so the next attempt ran it again, same effect key.
    assert (cut_task.attempt, cut_task.execution_status) == (1, "interrupted")
    assert cut_task.metadata["outcome_unknown"] is True
    assert (task.attempt, task.execution_status, task.effect_key) == (2, "completed", cut_task.effect_key)
    # The subagent's calls stay nested under the task call in both attempts,
    # after it in the timeline, and none of its lookups ran twice: a lookup
    # that completed in the first attempt is replayed, not executed again.
    children = [r for r in rows if r.namespace]
    assert children and {r.parent_operation_id for r in children} == {"call_task_slow_check"}
    assert all(r.sequence > cut_task.sequence for r in children if r.attempt == 1)
    assert all(r.sequence > task.sequence for r in children if r.attempt == 2)
    lookups = [r for r in children if r.role == "tool"]
    executed = Counter(r.operation_id for r in lookups if r.replayed_from_id is None and r.started_at is not None)
    assert executed and set(executed.values()) == {1}, executed
    assert {r.execution_status for r in children if r.attempt == 1 and r.role == "assistant"} >= {"interrupted"}
