"""Writes of run execution: submission, lease, audit rows, terminal state.

Every write that a worker makes into a run goes through
:func:`audit.lease.lock_run` inside its own short transaction (R-RUN-4,
R-RUN-5). Functions take keyword-only arguments and own their transaction.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Iterable

from django.db import IntegrityError, transaction
from django.utils import timezone

from conversations.models import Conversation, Message
from yuxi_project.errors import Conflict, InvalidInput, NotFound

from .errors import AuditConflict, RunNotStartable
from .lease import Lease, lock_run
from .models import AgentRun

log = logging.getLogger(__name__)

Status = AgentRun.Status
ExecStatus = Message.ExecutionStatus


# --------------------------------------------------------------------------
# Submission (R-RUN-1)
# --------------------------------------------------------------------------


def run_submit(*, user, thread_id: uuid.UUID, request_id: str, text: str) -> tuple[AgentRun, bool]:
    """Submit one user turn to a thread.

    Args:
        user: the thread's owner.
        thread_id: the conversation; another user's thread is not found.
        request_id: the client's idempotency key (1–200 characters).
        text: the user's input (non-empty).

    Returns ``(run, created)``. The same ``request_id`` again returns the
    existing run with ``created=False`` and enqueues nothing.

    Raises:
        NotFound: no such thread for this user.
        Conflict: ``request_id`` was used for another thread or user
            (``request_id_reused``), or the thread waits for an approval
            (``thread_interrupted``).

    Implements R-RUN-1; the run is enqueued only after commit.
    """
    if not text.strip():
        raise InvalidInput("input.text must not be empty")
    existing = _existing_submission(user=user, thread_id=thread_id, request_id=request_id)
    if existing is not None:
        return existing, False
    try:
        with transaction.atomic():
            # Serialises submissions of one thread, so the interrupt check
            # and FIFO order see every earlier run.
            thread = _lock_thread(user=user, thread_id=thread_id)
            _refuse_if_interrupted(thread)
            run = AgentRun.objects.create(
                request_id=request_id,
                thread=thread,
                user=user,
                agent_id=thread.agent_id,
                model=thread.model,
                input={"text": text},
            )
            Message.objects.create(thread=thread, run=run, role=Message.Role.USER, content=text)
            _enqueue_on_commit(run.id)
    except IntegrityError:
        # A concurrent submission with the same request_id won the insert.
        existing = _existing_submission(user=user, thread_id=thread_id, request_id=request_id)
        if existing is None:
            raise
        return existing, False
    return run, True


def _existing_submission(*, user, thread_id: uuid.UUID, request_id: str) -> AgentRun | None:
    run = AgentRun.objects.filter(request_id=request_id).first()
    if run is None:
        return None
    if run.user_id != user.pk or run.thread_id != thread_id:
        raise Conflict("request_id was already used for another submission", extra={"reason": "request_id_reused"})
    return run


def _lock_thread(*, user, thread_id: uuid.UUID) -> Conversation:
    thread = Conversation.objects.select_for_update().filter(pk=thread_id, user=user).first()
    if thread is None:
        raise NotFound("thread not found")
    return thread


def _refuse_if_interrupted(thread: Conversation) -> None:
    latest = AgentRun.objects.filter(thread=thread).order_by("-created_at").first()
    if latest is not None and latest.status == Status.INTERRUPTED:
        raise Conflict(
            "the thread waits for an approval: resume or cancel run first",
            extra={"reason": "thread_interrupted", "run_id": str(latest.id)},
        )


def _enqueue_on_commit(run_id: uuid.UUID) -> None:
    from .dispatch import enqueue_run

    transaction.on_commit(lambda: enqueue_run(run_id))


# --------------------------------------------------------------------------
# Lease (R-RUN-2, R-RUN-3, R-RUN-7)
# --------------------------------------------------------------------------


def run_acquire(*, run_id: uuid.UUID, owner: str, ttl_seconds: float, now: datetime | None = None) -> Lease:
    """Take the lease on a pending run.

    Locks the run row (``SELECT … FOR UPDATE``), checks that the run is
    ``pending`` and that no earlier run of its thread is still active (FIFO),
    then moves it to ``running``, sets the owner, increments the fencing
    token and sets the expiry ``now + ttl_seconds``.

    Raises:
        NotFound: no such run.
        RunNotStartable: the run is not pending (a second delivery, or it
            was cancelled) or an earlier run of its thread is active; the
            caller does nothing — the earlier run's end enqueues this one.

    Implements R-RUN-2 and R-RUN-3.
    """
    now = now or timezone.now()
    with transaction.atomic():
        run = AgentRun.objects.select_for_update(no_key=True, of=("self",)).filter(pk=run_id).first()
        if run is None:
            raise NotFound(f"run {run_id} not found")
        if run.status != Status.PENDING:
            raise RunNotStartable(f"run {run_id} is {run.status}, not pending")
        earlier = (
            AgentRun.objects.filter(thread_id=run.thread_id, created_at__lt=run.created_at)
            .active()
            .exclude(pk=run.pk)
            .exists()
        )
        if earlier:
            raise RunNotStartable(f"run {run_id} waits for an earlier run of its thread")
        run.status = Status.RUNNING
        run.lease_owner = owner
        run.fencing_token += 1
        run.lease_expires_at = now + timedelta(seconds=ttl_seconds)
        run.started_at = run.started_at or now
        run.save(update_fields=["status", "lease_owner", "fencing_token", "lease_expires_at", "started_at", "updated_at"])
    return Lease(
        run_id=run.id,
        request_id=run.request_id,
        thread_id=run.thread_id,
        owner=owner,
        fencing_token=run.fencing_token,
    )


def lease_renew(*, lease: Lease, ttl_seconds: float, now: datetime | None = None) -> str:
    """Extend the caller's lease to ``now + ttl_seconds``.

    Returns the run's status, so the owner learns of ``cancel_requested``.
    Raises what :func:`lock_run` raises. Implements R-RUN-7 (the owner
    renews while it works).
    """
    now = now or timezone.now()
    with transaction.atomic():
        run = lock_run(lease, now=now)
        AgentRun.objects.filter(pk=run.pk).update(lease_expires_at=now + timedelta(seconds=ttl_seconds))
        return run.status


# --------------------------------------------------------------------------
# Model audit (R-MA-1..5)
# --------------------------------------------------------------------------


def model_call_start(
    *,
    lease: Lease,
    operation_id: str,
    sequence: int,
    started_at: datetime,
    metadata: dict[str, Any] | None = None,
) -> Message:
    """Open the ``model_audit`` row of one model call at message-start.

    Args:
        operation_id: the message-start id (``lc_run--<model run id>``) or,
            without one, the model run id (R-MA-2).
        sequence: the event's root ``seq`` (per run, from 1).
        started_at: the event's wall clock (display only).
        metadata: namespace, model and provider names.

    A repeated start with the same key and sequence returns the row
    unchanged (it never reopens a completed row, R-MA-5).

    Raises:
        AuditConflict: the key exists with another sequence (R-MA-3).
        LeaseError: see :func:`lock_run`.
    """
    with transaction.atomic():
        run = lock_run(lease)
        row = _operation_row(run, Message.Role.ASSISTANT, operation_id)
        if row is not None:
            if row.sequence != sequence:
                raise AuditConflict(
                    f"operation {operation_id} started at sequence {row.sequence}, not {sequence}",
                    extra={"reason": "sequence_conflict"},
                )
            return row
        return Message.objects.create(
            thread_id=run.thread_id,
            run=run,
            role=Message.Role.ASSISTANT,
            message_type=Message.Type.MODEL_AUDIT,
            operation_id=operation_id,
            sequence=sequence,
            started_at=started_at,
            execution_status=ExecStatus.RUNNING,
            metadata=metadata or {},
        )


def model_call_finish(
    *,
    lease: Lease,
    operation_id: str,
    content: str,
    tool_calls: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    finished_at: datetime,
    duration_ms: int,
    metadata: dict[str, Any] | None = None,
) -> Message:
    """Close the model row at message-finish: content, declared tool calls
    ``[{id, name, args}]``, usage exactly as the provider reported it
    (tokens), ``finished_at``, ``duration_ms`` (monotonic, ms), completed.

    The same result again is a no-op; a different result for a completed
    row, or a finish for a row that is not running, is refused.

    Raises:
        AuditConflict: unknown operation, or a different result (R-MA-5).
        LeaseError: see :func:`lock_run`.

    Implements R-MA-4.
    """
    with transaction.atomic():
        run = lock_run(lease)
        row = _operation_row(run, Message.Role.ASSISTANT, operation_id)
        if row is None:
            raise AuditConflict(f"finish for unknown operation {operation_id}", extra={"reason": "unknown_operation"})
        result = {"content": content, "tool_calls": tool_calls or None, "usage": usage}
        if row.execution_status != ExecStatus.RUNNING:
            if row.execution_status == ExecStatus.COMPLETED and _same_result(row, result):
                return row
            raise AuditConflict(
                f"operation {operation_id} is already {row.execution_status} with another result",
                extra={"reason": "closed_operation"},
            )
        row.content = content
        row.tool_calls = tool_calls or None
        row.usage = usage
        row.finished_at = finished_at
        row.duration_ms = max(0, int(duration_ms))
        row.execution_status = ExecStatus.COMPLETED
        row.metadata = {**row.metadata, **(metadata or {})}
        row.save(
            update_fields=[
                "content", "tool_calls", "usage", "finished_at", "duration_ms",
                "execution_status", "metadata", "updated_at",
            ]
        )
        return row


def _same_result(row: Message, result: dict[str, Any]) -> bool:
    return (
        row.content == result["content"]
        and (row.tool_calls or None) == result["tool_calls"]
        and row.usage == result["usage"]
    )


def _operation_row(run: AgentRun, role: str, operation_id: str) -> Message | None:
    return Message.objects.filter(run=run, role=role, operation_id=operation_id).first()


# --------------------------------------------------------------------------
# Tool audit (R-TA-1, R-TA-2)
# --------------------------------------------------------------------------


def tool_call_start(
    *,
    lease: Lease,
    tool_call_id: str,
    tool_name: str,
    tool_input: Any,
    sequence: int | None,
    started_at: datetime,
    declared_by_operation_id: str | None,
    metadata: dict[str, Any] | None = None,
) -> Message:
    """Open the ``tool_audit`` row of one tool execution at tool-started.

    Args:
        tool_call_id: the model's tool call id (the operation key).
        tool_input: the arguments the tool was called with (JSON).
        declared_by_operation_id: the model call that declared the call.

    A repeated start returns the row unchanged; a closed row is never
    reopened (R-TA-2). Raises what :func:`lock_run` raises.
    """
    with transaction.atomic():
        run = lock_run(lease)
        row = _operation_row(run, Message.Role.TOOL, tool_call_id)
        if row is not None:
            return row
        declared_by = (
            _operation_row(run, Message.Role.ASSISTANT, declared_by_operation_id) if declared_by_operation_id else None
        )
        return Message.objects.create(
            thread_id=run.thread_id,
            run=run,
            role=Message.Role.TOOL,
            message_type=Message.Type.TOOL_AUDIT,
            operation_id=tool_call_id,
            tool_name=tool_name,
            tool_input=tool_input,
            sequence=sequence,
            started_at=started_at,
            execution_status=ExecStatus.RUNNING,
            declared_by=declared_by,
            metadata=metadata or {},
        )


def tool_call_finish(
    *,
    lease: Lease,
    tool_call_id: str,
    status: str,
    content: str,
    raw_output: dict[str, Any] | None,
    finished_at: datetime,
    duration_ms: int,
) -> Message:
    """Close the tool row: ``completed`` or ``failed`` (a handled tool
    error), the projected user ``content``, the raw output envelope (kept in
    ``metadata["raw_output"]``, staff only), ``finished_at`` and
    ``duration_ms`` (monotonic, ms).

    The same result again is a no-op; a different one is refused.

    Raises:
        AuditConflict: unknown tool call, or a different result (R-TA-2).
        InvalidInput: ``status`` is not completed/failed.
        LeaseError: see :func:`lock_run`.
    """
    if status not in (ExecStatus.COMPLETED, ExecStatus.FAILED):
        raise InvalidInput(f"a tool closes completed or failed, not {status}")
    with transaction.atomic():
        run = lock_run(lease)
        row = _operation_row(run, Message.Role.TOOL, tool_call_id)
        if row is None:
            raise AuditConflict(f"finish for unknown tool call {tool_call_id}", extra={"reason": "unknown_operation"})
        if row.execution_status != ExecStatus.RUNNING:
            if row.execution_status == status and row.content == content and row.metadata.get("raw_output") == raw_output:
                return row
            raise AuditConflict(
                f"tool call {tool_call_id} is already {row.execution_status} with another result",
                extra={"reason": "closed_operation"},
            )
        row.execution_status = status
        row.content = content
        row.metadata = {**row.metadata, "raw_output": raw_output}
        row.metadata.pop("awaiting_run_terminal", None)
        row.finished_at = finished_at
        row.duration_ms = max(0, int(duration_ms))
        row.save(update_fields=["execution_status", "content", "metadata", "finished_at", "duration_ms", "updated_at"])
        return row


def tool_call_error(*, lease: Lease, tool_call_id: str, error: str) -> Message:
    """Record a bare tool-error: the row stays ``running`` with the mark
    ``awaiting_run_terminal``, to be closed by the run's terminal transaction
    from the last error ToolMessage with the same id, or failed (R-TA-3).

    Raises:
        AuditConflict: unknown tool call.
        LeaseError: see :func:`lock_run`.
    """
    with transaction.atomic():
        run = lock_run(lease)
        row = _operation_row(run, Message.Role.TOOL, tool_call_id)
        if row is None:
            raise AuditConflict(f"error for unknown tool call {tool_call_id}", extra={"reason": "unknown_operation"})
        if row.execution_status != ExecStatus.RUNNING:
            return row
        row.metadata = {**row.metadata, "awaiting_run_terminal": True, "tool_error": error}
        row.save(update_fields=["metadata", "updated_at"])
        return row


# --------------------------------------------------------------------------
# Terminal transaction (R-MA-6..9, R-TA-3, R-RUN-6, R-RUN-7)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class StateMessage:
    """One message of the final graph State, as plain data.

    ``kind`` is ``ai``, ``tool``, ``human`` or ``system``; ``tool_calls`` are
    ``[{id, name, args}]``; ``status`` is a ToolMessage's status.
    """

    kind: str
    id: str | None
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_call_id: str | None = None
    status: str | None = None
    usage: dict[str, Any] | None = None
    namespace: tuple[str, ...] = ()


def run_finish(
    *,
    lease: Lease,
    status: str,
    final_state: list[StateMessage] | None = None,
    prior_message_ids: Iterable[str] = (),
    interrupts: list[dict[str, Any]] | None = None,
    error_type: str = "",
    error_message: str = "",
) -> AgentRun:
    """End the run in one lease-fenced transaction.

    Args:
        status: a terminal status (completed, failed, cancelled, interrupted).
        final_state: the messages of the final graph State, in order.
        prior_message_ids: ids of messages that were in the State before
            this run started; they belong to earlier runs and never bind
            (R-MA-9).
        interrupts: pending approval payloads when interrupted.

    Reconciles the State with this run's audit rows, closes running rows,
    binds ``output_message``, aggregates usage and releases the lease; after
    commit the next pending run of the thread is enqueued.

    Raises what :func:`lock_run` raises. Implements R-MA-6, R-MA-7, R-MA-8.
    """
    if status not in AgentRun.TERMINAL_STATUSES:
        raise InvalidInput(f"{status} is not a terminal status")
    with transaction.atomic():
        run = lock_run(lease)
        now = timezone.now()
        own_ai: dict[str, StateMessage] = {}
        if final_state:
            prior = set(prior_message_ids)
            own_ai = _own_ai_messages(final_state, prior)
            _reconcile_model_rows(run, own_ai, now=now)
            _reconcile_tool_rows(run, final_state, prior)
        if status in (Status.COMPLETED, Status.INTERRUPTED) and final_state:
            _bind_output(run, final_state, own_ai)
        _terminate(run, status=status, now=now, error_type=error_type, error_message=error_message, interrupts=interrupts)
        return run


def _own_ai_messages(final_state: list[StateMessage], prior: set[str]) -> dict[str, StateMessage]:
    """This run's root AIMessages by id; for one id only the last counts."""
    own: dict[str, StateMessage] = {}
    for message in final_state:
        if message.kind == "ai" and message.id and message.id not in prior and not message.namespace:
            own.pop(message.id, None)
            own[message.id] = message
    return own


