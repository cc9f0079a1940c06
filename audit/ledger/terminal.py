"""The run's terminal transaction: reconcile with the final State, close
running rows, bind the output (R-MA-6..9, R-TA-3)."""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from conversations.models import Message
from conversations.sql import MESSAGE_TABLE, message_columns, message_rows, messages_from_values
from core.db import atomic, execute_prepared_all, on_commit, stand_ins_bound, stand_ins_checked
from core.errors import InvalidInput
from costs.pricing import price_row
from dashboard.rollups import run_roll_up
from governance.seal import FACT_FIELDS, seal_run
from ops import metrics

from ..models import AgentRun, pending_action_requests
from .handover import enqueue_run
from .lease import Lease, lock_run, lock_run_then_read
from .tool_audit import effect_key
from .turns import at_head

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


class RunRows:
    """A run's audit rows, read once by the terminal transaction and changed
    in memory; :meth:`save` writes every changed row in one statement, each
    with only the fields that changed, and takes the stored values back
    (``RETURNING``), so :meth:`facts` are what a reader of the table sees.
    Must be used inside the transaction that locked the run row."""

    def __init__(self, fetched: list[tuple]):
        """The rows of :meth:`read_statement` (see :meth:`read`)."""
        db = connection
        op_field = Message._meta.get_field("operation_id")
        elsewhere = fetched[0][-1] if fetched else None
        self.elsewhere: set[str] = {op_field.from_db_value(op, None, db) for op in elsewhere or ()}
        # Read with the readers' loader: no Model.__init__ per row.
        read = messages_from_values([values[:-1] for values in fetched if values[0] is not None])
        self.all: list[Message] = [row for row in read if row.operation_id is not None]
        # The user's message of the run: no audit row, but sealed (R-GOV-3).
        self.prompts: list[Message] = [row for row in read if row.operation_id is None]
        self._changed: dict[int, tuple[Message, set[str]]] = {}
        self._inserted: list[Message] = []

    @staticmethod
    def read_statement(run_id: uuid.UUID, thread_id: uuid.UUID, *, state_ops: Iterable[str] = ()) -> tuple[str, list]:
        """The prepared statement that reads the run's audit rows and, in the
        same statement, which of ``state_ops`` (ids of the final State's
        AIMessages) are already model calls of another run of the thread
        (:attr:`elsewhere`); one outer row even without audit rows. The
        run's user message comes too (:attr:`prompts`)."""
        op_field = Message._meta.get_field("operation_id")
        ops = [op_field.get_db_prep_value(op, connection) for op in state_ops]
        return _RUN_ROWS_SQL(), [thread_id, Message.Role.ASSISTANT, ops, run_id, run_id, Message.Role.USER]

    @classmethod
    def read(cls, run: AgentRun, *, state_ops: Iterable[str] = ()) -> RunRows:
        """The rows of the locked ``run``, read now."""
        return cls(execute_prepared_all(*cls.read_statement(run.pk, run.thread_id, state_ops=state_ops)))

    def of(self, role: str, operation_ids=None, *, status: str | None = None) -> list[Message]:
        ids = None if operation_ids is None else set(operation_ids)
        return [
            row
            for row in self.all
            if row.role == role
            and (ids is None or row.operation_id in ids)
            and (status is None or row.execution_status == status)
        ]

    def running(self) -> list[Message]:
        return [row for row in self.all if row.execution_status == ExecStatus.RUNNING]

    def add(self, row: Message) -> None:
        """A row just inserted."""
        self.all.append(row)
        self._inserted.append(row)

    def changed(self, row: Message, *fields: str) -> None:
        self._changed.setdefault(id(row), (row, set()))[1].update(fields)

    def save(self) -> None:
        """Write the changed rows and load back, as stored, every row
        written in this transaction (the ``RETURNING`` of the update; a
        row inserted and not changed since is read)."""
        stored = {row.pk: row for row in _update_rows(list(self._changed.values()))} if self._changed else {}
        inserted = [row.pk for row in self._inserted if row.pk not in stored]
        if inserted:
            stored.update(
                (row.pk, row)
                for row in message_rows(
                    f"SELECT {message_columns()} FROM {MESSAGE_TABLE} WHERE id = ANY(%s)", [inserted]
                )
            )
        for row in self.all:
            if row.pk in stored:
                # The same instances stay (``run.output_message`` is one).
                row.__dict__.update((k, v) for k, v in stored[row.pk].__dict__.items() if k != "_state")
        self._changed.clear()
        self._inserted.clear()

    def facts(self) -> list[dict[str, Any]]:
        """The seal's facts of every audit row (R-GOV-3), as :func:`~governance.seal.audit_row_facts`
        reads them; the usage total and the metrics read them too."""
        return [{name: getattr(row, name) for name in FACT_FIELDS} for row in self.all]

    def prompt_facts(self) -> list[dict[str, Any]]:
        """The seal's facts of the run's user message (R-GOV-3)."""
        return [{name: getattr(row, name) for name in FACT_FIELDS} for row in self.prompts]


