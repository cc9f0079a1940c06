"""Model audit rows: one per model call (R-MA-1..5, R-MA-10, R-RUN-12).

A row opens when the model request is sent (:func:`model_call_open`,
R-MA-10) with a provisional ``sequence`` and ``metadata.awaiting_first_chunk``;
message-start (:func:`model_call_start`) finds it and gives it the stream's
sequence, once. Failed attempts before the first chunk are counted on the
row (:func:`model_call_retry`, R-RUN-12).

Open, start and finish are one statement fenced by the lease in the usual
case (:mod:`audit.ledger.fenced`), which each service yields as a step of
its body (:func:`~audit.ledger.fenced.fenced_service`: sent as it comes by
callers, awaited on the event loop by the worker); a repeat, a conflict or
a refused lease takes the locked path (:func:`~audit.ledger.lease.lock_run`),
which names the error or returns the row unchanged.
"""

from __future__ import annotations

import functools
import logging
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from conversations.models import Message
from costs.budgets import budget_allows_sql, budget_check_running
from costs.pricing import price_depends_on_time, price_row, price_usage
from ops import metrics

from ..errors import AuditConflict
from ..models import AgentRun
from .fenced import Assign, FencedWrite, fenced_service, fenced_write, json_param, operation_row, write_operation_row
from .lease import Lease, lock_run

log = logging.getLogger(__name__)

Status = AgentRun.Status
ExecStatus = Message.ExecutionStatus


# --------------------------------------------------------------------------
# Model audit (R-MA-1..5, R-MA-10)
# --------------------------------------------------------------------------


@fenced_service("model_open")
def model_call_open(
    *,
    lease: Lease,
    operation_id: str,
    sequence: int,
    started_at: datetime,
    metadata: dict[str, Any] | None = None,
    namespace: list[str] | None = None,
    parent_operation_id: str | None = None,
    budget_user_id: int | None = None,
    returning: bool = True,
) -> Message | None:
    """Open the ``model_audit`` row of one model call when its request is
    sent, before any chunk (R-MA-10) — with ``budget_user_id``, only while
    that user's budget has room (R-COST-3).

    Args:
        operation_id: ``lc_run--<model run id>``, the id message-start will
            carry (LangChain's chat-model start gives the model run id).
        sequence: provisional position: one past the last stream ``seq``
            the worker had consumed when the request went out (the earliest
            its message-start can carry). message-start replaces it; a call
            that never streams keeps it, so the run's rows stay in order.
        started_at: when the request was sent (wall clock).
        metadata: namespace, model run id, node, the request's fingerprint
            (``request``, R-REPLAY-2).
        namespace: the call's stream namespace (``[]`` at the root; default
            ``metadata["namespace"]``) and ``parent_operation_id`` the tool
            call id of the ``task`` call whose subagent makes it (R-SUB-1).
        budget_user_id: the user whose budget must have room (the run's):
            checked in the statement that opens the row (no round trip of
            its own), and by :func:`~costs.budgets.budget_check_running`
            under the run lock when that statement opened nothing.
        returning: False when the caller reads nothing back (the worker):
            the row's key alone comes back from the statement and the
            service returns None.

    The row is ``running`` with ``metadata.awaiting_first_chunk = true`` and
    ``metadata.attempts = 1``. Opening the same operation again returns the
    row unchanged.

    Raises:
        LeaseError: see :func:`lock_run`.
        BudgetExceeded: the budget's spend reached its limit; no row
            opens (nor is an existing one returned).
    """
    row = _new_model_row(
        sequence=sequence,
        started_at=started_at,
        metadata={**(metadata or {}), "awaiting_first_chunk": True, "attempts": 1},
        **subagent_fields(namespace, parent_operation_id, metadata),
    )
    now = timezone.now()
    opened = yield fenced_write(
        lease,
        role=Message.Role.ASSISTANT,
        operation_id=operation_id,
        now=now,
        insert=row,
        insert_when=None if budget_user_id is None else budget_allows_sql(budget_user_id, now=now),
        load=returning,
    )
    if opened is not None:
        return opened if returning else None
    with transaction.atomic():
        run = lock_run(lease)  # a lease error names the cause before the budget
        if budget_user_id is not None:
            budget_check_running(user_id=budget_user_id, now=now)
        existing = operation_row(run, Message.Role.ASSISTANT, operation_id)
        row = existing if existing is not None else _insert_model_row(lease, operation_id, row)
        return row if returning else None


