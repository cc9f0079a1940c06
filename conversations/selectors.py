"""Reads of conversations shared by the API, the admin and the dashboard."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from django.db import connection
from django.db.models import F, Q

from core.config import get_config
from core.cursors import page_cursor, parse_cursor
from core.db import execute_prepared_all, serial_plans, stand_ins_bound
from core.errors import InvalidInput, NotFound
from core.storable import (
    StoredHead,
    StoredLength,
    _StorableText,
    decode_head,
    decode_text,
    stored_head_sql,
    stored_length_sql,
)
from core.workspace import PREVIEW_CHARS, offloaded_summary, tool_row_large_result_path

from .models import Conversation, Message, MessageFeedback, history_carrier_q, history_ordinary_q
from .sql import MESSAGE_TABLE, message_columns, message_rows, predicate_sql


def threads_of(user, *, archived: bool | None = None, q: str = ""):
    """A user's threads, newest first (R-READ-5): with ``archived`` true
    only the archived ones, false only the others, ``None`` all; with ``q``
    only those whose title contains it, ignoring case (R-API-1; a blank
    ``q`` filters nothing). Index ``conv_user_created_idx`` serves the
    user's threads; the filters apply to them."""
    threads = Conversation.objects.visible_to(user)
    if archived is not None:
        threads = threads.archived(archived)
    if q.strip():
        threads = threads.filter(title__icontains=q.strip())
    return threads.order_by("-created_at", "-id")


def thread_of(user, thread_id: uuid.UUID) -> Conversation:
    """The user's thread; another user's thread, or one they deleted, is
    :class:`NotFound` (R-READ-5, R-API-1)."""
    thread = Conversation.objects.visible_to(user).filter(pk=thread_id).first()
    if thread is None:
        raise NotFound("thread not found")
    return thread


# --------------------------------------------------------------------------
# History and memory (R-READ-1, R-READ-2)
# --------------------------------------------------------------------------

HISTORY_PAGE_MAX = 200
# Operation metadata a user may see; lifecycle metadata (namespace, model
# run id, reconcile proofs, closing marks, raw tool output) never leaves.
PUBLIC_METADATA_FIELDS = frozenset({"model_name", "model_provider", "finish_reason"})
_NO_SEQUENCE = 2**31 - 1
# Runs in creation order; in a run the user's message first, then the
# run's rows by sequence (rows without one last), then id.
_HISTORY_KEY = [
    ("run_created", "datetime"),
    ("run_id", "uuid"),
    ("position", "int"),
    ("sequence_key", "int"),
    ("id", "int"),
]


@dataclass(frozen=True)
class HistoryEntry:
    """One history item. ``kind`` is ``user``, ``answer`` (a final answer)
    or ``tool_carrier`` (an intermediate model call shown for its tool
    calls); ``tool_executions`` are the tool rows of its declared calls."""

    message: Message
    kind: str
    tool_executions: list[Message] = field(default_factory=list)
    # The thread owner's feedback on an answer: {"rating", "reason"}.
    feedback: dict[str, str] | None = None

    def public_metadata(self) -> dict[str, Any]:
        return {k: v for k, v in (self.message.metadata or {}).items() if k in PUBLIC_METADATA_FIELDS}


@dataclass(frozen=True)
class HistoryPage:
    """The newest items (chronological order) and the cursor to older ones."""

    items: list[HistoryEntry]
    has_more: bool
    next_before: str | None


# A run whose turn a later turn rolled back (R-API-2) is out of the history
# and the memory; its rows stay for the audit (audit.models.RunRollback).
_NOT_ROLLED_BACK = "NOT EXISTS (SELECT 1 FROM audit_runrollback b WHERE b.run_id = audit_agentrun.id)"