@functools.cache
def _RUN_ROWS_SQL() -> str:  # noqa: N802 - a constant, built once the connection is known
    # Message.objects.audit() of the run, and the R-MA-9 check of
    # :func:`_own_ai_messages` (``.exclude(run=run)``: another run or none).
    return (
        f"SELECT {message_columns('m')}, e.ops FROM (SELECT array_agg(o.operation_id) AS ops "
        f"FROM {MESSAGE_TABLE} o WHERE o.thread_id = %s AND o.role = %s AND o.operation_id = ANY(CAST(%s AS text[])) "
        "AND o.run_id IS DISTINCT FROM %s) e "
        f"LEFT JOIN {MESSAGE_TABLE} m ON m.run_id = %s AND (m.operation_id IS NOT NULL OR m.role = %s) ORDER BY m.id"
    )


@functools.cache
def _END_RUN_SQL() -> tuple[str, list]:  # noqa: N802 - a constant, built once the connection is known
    qn = connection.ops.quote_name
    table = qn(AgentRun._meta.db_table)
    fields = [AgentRun._meta.get_field(name) for name in _TERMINAL_FIELDS]
    sets = ", ".join(f"{qn(f.column)} = %s" for f in fields)
    return f"UPDATE {table} SET {sets} WHERE id = %s RETURNING id", fields


def _update_rows(changes: list[tuple[Message, set[str]]]) -> list[Message]:
    """One ``UPDATE … FROM (VALUES …)`` of the rows ``[(row, changed
    field names)]``: each row gets only its own changed fields (a field
    another row changed keeps its stored value here) and ``updated_at``.
    Returns the rows as stored."""
    db = connection
    qn = db.ops.quote_name
    fields = [Message._meta.get_field(name) for name in sorted(set().union(*(changed for _, changed in changes)))]
    sets = [f"{qn(f.column)} = CASE WHEN v.s{i} THEN v.c{i} ELSE m.{qn(f.column)} END" for i, f in enumerate(fields)]
    casts = [f.db_type(db).split("(", 1)[0] for f in fields]
    one = "(CAST(%s AS bigint), " + ", ".join(f"%s, CAST(%s AS {cast})" for cast in casts) + ")"
    params: list[Any] = [timezone.now()]  # updated_at, as a save() sets it
    for row, changed in changes:
        params.append(row.pk)
        for f in fields:
            value = getattr(row, f.attname) if f.name in changed else None
            params += [f.name in changed, None if value is None else f.get_db_prep_save(value, db)]
    names = ", ".join(f"s{i}, c{i}" for i in range(len(fields)))
    returning = ", ".join(f"m.{qn(f.column)}" for f in Message._meta.concrete_fields)
    sql = (
        f"UPDATE {MESSAGE_TABLE} AS m SET {', '.join(sets)}, updated_at = %s "
        f"FROM (VALUES {', '.join([one] * len(changes))}) AS v(id, {names}) "
        f"WHERE m.id = v.id RETURNING {returning}"
    )
    # Prepared: the text depends only on the changed fields and the number
    # of rows, which repeat from run to run.
    stored = messages_from_values(execute_prepared_all(sql, params))
    if len(stored) != len(changes):
        raise DatabaseError("a changed audit row of the run no longer exists")
    return stored