def _new_model_row(
    *,
    sequence: int,
    started_at: datetime,
    metadata: dict[str, Any],
    namespace: list[str],
    parent_operation_id: str | None,
) -> dict[str, Any]:
    """The fields of a ``running`` model row (``insert`` of
    :func:`~audit.ledger.fenced.write_operation_row`): the one shape of a
    new model row for the request start (R-MA-10) and message-start
    (R-MA-3); a subagent's call carries its ``namespace`` and
    ``parent_operation_id`` (R-SUB-1, see :func:`subagent_fields`)."""
    return {
        "message_type": Message.Type.MODEL_AUDIT,
        "sequence": sequence,
        "started_at": started_at,
        "execution_status": ExecStatus.RUNNING,
        "metadata": metadata,
        "namespace": namespace,
        "parent_operation_id": parent_operation_id,
    }


def _insert_model_row(lease: Lease, operation_id: str, row: dict[str, Any]) -> Message:
    """Insert a new model row under the run lock the caller holds (the
    locked path); the statement is the fast path's."""
    saved = write_operation_row(
        lease, role=Message.Role.ASSISTANT, operation_id=operation_id, now=timezone.now(), insert=row
    )
    if saved is None:  # the caller holds the lock and saw no row
        raise AuditConflict(f"operation {operation_id} could not be opened", extra={"reason": "insert_refused"})
    return saved


@metrics.audit_write("model_retry")
def model_call_retry(*, lease: Lease, operation_id: str, failure: dict[str, Any]) -> Message:
    """Record one failed attempt of a model request that is sent again
    (R-RUN-12): ``metadata.attempts`` becomes ``failure["attempt"] + 1`` and
    ``failure`` (``{attempt, error, connected, retryable, status,
    retry_after, retry_in_ms}``) is appended to ``metadata.attempt_errors``.
    The same attempt again changes nothing.

    Raises:
        AuditConflict: unknown operation, or a row that is no longer
            waiting for its first chunk (retries happen only before it).
        LeaseError: see :func:`lock_run`.
    """
    with transaction.atomic():
        run = lock_run(lease)
        row = operation_row(run, Message.Role.ASSISTANT, operation_id)
        if row is None:
            raise AuditConflict(f"retry of unknown operation {operation_id}", extra={"reason": "unknown_operation"})
        errors = list(row.metadata.get("attempt_errors") or [])
        attempt = int(failure.get("attempt") or 0)
        if any(e.get("attempt") == attempt for e in errors):
            return row
        if row.execution_status != ExecStatus.RUNNING or not row.metadata.get("awaiting_first_chunk"):
            raise AuditConflict(
                f"operation {operation_id} retried after its first chunk", extra={"reason": "retry_after_first_chunk"}
            )
        errors.append(failure)
        row.metadata = {**row.metadata, "attempts": attempt + 1, "attempt_errors": errors}
        row.save(update_fields=["metadata", "updated_at"])
        return row


@fenced_service("model_start")
def model_call_start(
    *,
    lease: Lease,
    operation_id: str,
    sequence: int,
    started_at: datetime,
    metadata: dict[str, Any] | None = None,
    opened_as: str | None = None,
    namespace: list[str] | None = None,
    parent_operation_id: str | None = None,
    returning: bool = True,
) -> Message | None:
    """Record message-start of one model call: find the row opened at
    request start (R-MA-10) or open it now.

    Args:
        operation_id: the message-start id (``lc_run--<model run id>``) or,
            without one, the model run id (R-MA-2).
        sequence: the event's root ``seq`` (per run, from 1).
        started_at: the event's wall clock (display only; a row opened at
            request start keeps its request time).
        metadata: namespace, model and provider names.
        opened_as: the key the row was opened under at request start, when
            it differs: a model that does not stream sends its whole message
            under the provider's id (PROTOCOL.md §4), and that row is re-keyed
            once, while it still awaits its first chunk.
        namespace, parent_operation_id: as for :func:`model_call_open`
            (R-SUB-1); a row opened at request start takes them here.
        returning: as for :func:`model_call_open`.

    A row still ``awaiting_first_chunk`` takes ``sequence`` and loses the
    mark (its status is never changed: a closed row is never reopened,
    R-MA-5). A repeated start with the same key and sequence returns the
    row unchanged.

    Raises:
        AuditConflict: the key exists with another sequence (R-MA-3).
        LeaseError: see :func:`lock_run`.
    """
    metadata = metadata or {}
    nesting = subagent_fields(namespace, parent_operation_id, metadata)
    if not opened_as:
        # One statement: take the sequence of a row that awaits its first
        # chunk, or insert the row when there is none.
        row = yield fenced_write(
            lease,
            role=Message.Role.ASSISTANT,
            operation_id=operation_id,
            now=timezone.now(),
            update=Assign()
            .value("sequence", sequence)
            .sql("metadata", "(m.metadata || %s) - 'awaiting_first_chunk'", metadata)
            .value("namespace", nesting["namespace"])
            .sql("parent_operation_id", "COALESCE(%s, m.parent_operation_id)", nesting["parent_operation_id"]),
            update_when=("m.metadata @> %s", [_AWAITING_FIRST_CHUNK()]),
            insert=_new_model_row(sequence=sequence, started_at=started_at, metadata=metadata, **nesting),
            load=returning,
        )
        if row is not None:
            return row if returning else None
    row = _start_locked(
        lease,
        operation_id=operation_id,
        sequence=sequence,
        started_at=started_at,
        metadata=metadata,
        opened_as=opened_as,
        nesting=nesting,
    )
    return row if returning else None


