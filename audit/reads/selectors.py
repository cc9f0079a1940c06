"""Reads of runs and their audit, shared by the API, the admin and the dashboard."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db.models import Count, F, IntegerField, OuterRef, Q, Subquery, Sum, Value
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast, Coalesce

from conversations.models import Message
from conversations.sql import MESSAGE_TABLE, message_columns, message_rows, predicate_sql
from core.config import get_config
from core.cursors import before_key, page_cursor, parse_cursor
from core.errors import InvalidInput, NotFound
from core.workspace import tool_row_large_result_path
from costs.selectors import usd_text
from governance.payloads import payload_note

from ..models import AgentRun, RunRollback, pending_action_requests


def run_of(user, run_id: uuid.UUID) -> AgentRun:
    """The user's run; another user's run is :class:`NotFound` (R-READ-5)."""
    run = AgentRun.objects.visible_to(user).select_related("rollback").filter(pk=run_id).first()
    if run is None:
        raise NotFound("run not found")
    return run


# A thread's runs, newest first (R-API-1); index run_thread_created_idx
# (thread, created_at), read backwards.
THREAD_RUNS_KEY = [("created_at", "datetime"), ("id", "uuid")]
THREAD_RUNS_MAX = 100


@dataclass(frozen=True)
class ThreadRunsPage:
    """Runs newest first; ``next_before`` is the cursor of the next (older)
    page when ``has_more``, else ``None``."""

    items: list[AgentRun]
    has_more: bool
    next_before: str | None


def thread_runs_page(*, thread_id: uuid.UUID, limit: int = 20, before: str | None = None) -> ThreadRunsPage:
    """One page of a thread's runs (resume runs included), newest first,
    keyset-paginated by ``(created_at, id)``: ``before`` is the
    ``next_before`` of the newer page. One query. The caller has checked
    that the thread is the user's (R-READ-5). Implements R-API-1.

    Raises:
        InvalidInput: ``limit`` outside 1–100 (``reason: bad_limit``) or a
            malformed cursor (``reason: bad_cursor``).
    """
    if not 1 <= limit <= THREAD_RUNS_MAX:
        raise InvalidInput(f"limit must be between 1 and {THREAD_RUNS_MAX}", extra={"reason": "bad_limit"})
    runs = AgentRun.objects.select_related("rollback").filter(thread_id=thread_id)
    names = [name for name, _ in THREAD_RUNS_KEY]
    if before is not None:
        runs = runs.filter(before_key(names, parse_cursor(before, THREAD_RUNS_KEY)))
    rows = list(runs.order_by(*(f"-{name}" for name in names))[: limit + 1])
    has_more = len(rows) > limit
    items = rows[:limit]
    next_before = page_cursor(items[-1], THREAD_RUNS_KEY) if has_more else None
    return ThreadRunsPage(items=items, has_more=has_more, next_before=next_before)


def _count_of(rows) -> Subquery:
    """A correlated ``COUNT`` of ``rows`` of the outer run. Evaluated only
    for the rows of the page (after ORDER BY ... LIMIT), unlike a JOIN with
    GROUP BY, which would aggregate every run's rows first."""
    counted = rows.filter(run=OuterRef("pk")).order_by().values("run").annotate(n=Count("id")).values("n")
    return Coalesce(Subquery(counted, output_field=IntegerField()), Value(0))


def with_operation_counts(runs):
    """``runs`` annotated with ``model_call_count`` and
    ``tool_execution_count`` (executions that started: R-READ-4)."""
    return runs.annotate(
        model_call_count=_count_of(Message.objects.model_calls()),
        tool_execution_count=_count_of(Message.objects.tool_executions()),
    )


# --------------------------------------------------------------------------
# Audit timeline (R-READ-3), shared by the API, the admin and the dashboard
# --------------------------------------------------------------------------

TIMELINE_MAX_ROWS = 500
# Rows without a sequence (a model call only the final State proved) sort
# after the stream's rows of their run: ``sequence`` ascending NULLS LAST,
# which is the order of the (run, sequence, id) index. Cursors carry this
# value in place of a NULL sequence. A rejected approval row has sequence
# 0: first in its resume run, at the decision (R-TA-5).
_NO_SEQUENCE = 2**31 - 1
_TIMELINE_KEY = [("run_created", "datetime"), ("run_id", "uuid"), ("sequence_key", "int"), ("id", "int")]