@metrics.audit_write("run_finish")
def run_finish(
    *,
    lease: Lease,
    status: str,
    final_state: list[StateMessage] | None = None,
    prior_message_ids: Iterable[str] = (),
    interrupts: list[dict[str, Any]] | None = None,
    error_type: str = "",
    error_message: str = "",
    partial_content: dict[str, str] | None = None,
    cut_calls: dict[str, dict[str, Any]] | None = None,
) -> AgentRun:
    """End the run in one lease-fenced transaction.

    Args:
        status: a terminal status (completed, failed, cancelled, interrupted).
        final_state: the messages of the final graph State, in order.
        prior_message_ids: ids of messages that were in the State before
            this run started; they belong to earlier runs and never bind
            (R-MA-9).
        interrupts: pending approval payloads when interrupted.
        partial_content: ``{operation_id: text}`` streamed so far by model
            calls that never finished; kept on their rows, marked
            ``content_partial`` (one write here, never one per token).
        cut_calls: ``{operation_id: {"duration_ms": int, "error_type": str | None, "error": str |
            None, "finished_at": datetime | None}}`` for model calls that
            started (at request start, R-MA-10) but never finished: their
            monotonic duration until they were cut off, the error that ended
            them and when it did (wall clock, aware; the row's
            ``finished_at``, else the terminal's time: R-SUB-2). A call with an error is
            closed ``failed`` whatever the run's status (a handled model
            error in a completed run is still a failed call), with the error
            in ``metadata.error``; the others are closed by the run's status.

    Reconciles the State with this run's audit rows, closes running rows,
    binds ``output_message``, aggregates usage and releases the lease; after
    commit the next pending run of the thread is enqueued.

    Raises what :func:`lock_run` raises. Implements R-MA-6, R-MA-7, R-MA-8.
    """
    if status not in AgentRun.TERMINAL_STATUSES:
        raise InvalidInput(f"{status} is not a terminal status")
    prior = set(prior_message_ids)
    own_ai = _own_ai_messages(final_state, prior) if final_state else {}
    # Django's transaction, or the worker's pooled one on its event loop
    # (core.db.call_with_pooled_statements, issue 11).
    with atomic():
        # One read of the run's rows serves every step below, sent with the
        # lock in one round trip; each changed row is written once, at the
        # end (R-RUN-5: a short transaction).
        run, fetched = lock_run_then_read(
            lease, only=_RUN_FIELDS, read=RunRows.read_statement(lease.run_id, lease.thread_id, state_ops=own_ai)
        )
        now = timezone.now()
        rows = RunRows(fetched)
        own_ai = {op: message for op, message in own_ai.items() if op not in rows.elsewhere}
        if final_state:
            _reconcile_model_rows(run, own_ai, rows, now=now)
            _reconcile_tool_rows(final_state, prior, rows)
            _record_rejections(run, final_state, prior, rows, now=now)
        if status in (Status.COMPLETED, Status.INTERRUPTED) and final_state:
            _bind_output(run, final_state, own_ai, rows)
        if partial_content:
            _keep_partial_content(partial_content, rows)
        if cut_calls:
            _close_cut_calls(cut_calls, rows, now=now)
        _terminate(
            run,
            status=status,
            now=now,
            error_type=error_type,
            error_message=error_message,
            interrupts=interrupts,
            rows=rows,
        )
        return run


def run_finish_fallback(*, lease: Lease, error_type: str, error_message: str) -> AgentRun:
    """End the run ``failed`` in one minimal lease-fenced transaction that
    carries no payload: no State reconcile, no output binding, no partial
    content — only the status, ``error_type`` (at most 100 characters) and
    ``error_message``, the running rows closed (``failed``), usage summed
    from the stored rows, and the lease released; the thread's next run is
    enqueued after commit.

    The worker calls it when :func:`run_finish` was refused by the database
    (R-RUN-11), so that the run ends at once with its cause instead of
    waiting for the lease sweeper.

    Raises what :func:`lock_run` raises.
    """
    with transaction.atomic():
        run = lock_run(lease, only=_RUN_FIELDS)
        _terminate(run, status=Status.FAILED, now=timezone.now(), error_type=error_type, error_message=error_message)
        return run


