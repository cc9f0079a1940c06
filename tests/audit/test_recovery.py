"""Recovery of a run whose worker died (R-RUN-15, first step).

With ``RUN_RECOVERY=resume`` the lease sweeper does not fail a run whose
lease expired: it closes what the dead attempt left running (a tool's
outcome marked unknown), puts the run back to ``pending`` with ``attempt``
+ 1, and another worker continues it — the same run, a new fencing token —
from the last checkpoint the dead attempt wrote, or from its input when it
wrote none. ``RUN_RECOVERY_ATTEMPTS`` bounds how often; the stale owner
writes nothing (R-RUN-4).

A worker "dies" here by a ``BaseException`` raised from its stream loop at
a step boundary: nothing after that point of the worker runs (no terminal
write, no lease release), as after SIGKILL. Runs go through the real
runner, the built-in agents and the replay model server, in process."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from audit import ledger
from audit.errors import LeaseError
from audit.execution.checkpoint import open_checkpointer, postgres_conninfo
from audit.execution.recorder import LifecycleRecorder
from audit.execution.runner import RunExecutor, run_execute
from audit.execution.worker_loop import run_in_worker_loop
from audit.models import AgentRun
from conversations.models import Conversation, Message
from core.config import get_config
from tests.conftest import acquire, make_run

pytestmark = pytest.mark.django_db(transaction=True)

Status = AgentRun.Status
ExecStatus = Message.ExecutionStatus


class WorkerDied(BaseException):
    """The worker process died here: nothing after this point of it runs."""


@pytest.fixture
def resume_recovery(monkeypatch):
    monkeypatch.setattr(get_config(), "RUN_RECOVERY", "resume")
    monkeypatch.setattr(get_config(), "RUN_RECOVERY_ATTEMPTS", 3)


def _thread(user, scenario: str) -> Conversation:
    return Conversation.objects.create(user=user, agent_id="assistant", model=f"replay:{scenario}")


def _die_after(monkeypatch, predicate) -> None:
    """The worker dies right after it handled the first stream event for
    which ``predicate(event)`` holds (its audit write, if any, is done)."""
    real = LifecycleRecorder.handle

    async def handle(self, event):
        await real(self, event)
        if predicate(event):
            raise WorkerDied(f"died after {event.get('method')} seq {event.get('seq')}")

    monkeypatch.setattr(LifecycleRecorder, "handle", handle)


def _tool_event(kind: str):
    def matches(event) -> bool:
        params = event.get("params") or {}
        return event.get("method") == "tools" and (params.get("data") or {}).get("event") == kind

    return matches


def _expire_and_sweep(run: AgentRun) -> list:
    """The dead worker's lease runs out and the sweeper runs."""
    AgentRun.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))
    return ledger.run_sweep_expired_leases()


def _checkpoint_tool_call_ids(thread_id) -> set[str]:
    """The tool call ids answered by ToolMessages in the thread's last
    checkpoint, its values or the writes its next step's finished tasks
    left (what a continued attempt will not execute again)."""

    async def read():
        async with open_checkpointer(postgres_conninfo()) as saver:
            found = await saver.aget_tuple({"configurable": {"thread_id": str(thread_id), "checkpoint_ns": ""}})
        if found is None:
            return set()
        messages = list(found.checkpoint["channel_values"].get("messages") or [])
        for _, channel, value in found.pending_writes or []:
            if channel == "messages":
                messages += value if isinstance(value, list) else [value]
        return {m.tool_call_id for m in messages if getattr(m, "type", "") == "tool"}

    return run_in_worker_loop(read())