@dataclass(frozen=True)
class TimelinePage:
    """One page of a timeline.

    ``items`` are audit rows (:class:`Message`) in display order: runs by
    creation time (then id), then ``sequence`` (rows without one last), then
    id. ``truncated`` is true when older rows exist; ``next_before`` is then
    the opaque cursor that pages back to them (else ``None``).
    """

    items: list[Message]
    truncated: bool
    next_before: str | None


def run_timeline(*, run_id: uuid.UUID | str, limit: int = TIMELINE_MAX_ROWS, before: str | None = None) -> TimelinePage:
    """The newest ``limit`` (1–500) model and tool rows of one run, in
    display order. Works while the run is still running. Model and tool rows
    that share an operation id are separate items. One query, an index scan
    of ``message_run_sequence_idx`` that stops after ``limit`` + 1 rows,
    also on a page far back (the cursor bounds the scan).

    Access control is the caller's: this selector is for staff readers.

    Raises:
        InvalidInput: ``limit`` out of range or a malformed ``before``.

    Implements R-READ-3.
    """
    return _timeline_page("id", run_id, limit=limit, before=before)


def thread_timeline(
    *, thread_id: uuid.UUID | str, limit: int = TIMELINE_MAX_ROWS, before: str | None = None
) -> TimelinePage:
    """The newest ``limit`` (1–500) model and tool rows of every run of one
    thread: runs in creation order, each run's rows by ``sequence``. One
    query: the thread's runs newest first, and for each, its rows through
    the (run, sequence, id) index, until the page is full.

    Raises:
        InvalidInput: ``limit`` out of range or a malformed ``before``.

    Implements R-READ-3.
    """
    return _timeline_page("thread_id", thread_id, limit=limit, before=before)


def _timeline_page(scope: str, value, *, limit: int, before: str | None) -> TimelinePage:
    if not 1 <= limit <= TIMELINE_MAX_ROWS:
        raise InvalidInput(f"limit must be between 1 and {TIMELINE_MAX_ROWS}", extra={"reason": "bad_limit"})
    cursor = parse_cursor(before, _TIMELINE_KEY) if before is not None else None
    sql, params = timeline_sql(scope, limit=limit + 1, cursor=cursor)
    newest_first = message_rows(
        sql, [value if p is _SCOPE else p for p in params], extra=("run_created", "run_model", "run_rolled_back")
    )
    truncated = len(newest_first) > limit
    items = newest_first[:limit][::-1]
    for row in items:
        row.sequence_key = _NO_SEQUENCE if row.sequence is None else row.sequence
    next_before = page_cursor(items[0], _TIMELINE_KEY) if truncated else None
    return TimelinePage(items=items, truncated=truncated, next_before=next_before)


_SCOPE = object()  # placeholder of the run or thread id in timeline_sql's params
# Whether the row's run was rolled back by a later turn (R-API-2).
_ROLLED_BACK = "EXISTS (SELECT 1 FROM audit_runrollback b WHERE b.run_id = r.id) AS run_rolled_back"