@metrics.audit_write("run_hand_over")
def run_hand_over(
    *,
    lease: Lease,
    reason: str,
    partial_content: dict[str, str] | None = None,
    cut_calls: dict[str, dict[str, Any]] | None = None,
) -> AgentRun:
    """Hand the run over to another worker: its worker is stopping (a
    deploy, R-RUN-15). In one lease-fenced transaction the run becomes
    ``pending`` as its next attempt, as the lease sweeper makes a run whose
    worker died (:func:`run_requeue_attempt`: what the attempt left running
    is closed, the lease released, the run enqueued after commit), without
    waiting for the lease to expire. Unlike the sweeper, the stopping
    worker knows what its cut model calls streamed: ``partial_content``
    (``{operation_id: text}``) is kept on their rows
    (``metadata.content_partial``) and ``cut_calls``
    (``{operation_id: {duration_ms?}}``) gives their durations, as a
    terminal write keeps them (R-MA-10). ``reason`` goes to the log.

    Raises what :func:`lock_run` raises."""
    with transaction.atomic():
        run = lock_run(lease, only=_RUN_FIELDS)
        now = timezone.now()
        rows = RunRows.read(run)
        if partial_content:
            _keep_partial_content(partial_content, rows)
        if cut_calls:
            _close_cut_calls(cut_calls, rows, now=now)
        run_requeue_attempt(run, now=now, reason=reason, rows=rows)
        return run


def _keep_partial_content(partial_content: dict[str, str], rows: RunRows) -> None:
    """Store what cut-off model calls streamed before they stopped on their
    still-running rows (the terminal close follows in the same
    transaction). A row that has content already is left alone."""
    ops = [op for op, text in partial_content.items() if text]
    for row in rows.of(Message.Role.ASSISTANT, ops, status=ExecStatus.RUNNING):
        if row.content:
            continue
        row.content = partial_content[row.operation_id]
        row.metadata = {**row.metadata, "content_partial": True}
        rows.changed(row, "content", "metadata")


def _close_cut_calls(cut_calls: dict[str, dict[str, Any]], rows: RunRows, *, now: datetime) -> None:
    """Duration and, when an error ended it, the ``failed`` close of each
    model call that never finished (R-MA-10, R-RUN-12). Usage stays unknown."""
    for row in rows.of(Message.Role.ASSISTANT, cut_calls, status=ExecStatus.RUNNING):
        facts = cut_calls[row.operation_id]
        update = ["metadata"]
        if row.duration_ms is None and facts.get("duration_ms") is not None:
            row.duration_ms = max(0, int(facts["duration_ms"]))
            update.append("duration_ms")
        if facts.get("error"):
            row.execution_status = ExecStatus.FAILED
            row.finished_at = row.finished_at or facts.get("finished_at") or now
            row.metadata = {
                **row.metadata,
                "error": str(facts["error"])[:2000],
                **({"error_type": str(facts["error_type"])[:100]} if facts.get("error_type") else {}),
                "closed_by": "run_terminal",
                "usage_unknown": row.usage is None,
            }
            update += ["execution_status", "finished_at"]
        rows.changed(row, *update)


def _own_ai_messages(final_state: list[StateMessage], prior: set[str]) -> dict[str, StateMessage]:
    """This run's root AIMessages by id, as far as the State tells; for one
    id only the last counts. An id that was in the State before the run
    started belongs to an earlier run; so does one that is already an
    operation of another run of the thread (:attr:`RunRows.elsewhere`,
    removed by the caller): it never binds to or duplicates into this one
    (R-MA-9)."""
    own: dict[str, StateMessage] = {}
    for message in final_state:
        if message.kind == "ai" and message.id and message.id not in prior and not message.namespace:
            own.pop(message.id, None)
            own[message.id] = message
    return own