def _reconcile_model_rows(run: AgentRun, own_ai: dict[str, StateMessage], *, now: datetime) -> None:
    if not own_ai:
        return
    rows = {
        row.operation_id: row
        for row in Message.objects.filter(run=run, role=Message.Role.ASSISTANT, operation_id__in=list(own_ai))
    }
    for op_id, message in own_ai.items():
        row = rows.get(op_id)
        if row is None:
            # The stream missed this call but the State proves it under a
            # stable id: insert it once, completed, without stream timing.
            Message.objects.create(
                thread_id=run.thread_id,
                run=run,
                role=Message.Role.ASSISTANT,
                message_type=Message.Type.MODEL_AUDIT,
                operation_id=op_id,
                content=message.content,
                tool_calls=message.tool_calls or None,
                usage=message.usage,
                execution_status=ExecStatus.COMPLETED,
                finished_at=now,
                metadata={"state_reconciled": True, "source": "state"},
            )
            continue
        update = ["metadata", "updated_at"]
        if not row.content and message.content:
            row.content = message.content
            update.append("content")
        if row.tool_calls is None and message.tool_calls:
            row.tool_calls = message.tool_calls
            update.append("tool_calls")
        if row.execution_status == ExecStatus.RUNNING:
            # The State holds the finished message although the stream never
            # delivered message-finish: the State is the proof. Its usage is
            # not taken from the State snapshot (it repeats in every values
            # event), so it stays unknown unless the State has it.
            row.execution_status = ExecStatus.COMPLETED
            row.finished_at = now
            if row.usage is None and message.usage:
                row.usage = message.usage
                update.append("usage")
            update += ["execution_status", "finished_at"]
        row.metadata = {**row.metadata, "state_reconciled": True}
        row.save(update_fields=update)