def history_sql(
    thread_id: uuid.UUID,
    *,
    limit: int | None,
    cursor: list | None = None,
    runs_before: Any = None,
    exclude: frozenset[str] = frozenset(),
) -> tuple[str, list]:
    """The statement of a thread's history rows (R-READ-1): the thread's
    runs (``audit_agentrun``, index ``run_thread_created_idx``), and for
    each run its rows that :meth:`MessageQuerySet.visible_in_history`
    admits, through the run's own index; annotated ``run_created``,
    ``turn``, ``position`` (0 for the user's message, else 1).

    With ``limit``: the newest ``limit`` rows, newest first, before the
    ``cursor`` (``[run_created, run_id, position, sequence_key, id]``) if
    given; PostgreSQL stops reading runs once the page is full, so a page
    costs the same for a turn of today and one of last month. Without:
    every row, oldest first (memory). ``runs_before`` (a datetime) keeps
    runs created before it only. ``exclude`` names message fields not to
    read (they are then deferred). Kept public for the read-path
    benchmark, which EXPLAINs it."""
    from audit.models import AgentRun

    ordinary_sql, ordinary_params = predicate_sql(history_ordinary_q())
    carrier_sql, carrier_params = predicate_sql(history_carrier_q())
    t = MESSAGE_TABLE
    position = f"CASE WHEN {t}.role = %s THEN 0 ELSE 1 END"
    terminal = ", ".join(["%s"] * len(AgentRun.TERMINAL_STATUSES))
    visible = f"({ordinary_sql} OR ({carrier_sql} AND r.status IN ({terminal})))"
    visible_params = [*ordinary_params, *carrier_params, *AgentRun.TERMINAL_STATUSES]
    newest_first = limit is not None
    direction = "DESC" if newest_first else "ASC"
    nulls = "NULLS FIRST" if newest_first else "NULLS LAST"
    row_order = f"position {direction}, {t}.sequence {direction} {nulls}, {t}.id {direction}"
    page_order = (
        f"r.created_at {direction}, r.id {direction}, x.position {direction}, "
        f"x.sequence {direction} {nulls}, x.id {direction}"
    )

    def rows_of_runs(run_filter: str, run_params: list, bound: str = "", bound_params: tuple = ()) -> tuple[str, list]:
        inner_limit = "LIMIT %s" if newest_first else ""
        sql = f"""SELECT x.*, r.created_at AS run_created, r.turn_id AS turn
            FROM (SELECT id, created_at, turn_id, status FROM audit_agentrun
                  WHERE thread_id = %s AND {_NOT_ROLLED_BACK} {run_filter}) r
            CROSS JOIN LATERAL (
                SELECT {message_columns(exclude=exclude)}, {position} AS position FROM {t}
                WHERE {t}.run_id = r.id AND {visible} {bound}
                ORDER BY {row_order} {inner_limit}) x"""
        params = [thread_id, *run_params, Message.Role.USER, *visible_params, *bound_params]
        return sql, params + ([limit] if newest_first else [])

    before_run_filter, before_run_params = ("AND created_at < %s", [runs_before]) if runs_before else ("", [])
    if cursor is None:
        sql, params = rows_of_runs(before_run_filter, before_run_params)
        sql = f"{sql} ORDER BY {page_order}" + (" LIMIT %s" if newest_first else "")
        return sql, params + ([limit] if newest_first else [])
    run_created, run_id, position_key, sequence_key, row_id = cursor
    bound = f"AND ({position}, COALESCE({t}.sequence, %s), {t}.id) < (%s, %s, %s)"
    bound_params = (Message.Role.USER, _NO_SEQUENCE, position_key, sequence_key, row_id)
    same_run_sql, same_run_params = rows_of_runs(
        "AND id = %s AND created_at = %s", [run_id, run_created], bound, bound_params
    )
    older_sql, older_params = rows_of_runs("AND (created_at, id) < (%s, %s)", [run_created, run_id])
    sql = f"""SELECT * FROM (({same_run_sql}) UNION ALL ({older_sql} ORDER BY {page_order} LIMIT %s)) page
        ORDER BY run_created DESC, run_id DESC, position DESC, sequence DESC NULLS FIRST, id DESC LIMIT %s"""
    return sql, [*same_run_params, *older_params, limit, limit]