def _reconcile_model_rows(run: AgentRun, own_ai: dict[str, StateMessage], rows: RunRows, *, now: datetime) -> None:
    if not own_ai:
        return
    found = {row.operation_id: row for row in rows.of(Message.Role.ASSISTANT, own_ai)}
    for op_id, message in own_ai.items():
        row = found.get(op_id)
        if row is None:
            # The stream missed this call but the State proves it under a
            # stable id: insert it once, completed, without stream timing.
            inserted = Message.objects.create(
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
                attempt=run.attempt,
                metadata={"state_reconciled": True, "source": "state"},
            )
            rows.add(inserted)
            continue
        update = ["metadata"]
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
        rows.changed(row, *update)


def _reconcile_tool_rows(final_state: list[StateMessage], prior: set[str], rows: RunRows) -> None:
    """Close tool rows left ``running`` with ``awaiting_run_terminal`` from
    the last error ToolMessage with the same id (R-TA-3). Closed rows are
    never touched: the lifecycle owns them."""
    # The root's tool rows only: the root State answers none of a
    # subagent's calls (R-SUB-1); the terminal close ends those.
    awaiting = [
        row
        for row in rows.of(Message.Role.TOOL, status=ExecStatus.RUNNING)
        if row.metadata.get("awaiting_run_terminal") and not row.namespace
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
        # The tool-error's time when the stream gave it (R-SUB-2).
        row.finished_at = row.finished_at or now
        row.metadata = {**row.metadata, "state_reconciled": True}
        row.metadata.pop("awaiting_run_terminal", None)
        rows.changed(row, "execution_status", "content", "finished_at", "metadata")


def _record_rejections(
    run: AgentRun, final_state: list[StateMessage], prior: set[str], rows: RunRows, *, now: datetime
) -> None:
    """Record one ``rejected`` tool row per call a reviewer rejected (R-TA-5).

    A rejection emits no tool events (PROTOCOL.md §4, capture d2): the
    approval middleware puts an error ToolMessage into the State instead.
    The row is written here, in the resume run's terminal transaction, and
    not when the resume is submitted, because only the State proves that
    the graph applied the decision: a resume cancelled before it started, or
    refused by the graph, rejected nothing. The proof alone is not enough
    either (an unknown tool name also yields an error ToolMessage without
    tool events), so a call is rejected only when

    * this run resumes an interrupted run and its ``reject`` decision at
      index *i* answers that run's action request *i* (same order as the
      approval middleware), matched by name and arguments to a declaration
      of the interrupted run's turn, and
    * this run's State has a new error ToolMessage for that ``tool_call_id``
      while this run has no tool row for it.

    The row has no ``started_at`` (the tool never started, so it counts as
    no execution: R-READ-4), the call's effect key (R-EFF-1), ``sequence``
    0 (the timeline shows it at the decision, before the resume run's first
    event), ``metadata.source = "approval_decision"`` with the decision, and the ToolMessage text as content. Runs again, it
    inserts nothing twice.
    """
    rejected = _rejected_declarations(run)
    if not rejected:
        return
    answered = {
        m.tool_call_id: m
        for m in final_state
        if m.kind == "tool" and m.status == "error" and m.tool_call_id and m.id not in prior
    }
    recorded = {row.operation_id for row in rows.of(Message.Role.TOOL, rejected)}
    for tool_call_id, (declared_by, tool_call, decision) in rejected.items():
        message = answered.get(tool_call_id)
        if message is None or tool_call_id in recorded:
            continue
        inserted = Message.objects.create(
            thread_id=run.thread_id,
            run=run,
            role=Message.Role.TOOL,
            message_type=Message.Type.TOOL_AUDIT,
            operation_id=tool_call_id,
            tool_name=tool_call.get("name") or "",
            tool_input=tool_call.get("args"),
            content=message.content,
            execution_status=ExecStatus.REJECTED,
            # The decision came before this run's stream (its seq starts at
            # 1): the row sorts first in the resume run, where it happened.
            sequence=0,
            finished_at=now,
            declared_by=declared_by,
            # A reviewer rejects calls of the root graph (the approval
            # middleware is the root agent's): no parent (R-EFF-1).
            effect_key=effect_key(run.turn_id, tool_call_id),
            attempt=run.attempt,
            metadata={"source": "approval_decision", "decision": decision, "state_reconciled": True},
        )
        rows.add(inserted)


def _rejected_declarations(run: AgentRun) -> dict[str, tuple[Message, dict[str, Any], dict[str, Any]]]:
    """``{tool_call_id: (declaring model row, tool call, decision)}`` for the
    ``reject`` decisions of a resume run (see :func:`_record_rejections`)."""
    if not run.resumed_from_id:
        return {}
    decisions = (run.input or {}).get("decisions") or []
    if not any(isinstance(d, dict) and d.get("type") == "reject" for d in decisions):
        return {}
    interrupted = AgentRun.objects.filter(pk=run.resumed_from_id).only("interrupts").first()
    actions = pending_action_requests(interrupted.interrupts if interrupted else None)
    declarations = [
        (row, call)
        for row in Message.objects.model_calls()
        .filter(thread_id=run.thread_id, run__turn_id=run.turn_id, tool_calls__isnull=False)
        .exclude(run=run)
        .order_by("-id")
        for call in row.tool_calls or []
    ]
    result: dict[str, tuple[Message, dict[str, Any], dict[str, Any]]] = {}
    for action, decision in zip(actions, decisions, strict=False):
        if not isinstance(decision, dict) or decision.get("type") != "reject":
            continue
        for row, call in declarations:
            if (
                call.get("id")
                and call["id"] not in result
                and call.get("name") == action.get("name")
                and (call.get("args") or {}) == (action.get("args") or {})
            ):
                result[call["id"]] = (row, call, decision)
                break
    return result


def _bind_output(
    run: AgentRun, final_state: list[StateMessage], own_ai: dict[str, StateMessage], rows: RunRows
) -> None:
    """Bind ``output_message`` to the row of the State's last AIMessage, and
    only if that message belongs to this run (R-MA-8): no fallback to an
    earlier row."""
    last_ai = next((m for m in reversed(final_state) if m.kind == "ai" and not m.namespace), None)
    if last_ai is None or last_ai.id not in own_ai:
        return
    row = next(iter(rows.of(Message.Role.ASSISTANT, [last_ai.id])), None)
    if row is None or row.namespace or row.metadata.get("namespace"):
        # A subgraph's or subagent's call is never the run's answer (R-SUB-1).
        return
    row.message_type = Message.Type.TEXT
    rows.changed(row, "message_type")
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
    rows: RunRows | None = None,
) -> None:
    """Make a locked run terminal: close its running rows, aggregate usage,
    release the lease. Must be called inside ``transaction.atomic()`` with
    the run row locked; ``rows``: the run's rows as this transaction changed
    them so far (read here when not given). Enqueues the thread's next run
    after commit."""
    rows = rows if rows is not None else RunRows.read(run)
    close_as = _CLOSE_RUNNING[status]
    _close_running(rows, lambda _row: close_as, now=now, closed_by="run_terminal")
    # Rows closed from the final State carry usage but no price (R-COST-1).
    for row in rows.of(Message.Role.ASSISTANT):
        if row.price_source == "" and row.usage is not None:
            rows.changed(row, *price_row(row, model=run.model))
    rows.save()
    facts = rows.facts()
    run.usage = _usage_total(facts)
    run.status = status
    run.finished_at = now
    run.lease_expires_at = None
    run.error_type = error_type[:100]
    run.error_message = error_message
    run.interrupts = interrupts if status == Status.INTERRUPTED else None
    # R-GOV-3: every row is closed now; written with the run below.
    seal_run(run, rows=[*rows.prompt_facts(), *facts])
    run.updated_at = timezone.now()
    # The run is locked: a run not marked yet is marked by the write of its
    # end, and its figures are added in the same round trip below (a run
    # marked before — an interrupted run now cancelled — adds nothing).
    first_roll_up = run.rolled_up_at is None
    if first_roll_up:
        run.rolled_up_at = now
    # One statement writes the run (only the fields this path changes).
    sql, fields = _END_RUN_SQL()
    end_run = [
        *(
            None if (value := getattr(run, f.attname)) is None else f.get_db_prep_save(value, connection)
            for f in fields
        ),
        run.pk,
    ]
    # Dashboard figures of the run, added once with the run's end (R-DASH-1),
    # which goes first in the same round trip; in the worker's pooled
    # transaction the commit and the handover of the thread's head follow
    # in that round trip too.
    handover = _head_handover(run.thread_id, now=now)
    rolled_up, ended, head = run_roll_up(
        run_id=run.pk, lead=(sql, end_run), commit_then=handover, marked_by_lead=first_roll_up
    )
    if not ended:
        raise DatabaseError(f"run {run.pk} no longer exists")
    if first_roll_up and not rolled_up:  # left for the catch-up: the mark was undone
        run.rolled_up_at = None
    metrics.run_ended(run, rows=facts)
    # Always after commit, also when no run waited: a turn submitted while
    # this transaction was open saw this run hold the thread and was not
    # handed over (R-RUN-2, :func:`audit.ledger.runs.run_submit`).
    if head is None:
        transaction.on_commit(lambda: _enqueue_head(execute_prepared_all(*handover)))
    else:
        on_commit(lambda: _enqueue_head(head))


