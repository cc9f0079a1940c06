"""Model audit rows: one per model call (R-MA-1..5)."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.db import transaction

from conversations.models import Message
from costs.pricing import price_row
from ops import metrics

from ..errors import AuditConflict
from ..lease import Lease, lock_run
from ..models import AgentRun

log = logging.getLogger(__name__)

Status = AgentRun.Status
ExecStatus = Message.ExecutionStatus


# --------------------------------------------------------------------------
# Model audit (R-MA-1..5)
# --------------------------------------------------------------------------


@metrics.audit_write("model_start")
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


@metrics.audit_write("model_finish")
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

    The row's cost is computed here from its usage (R-COST-1,
    :func:`costs.pricing.price_row`; unknown cost never fails the close).
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
        price_row(row, model=run.model)  # R-COST-1: cost at close, never raises
        row.save(
            update_fields=[
                "content",
                "tool_calls",
                "usage",
                "finished_at",
                "duration_ms",
                "execution_status",
                "metadata",
                "cost_usd",
                "price_source",
                "price_version",
                "updated_at",
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