def _reconcile_tool_rows(run: AgentRun, final_state: list[StateMessage], prior: set[str]) -> None:
    """Close tool rows left ``running`` with ``awaiting_run_terminal`` from
    the last error ToolMessage with the same id (R-TA-3). Closed rows are
    never touched: the lifecycle owns them."""
    awaiting = [
        row
        for row in Message.objects.filter(
            run=run, role=Message.Role.TOOL, execution_status=ExecStatus.RUNNING
        )
        if row.metadata.get("awaiting_run_terminal")
    ]
    if not awaiting:
        return
    last_error: dict[str, StateMessage] = {}
    for message in final_state:
        if message.kind == "tool" and message.status == "error" and message.tool_call_id and message.id not in prior:
            last_error[message.tool_call_id] = message
    now = timezone.now()
    for row in awaiting:
        message = last_error.get(row.operation_id)
        if message is None:
            continue
        row.execution_status = ExecStatus.FAILED
        row.content = message.content
        row.finished_at = now
        row.metadata = {**row.metadata, "state_reconciled": True}
        row.metadata.pop("awaiting_run_terminal", None)
        row.save(update_fields=["execution_status", "content", "finished_at", "metadata", "updated_at"])


def _bind_output(run: AgentRun, final_state: list[StateMessage], own_ai: dict[str, StateMessage]) -> None:
    """Bind ``output_message`` to the row of the State's last AIMessage, and
    only if that message belongs to this run (R-MA-8): no fallback to an
    earlier row."""
    last_ai = next((m for m in reversed(final_state) if m.kind == "ai" and not m.namespace), None)
    if last_ai is None or last_ai.id not in own_ai:
        return
    row = Message.objects.filter(run=run, role=Message.Role.ASSISTANT, operation_id=last_ai.id).first()
    if row is None:
        return
    row.message_type = Message.Type.TEXT
    row.save(update_fields=["message_type", "updated_at"])
    run.output_message = row