def run_requeue_attempt(run: AgentRun, *, now: datetime, reason: str, rows: RunRows | None = None) -> None:
    """Put a locked run whose worker is gone back to ``pending`` as its next
    attempt, to be continued by another worker from its last checkpoint
    (R-RUN-15). Must be called inside ``transaction.atomic()`` with the run
    row locked (the lease sweeper's claim).

    In the same transaction: every row the attempt left ``running`` is
    closed ``interrupted`` with ``metadata.closed_by = "recovery"`` and the
    attempt's number (``usage_unknown`` as the terminal close sets it, see
    :func:`_close_running`); a tool row is marked ``outcome_unknown``, as
    nobody knows whether its effect happened, except one whose tool raised
    (its error is recorded, ``awaiting_run_terminal``), which closes
    ``failed``. The run becomes ``pending`` with ``attempt`` + 1, no owner
    and no expiry; its fencing token stays, so the next acquisition's is
    new and every write of the old owner stays refused (R-RUN-4). Its
    ``started_at``, usage (summed again at its end over every attempt's
    rows) and turn stay. ``reason`` (the expired lease) is kept in the
    log. The run is enqueued after commit (the dispatcher offers it again
    if that message is lost, R-RUN-9). ``rows``: the run's rows when the
    caller has read them (and changed some: saved here), else read here.
    """
    rows = rows if rows is not None else RunRows.read(run)

    def close_as(row: Message) -> str:
        # A tool that raised has a known outcome; any other was cut off.
        raised = row.role == Message.Role.TOOL and bool(row.metadata.get("awaiting_run_terminal"))
        return ExecStatus.FAILED if raised else ExecStatus.INTERRUPTED

    for row in _close_running(rows, close_as, now=now, closed_by="recovery", recovered_attempt=run.attempt):
        if row.role == Message.Role.TOOL and row.execution_status == ExecStatus.INTERRUPTED:
            row.metadata["outcome_unknown"] = True
    rows.save()
    run.status = Status.PENDING
    run.attempt += 1
    run.lease_owner = None
    run.lease_expires_at = None
    run.save(update_fields=["status", "attempt", "lease_owner", "lease_expires_at", "updated_at"])
    log.warning("run %s continues as attempt %d: %s", run.id, run.attempt, reason)
    metrics.run_recovered()
    run_id = run.id
    transaction.on_commit(lambda: enqueue_run(run_id))