def thread_history(*, thread: Conversation, limit: int = 50, before: str | None = None) -> HistoryPage:
    """The chat history of ``thread`` for the chat UI, newest ``limit``
    (1–200) items in chronological order; ``before`` (an opaque cursor from
    ``next_before``) pages back.

    Applies :meth:`MessageQuerySet.visible_in_history`; each item that
    declared tool calls carries its tool executions (finished ones of the
    same turn, in order), so tool displays survive a page refresh. Two
    queries whatever the page size and the thread's length: the page
    (the thread's runs newest first, each run's rows through its index,
    :func:`history_sql`) and the tool executions of its carriers.

    Raises:
        InvalidInput: ``limit`` out of range or a malformed cursor (422).

    Implements R-READ-1.
    """
    if not 1 <= limit <= HISTORY_PAGE_MAX:
        raise InvalidInput(f"limit must be between 1 and {HISTORY_PAGE_MAX}", extra={"reason": "bad_limit"})
    cursor = parse_cursor(before, _HISTORY_KEY) if before is not None else None
    sql, params = history_sql(thread.id, limit=limit + 1, cursor=cursor)
    newest_first = message_rows(sql, params, extra=("position", "run_created", "turn"))
    has_more = len(newest_first) > limit
    page = newest_first[:limit][::-1]
    for row in page:
        row.sequence_key = _NO_SEQUENCE if row.sequence is None else row.sequence
    next_before = page_cursor(page[0], _HISTORY_KEY) if has_more else None
    entries = _with_feedback(thread.user_id, _with_tool_executions(thread.id, page))
    return HistoryPage(items=entries, has_more=has_more, next_before=next_before)


def _with_feedback(user_id: int, entries: list[HistoryEntry]) -> list[HistoryEntry]:
    """The entries, each answer carrying the thread owner's feedback on it
    (``MessageFeedback``, one per user and message), so that a chat page
    shows a rating after a reload (R-READ-1, R-UI-1). One query, and none
    for a page without answers."""
    answer_ids = [entry.message.id for entry in entries if entry.kind == "answer"]
    if not answer_ids:
        return entries
    given = {
        message_id: {"rating": rating, "reason": reason}
        for message_id, rating, reason in MessageFeedback.objects.filter(
            user_id=user_id, message_id__in=answer_ids
        ).values_list("message_id", "rating", "reason")
    }
    if not given:
        return entries
    return [replace(e, feedback=given[e.message.id]) if e.message.id in given else e for e in entries]


def _with_tool_executions(thread_id: uuid.UUID, rows: list[Message]) -> list[HistoryEntry]:
    """Attach to each row that declared tool calls the finished tool rows
    of those call ids in the same turn (an approved call runs in the resume
    run of the turn). Tool rows of runs still running stay hidden."""
    from audit.models import AgentRun

    wanted = {(row.turn, call["id"]) for row in rows for call in row.tool_calls or [] if call.get("id")}
    by_call: dict[tuple, list[Message]] = {}
    if wanted:
        head_chars = _content_head_chars()
        tool_rows = (
            Message.objects.filter(
                thread_id=thread_id,
                message_type=Message.Type.TOOL_AUDIT,
                operation_id__in={call_id for _, call_id in wanted},
                run__turn_id__in={turn for turn, _ in wanted},
                run__status__in=AgentRun.TERMINAL_STATUSES,
                # The root's executions: a subagent's own tool calls show
                # only through the task call's result (R-SUB-1).
                namespace=[],
            )
            .exclude(execution_status=Message.ExecutionStatus.RUNNING)
            # Never the full result nor the raw output: a tool may return
            # megabytes, and readers see the projection (R-READ-7).
            .only(*_TOOL_ROW_FIELDS)
            .annotate(
                turn=F("run__turn_id"),
                run_created=F("run__created_at"),
                # The real size and head, as the field decodes the text
                # (R-RUN-13): read through SQL, they bypass its decoding.
                content_chars=StoredLength("content"),
                content_head=StoredHead("content", head_chars),
            )
            .order_by("run_created", "sequence", "id")
        )
        for tool_row in tool_rows:
            tool_row.content_head = decode_head(tool_row.content_head, head_chars)
            by_call.setdefault((tool_row.turn, tool_row.operation_id), []).append(tool_row)
    entries = []
    for row in rows:
        if row.role == Message.Role.USER:
            kind = "user"
        elif row.is_final_answer:
            kind = "answer"
        else:
            # Also the bound message of an interrupted run that asks for
            # approval: it declares tool calls and answers nothing yet.
            kind = "tool_carrier"
        executions = [
            tool_row
            for call in row.tool_calls or []
            if call.get("id")
            for tool_row in by_call.get((row.turn, call["id"]), [])
        ]
        entries.append(HistoryEntry(message=row, kind=kind, tool_executions=executions))
    return entries