@functools.cache
def _AWAITING_FIRST_CHUNK() -> Any:  # noqa: N802 - a constant, built once the connection is known
    return json_param({"awaiting_first_chunk": True})


def _start_locked(
    lease: Lease,
    *,
    operation_id: str,
    sequence: int,
    started_at: datetime,
    metadata: dict[str, Any],
    opened_as: str | None,
    nesting: dict[str, Any],
) -> Message:
    """:func:`model_call_start` under the run lock: a row opened under
    another key, a repeat, a conflict, or a row to insert."""
    with transaction.atomic():
        run = lock_run(lease)
        row = operation_row(run, Message.Role.ASSISTANT, operation_id)
        if row is None and opened_as:
            row = operation_row(run, Message.Role.ASSISTANT, opened_as)
            if row is not None and row.metadata.get("awaiting_first_chunk"):
                row.operation_id = operation_id
            else:
                row = None
        if row is not None:
            if row.metadata.get("awaiting_first_chunk"):
                row.sequence = sequence
                row.metadata = {**row.metadata, **metadata}
                row.metadata.pop("awaiting_first_chunk", None)
                row.namespace = nesting["namespace"]
                row.parent_operation_id = nesting["parent_operation_id"] or row.parent_operation_id
                row.save(
                    update_fields=[
                        "operation_id",
                        "sequence",
                        "metadata",
                        "namespace",
                        "parent_operation_id",
                        "updated_at",
                    ]
                )
                return row
            if row.sequence != sequence:
                raise AuditConflict(
                    f"operation {operation_id} started at sequence {row.sequence}, not {sequence}",
                    extra={"reason": "sequence_conflict"},
                )
            return row
        return _insert_model_row(
            lease,
            operation_id,
            _new_model_row(sequence=sequence, started_at=started_at, metadata=metadata, **nesting),
        )