def _close_running(
    rows: RunRows, close_as: Callable[[Message], str], *, now: datetime, closed_by: str, **marks: Any
) -> list[Message]:
    """Close every row of ``rows`` still running with the status
    ``close_as(row)``, ``finished_at`` kept or ``now``, and in
    ``metadata``: ``closed_by``, ``usage_unknown`` (cut off before the
    provider reported usage: unknown, not zero) and ``marks``; the
    ``awaiting_run_terminal`` mark goes. Returns the rows it closed (their
    metadata may still be added to before ``rows.save()``)."""
    closed = rows.running()
    for row in closed:
        row.execution_status = close_as(row)
        row.finished_at = row.finished_at or now
        row.metadata = {**row.metadata, "closed_by": closed_by, "usage_unknown": row.usage is None, **marks}
        row.metadata.pop("awaiting_run_terminal", None)
        rows.changed(row, "execution_status", "finished_at", "metadata")
    return closed


# What the terminal transaction reads of the run (the lease checks', the
# terminal path's and what the worker reads of the returned run); the rest
# loads on access.
_RUN_FIELDS = (
    "request_id",
    "thread_id",
    "lease_owner",
    "fencing_token",
    "status",
    "lease_expires_at",
    "model",
    "resumed_from_id",
    "started_at",
    "error_type",
    "output_message_id",
    # The rows the reconcile inserts carry them (R-EFF-1).
    "turn_id",
    "attempt",
    # The seal covers the run's own facts too (governance.seal.RUN_FACT_FIELDS).
    "user_id",
    "agent_id",
    "input",
    "replay_of",
    "usage",
    "error_message",
    "interrupts",
    # Whether the run's end also marks it rolled up (_terminate).
    "rolled_up_at",
)
# What :func:`_terminate` changes on the run: its UPDATE writes these.
_TERMINAL_FIELDS = (
    "usage",
    "status",
    "finished_at",
    "lease_expires_at",
    "error_type",
    "error_message",
    "interrupts",
    "output_message",
    "seal_head",
    "seal_row_count",
    "seal_rows",
    "seal_version",
    "sealed_at",
    "updated_at",
    # The dashboard's mark, written with the run's end (dashboard.rollups.run_roll_up).
    "rolled_up_at",
)