def test_a_run_whose_worker_died_after_a_tool_continues_from_its_checkpoint_as_attempt_2_R_RUN_15(
    user, replay_models, resume_recovery, monkeypatch
):
    thread = _thread(user, "tool_then_answer")
    run = make_run(thread, text="weather in Paris?")
    with monkeypatch.context() as patch:
        _die_after(patch, _tool_event("tool-finished"))
        with pytest.raises(WorkerDied):
            run_execute(run_id=run.id, owner="worker-a")
    run.refresh_from_db()
    assert run.status == Status.RUNNING and run.attempt == 1
    token = run.fencing_token

    assert _expire_and_sweep(run) == [run.id]
    run.refresh_from_db()
    assert (run.status, run.attempt, run.lease_owner, run.fencing_token) == (Status.PENDING, 2, None, token)
    assert not run.error_type and run.finished_at is None
    assert not Message.objects.audit().filter(run=run, execution_status=ExecStatus.RUNNING).exists()
    answered_in_checkpoint = "call_weather_paris" in _checkpoint_tool_call_ids(thread.pk)

    assert run_execute(run_id=run.id, owner="worker-b") == "completed"
    run.refresh_from_db()
    assert run.attempt == 2 and run.fencing_token == token + 1
    assert run.output_message.content.startswith("It is 18°C and sunny in Paris")
    assert not Message.objects.audit().filter(run=run, execution_status=ExecStatus.RUNNING).exists()
    tools = list(Message.objects.audit().filter(run=run, role=Message.Role.TOOL).order_by("attempt"))
    # The first attempt's execution completed; the second executes the
    # call again only when the checkpoint had lost its result (get_weather
    # is idempotent; the replay guard of R-EFF-1 comes next).
    assert tools[0].attempt == 1 and tools[0].execution_status == ExecStatus.COMPLETED
    assert [row.attempt for row in tools] == ([1] if answered_in_checkpoint else [1, 2])
    assert len({row.effect_key for row in tools}) == 1
    models = list(Message.objects.model_calls().filter(run=run).order_by("attempt", "sequence"))
    # The declaring call was the first attempt's; the answer is the second's.
    assert models[0].attempt == 1 and models[0].tool_calls
    assert models[-1].attempt == 2 and run.output_message_id == models[-1].pk
    # The second attempt's rows follow the first's in the timeline.
    rows = list(Message.objects.audit().filter(run=run, sequence__isnull=False))
    assert max(r.sequence for r in rows if r.attempt == 1) < min(r.sequence for r in rows if r.attempt == 2)
    # Usage counts every call made, once, over both attempts.
    known = [row.usage for row in models if row.usage]
    assert run.usage["total_tokens"] == sum(u["total_tokens"] for u in known)
    assert run.usage["unknown_calls"] == len(models) - len(known)
    # One human message, the run's own: the input was not given twice.
    state = _checkpoint_messages(thread.pk)
    assert [m.id for m in state if m.type == "human"] == [f"human-{run.id}"]


def _checkpoint_messages(thread_id) -> list:
    async def read():
        async with open_checkpointer(postgres_conninfo()) as saver:
            found = await saver.aget_tuple({"configurable": {"thread_id": str(thread_id), "checkpoint_ns": ""}})
        return list(found.checkpoint["channel_values"].get("messages") or [])

    return run_in_worker_loop(read())


def test_a_run_whose_worker_died_before_its_first_checkpoint_starts_again_from_its_input_R_RUN_15(
    user, replay_models, resume_recovery
):
    earlier = _thread(user, "plain_answer")
    first = make_run(earlier, text="hello")
    assert run_execute(run_id=first.id, owner="in-process") == "completed"
    run = make_run(earlier, text="and again")
    acquire(run, owner="worker-a")  # the worker died right after it took the run

    assert _expire_and_sweep(run) == [run.id]
    assert run_execute(run_id=run.id, owner="worker-b") == "completed"
    run.refresh_from_db()
    assert run.attempt == 2 and run.output_message is not None
    # The first turn's messages are prior: its answer binds to neither run twice.
    first.refresh_from_db()
    assert run.output_message_id != first.output_message_id
    human = [m.id for m in _checkpoint_messages(earlier.pk) if m.type == "human"]
    assert human == [f"human-{first.id}", f"human-{run.id}"]


def test_a_worker_that_died_after_the_graph_ended_leaves_a_run_the_next_attempt_ends_with_no_new_call_R_RUN_15(
    user, replay_models, resume_recovery, monkeypatch
):
    thread = _thread(user, "plain_answer")
    run = make_run(thread, text="hello")

    async def die(self, outcome):
        raise WorkerDied("died before the terminal write")

    with monkeypatch.context() as patch:
        patch.setattr(RunExecutor, "_finish", die)
        with pytest.raises(WorkerDied):
            run_execute(run_id=run.id, owner="worker-a")
    calls = Message.objects.model_calls().filter(run=run).count()
    assert _expire_and_sweep(run) == [run.id]
    assert run_execute(run_id=run.id, owner="worker-b") == "completed"
    run.refresh_from_db()
    assert run.attempt == 2 and run.output_message is not None
    assert Message.objects.model_calls().filter(run=run).count() == calls, "the graph had ended: no call again"