def timeline_sql(scope: str, *, limit: int, cursor: list | None) -> tuple[str, list]:
    """The statement of one timeline page, newest row first: ``scope`` is
    ``"id"`` (one run) or ``"thread_id"`` (every run of a thread); the
    scope's value is the :data:`_SCOPE` placeholder in the params. With a
    ``cursor`` ``[run_created, run_id, sequence_key, id]``: the cursor run's
    rows before it (a bound of the index scan: ``(sequence, id) < (s, i)``),
    then the runs before the cursor run. Kept public for the read-path
    benchmark, which EXPLAINs it."""
    audit_sql, audit_params = predicate_sql(Q(operation_id__isnull=False))
    columns = message_columns()
    # PostgreSQL's ascending order puts NULLs last: a backward scan of
    # (run, sequence, id) yields "sequence DESC NULLS FIRST, id DESC".
    rows_order = f"{MESSAGE_TABLE}.sequence DESC NULLS FIRST, {MESSAGE_TABLE}.id DESC"
    rows_of_run = f"""SELECT {columns} FROM {MESSAGE_TABLE}
        WHERE {MESSAGE_TABLE}.run_id = r.id AND {audit_sql} {{bound}}
        ORDER BY {rows_order} LIMIT %s"""
    page_order = "r.created_at DESC, r.id DESC, x.sequence DESC NULLS FIRST, x.id DESC"
    if cursor is None and scope == "id":
        # One run: its newest rows straight from the index, the run's two
        # columns from one lookup (an uncorrelated subquery runs once).
        sql = f"""SELECT {columns},
                (SELECT created_at FROM audit_agentrun WHERE id = %s) AS run_created,
                (SELECT model FROM audit_agentrun WHERE id = %s) AS run_model,
                EXISTS (SELECT 1 FROM audit_runrollback WHERE run_id = %s) AS run_rolled_back
            FROM {MESSAGE_TABLE} WHERE {MESSAGE_TABLE}.run_id = %s AND {audit_sql}
            ORDER BY {rows_order} LIMIT %s"""
        return sql, [_SCOPE, _SCOPE, _SCOPE, _SCOPE, *audit_params, limit]
    if cursor is None:
        sql = f"""SELECT x.*, r.created_at AS run_created, r.model AS run_model, {_ROLLED_BACK}
            FROM (SELECT id, created_at, model FROM audit_agentrun WHERE {scope} = %s) r
            CROSS JOIN LATERAL ({rows_of_run.format(bound="")}) x
            ORDER BY {page_order} LIMIT %s"""
        return sql, [_SCOPE, *audit_params, limit, limit]
    run_created, run_id, sequence_key, row_id = cursor
    if sequence_key == _NO_SEQUENCE:
        bound, bound_params = f"AND ({MESSAGE_TABLE}.sequence IS NOT NULL OR {MESSAGE_TABLE}.id < %s)", [row_id]
    else:
        bound, bound_params = f"AND ({MESSAGE_TABLE}.sequence, {MESSAGE_TABLE}.id) < (%s, %s)", [sequence_key, row_id]
    sql = f"""SELECT * FROM (
        (SELECT x.*, r.created_at AS run_created, r.model AS run_model, {_ROLLED_BACK}
            FROM (SELECT id, created_at, model FROM audit_agentrun
                  WHERE {scope} = %s AND id = %s AND created_at = %s) r
            CROSS JOIN LATERAL ({rows_of_run.format(bound=bound)}) x)
        UNION ALL
        (SELECT x.*, r.created_at AS run_created, r.model AS run_model, {_ROLLED_BACK}
            FROM (SELECT id, created_at, model FROM audit_agentrun
                  WHERE {scope} = %s AND (created_at, id) < (%s, %s)) r
            CROSS JOIN LATERAL ({rows_of_run.format(bound="")}) x
            ORDER BY {page_order} LIMIT %s)
        ) page
        ORDER BY run_created DESC, run_id DESC, sequence DESC NULLS FIRST, id DESC LIMIT %s"""
    params = [
        *[_SCOPE, run_id, run_created, *audit_params, *bound_params, limit],
        *[_SCOPE, run_created, run_id, *audit_params, limit, limit],
        limit,
    ]
    return sql, params


def _run_rolled_back(row: Message) -> bool:
    """Whether ``row``'s run was rolled back (R-API-2): read with the row
    by the timeline and the exports (``run_rolled_back``), else one query."""
    flag = getattr(row, "run_rolled_back", None)
    if flag is None:
        flag = row.run_id is not None and RunRollback.objects.filter(run_id=row.run_id).exists()
    return bool(flag)


# Metadata keys that the timeline shows in their own fields, or never.
_TIMELINE_HIDDEN_METADATA = {"raw_output"}