def _usage_total(rows: list[dict[str, Any]]) -> dict[str, int]:
    total = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "unknown_calls": 0}
    for row in rows:
        if row["role"] != Message.Role.ASSISTANT:
            continue
        usage = row["usage"]
        if not usage:
            total["unknown_calls"] += 1
            continue
        for key in ("input_tokens", "output_tokens", "total_tokens"):
            total[key] += int(usage.get(key) or 0)
    return total


def _head_handover(thread_id: uuid.UUID, *, now: datetime) -> tuple[str, list]:
    """The statement, run after the end's commit, that reads the pending
    runs at the thread's head (:func:`~audit.ledger.turns.at_head`: the
    next turn; none while an earlier turn still holds the thread) and stamps
    their ``dispatched_at`` with ``now``: the dispatcher's grace counts from
    the handover, in case its message is lost (R-RUN-9). Returns their ids,
    oldest first. The stamp skips a row another transaction locked (a
    cancel, a worker's acquisition): it never waits for one."""
    sql, params = _HEAD_HANDOVER_SQL()
    return sql, [*stand_ins_bound(params, {_THREAD_STANDIN: thread_id}), now]


# Compiled into the handover's statement in place of the thread id.
_THREAD_STANDIN = uuid.UUID(int=0x7EAD)


@functools.cache
def _HEAD_HANDOVER_SQL() -> tuple[str, tuple]:  # noqa: N802 - a constant, built once the connection is known
    head = AgentRun.objects.filter(thread_id=_THREAD_STANDIN).filter(at_head()).order_by().values("id", "created_at")
    head_sql, params = head.query.get_compiler(using=connection.alias).as_sql()
    table = connection.ops.quote_name(AgentRun._meta.db_table)
    sql = (
        f"WITH head AS ({head_sql}), "
        f"stamped AS (UPDATE {table} SET dispatched_at = %s WHERE id IN (SELECT id FROM {table} "
        "WHERE id IN (SELECT id FROM head) FOR NO KEY UPDATE SKIP LOCKED)) "
        "SELECT id FROM head ORDER BY created_at, id"
    )
    return sql, stand_ins_checked(params, _THREAD_STANDIN)


def _enqueue_head(rows: list[tuple]) -> None:
    """Hand the runs at the thread's head (``rows`` of
    :func:`_head_handover`) to workers, oldest first (R-RUN-2, R-RUN-9)."""
    for (run_id,) in rows:
        enqueue_run(run_id)