def test_the_sweeper_closes_what_the_dead_attempt_left_running_and_marks_a_tools_outcome_unknown_R_RUN_15(
    thread, resume_recovery
):
    run = make_run(thread)
    lease = acquire(run)
    ledger.model_call_start(lease=lease, operation_id="lc_run--m1", sequence=1, started_at=timezone.now())
    for call_id in ("call_unknown", "call_raised"):
        ledger.tool_call_start(
            lease=lease,
            tool_call_id=call_id,
            tool_name="send_email",
            tool_input={"to": "a@example.com"},
            sequence=2,
            started_at=timezone.now(),
            declared_by_operation_id=None,
        )
    ledger.tool_call_error(lease=lease, tool_call_id="call_raised", error="SMTP refused")

    assert _expire_and_sweep(run) == [run.id]
    rows = {row.operation_id: row for row in Message.objects.audit().filter(run=run)}
    model, unknown, raised = rows["lc_run--m1"], rows["call_unknown"], rows["call_raised"]
    assert model.execution_status == ExecStatus.INTERRUPTED and model.metadata["usage_unknown"] is True
    assert unknown.execution_status == ExecStatus.INTERRUPTED and unknown.metadata["outcome_unknown"] is True
    assert raised.execution_status == ExecStatus.FAILED and "outcome_unknown" not in raised.metadata
    for row in rows.values():
        assert row.attempt == 1 and row.finished_at is not None
        assert row.metadata["closed_by"] == "recovery" and row.metadata["recovered_attempt"] == 1

    # The dead attempt's owner writes nothing more, before and after the
    # next acquisition (R-RUN-4).
    with pytest.raises(LeaseError):
        ledger.lease_renew(lease=lease, ttl_seconds=60)
    acquire(run, owner="worker-b")
    with pytest.raises(LeaseError):
        ledger.tool_call_start(
            lease=lease,
            tool_call_id="call_stale",
            tool_name="get_weather",
            tool_input={},
            sequence=3,
            started_at=timezone.now(),
            declared_by_operation_id=None,
        )
    assert not Message.objects.filter(run=run, operation_id="call_stale").exists()


def test_a_run_is_continued_at_most_RUN_RECOVERY_ATTEMPTS_times_then_fails_lease_expired_R_RUN_15(
    thread, resume_recovery, monkeypatch
):
    monkeypatch.setattr(get_config(), "RUN_RECOVERY_ATTEMPTS", 2)
    run = make_run(thread)
    for attempt in (1, 2):
        acquire(run, owner=f"worker-{attempt}")
        assert _expire_and_sweep(run) == [run.id]
        run.refresh_from_db()
        assert (run.status, run.attempt) == (Status.PENDING, attempt + 1)
    acquire(run, owner="worker-3")
    assert _expire_and_sweep(run) == [run.id]
    run.refresh_from_db()
    assert (run.status, run.error_type, run.attempt) == (Status.FAILED, "lease_expired", 3)
    assert "after 2 recoveries" in run.error_message


def test_with_RUN_RECOVERY_fail_an_expired_run_fails_as_before_R_RUN_15(thread, monkeypatch):
    monkeypatch.setattr(get_config(), "RUN_RECOVERY", "fail")
    run = make_run(thread)
    acquire(run)
    assert _expire_and_sweep(run) == [run.id]
    run.refresh_from_db()
    assert (run.status, run.error_type, run.attempt) == (Status.FAILED, "lease_expired", 1)


def test_a_cancel_or_a_reported_cause_is_honoured_not_continued_R_RUN_15(thread, user, resume_recovery):
    from audit.ledger.causes import failure_cause_send

    cancelled = make_run(thread)
    acquire(cancelled)
    ledger.run_request_cancel(user=user, run_id=cancelled.id)
    other = Conversation.objects.create(user=user, agent_id="assistant", model=thread.model)
    broken = make_run(other)
    acquire(broken)
    failure_cause_send(run_id=broken.id, error_type="audit_write_failed", message="database unreachable")
    _expire_and_sweep(cancelled)
    _expire_and_sweep(broken)
    cancelled.refresh_from_db()
    broken.refresh_from_db()
    assert (cancelled.status, cancelled.attempt) == (Status.CANCELLED, 1)
    assert (broken.status, broken.error_type, broken.attempt) == (Status.FAILED, "audit_write_failed", 1)


def test_a_run_waiting_to_be_continued_can_be_cancelled_R_RUN_15(thread, user, resume_recovery):
    run = make_run(thread)
    acquire(run)
    _expire_and_sweep(run)
    cancelled = ledger.run_request_cancel(user=user, run_id=run.id)
    assert cancelled.status == Status.CANCELLED
    assert cancelled.error_message == "cancelled while waiting to be continued as attempt 2"