def timeline_item(row: Message, *, include_raw_output: bool) -> dict[str, Any]:
    """A display dict of one timeline row, for the API and the admin.

    The keys are those of ``TimelineItemOut``, in its order, and the values
    what that schema dumps: the API encodes this dict as it is
    (:func:`yuxi_project.responses.json_response`).

    ``kind`` is ``model`` or ``tool``; times are datetimes; ``duration_ms``
    in ms; ``usage`` in tokens as the provider reported it, with
    ``usage_cause`` naming why it is null when known (R-MA-12); ``cost_usd`` a
    decimal string of USD or ``None`` (R-COST-1). ``raw_output``
    (the tool's raw output envelope) is present only when
    ``include_raw_output`` is true: pass it for staff only (R-READ-5).
    ``workspace_path`` is the workspace file of a large tool result (R-TA-7).
    ``namespace`` (list of strings, ``[]`` at the root) and
    ``parent_operation_id`` (the spawning ``task`` call's tool call id, or
    None) place a subagent's call under the call that started it (R-SUB-1).
    ``attempt`` is the run attempt that wrote the row (int, R-RUN-15),
    ``effect_key`` a tool row's effect key (None on model rows) and
    ``replayed_from`` the ``id`` of the tool row whose recorded result this
    one returned, or None (R-EFF-1). ``rolled_back`` tells that the row's
    run was rolled back by a later turn: the row stays, out of the history
    and the memory (R-API-2).
    """
    is_tool = row.role == Message.Role.TOOL
    item: dict[str, Any] = {
        "id": row.id,
        "kind": "tool" if is_tool else "model",
        "run_id": row.run_id,
        "operation_id": row.operation_id,
        "sequence": row.sequence,
        "status": row.execution_status,
        "started_at": row.started_at,
        "finished_at": row.finished_at,
        "duration_ms": row.duration_ms,
        "usage": row.usage,
        "usage_cause": row.usage_cause,
        "cost_usd": usd_text(row.cost_usd),
        "price_source": row.price_source,
        "price_version": row.price_version,
        "content": row.content,
        "tool_calls": row.tool_calls,
        "tool_name": row.tool_name or None,
        "tool_input": row.tool_input,
        "declared_by_id": row.declared_by_id,
        "namespace": list(row.namespace or []),
        "parent_operation_id": row.parent_operation_id,
        "attempt": row.attempt,
        "effect_key": row.effect_key,
        "replayed_from": row.replayed_from_id,
        "rolled_back": _run_rolled_back(row),
        "is_final_answer": row.is_final_answer,
        "metadata": {k: v for k, v in (row.metadata or {}).items() if k not in _TIMELINE_HIDDEN_METADATA},
    }
    if include_raw_output:
        item["raw_output"] = (row.metadata or {}).get("raw_output") if is_tool else None
    item["workspace_path"] = tool_row_workspace_path(row) if is_tool else None
    item["payload_note"] = payload_note(row.metadata)
    return item


# --------------------------------------------------------------------------
# Live state for the event stream's gap event (R-EVT-2)
# --------------------------------------------------------------------------


def run_live_state(run_id: uuid.UUID | str) -> dict[str, Any] | None:
    """The run as PostgreSQL has it now, for a client whose live events were
    trimmed (R-EVT-2), or ``None`` when the run does not exist.

    Returns ``{status, error_type, usage, output_message_id, interrupts,
    operations}``: ``usage`` is the run's total when it is terminal, else
    the sum of its finished model calls so far (tokens; ``unknown_calls``
    counts calls without usage); ``operations`` are the run's root model
    and tool calls in sequence order — the ones the live events describe —
    each ``{kind, operation_id, sequence, status, content, tool_calls,
    tool_name, usage}`` (``content`` is empty while a model call runs: its
    text travels only as live deltas). Raw tool output and lifecycle
    metadata are not included; the caller already checked the reader may
    see the run.
    """
    run = (
        AgentRun.objects.filter(pk=run_id)
        .only("status", "error_type", "usage", "output_message_id", "interrupts")
        .first()
    )
    if run is None:
        return None
    rows = (
        Message.objects.audit()
        .filter(run_id=run.pk)
        .order_by(F("sequence").asc(nulls_last=True), "id")
        .only(
            "role",
            "operation_id",
            "sequence",
            "execution_status",
            "content",
            "tool_calls",
            "tool_name",
            "usage",
            "metadata",
        )
    )
    operations = []
    usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "unknown_calls": 0}
    for row in rows:
        if (row.metadata or {}).get("namespace"):
            continue  # a subgraph's call: the live events show root calls only
        is_tool = row.role == Message.Role.TOOL
        operations.append(
            {
                "kind": "tool" if is_tool else "model",
                "operation_id": row.operation_id,
                "sequence": row.sequence,
                "status": row.execution_status,
                "content": row.content,
                "tool_calls": row.tool_calls,
                "tool_name": row.tool_name or None,
                "usage": row.usage,
            }
        )
        if not is_tool and row.execution_status != Message.ExecutionStatus.RUNNING:
            if row.usage:
                for key in ("input_tokens", "output_tokens", "total_tokens"):
                    usage[key] += int(row.usage.get(key) or 0)
            else:
                usage["unknown_calls"] += 1
    return {
        "status": run.status,
        "error_type": run.error_type,
        "usage": run.usage if run.is_terminal and run.usage else usage,
        "output_message_id": run.output_message_id,
        "interrupts": run.interrupts if run.status == AgentRun.Status.INTERRUPTED else None,
        "operations": operations,
    }


def tool_row_workspace_path(row: Message) -> str | None:
    """The workspace-relative file of a tool row's large result (the path
    its run's State holds), else None; for the timeline and the admin
    (R-TA-4, R-TA-7)."""
    if len(row.content or "") <= get_config().LARGE_TOOL_RESULT_CHARS:
        return None
    return tool_row_large_result_path(
        thread_id=row.thread_id, run_id=row.run_id, tool_call_id=row.operation_id
    ).as_posix()