_CLOSE_RUNNING = {
    Status.FAILED: ExecStatus.FAILED,
    Status.CANCELLED: ExecStatus.INTERRUPTED,
    Status.INTERRUPTED: ExecStatus.INTERRUPTED,
    Status.COMPLETED: ExecStatus.ABANDONED,
}


def _terminate(
    run: AgentRun,
    *,
    status: str,
    now: datetime,
    error_type: str = "",
    error_message: str = "",
    interrupts: list[dict[str, Any]] | None = None,
) -> None:
    """Make a locked run terminal: close its running rows, aggregate usage,
    release the lease. Must be called inside ``transaction.atomic()`` with
    the run row locked. Enqueues the thread's next run after commit."""
    close_as = _CLOSE_RUNNING[status]
    for row in Message.objects.filter(run=run, execution_status=ExecStatus.RUNNING):
        row.execution_status = close_as
        row.finished_at = row.finished_at or now
        # Cut off before the provider reported usage: unknown, not zero.
        row.metadata = {**row.metadata, "closed_by": "run_terminal", "usage_unknown": row.usage is None}
        row.metadata.pop("awaiting_run_terminal", None)
        row.save(update_fields=["execution_status", "finished_at", "metadata", "updated_at"])
    run.usage = _usage_total(run)
    run.status = status
    run.finished_at = now
    run.lease_expires_at = None
    run.error_type = error_type[:100]
    run.error_message = error_message
    run.interrupts = interrupts if status == Status.INTERRUPTED else None
    run.save()
    thread_id = run.thread_id
    transaction.on_commit(lambda: _enqueue_next_in_thread(thread_id))


