"""The run's terminal transaction: reconcile with the final State, close
running rows, bind the output (R-MA-6..9, R-TA-3)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from conversations.models import Message
from yuxi_project.errors import InvalidInput

from ..lease import Lease, lock_run
from ..models import AgentRun

log = logging.getLogger(__name__)

Status = AgentRun.Status
ExecStatus = Message.ExecutionStatus


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
            own_ai = _own_ai_messages(run, final_state, prior)
            _reconcile_model_rows(run, own_ai, now=now)
            _reconcile_tool_rows(run, final_state, prior)
        if status in (Status.COMPLETED, Status.INTERRUPTED) and final_state:
            _bind_output(run, final_state, own_ai)
        _terminate(
            run, status=status, now=now, error_type=error_type, error_message=error_message, interrupts=interrupts
        )
        return run


def _own_ai_messages(run: AgentRun, final_state: list[StateMessage], prior: set[str]) -> dict[str, StateMessage]:
    """This run's root AIMessages by id; for one id only the last counts.

    An id that was in the State before the run started, or that is already
    an operation of another run of the thread, belongs to that earlier run
    and never binds to or duplicates into this one (R-MA-9)."""
    own: dict[str, StateMessage] = {}
    for message in final_state:
        if message.kind == "ai" and message.id and message.id not in prior and not message.namespace:
            own.pop(message.id, None)
            own[message.id] = message
    if own:
        elsewhere = set(
            Message.objects.filter(thread_id=run.thread_id, role=Message.Role.ASSISTANT, operation_id__in=list(own))
            .exclude(run=run)
            .values_list("operation_id", flat=True)
        )
        for op_id in elsewhere:
            own.pop(op_id, None)
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
        for row in Message.objects.filter(run=run, role=Message.Role.TOOL, execution_status=ExecStatus.RUNNING)
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
    if row is None or row.metadata.get("namespace"):
        # A subgraph's or subagent's call is never the run's answer.
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
    from ..dispatch import enqueue_run

    # Every pending run is offered, oldest first: the acquisition check
    # decides which one may start (a resume run keeps its turn's place), the
    # others are skipped and offered again when the next run ends.
    for run_id in AgentRun.objects.filter(thread_id=thread_id, status=Status.PENDING).order_by("created_at").values_list(
        "id", flat=True
    ):
        enqueue_run(run_id)
