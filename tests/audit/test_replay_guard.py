"""The replay guard (R-EFF-1 with R-RUN-15): a tool call of a turn whose
execution completed is never executed again when its run is continued by
another worker; its recorded result goes back to the graph and a new row
of the new attempt says ``replayed_from``. A non-idempotent tool whose
execution was cut off is not executed again blindly: the run stops
``interrupted`` with an "outcome unknown" request that a resume answers
with ``retry`` or ``skip`` (R-RUN-15); an idempotent one runs again.

The ledger's check is tested on hand-made rows; the whole path runs the
real runner, the assistant and the replay model server in process, the
worker dying (a ``BaseException`` from its stream loop) right after
``send_email`` ran and before anything of that reached the checkpoint —
the window in which LangGraph alone would send the email again."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from django.urls import reverse
from django.utils import timezone

from audit import ledger
from audit.agents.tools import send_email
from audit.execution.checkpoint import ReconnectingPostgresSaver
from audit.execution.recorder import LifecycleRecorder
from audit.execution.runner import run_execute
from audit.ledger.tool_audit import effect_key
from audit.models import AgentRun
from conversations.models import Conversation, Message
from core.config import get_config
from tests.conftest import acquire, bearer, make_run
from tests.read.test_memory_runtime import checkpoint_messages

pytestmark = pytest.mark.django_db(transaction=True)

Status = AgentRun.Status
ExecStatus = Message.ExecutionStatus


class WorkerDied(BaseException):
    """The worker process died here: nothing after this point of it runs."""


@pytest.fixture(autouse=True)
def resume_recovery(monkeypatch):
    monkeypatch.setattr(get_config(), "RUN_RECOVERY", "resume")


def _expire_and_sweep(run: AgentRun) -> None:
    AgentRun.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))
    assert ledger.run_sweep_expired_leases() == [run.id]


def _tool_row(lease, call_id: str, name: str, *, finish: bool) -> Message:
    ledger.tool_call_start(
        lease=lease,
        tool_call_id=call_id,
        tool_name=name,
        tool_input={"to": "ops@example.com"},
        sequence=2,
        started_at=timezone.now(),
        declared_by_operation_id=None,
    )
    if finish:
        ledger.tool_call_finish(
            lease=lease,
            tool_call_id=call_id,
            status="completed",
            content="Email to ops@example.com recorded.",
            raw_output={"content": "Email to ops@example.com recorded."},
            finished_at=timezone.now(),
            duration_ms=5,
        )
    return Message.objects.get(run_id=lease.run_id, role=Message.Role.TOOL, operation_id=call_id)


def test_a_completed_execution_is_replayed_once_in_the_next_attempt_R_EFF_1(thread):
    run = make_run(thread)
    original = _tool_row(acquire(run), "call_email_1", "send_email", finish=True)
    _expire_and_sweep(run)
    lease = acquire(run, owner="worker-b")

    check = ledger.tool_effect_check(
        lease=lease, tool_call_id="call_email_1", tool_name="send_email", idempotent=False, namespace=[], sequence=7
    )
    assert check.action == "replayed" and check.original.pk == original.pk
    replay = check.replay
    assert (replay.run_id, replay.attempt, replay.replayed_from_id) == (run.id, 2, original.pk)
    assert replay.execution_status == ExecStatus.COMPLETED and replay.content == original.content
    assert replay.effect_key == original.effect_key == effect_key(run.turn_id, "call_email_1")
    assert replay.metadata["replayed"] is True and replay.duration_ms == 0 and replay.sequence == 7

    again = ledger.tool_effect_check(
        lease=lease, tool_call_id="call_email_1", tool_name="send_email", idempotent=False, namespace=[]
    )
    assert again.action == "replayed" and again.replay.pk == replay.pk
    assert Message.objects.filter(run=run, operation_id="call_email_1").count() == 2


def test_a_cut_off_execution_stops_a_non_idempotent_tool_and_lets_an_idempotent_one_run_R_EFF_1(thread):
    run = make_run(thread)
    lease = acquire(run)
    _tool_row(lease, "call_email_1", "send_email", finish=False)
    _tool_row(lease, "call_weather_1", "get_weather", finish=False)
    _expire_and_sweep(run)
    lease = acquire(run, owner="worker-b")

    email = ledger.tool_effect_check(
        lease=lease, tool_call_id="call_email_1", tool_name="send_email", idempotent=False, namespace=[]
    )
    weather = ledger.tool_effect_check(
        lease=lease, tool_call_id="call_weather_1", tool_name="get_weather", idempotent=True, namespace=[]
    )
    assert email.action == "outcome_unknown" and email.original.attempt == 1
    assert weather.action == "execute"
    # Nothing recorded: the key of a call never made, another turn's key.
    fresh = ledger.tool_effect_check(
        lease=lease, tool_call_id="call_new", tool_name="send_email", idempotent=False, namespace=[]
    )
    assert fresh.action == "execute"
    assert Message.objects.filter(run=run, attempt=2).count() == 0


def test_the_check_is_fenced_by_the_lease_R_RUN_4(thread):
    run = make_run(thread)
    stale = acquire(run)
    _tool_row(stale, "call_email_1", "send_email", finish=True)
    _expire_and_sweep(run)
    acquire(run, owner="worker-b")
    with pytest.raises(ledger_errors().LeaseError):
        ledger.tool_effect_check(
            lease=stale, tool_call_id="call_email_1", tool_name="send_email", idempotent=False, namespace=[]
        )
    assert Message.objects.filter(run=run, attempt=2).count() == 0


def ledger_errors():
    from audit import errors

    return errors


def _count_sends(monkeypatch, *, lose_checkpoints: bool = True) -> dict:
    """Count send_email's executions; with ``lose_checkpoints``, from its
    first one on the checkpointer loses every write (the worker dies before
    any reaches PostgreSQL)."""
    seen = {"sends": 0, "lost": False}
    real_func = send_email.func

    def counting(*args, **kwargs):
        seen["sends"] += 1
        seen["lost"] = lose_checkpoints
        return real_func(*args, **kwargs)

    monkeypatch.setattr(send_email, "func", counting)
    real_put, real_writes = ReconnectingPostgresSaver.aput, ReconnectingPostgresSaver.aput_writes

    async def aput(self, config, checkpoint, metadata, new_versions):
        if seen["lost"]:
            configurable = config["configurable"]
            return {
                "configurable": {
                    "thread_id": configurable["thread_id"],
                    "checkpoint_ns": configurable.get("checkpoint_ns", ""),
                    "checkpoint_id": checkpoint["id"],
                }
            }
        return await real_put(self, config, checkpoint, metadata, new_versions)

    async def aput_writes(self, config, writes, task_id, task_path=""):
        if not seen["lost"]:
            await real_writes(self, config, writes, task_id, task_path)

    monkeypatch.setattr(ReconnectingPostgresSaver, "aput", aput)
    monkeypatch.setattr(ReconnectingPostgresSaver, "aput_writes", aput_writes)
    return seen


def _die_once_after(monkeypatch, tool_event: str) -> None:
    """The first worker dies right after it handled the stream's
    ``tool_event`` (its audit write done); later workers live."""
    real = LifecycleRecorder.handle
    died = []

    async def handle(self, event):
        await real(self, event)
        data = (event.get("params") or {}).get("data")
        if event.get("method") == "tools" and isinstance(data, dict) and data.get("event") == tool_event and not died:
            died.append(event)
            raise WorkerDied(f"died right after {tool_event}")

    monkeypatch.setattr(LifecycleRecorder, "handle", handle)


def _approved_email_run(user) -> AgentRun:
    """The resume run that sends the approved email of a new thread."""
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:approval_send_email")
    first = make_run(thread, text="send the report")
    assert run_execute(run_id=first.id, owner="in-process") == "interrupted"
    return ledger.run_resume(user=user, run_id=first.id, request_id=uuid.uuid4().hex, decisions=[{"type": "approve"}])[
        0
    ]


def _die_after_then_continue(monkeypatch, resume: AgentRun, tool_event: str) -> tuple[int, str, int]:
    """Worker A runs ``resume`` and dies right after ``tool_event`` (its
    checkpointer losing every write from send_email on); the sweeper puts
    the run back and worker B, whose checkpointer works, continues it.
    Returns (sends when A died, B's result, sends in all)."""
    with monkeypatch.context() as patch:
        seen = _count_sends(patch)
        _die_once_after(patch, tool_event)
        with pytest.raises(WorkerDied):
            run_execute(run_id=resume.id, owner="worker-a")
        sends_before = seen["sends"]
        _expire_and_sweep(resume)
        seen["lost"] = False
        status = run_execute(run_id=resume.id, owner="worker-b")
        return sends_before, status, seen["sends"]


def test_an_email_sent_before_the_worker_died_is_not_sent_again_by_the_continued_run_R_EFF_1_R_RUN_15(
    user, replay_models, monkeypatch
):
    resume = _approved_email_run(user)
    sends_before, status, sends_after = _die_after_then_continue(monkeypatch, resume, "tool-finished")
    assert sends_before == 1
    assert status == "completed"
    assert sends_after == 1, "the email was sent again"

    resume.refresh_from_db()
    assert resume.attempt == 2 and resume.output_message.content == "The email was sent."
    rows = list(Message.objects.filter(run=resume, role=Message.Role.TOOL, operation_id="call_email_1").order_by("id"))
    original, replay = rows
    assert (original.attempt, original.execution_status, original.replayed_from_id) == (1, "completed", None)
    assert (replay.attempt, replay.execution_status, replay.replayed_from_id) == (2, "completed", original.pk)
    assert replay.content == original.content and replay.effect_key == original.effect_key
    assert not Message.objects.audit().filter(run=resume, execution_status=ExecStatus.RUNNING).exists()


def _cut_off_email_run(user, monkeypatch) -> tuple[AgentRun, int]:
    """The approved email's resume run whose worker died while send_email
    ran, continued by another worker: returns it (interrupted) and the
    sends so far."""
    resume = _approved_email_run(user)
    sends_before, status, sends_after = _die_after_then_continue(monkeypatch, resume, "tool-started")
    assert status == "interrupted"
    assert sends_after == sends_before, "a send whose outcome is unknown was made again"
    resume.refresh_from_db()
    return resume, sends_after


def _answer(run: AgentRun, decision: dict) -> AgentRun:
    return ledger.run_resume(user=run.user, run_id=run.id, request_id=uuid.uuid4().hex, decisions=[decision])[0]


def _sends_in(monkeypatch, run: AgentRun) -> tuple[str, int]:
    """Run ``run`` on a live worker; returns (result, send_email executions)."""
    with monkeypatch.context() as patch:
        seen = _count_sends(patch, lose_checkpoints=False)
        return run_execute(run_id=run.id, owner="worker-c"), seen["sends"]


def test_an_email_cut_off_by_the_dying_worker_stops_the_run_with_an_outcome_unknown_request_R_EFF_1_R_RUN_15(
    client, user, replay_models, monkeypatch
):
    resume, _ = _cut_off_email_run(user, monkeypatch)
    assert (resume.status, resume.attempt, resume.error_type) == (Status.INTERRUPTED, 2, "")
    (cut,) = Message.objects.filter(run=resume, role=Message.Role.TOOL, operation_id="call_email_1")
    assert cut.execution_status == ExecStatus.INTERRUPTED and cut.metadata["outcome_unknown"] is True
    assert not Message.objects.audit().filter(run=resume, execution_status=ExecStatus.RUNNING).exists()

    body = client.get(f"/api/runs/{resume.id}", headers=bearer(user)).json()
    assert body["status"] == "interrupted"
    (request,) = body["approval"]["action_requests"]
    assert request["kind"] == "outcome_unknown" and request["name"] == "send_email"
    assert request["args"] == cut.tool_input and request["allowed_decisions"] == ["retry", "skip"]
    assert "attempt 1" in request["description"] and "unknown" in request["description"]
    (pending,) = body["pending_approval"]
    assert pending["value"]["action_requests"][0]["outcome_unknown"] == {"row_id": cut.pk, "attempt": 1}

    # Only its own decisions answer it; nothing is created on a refusal.
    for wrong in ({"type": "approve"}, {"type": "edit", "args": {"to": "x@example.com"}}, {"type": "reject"}):
        refused = client.post(
            f"/api/runs/{resume.id}/resume",
            {"request_id": uuid.uuid4().hex, "decisions": [wrong]},
            content_type="application/json",
            headers=bearer(user),
        )
        assert refused.status_code == 422, refused.content
        assert refused.json()["error"]["allowed"] == ["retry", "skip"]
    assert not AgentRun.objects.filter(resumed_from=resume).exists()

    staff = type(user).objects.create_user(username=f"staff-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client.force_login(staff)
    html = client.get(reverse("admin:audit_agentrun_change", args=[resume.pk])).content.decode()
    panel = html[html.index('class="yx-approval') : html.index("</section>", html.index('class="yx-approval'))]
    assert "Waiting for approval" in panel and "outcome unknown</span>" in panel and "retry, skip" in panel


def test_skip_goes_on_without_executing_the_call_again_and_records_the_decision_R_RUN_15(
    user, replay_models, monkeypatch
):
    resume, sends = _cut_off_email_run(user, monkeypatch)
    (cut,) = Message.objects.filter(run=resume, role=Message.Role.TOOL, operation_id="call_email_1")
    skip = _answer(resume, {"type": "skip"})
    assert skip.input["decisions"] == [{"type": "skip", "tool_call_id": "call_email_1", "row_id": cut.pk}]
    status, sends_now = _sends_in(monkeypatch, skip)
    assert status == "completed" and sends_now == 0

    (skipped,) = Message.objects.filter(run=skip, role=Message.Role.TOOL, operation_id="call_email_1")
    assert skipped.execution_status == ExecStatus.REJECTED and skipped.started_at is None
    assert skipped.metadata["source"] == "outcome_unknown_decision"
    assert skipped.metadata["outcome_unknown_row"] == cut.pk
    assert skipped.effect_key == cut.effect_key and skipped.tool_input == cut.tool_input
    assert "not executed again" in skipped.content
    # The graph was told: the State's tool message is the skip, not a send.
    (told,) = [m for m in checkpoint_messages(skip.thread) if getattr(m, "tool_call_id", None) == "call_email_1"]
    assert "not executed again" in told.content and told.status == "error"


def test_retry_executes_the_call_again_once_R_RUN_15(user, replay_models, monkeypatch):
    resume, _ = _cut_off_email_run(user, monkeypatch)
    retry = _answer(resume, {"type": "retry"})
    status, sends_now = _sends_in(monkeypatch, retry)
    assert status == "completed" and sends_now == 1
    retry.refresh_from_db()
    assert retry.output_message.content == "The email was sent."
    (sent,) = Message.objects.filter(run=retry, role=Message.Role.TOOL, operation_id="call_email_1")
    assert sent.execution_status == ExecStatus.COMPLETED and sent.replayed_from_id is None


def test_a_retry_cut_off_again_asks_again_about_the_new_execution_R_RUN_15(user, replay_models, monkeypatch):
    resume, _ = _cut_off_email_run(user, monkeypatch)
    retry = _answer(resume, {"type": "retry"})
    sends_before, status, sends_after = _die_after_then_continue(monkeypatch, retry, "tool-started")
    assert (sends_before, status, sends_after) == (1, "interrupted", 1)
    retry.refresh_from_db()
    (cut_again,) = Message.objects.filter(run=retry, role=Message.Role.TOOL, operation_id="call_email_1")
    [request] = retry.interrupts[0]["value"]["action_requests"]
    assert request["outcome_unknown"] == {"row_id": cut_again.pk, "attempt": 1}

    skip = _answer(retry, {"type": "skip"})
    status, sends_now = _sends_in(monkeypatch, skip)
    assert status == "completed" and sends_now == 0