def _usage_total(run: AgentRun) -> dict[str, int]:
    total = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "unknown_calls": 0}
    for usage in Message.objects.filter(run=run, role=Message.Role.ASSISTANT, operation_id__isnull=False).values_list(
        "usage", flat=True
    ):
        if not usage:
            total["unknown_calls"] += 1
            continue
        for key in ("input_tokens", "output_tokens", "total_tokens"):
            total[key] += int(usage.get(key) or 0)
    return total


def _enqueue_next_in_thread(thread_id: uuid.UUID) -> None:
    """FIFO (R-RUN-2): start the thread's oldest pending run, if any."""
    from .dispatch import enqueue_run

    next_run = AgentRun.objects.filter(thread_id=thread_id, status=Status.PENDING).order_by("created_at").first()
    if next_run is not None:
        enqueue_run(next_run.id)


# --------------------------------------------------------------------------
# Cancellation (R-RUN-6)
# --------------------------------------------------------------------------


def run_request_cancel(*, user, run_id: uuid.UUID) -> AgentRun:
    """Ask for a run to stop.

    A pending run is cancelled at once (it never starts). A running run
    becomes ``cancel_requested``; its worker stops at the next event
    boundary and ends it ``cancelled``. A terminal run is returned unchanged.

    Raises:
        NotFound: no such run for this user (R-READ-5).
    """
    with transaction.atomic():
        # Lock before the state change: the worker's lease checks take the
        # same lock, so the status it reads next is this one.
        run = AgentRun.objects.select_for_update(no_key=True, of=("self",)).filter(pk=run_id, user=user).first()
        if run is None:
            raise NotFound("run not found")
        if run.status == Status.PENDING:
            _terminate(run, status=Status.CANCELLED, now=timezone.now(), error_type="cancelled",
                       error_message="cancelled before it started")
        elif run.status == Status.RUNNING:
            run.status = Status.CANCEL_REQUESTED
            run.cancel_requested_at = timezone.now()
            run.save(update_fields=["status", "cancel_requested_at", "updated_at"])
        return run