# The ``kind`` column of memory_sql(include_tools=True): what a row is, in
# the order the reader asks (a tool row first, then a user message, then a
# model row that is an answer or a tool carrier).
_KIND_HUMAN, _KIND_AI, _KIND_TOOL = 0, 1, 2
# The memory readers decode the stored escapes of these text columns as
# their fields' from_db_value does (R-RUN-11), and only in text that holds
# one: called per row, the converter cost more than the row.
for _name in ("content", "operation_id", "tool_name"):
    assert type(Message._meta.get_field(_name)).from_db_value is _StorableText.from_db_value
del _name


def thread_memory(
    *,
    thread_id: uuid.UUID,
    include_tools: bool = False,
    before_run=None,
    call_dict: Callable[[Any], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The thread's history as LangChain-style message dicts, oldest first,
    under the same rules as :func:`thread_history` (R-READ-2). Each dict has
    the fields of ``MemoryMessageOut`` in its order — ``type``, ``id``,
    ``content``, ``tool_calls``, ``tool_call_id``, ``name``, ``status`` —
    those its type does not use None:

    - ``{"type": "human", "id", "content"}`` for user messages;
    - ``{"type": "ai", "id", "content", "tool_calls"}``, the calls as the
      model declared them (``[{id, name, args}]``), each passed through
      ``call_dict`` if given (the API's dump of a call: the dicts are then
      what ``MemoryOut`` dumps);
    - with ``include_tools`` only: tool carriers, and after each AI message
      one ``{"type": "tool", "id", "tool_call_id", "name", "content",
      "status": "success"|"error"}`` per finished execution. A declared call
      without an execution is left out of ``tool_calls``, so the sequence is
      one a model accepts.

    Without ``include_tools`` answers keep their text and no tool calls
    (``[]``), and neither carriers nor tool rows are read. With
    ``before_run`` (an AgentRun) only runs created before it count: the
    agent runtime's view when it starts that run.

    One statement (:func:`memory_sql`, run by :func:`memory_rows`); its
    rows become these dicts in one pass, with no object per row (issue 11:
    a 1,000-turn thread has 3,400 messages).
    """
    runs_before = before_run.created_at if before_run is not None else None
    fetched = memory_rows(*memory_sql(thread_id, runs_before=runs_before, include_tools=include_tools))
    if include_tools:
        return _memory_with_tools(thread_id, fetched, call_dict)
    return _memory_answers(fetched)


def _memory_answers(fetched: list[tuple]) -> list[dict[str, Any]]:
    """The messages of ``memory_sql(include_tools=False)`` rows: user
    messages and the final answers that have text. Stored escapes are
    decoded as the model fields decode them (R-RUN-11), and only in text
    that holds one."""
    messages: list[dict[str, Any]] = []
    append = messages.append
    for row_id, is_user, content, operation_id in fetched:
        if "\\u" in content:
            content = decode_text(content)
        if is_user:
            message_id, tool_calls, message_type = f"msg-{row_id}", None, "human"
        elif content:
            if operation_id is not None and "\\u" in operation_id:
                operation_id = decode_text(operation_id)
            message_id, tool_calls, message_type = operation_id or f"msg-{row_id}", [], "ai"
        else:
            continue
        append(
            {
                "type": message_type,
                "id": message_id,
                "content": content,
                "tool_calls": tool_calls,
                "tool_call_id": None,
                "name": None,
                "status": None,
            }
        )
    return messages


def _memory_with_tools(thread_id: uuid.UUID, fetched: list[tuple], call_dict) -> list[dict[str, Any]]:
    """The messages of ``memory_sql(include_tools=True)`` rows. A declared
    call's execution is the last finished tool row of that call id in the
    same turn (an approved call runs in the turn's resume run)."""

    executions: dict[tuple[str, str | None], tuple] = {}
    head_chars = _content_head_chars()
    declared = []  # the calls of each model row, as stored: read in one go below
    for row in fetched:
        kind = row[1]
        if kind == _KIND_TOOL:
            tool_id, _, head, _, operation_id, turn, size, status, tool_name, run_id = row
            head = decode_head(head, head_chars)
            if operation_id is not None and "\\u" in operation_id:
                operation_id = decode_text(operation_id)
            if "\\u" in tool_name:
                tool_name = decode_text(tool_name)
            executions[turn, operation_id] = (tool_id, head, size or 0, operation_id, status, tool_name, run_id)
        elif kind == _KIND_AI and row[3] is not None:
            declared.append(row[3])
    declared_calls = iter(Message._meta.get_field("tool_calls").from_db_values(declared, connection))
    threshold = get_config().LARGE_TOOL_RESULT_CHARS
    completed = Message.ExecutionStatus.COMPLETED
    messages: list[dict[str, Any]] = []
    append = messages.append
    for row_id, kind, content, calls, operation_id, turn, _, _, _, _ in fetched:
        if kind == _KIND_TOOL:
            continue
        if "\\u" in content:
            content = decode_text(content)
        if kind == _KIND_HUMAN:
            append(
                {
                    "type": "human",
                    "id": f"msg-{row_id}",
                    "content": content,
                    "tool_calls": None,
                    "tool_call_id": None,
                    "name": None,
                    "status": None,
                }
            )
            continue
        executed = []
        if calls is not None:
            executed = [
                call
                for call in next(declared_calls) or ()
                if (call_id := call.get("id")) and (turn, call_id) in executions
            ]
        if not content and not executed:
            continue
        if operation_id is not None and "\\u" in operation_id:
            operation_id = decode_text(operation_id)
        append(
            {
                "type": "ai",
                "id": operation_id or f"msg-{row_id}",
                "content": content,
                "tool_calls": executed if call_dict is None or not executed else [call_dict(c) for c in executed],
                "tool_call_id": None,
                "name": None,
                "status": None,
            }
        )
        for call in executed:
            tool_id, head, size, tool_call_id, status, tool_name, run_id = executions[turn, call["id"]]
            if size <= threshold:  # tool_result_view's common case, without its object
                result = head
            else:
                result = _tool_result(
                    thread_id=thread_id, run_id=run_id, tool_call_id=tool_call_id, head=head, size=size
                ).content
            append(
                {
                    "type": "tool",
                    "id": f"msg-{tool_id}",
                    "content": result,
                    "tool_calls": None,
                    "tool_call_id": tool_call_id,
                    "name": tool_name,
                    "status": "success" if status == completed else "error",
                }
            )
    return messages


def memory_sql(thread_id: uuid.UUID, *, runs_before: Any = None, include_tools: bool = True) -> tuple[str, list]:
    """The statement behind :func:`thread_memory`: the rows history shows
    for every run of the thread (created before ``runs_before`` if given),
    in history order. One statement: the thread's runs, then each run's rows
    by its own index.

    Without ``include_tools``: the ordinary rows only, as ``(id, is_user,
    content, operation_id)``. With: also the tool carriers and the finished
    tool rows of terminal runs, as ``(id, kind, content, tool_calls,
    operation_id, turn, content_chars, execution_status, tool_name,
    run_id)``: ``kind`` is ``_KIND_HUMAN``, ``_KIND_AI`` or ``_KIND_TOOL``;
    ``turn`` (as text) only on rows that declare calls and on tool rows,
    which it pairs; the last four on tool rows only: the content is cut to
    the projection's length, in the stored form (:func:`core.storable.decode_head`
    gives the real head), ``content_chars`` is its full length in real
    characters (R-RUN-13) and ``run_id`` is text. Kept public for the
    read-path benchmark and the plan test, which EXPLAIN it."""
    sql, params = _memory_statement(include_tools, runs_before is not None)
    values = {_THREAD: thread_id, _RUNS_BEFORE: runs_before, _HEAD_CHARS: _content_head_chars()}
    return sql, stand_ins_bound(params, values)


# Placeholders in _memory_statement's params for the values of each call.
_THREAD, _RUNS_BEFORE, _HEAD_CHARS = object(), object(), object()


@functools.cache
def _memory_statement(include_tools: bool, runs_before: bool) -> tuple[str, tuple]:
    """:func:`memory_sql`'s text and params, the values of a call as
    placeholders: the same for every call, and compiling the row predicates
    took longer than planning the statement."""
    from audit.models import AgentRun

    t = MESSAGE_TABLE
    tool_type, user = Message.Type.TOOL_AUDIT, Message.Role.USER
    ordinary_sql, ordinary_params = predicate_sql(history_ordinary_q())
    run_filter, run_params = ("AND created_at < %s", [_RUNS_BEFORE]) if runs_before else ("", [])
    if include_tools:
        carrier_sql, carrier_params = predicate_sql(history_carrier_q())
        tool_sql, tool_params = predicate_sql(
            Q(message_type=tool_type) & ~Q(execution_status=Message.ExecutionStatus.RUNNING)
        )
        terminal = ", ".join(["%s"] * len(AgentRun.TERMINAL_STATUSES))
        assert (_KIND_HUMAN, _KIND_AI, _KIND_TOOL) == (0, 1, 2)
        outer = f"""x.id, x.kind, x.content, x.tool_calls, x.operation_id,
               CASE WHEN x.kind = {_KIND_TOOL} OR x.tool_calls IS NOT NULL THEN r.turn_id::text END,
               x.content_chars, x.execution_status, x.tool_name, x.run_id"""
        tool = f"{t}.message_type = %s"
        # The real size and a head that decodes to the wanted characters,
        # as history reads them (R-RUN-13).
        head_sql, head_params = stored_head_sql(f"{t}.content", _HEAD_CHARS)
        columns = f"""{t}.id, {t}.tool_calls, {t}.operation_id,
                   CASE WHEN {tool} THEN 2 WHEN {t}.role = %s THEN 0 ELSE 1 END AS kind,
                   CASE WHEN {tool} THEN {head_sql} ELSE {t}.content END AS content,
                   CASE WHEN {tool} THEN {stored_length_sql(f"{t}.content")} END AS content_chars,
                   CASE WHEN {tool} THEN {t}.execution_status END AS execution_status,
                   CASE WHEN {tool} THEN {t}.tool_name END AS tool_name,
                   CASE WHEN {tool} THEN {t}.run_id::text END AS run_id"""
        column_params = [tool_type, user, tool_type, *head_params, tool_type, tool_type, tool_type, tool_type]
        visible = f"({ordinary_sql} OR (({carrier_sql}) OR ({tool_sql})) AND r.status IN ({terminal}))"
        visible_params = [*ordinary_params, *carrier_params, *tool_params, *AgentRun.TERMINAL_STATUSES]
    else:
        outer = "x.id, x.is_user, x.content, x.operation_id"
        columns = f"{t}.id, {t}.role = %s AS is_user, {t}.content, {t}.operation_id"
        column_params = [user]
        visible, visible_params = ordinary_sql, ordinary_params
    # OFFSET 0 keeps the run's rows a subquery of their own (PostgreSQL
    # does not pull a subquery with an OFFSET up into the join), so the
    # plan is always the walk: the thread's runs, and for each an index
    # scan of its rows; pulled up, the join order and method were the
    # planner's choice from sampled estimates. The runs come in order (a
    # subquery's ORDER BY is kept too), so the rows are sorted run by run
    # (an incremental sort), never all 3,400 of a long thread at once.
    sql = f"""SELECT {outer}
        FROM (SELECT id, created_at, turn_id, status FROM audit_agentrun WHERE thread_id = %s AND {_NOT_ROLLED_BACK} {run_filter}
              ORDER BY created_at, id) r
        CROSS JOIN LATERAL (
            SELECT {columns}, {t}.sequence, CASE WHEN {t}.role = %s THEN 0 ELSE 1 END AS position
            FROM {t}
            WHERE {t}.run_id = r.id AND {visible}
            OFFSET 0) x
        ORDER BY r.created_at, r.id, x.position, x.sequence NULLS LAST, x.id"""
    return sql, (_THREAD, *run_params, *column_params, user, *visible_params)


def memory_rows(sql: str, params: list) -> list[tuple]:
    """The rows of a :func:`memory_sql` statement (or of its ``EXPLAIN``) as
    :func:`thread_memory` reads them: prepared once per connection
    (planning the statement with tools took about 2 ms, a fifth of its
    execution), and planned without parallel workers
    (:func:`core.db.serial_plans`), so every thread is read by the
    walk over its runs whatever statistics the last ``ANALYZE`` sampled
    (issue 11). Kept public for the plan test and the read-path benchmark."""
    with serial_plans():
        return execute_prepared_all(sql, params)


_TOOL_ROW_FIELDS = ("id", "thread_id", "run_id", "operation_id", "tool_name", "execution_status", "sequence")


def _content_head_chars() -> int:
    # Enough to hold a whole result up to the threshold, and the preview.
    return max(get_config().LARGE_TOOL_RESULT_CHARS, PREVIEW_CHARS)


@dataclass(frozen=True)
class ToolResultView:
    """A tool execution's result as users and the agent see it again.

    ``content`` is the full text up to ``LARGE_TOOL_RESULT_CHARS``
    characters; above it, the same path-and-preview the graph State held
    (the full text stays in the workspace file and on the audit row, for
    the staff timeline). ``size_chars`` is the full result's length in
    characters; ``workspace_path`` the workspace-relative file of a large
    result, else None."""

    content: str
    size_chars: int
    workspace_path: str | None


def tool_result_view(tool_row: Message) -> ToolResultView:
    """The projection of one tool row loaded by :func:`_with_tool_executions`
    (anything with ``content_chars``, the real length, ``content_head``, the
    decoded head, ``thread_id``, ``run_id`` and ``operation_id``), shared by
    history and memory so both show exactly the same (R-TA-4, R-READ-2,
    R-READ-7, R-RUN-13)."""
    return _tool_result(
        thread_id=tool_row.thread_id,
        run_id=tool_row.run_id,
        tool_call_id=tool_row.operation_id,
        head=tool_row.content_head,
        size=tool_row.content_chars or 0,
    )


def _tool_result(*, thread_id, run_id, tool_call_id: str, head: str | None, size: int) -> ToolResultView:
    """:func:`tool_result_view` of a tool row's values: ``head`` is its
    content cut to :func:`_content_head_chars` real characters (decoded),
    ``size`` its full length in real characters (R-RUN-13); ``run_id`` a
    UUID or its text."""
    if size <= get_config().LARGE_TOOL_RESULT_CHARS:
        return ToolResultView(content=head or "", size_chars=size, workspace_path=None)
    path = tool_row_large_result_path(thread_id=thread_id, run_id=run_id, tool_call_id=tool_call_id)
    return ToolResultView(
        content=offloaded_summary(path, head or "", size), size_chars=size, workspace_path=path.as_posix()
    )


def thread_memory_messages(*, thread_id: uuid.UUID, include_tools: bool = False, before_run=None) -> list:
    """:func:`thread_memory` as LangChain message objects, for the agent
    runtime when the checkpointer no longer has the history (R-READ-2)."""
    return [
        memory_message(item)
        for item in thread_memory(thread_id=thread_id, include_tools=include_tools, before_run=before_run)
    ]


def memory_message(item: dict[str, Any]) -> Any:
    """One :func:`thread_memory` dict as the LangChain message the agent
    runtime holds (``HumanMessage``, ``AIMessage`` with its tool calls,
    ``ToolMessage``), id kept: the id tells the recorder that the message
    came before the run (R-MA-9). Raises ``ValueError`` for an unknown
    ``type``."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    kind = item.get("type")
    if kind == "human":
        return HumanMessage(content=item["content"], id=item["id"])
    if kind == "ai":
        return AIMessage(
            content=item["content"],
            id=item["id"],
            tool_calls=[
                {"id": c["id"], "name": c["name"], "args": c.get("args") or {}, "type": "tool_call"}
                for c in item.get("tool_calls") or []
            ],
        )
    if kind == "tool":
        return ToolMessage(
            content=item["content"],
            id=item["id"],
            tool_call_id=item["tool_call_id"],
            name=item["name"],
            status=item["status"],
        )
    raise ValueError(f"unknown memory message type {kind!r}")


def message_feedback_of(user, message_id: int) -> Message:
    """The user's message for feedback; another user's message, or none, is
    :class:`NotFound` (R-READ-5)."""
    message = Message.objects.filter(pk=message_id, thread__in=Conversation.objects.visible_to(user)).first()
    if message is None:
        raise NotFound("message not found")
    return message