# --------------------------------------------------------------------------
# Approval of an interrupted run (R-TA-5)
# --------------------------------------------------------------------------


def _asks_approval(run: AgentRun) -> bool:
    return run.status == AgentRun.Status.INTERRUPTED and bool(run.interrupts)


# The resume run's fields an approval shows, and ``resumed_from`` to key a page's.
_RESUME_FIELDS = ("id", "status", "input", "resumed_from")


def resumes_of(runs: Iterable[AgentRun]) -> dict[uuid.UUID, AgentRun]:
    """The resume runs that answered the approvals of ``runs``, for
    :func:`approval_of` over a page of runs (``GET
    /api/threads/{thread_id}/runs``): ``{interrupted run id: resume run}``,
    the resume run read with ``id``, ``status``, ``input`` and
    ``resumed_from`` only; a run whose approval is still pending, or that
    asked for none, has no entry. One query however many of ``runs`` are
    interrupted, none when no run asked for an approval. Implements R-TA-5,
    R-API-1.
    """
    asking = [run.id for run in runs if _asks_approval(run)]
    if not asking:
        return {}
    # resumed_from is one-to-one: at most one resume run per interrupted run.
    answers = AgentRun.objects.filter(resumed_from_id__in=asking).only(*_RESUME_FIELDS)
    return {resume.resumed_from_id: resume for resume in answers}


def rolled_back_by(run: AgentRun) -> uuid.UUID | None:
    """The run whose turn rolled ``run``'s turn back (R-API-2), or None; no
    query when ``run`` was read with ``select_related("rollback")``."""
    try:
        return run.rollback.by_run_id
    except RunRollback.DoesNotExist:
        return None


def approval_of(run: AgentRun, *, resumes: dict[uuid.UUID, AgentRun] | None = None) -> dict[str, Any] | None:
    """The human approval an interrupted run asked for, and its answer.

    ``None`` when the run asked for none. Else ``{"status", "action_requests",
    "resume_run_id", "resume_run_status", "decisions"}``: ``status`` is
    ``pending`` until a resume run answers it, then ``answered``;
    ``action_requests`` are ``[{kind, name, args, description,
    allowed_decisions}]`` in order (``kind``: ``approval``, or
    ``outcome_unknown`` for a tool call cut off by a worker that stopped,
    answered by ``retry`` or ``skip``: R-RUN-15); ``decisions`` are the resume run's decisions as submitted
    (``[{type, args?, message?}]``, one per action request).

    ``resumes`` is :func:`resumes_of` of runs that include ``run``, when the
    caller read a page's answers already: no query then. Without it, one
    query for the resume run. Implements R-TA-5.
    """
    if not _asks_approval(run):
        return None
    allowed: list[list[str]] = []
    for item in run.interrupts:
        value = item.get("value") if isinstance(item, dict) else None
        for config in (value or {}).get("review_configs") or []:
            allowed.append(list(config.get("allowed_decisions") or []) if isinstance(config, dict) else [])
    requests = [
        {
            "kind": "outcome_unknown" if action.get("outcome_unknown") else "approval",
            "name": action.get("name"),
            "args": action.get("args"),
            "description": action.get("description"),
            "allowed_decisions": allowed[i] if i < len(allowed) else ["approve", "edit", "reject"],
        }
        for i, action in enumerate(pending_action_requests(run.interrupts))
    ]
    if resumes is not None:
        resume = resumes.get(run.id)
    else:
        resume = AgentRun.objects.filter(resumed_from=run).only(*_RESUME_FIELDS).first()
    return {
        "status": "pending" if resume is None else "answered",
        "action_requests": requests,
        "resume_run_id": resume.id if resume else None,
        "resume_run_status": resume.status if resume else None,
        "decisions": (resume.input or {}).get("decisions") if resume else None,
    }


def usage_so_far(run_id: uuid.UUID) -> dict[str, int]:
    """Tokens of a run's model calls that reported usage so far
    (``{input_tokens, output_tokens, total_tokens}``), for a run that is
    not terminal yet: its ``usage`` is aggregated at the end. One query."""
    return (
        Message.objects.model_calls()
        .filter(run_id=run_id, usage__isnull=False)
        .aggregate(
            **{
                key: Coalesce(Sum(Cast(KeyTextTransform(key, "usage"), IntegerField())), 0)
                for key in ("input_tokens", "output_tokens", "total_tokens")
            }
        )
    )
