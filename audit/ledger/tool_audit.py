"""Tool audit rows: one persistent fact per tool execution (R-TA-1..3).

Start, finish and error are one statement fenced by the lease in the usual
case (:mod:`audit.ledger.fenced`), which each service yields as a step of
its body (:func:`~audit.ledger.fenced.fenced_service`); a repeat, a
conflict or a refused lease takes the locked path
(:func:`~audit.ledger.lease.lock_run`), which names the error or returns
the row unchanged.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from conversations.models import Message
from core.errors import InvalidInput

from ..errors import AuditConflict, ToolResultConflict
from ..models import AgentRun
from .fenced import Assign, fenced_service, fenced_write, operation_row, write_operation_row
from .lease import Lease, lock_run
from .model_audit import subagent_fields

log = logging.getLogger(__name__)

Status = AgentRun.Status
ExecStatus = Message.ExecutionStatus

# --------------------------------------------------------------------------
# Effect key (R-EFF-1)
# --------------------------------------------------------------------------


def effect_key(turn_id: uuid.UUID | str, tool_call_id: str, parent_operation_id: str | None = None) -> str:
    """The effect key of one tool execution: SHA-256 (64 hex digits) of
    the turn id, the namespace the tool runs in — expressed by the tool
    call id of the ``task`` call whose subagent runs it
    (``parent_operation_id``; None or ``""`` at the root) — and its
    ``tool_call_id``, encoded as a JSON list with ASCII escapes.

    Every run of a turn (the first and its resumes, and the same run
    continued by another worker) gives the same execution the same key,
    and nothing else does: a tool call id reused by another turn, or by a
    subagent of the same turn, gets another. LangGraph's ``tools:<task
    id>`` namespace is not part of it: task ids change when a run is
    retried. A hash, so that any tool call id (a NUL, a lone surrogate,
    any length) makes a key of the same short, storable form. Never
    raises for strings. Implements R-EFF-1.
    """
    identity = json.dumps(
        [str(turn_id), parent_operation_id or "", tool_call_id], ensure_ascii=True, separators=(",", ":")
    )
    return hashlib.sha256(identity.encode("ascii")).hexdigest()


def lease_turn_id(lease: Lease) -> uuid.UUID | None:
    """The turn id of the leased run: the lease's own (a worker's lease
    carries it), else read (a hand-built lease; None only for a run that
    does not exist, whose write the lease then refuses)."""
    if lease.turn_id is not None:
        return lease.turn_id
    return AgentRun.objects.filter(pk=lease.run_id).values_list("turn_id", flat=True).first()


# --------------------------------------------------------------------------
# Tool audit (R-TA-1, R-TA-2)
# --------------------------------------------------------------------------


@fenced_service("tool_start")
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
    namespace: list[str] | None = None,
    parent_operation_id: str | None = None,
    returning: bool = True,
) -> Message | None:
    """Open the ``tool_audit`` row of one tool execution at tool-started.

    Args:
        tool_call_id: the model's tool call id (the operation key).
        tool_input: the arguments the tool was called with (JSON).
        declared_by_operation_id: the model call that declared the call.
        namespace: the stream namespace of the graph the tool runs in
            (``[]`` at the root; default ``metadata["namespace"]``) and
            ``parent_operation_id`` the ``task`` call whose subagent runs
            it (R-SUB-1).
        returning: False when the caller reads nothing back (the worker):
            the row's key alone comes back from the statement and the
            service returns None.

    When this run's stream did not declare the call (a resume run executes
    the call its interrupted ancestor declared), the declaring model row is
    looked up in the same turn (:func:`declaring_model_row`).

    The row carries its :func:`effect_key` (the lease's turn, the row's
    parent, ``tool_call_id``) and, like every row a fenced write inserts,
    the locked run's ``attempt``, in the same statement (R-EFF-1).

    A repeated start returns the row unchanged; a closed row is never
    reopened (R-TA-2). Raises what :func:`lock_run` raises.
    """
    nesting = subagent_fields(namespace, parent_operation_id, metadata)
    row = {
        "message_type": Message.Type.TOOL_AUDIT,
        "tool_name": tool_name,
        "tool_input": tool_input,
        "sequence": sequence,
        "started_at": started_at,
        "execution_status": ExecStatus.RUNNING,
        "metadata": metadata or {},
        **nesting,
        "effect_key": effect_key(lease_turn_id(lease), tool_call_id, nesting["parent_operation_id"]),
    }
    if declared_by_operation_id:
        # The declaring model row of this run, looked up in the statement.
        started = yield fenced_write(
            lease,
            role=Message.Role.TOOL,
            operation_id=tool_call_id,
            now=timezone.now(),
            insert=row,
            insert_sql={"declared_by_id": (_DECLARED_BY_SQL(), [Message.Role.ASSISTANT, declared_by_operation_id])},
            load=returning,
        )
        if started is not None:
            return started if returning else None
    with transaction.atomic():
        run = lock_run(lease)
        existing = operation_row(run, Message.Role.TOOL, tool_call_id)
        if existing is not None:
            return existing if returning else None
        declared_by = (
            operation_row(run, Message.Role.ASSISTANT, declared_by_operation_id)
            if declared_by_operation_id
            else declaring_model_row(run, tool_call_id)
        )
        row["declared_by"] = None if declared_by is None else declared_by.pk
        started = write_operation_row(
            lease, role=Message.Role.TOOL, operation_id=tool_call_id, now=timezone.now(), insert=row
        )
        if started is None:  # the lock is held and there was no row
            raise AuditConflict(f"tool call {tool_call_id} could not be opened", extra={"reason": "insert_refused"})
        return started if returning else None


@functools.cache
def _DECLARED_BY_SQL() -> str:  # noqa: N802 - a constant, built once the connection is known
    table = connection.ops.quote_name(Message._meta.db_table)
    return f"(SELECT d.id FROM {table} AS d WHERE d.run_id = leased_run.id AND d.role = %s AND d.operation_id = %s)"


@fenced_service("tool_finish")
def tool_call_finish(
    *,
    lease: Lease,
    tool_call_id: str,
    status: str,
    content: str,
    raw_output: dict[str, Any] | None,
    finished_at: datetime,
    duration_ms: int,
    returning: bool = True,
) -> Message | None:
    """Close the tool row: ``completed`` or ``failed`` (a handled tool
    error), the projected user ``content``, the raw output envelope (kept in
    ``metadata["raw_output"]``, staff only), ``finished_at`` and
    ``duration_ms`` (monotonic, ms).

    The same result again is a no-op; a different one is refused.
    ``returning``: as for :func:`tool_call_start`.

    Raises:
        AuditConflict: unknown tool call (``reason: unknown_operation``).
        ToolResultConflict: the row is closed with a different result
            (R-TA-2); nothing is written.
        InvalidInput: ``status`` is not completed/failed.
        LeaseError: see :func:`lock_run`.
    """
    if status not in (ExecStatus.COMPLETED, ExecStatus.FAILED):
        raise InvalidInput(f"a tool closes completed or failed, not {status}")
    duration_ms = max(0, int(duration_ms))
    closed = yield fenced_write(
        lease,
        role=Message.Role.TOOL,
        operation_id=tool_call_id,
        now=timezone.now(),
        update=Assign()
        .value("execution_status", status)
        .value("content", content)
        .sql("metadata", "(m.metadata || %s) - 'awaiting_run_terminal'", {"raw_output": raw_output})
        .value("finished_at", finished_at)
        .value("duration_ms", duration_ms),
        update_when=("m.execution_status = %s", [ExecStatus.RUNNING]),
        load=returning,
    )
    if closed is not None:
        return closed if returning else None
    with transaction.atomic():
        run = lock_run(lease)
        row = operation_row(run, Message.Role.TOOL, tool_call_id)
        if row is None:
            raise AuditConflict(f"finish for unknown tool call {tool_call_id}", extra={"reason": "unknown_operation"})
        if row.execution_status != ExecStatus.RUNNING:
            if (
                row.execution_status == status
                and row.content == content
                and row.metadata.get("raw_output") == raw_output
            ):
                return row if returning else None
            raise ToolResultConflict(
                f"tool call {tool_call_id} is already {row.execution_status} with another result",
                extra={"reason": "closed_operation"},
            )
        row.execution_status = status
        row.content = content
        row.metadata = {**row.metadata, "raw_output": raw_output}
        row.metadata.pop("awaiting_run_terminal", None)
        row.finished_at = finished_at
        row.duration_ms = duration_ms
        row.save(update_fields=["execution_status", "content", "metadata", "finished_at", "duration_ms", "updated_at"])
        return row if returning else None


@fenced_service("tool_error")
def tool_call_error(
    *,
    lease: Lease,
    tool_call_id: str,
    error: str,
    error_type: str | None = None,
    finished_at: datetime | None = None,
    duration_ms: int | None = None,
    returning: bool = True,
) -> Message | None:
    """Record a bare tool-error: the row stays ``running`` with the mark
    ``awaiting_run_terminal``, to be closed by the run's terminal transaction
    from the last error ToolMessage with the same id, or failed (R-TA-3).

    Args:
        error: the error's text (``metadata["tool_error"]``).
        error_type: the class of the exception the tool raised, when known
            (``metadata["error_type"]``, at most 100 characters; R-OTEL-2).
        finished_at: when the tool raised (wall clock, aware) and
            ``duration_ms`` (monotonic, ms) how long it ran: the row keeps
            them when the terminal closes it, as a model call that answers
            from the error starts after it (R-SUB-2). Without them the
            terminal stamps its own time.
        returning: as for :func:`tool_call_start`.

    Raises:
        AuditConflict: unknown tool call.
        LeaseError: see :func:`lock_run`.
    """
    marks: dict[str, Any] = {"awaiting_run_terminal": True, "tool_error": error}
    if error_type:
        marks["error_type"] = str(error_type)[:100]
    update = Assign().sql("metadata", "m.metadata || %s", marks)
    if finished_at is not None:
        update.value("finished_at", finished_at)
    if duration_ms is not None:
        duration_ms = max(0, int(duration_ms))
        update.value("duration_ms", duration_ms)
    marked = yield fenced_write(
        lease,
        role=Message.Role.TOOL,
        operation_id=tool_call_id,
        now=timezone.now(),
        update=update,
        update_when=("m.execution_status = %s", [ExecStatus.RUNNING]),
        load=returning,
    )
    if marked is not None:
        return marked if returning else None
    with transaction.atomic():
        run = lock_run(lease)
        row = operation_row(run, Message.Role.TOOL, tool_call_id)
        if row is None:
            raise AuditConflict(f"error for unknown tool call {tool_call_id}", extra={"reason": "unknown_operation"})
        if row.execution_status == ExecStatus.RUNNING:
            row.metadata = {**row.metadata, **marks}
            fields = ["metadata", "updated_at"]
            if finished_at is not None:
                row.finished_at = finished_at
                fields.append("finished_at")
            if duration_ms is not None:
                row.duration_ms = duration_ms
                fields.append("duration_ms")
            row.save(update_fields=fields)
        return row if returning else None


# --------------------------------------------------------------------------
# Replay guard (R-EFF-1, R-RUN-15)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class EffectCheck:
    """What :func:`tool_effect_check` found under one effect key.

    ``action`` is ``"execute"`` (nothing recorded forbids running the tool),
    ``"replayed"`` (an execution under the key completed: ``original`` is
    its row, ``replay`` the new row that gives its result back) or
    ``"outcome_unknown"`` (an execution under the key was cut off by a
    dead worker and the tool is not idempotent: ``original`` is the newest
    such row) or ``"skipped"`` (this attempt already recorded a reviewer's
    skip of that call: ``replay`` is the skip row, see
    :func:`tool_effect_skip`).
    """

    action: str
    original: Message | None = None
    replay: Message | None = None


def tool_effect_check(
    *,
    lease: Lease,
    tool_call_id: str,
    tool_name: str,
    idempotent: bool,
    namespace: list[str] | None = None,
    parent_operation_id: str | None = None,
    sequence: int | None = None,
    at: datetime | None = None,
) -> EffectCheck:
    """Decide, before a tool runs, whether it may: look up the executions
    recorded under its effect key (the lease's turn, ``parent_operation_id``
    — the ``task`` call whose subagent runs it, None at the root — and
    ``tool_call_id``) in one transaction under the run lock (R-RUN-4).

    * An execution that completed is never made again: a new row of this
      attempt records the replay — ``completed``, the original's content
      and input, ``replayed_from`` the original, no duration,
      ``metadata.replayed`` — and ``action`` is ``"replayed"``; the caller
      gives the recorded result to the graph. A replay row already there
      (the check made again) is returned as it is.
    * Else an execution whose outcome is unknown (its worker died while it
      ran: ``metadata.outcome_unknown``) of a tool that is not
      ``idempotent`` must not be made again blindly: ``"outcome_unknown"``.
    * Else ``"execute"``: the recorder opens the row when the tool starts.
    * A skip this attempt recorded (:func:`tool_effect_skip`) is
      ``"skipped"``, whatever else is recorded.

    ``sequence`` and ``at`` (aware; default now) place the replay row in
    the timeline. Raises what :func:`lock_run` raises. Implements R-EFF-1
    and R-RUN-15.
    """
    at = at or timezone.now()
    nesting = subagent_fields(namespace, parent_operation_id, None)
    key = effect_key(lease_turn_id(lease), tool_call_id, nesting["parent_operation_id"])
    with transaction.atomic():
        run = lock_run(lease)
        # The key is made of the turn: no other turn's row carries it.
        recorded = list(Message.objects.filter(effect_key=key, role=Message.Role.TOOL).order_by("id"))
        current = next((row for row in recorded if row.run_id == run.pk and row.attempt == run.attempt), None)
        if current is not None:
            if current.execution_status == ExecStatus.REJECTED:
                return EffectCheck("skipped", replay=current)
            if current.replayed_from_id is None:
                return EffectCheck("execute")
            original = next((row for row in recorded if row.pk == current.replayed_from_id), None)
            return EffectCheck("replayed", original=original, replay=current)
        original = next(
            (row for row in recorded if row.execution_status == ExecStatus.COMPLETED and row.replayed_from_id is None),
            None,
        )
        if original is not None:
            replay = _insert_effect_row(
                lease,
                run,
                tool_call_id=tool_call_id,
                key=key,
                nesting=nesting,
                at=at,
                sequence=sequence,
                fields={
                    "tool_name": tool_name or original.tool_name,
                    "tool_input": original.tool_input,
                    "content": original.content,
                    "started_at": at,
                    "duration_ms": 0,
                    "execution_status": ExecStatus.COMPLETED,
                    "replayed_from": original.pk,
                },
                metadata={"replayed": True},
            )
            return EffectCheck("replayed", original=original, replay=replay)
        if not idempotent and any(row.metadata.get("outcome_unknown") for row in recorded):
            unknown = [row for row in recorded if row.metadata.get("outcome_unknown")]
            return EffectCheck("outcome_unknown", original=unknown[-1])
        return EffectCheck("execute")


def tool_effect_skip(
    *,
    lease: Lease,
    tool_call_id: str,
    tool_name: str,
    tool_input: Any,
    original: Message,
    decision: dict[str, Any],
    content: str,
    namespace: list[str] | None = None,
    parent_operation_id: str | None = None,
    sequence: int | None = None,
    at: datetime | None = None,
) -> Message:
    """Record that a reviewer chose to skip a tool call whose earlier
    execution (``original``, cut off by a worker that died: its outcome
    unknown) is not made again (R-RUN-15): one ``rejected`` row of this
    attempt under the call's effect key, with no ``started_at`` (the tool
    never started: it counts as no execution, R-READ-4), ``content`` (what
    the graph is told instead of the tool's result) and
    ``metadata.source = "outcome_unknown_decision"`` with ``decision`` and
    the ``outcome_unknown_row``. Made again in the same attempt, it returns
    the row already there. ``sequence`` and ``at`` (aware; default now)
    place it in the timeline. Raises what :func:`lock_run` raises, and
    :class:`AuditConflict` when this attempt already ran the call.
    """
    return _record_unexecuted(
        lease,
        tool_call_id=tool_call_id,
        namespace=namespace,
        parent_operation_id=parent_operation_id,
        sequence=sequence,
        at=at or timezone.now(),
        same=lambda row: row.execution_status == ExecStatus.REJECTED,
        fields={
            "tool_name": tool_name or original.tool_name,
            "tool_input": tool_input,
            "content": content,
            "execution_status": ExecStatus.REJECTED,
        },
        metadata={
            "source": "outcome_unknown_decision",
            "decision": decision,
            "outcome_unknown_row": original.pk,
        },
    )


def tool_effect_recorded(
    *,
    lease: Lease,
    tool_call_id: str,
    tool_name: str,
    tool_input: Any,
    content: str,
    status: str,
    source: str,
    error_type: str = "",
    namespace: list[str] | None = None,
    parent_operation_id: str | None = None,
    sequence: int | None = None,
    at: datetime | None = None,
) -> Message:
    """Record that a replayed run (R-REPLAY-2) answered a tool call with
    the result its recorded turn holds instead of executing the tool: one
    row of this attempt under the call's effect key, ``content`` and
    ``status`` (an execution status) as recorded, started and finished at
    ``at`` (aware; default now) with no duration, ``metadata.source``
    ``source`` (``replay_recorded``, or ``replay_unrecorded`` with status
    ``rejected`` for a call the recorded turn never made) and the recorded
    ``error_type`` of a tool that raised. Made again in the same attempt,
    it returns the row already there. Raises what :func:`lock_run` raises,
    and :class:`AuditConflict` when this attempt already ran the call.
    """
    at = at or timezone.now()
    metadata: dict[str, Any] = {"source": source}
    if error_type:
        metadata["error_type"] = str(error_type)[:100]
    return _record_unexecuted(
        lease,
        tool_call_id=tool_call_id,
        namespace=namespace,
        parent_operation_id=parent_operation_id,
        sequence=sequence,
        at=at,
        same=lambda row: (row.metadata or {}).get("source") == source,
        fields={
            "tool_name": tool_name,
            "tool_input": tool_input,
            "content": content,
            "execution_status": status,
            **({} if status == ExecStatus.REJECTED else {"started_at": at, "duration_ms": 0}),
        },
        metadata=metadata,
    )


def _record_unexecuted(
    lease: Lease,
    *,
    tool_call_id: str,
    namespace: list[str] | None,
    parent_operation_id: str | None,
    sequence: int | None,
    at: datetime,
    same: Callable[[Message], bool],
    fields: dict[str, Any],
    metadata: dict[str, Any],
) -> Message:
    """Under the run lock, the row of this attempt that stands for tool call
    ``tool_call_id`` not executed (a skip, a recorded answer): the row
    already there when ``same(row)`` says it is this kind (the same write
    made again), else a new one. Raises :class:`AuditConflict` when this
    attempt already ran the call."""
    nesting = subagent_fields(namespace, parent_operation_id, None)
    key = effect_key(lease_turn_id(lease), tool_call_id, nesting["parent_operation_id"])
    with transaction.atomic():
        run = lock_run(lease)
        current = operation_row(run, Message.Role.TOOL, tool_call_id)
        if current is not None:
            if not same(current):
                raise AuditConflict(
                    f"tool call {tool_call_id} already ran in attempt {run.attempt}",
                    extra={"reason": "already_executed"},
                )
            return current
        return _insert_effect_row(
            lease,
            run,
            tool_call_id=tool_call_id,
            key=key,
            nesting=nesting,
            at=at,
            sequence=sequence,
            fields=fields,
            metadata=metadata,
        )


def _insert_effect_row(
    lease: Lease,
    run: AgentRun,
    *,
    tool_call_id: str,
    key: str,
    nesting: dict[str, Any],
    at: datetime,
    sequence: int | None,
    fields: dict[str, Any],
    metadata: dict[str, Any],
) -> Message:
    """Insert the row of this attempt that stands for a tool call the
    replay guard did not execute (a replay, a skip), under the run lock the
    caller holds."""
    declared_by = declaring_model_row(run, tool_call_id)
    row = write_operation_row(
        lease,
        role=Message.Role.TOOL,
        operation_id=tool_call_id,
        now=at,
        insert={
            "message_type": Message.Type.TOOL_AUDIT,
            "sequence": sequence,
            "finished_at": at,
            **fields,
            "metadata": {"namespace": nesting["namespace"], **metadata},
            **nesting,
            "effect_key": key,
            "declared_by": None if declared_by is None else declared_by.pk,
        },
    )
    if row is None:  # the lock is held and there was no row
        raise AuditConflict(f"the row of tool call {tool_call_id} could not be recorded")
    return row


def declaring_model_row(run: AgentRun, tool_call_id: str) -> Message | None:
    """The newest model row of ``run``'s turn (the run itself and its resume
    ancestry) whose declarations contain ``tool_call_id``, or None.

    Only the same turn counts: a tool call id reused in another turn of the
    thread never links to this one (R-TA-1, R-MA-9).
    """
    # A turn has a handful of model calls; matching in Python keeps this
    # portable to the embedded SQLite default (no JSON containment there).
    candidates = Message.objects.filter(
        thread_id=run.thread_id,
        run__turn_id=run.turn_id,
        role=Message.Role.ASSISTANT,
        operation_id__isnull=False,
        tool_calls__isnull=False,
    ).order_by("-id")
    return next(
        (row for row in candidates if any(call.get("id") == tool_call_id for call in row.tool_calls or [])),
        None,
    )