@fenced_service("model_finish")
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
    returning: bool = True,
    usage_cause: str | None = None,
) -> Message | None:
    """Close the model row at message-finish: content, declared tool calls
    ``[{id, name, args}]``, usage exactly as the provider reported it
    (tokens), ``finished_at``, ``duration_ms`` (monotonic, ms), completed.
    ``usage_cause`` names why ``usage`` is unknown when the worker knows
    (``usage_mode_conflict``, R-MA-12), else None.

    The row's cost is computed here from its usage (R-COST-1,
    :func:`costs.pricing.price_row`; unknown cost never fails the close).
    The same result again is a no-op; a different result for a completed
    row, or a finish for a row that is not running, is refused.
    ``returning``: as for :func:`model_call_open`.

    Raises:
        AuditConflict: unknown operation, or a different result (R-MA-5).
        LeaseError: see :func:`lock_run`.

    Implements R-MA-4.
    """
    duration_ms = max(0, int(duration_ms))
    model = lease.model or AgentRun.objects.filter(pk=lease.run_id).values_list("model", flat=True).first() or ""
    closed = yield _close_running_model_row(
        lease,
        operation_id=operation_id,
        model=model,
        content=content,
        tool_calls=tool_calls or None,
        usage=usage,
        finished_at=finished_at,
        duration_ms=duration_ms,
        metadata=metadata or {},
        load=returning,
        usage_cause=usage_cause,
    )
    if closed is not None:
        return closed if returning else None
    with transaction.atomic():
        run = lock_run(lease)
        row = operation_row(run, Message.Role.ASSISTANT, operation_id)
        if row is None:
            raise AuditConflict(f"finish for unknown operation {operation_id}", extra={"reason": "unknown_operation"})
        result = {"content": content, "tool_calls": tool_calls or None, "usage": usage}
        if row.execution_status != ExecStatus.RUNNING:
            if row.execution_status == ExecStatus.COMPLETED and _same_result(row, result):
                return row if returning else None
            raise AuditConflict(
                f"operation {operation_id} is already {row.execution_status} with another result",
                extra={"reason": "closed_operation"},
            )
        row.content = content
        row.tool_calls = tool_calls or None
        row.usage = usage
        row.usage_cause = usage_cause
        row.finished_at = finished_at
        row.duration_ms = duration_ms
        row.execution_status = ExecStatus.COMPLETED
        row.metadata = {**row.metadata, **(metadata or {})}
        price_row(row, model=model)  # R-COST-1: cost at close, never raises
        row.save(
            update_fields=[
                "content",
                "tool_calls",
                "usage",
                "usage_cause",
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
        return row if returning else None


def _close_running_model_row(
    lease: Lease,
    *,
    operation_id: str,
    model: str,
    content: str,
    tool_calls: list[dict[str, Any]] | None,
    usage: dict[str, Any] | None,
    finished_at: datetime,
    duration_ms: int,
    metadata: dict[str, Any],
    load: bool,
    usage_cause: str | None = None,
) -> FencedWrite:
    """The close of a ``running`` model row as one statement, priced before
    it is sent (R-COST-1); it writes nothing when the row is not running (or
    the lease does not hold): the caller then takes the locked path.

    The price is taken at the call's start (``started_at``, which the row
    holds): ``finished_at - duration_ms`` is that start as the worker
    measured it. A price that depends on the time (the genai-prices
    catalogue: price changes by date and time of day) is used only when the
    row's ``started_at`` lies in the same second; otherwise the locked path
    prices the row at its stored start. The metadata patch is what
    :func:`~costs.pricing.price_row` would add to the row's."""
    at = finished_at - timedelta(milliseconds=duration_ms)
    cost = price_usage(model=model, usage=usage, at=at, reported_model=str(metadata.get("model_name") or ""))
    if cost.unknown:
        metadata = {**metadata, "cost_unknown": cost.unknown}
    when, params = _CLOSE_WHEN, [ExecStatus.RUNNING]
    if price_depends_on_time(model):
        second = at.replace(microsecond=0)
        when = _CLOSE_WHEN_SAME_SECOND
        params += [second, second + timedelta(seconds=1)]
    return fenced_write(
        lease,
        role=Message.Role.ASSISTANT,
        operation_id=operation_id,
        now=timezone.now(),
        update=Assign()
        .value("content", content)
        .value("tool_calls", tool_calls)
        .value("usage", usage)
        .value("usage_cause", usage_cause)
        .value("finished_at", finished_at)
        .value("duration_ms", duration_ms)
        .value("execution_status", ExecStatus.COMPLETED)
        .sql("metadata", "m.metadata || %s", metadata)
        .value("cost_usd", cost.usd)
        .value("price_source", cost.source)
        .value("price_version", cost.version),
        update_when=(when, params),
        load=load,
    )


_CLOSE_WHEN = "m.execution_status = %s"
_CLOSE_WHEN_SAME_SECOND = _CLOSE_WHEN + " AND m.started_at >= %s AND m.started_at < %s"


def subagent_fields(
    namespace: list[str] | None, parent_operation_id: str | None, metadata: dict[str, Any] | None
) -> dict[str, Any]:
    """The ``namespace`` and ``parent_operation_id`` columns of a new audit
    row (R-SUB-1): ``namespace`` defaults to ``metadata["namespace"]``,
    where writers before these columns put it; a root row has no parent."""
    if namespace is None:
        namespace = (metadata or {}).get("namespace") or []
    namespace = [str(part) for part in namespace]
    return {"namespace": namespace, "parent_operation_id": (parent_operation_id or None) if namespace else None}


def _same_result(row: Message, result: dict[str, Any]) -> bool:
    return (
        row.content == result["content"]
        and (row.tool_calls or None) == result["tool_calls"]
        and row.usage == result["usage"]
    )
