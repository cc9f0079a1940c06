"""Reads of conversations shared by the API, the admin and the dashboard."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from django.db import connection
from django.db.models import F, Q
from django.db.models.functions import Length, Substr

from yuxi_project.cursors import page_cursor, parse_cursor
from yuxi_project.errors import InvalidInput, NotFound
from yuxi_project.storable import _StorableText, decode_text

from .models import Conversation, Message, history_carrier_q, history_ordinary_q
from .sql import MESSAGE_TABLE, message_columns, message_rows, predicate_sql


def threads_of(user):
    """A user's threads, newest first (R-READ-5)."""
    return Conversation.objects.filter(user=user).order_by("-created_at", "-id")


def thread_of(user, thread_id: uuid.UUID) -> Conversation:
    """The user's thread; another user's thread is :class:`NotFound` (R-READ-5)."""
    thread = Conversation.objects.filter(pk=thread_id, user=user).first()
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

    def public_metadata(self) -> dict[str, Any]:
        return {k: v for k, v in (self.message.metadata or {}).items() if k in PUBLIC_METADATA_FIELDS}


@dataclass(frozen=True)
class HistoryPage:
    """The newest items (chronological order) and the cursor to older ones."""

    items: list[HistoryEntry]
    has_more: bool
    next_before: str | None


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
                  WHERE thread_id = %s {run_filter}) r
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
    return HistoryPage(items=_with_tool_executions(thread.id, page), has_more=has_more, next_before=next_before)


def _with_tool_executions(thread_id: uuid.UUID, rows: list[Message]) -> list[HistoryEntry]:
    """Attach to each row that declared tool calls the finished tool rows
    of those call ids in the same turn (an approved call runs in the resume
    run of the turn). Tool rows of runs still running stay hidden."""
    from audit.models import AgentRun

    wanted = {(row.turn, call["id"]) for row in rows for call in row.tool_calls or [] if call.get("id")}
    by_call: dict[tuple, list[Message]] = {}
    if wanted:
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
                content_chars=Length("content"),
                content_head=Substr("content", 1, _content_head_chars()),
            )
            .order_by("run_created", "sequence", "id")
        )
        for tool_row in tool_rows:
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


def thread_memory(*, thread_id: uuid.UUID, include_tools: bool = False, before_run=None) -> list[dict[str, Any]]:
    """The thread's history as LangChain-style message dicts, oldest first,
    under the same rules as :func:`thread_history` (R-READ-2):

    - ``{"type": "human", "id", "content"}`` for user messages;
    - ``{"type": "ai", "id", "content", "tool_calls": [{id, name, args}]}``;
    - with ``include_tools`` only: tool carriers, and after each AI message
      one ``{"type": "tool", "id", "tool_call_id", "name", "content",
      "status": "success"|"error"}`` per finished execution. A declared call
      without an execution is left out of ``tool_calls``, so the sequence is
      one a model accepts.

    Without ``include_tools`` answers keep their text and no tool calls.
    With ``before_run`` (an AgentRun) only runs created before it count:
    the agent runtime's view when it starts that run.
    """
    rows = _memory_rows(thread_id, runs_before=before_run.created_at if before_run is not None else None)
    by_call: dict[tuple, list[SimpleNamespace]] = {}
    for row in rows:
        if row.is_tool:
            by_call.setdefault((row.turn, row.operation_id), []).append(row)
    messages: list[dict[str, Any]] = []
    for row in rows:
        if row.is_tool:
            continue
        if row.role == Message.Role.USER:
            messages.append({"type": "human", "id": f"msg-{row.id}", "content": row.content})
            continue
        if row.message_type != Message.Type.TEXT and not include_tools:
            continue  # a tool carrier
        executed = {
            tool_row.operation_id: tool_row
            for call in row.tool_calls or []
            if call.get("id")
            for tool_row in by_call.get((row.turn, call["id"]), [])
        }
        tool_calls = [call for call in row.tool_calls or [] if include_tools and call.get("id") in executed]
        if not row.content and not tool_calls:
            continue
        messages.append(
            {"type": "ai", "id": row.operation_id or f"msg-{row.id}", "content": row.content, "tool_calls": tool_calls}
        )
        for call in tool_calls:
            tool_row = executed[call["id"]]
            messages.append(
                {
                    "type": "tool",
                    "id": f"msg-{tool_row.id}",
                    "tool_call_id": tool_row.operation_id,
                    "name": tool_row.tool_name,
                    "content": tool_result_view(tool_row).content,
                    "status": "success" if tool_row.execution_status == Message.ExecutionStatus.COMPLETED else "error",
                }
            )
    return messages


def memory_sql(thread_id: uuid.UUID, *, runs_before: Any = None) -> tuple[str, list]:
    """The statement behind :func:`thread_memory`: the rows history shows,
    plus the finished tool rows of terminal runs (their content cut to the
    projection's length, with the full length), for every run of the thread
    (created before ``runs_before`` if given) in history order. One
    statement: the thread's runs, then each run's rows by its own index.
    Kept public for the read-path benchmark, which EXPLAINs it."""
    from audit.models import AgentRun

    t = MESSAGE_TABLE
    ordinary_sql, ordinary_params = predicate_sql(history_ordinary_q())
    carrier_sql, carrier_params = predicate_sql(history_carrier_q())
    tool_sql, tool_params = predicate_sql(
        Q(message_type=Message.Type.TOOL_AUDIT) & ~Q(execution_status=Message.ExecutionStatus.RUNNING)
    )
    terminal = ", ".join(["%s"] * len(AgentRun.TERMINAL_STATUSES))
    run_filter, run_params = ("AND created_at < %s", [runs_before]) if runs_before is not None else ("", [])
    sql = f"""SELECT x.id, x.role, x.message_type, x.content, x.content_chars, x.tool_calls, x.operation_id,
               x.execution_status, x.tool_name, x.run_id, r.turn_id, x.is_tool
        FROM (SELECT id, created_at, turn_id, status FROM audit_agentrun WHERE thread_id = %s {run_filter}) r
        CROSS JOIN LATERAL (
            SELECT {t}.id, {t}.role, {t}.message_type, {t}.tool_calls, {t}.operation_id, {t}.execution_status,
                   {t}.tool_name, {t}.run_id, {t}.sequence,
                   CASE WHEN {t}.message_type = %s THEN substr({t}.content, 1, %s) ELSE {t}.content END AS content,
                   CASE WHEN {t}.message_type = %s THEN length({t}.content) END AS content_chars,
                   CASE WHEN {t}.role = %s THEN 0 ELSE 1 END AS position,
                   {t}.message_type = %s AS is_tool
            FROM {t}
            WHERE {t}.run_id = r.id
              AND ({ordinary_sql} OR (({carrier_sql}) OR ({tool_sql})) AND r.status IN ({terminal}))) x
        ORDER BY r.created_at, r.id, x.position, x.sequence NULLS LAST, x.id"""
    tool_type = Message.Type.TOOL_AUDIT
    params = [
        thread_id,
        *run_params,
        tool_type,
        _content_head_chars(),
        tool_type,
        Message.Role.USER,
        tool_type,
        *ordinary_params,
        *carrier_params,
        *tool_params,
        *AgentRun.TERMINAL_STATUSES,
    ]
    return sql, params


def _memory_rows(thread_id: uuid.UUID, *, runs_before: Any) -> list[SimpleNamespace]:
    """The rows of :func:`memory_sql` as plain objects, the stored escapes
    decoded as the model fields decode them (R-RUN-11): no model instances,
    whose construction would cost more than the whole statement on a long
    thread."""
    sql, params = memory_sql(thread_id, runs_before=runs_before)
    # The text columns are StorableText/CharFields, whose from_db_value is
    # decode_text on a string: called directly, and only on text that holds
    # an escape (a thousand-turn thread has thousands of rows; issue 11).
    for name in ("content", "operation_id", "tool_name"):
        assert type(Message._meta.get_field(name)).from_db_value is _StorableText.from_db_value
    decode_calls = Message._meta.get_field("tool_calls").from_db_value
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        fetched = cursor.fetchall()
    rows = []
    new = SimpleNamespace
    for row_id, role, message_type, content, chars, tool_calls, op, status, tool_name, run_id, turn, is_tool in fetched:
        if content is not None and "\\u" in content:
            content = decode_text(content)
        if op is not None and "\\u" in op:
            op = decode_text(op)
        if tool_name is not None and "\\u" in tool_name:
            tool_name = decode_text(tool_name)
        if tool_calls is not None:
            tool_calls = decode_calls(tool_calls, None, connection)
        row = new(
            id=row_id,
            role=role,
            message_type=message_type,
            content=content,
            content_chars=chars,
            tool_calls=tool_calls,
            operation_id=op,
            execution_status=status,
            tool_name=tool_name,
            run_id=run_id,
            turn=turn,
            is_tool=is_tool,
        )
        if is_tool:
            row.thread_id, row.content_head = thread_id, content
        rows.append(row)
    return rows


_TOOL_ROW_FIELDS = ("id", "thread_id", "run_id", "operation_id", "tool_name", "execution_status", "sequence")


def _content_head_chars() -> int:
    from audit.agents.large_results import PREVIEW_CHARS
    from yuxi_project.config import get_config

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
    or :func:`_memory_rows` (anything with ``content_chars``,
    ``content_head``, ``thread_id``, ``run_id`` and ``operation_id``),
    shared by history and memory so both show exactly the same (R-TA-4,
    R-READ-2, R-READ-7)."""
    from audit.agents.large_results import offloaded_summary
    from audit.agents.workspace import tool_row_large_result_path
    from yuxi_project.config import get_config

    size = tool_row.content_chars or 0
    if size <= get_config().LARGE_TOOL_RESULT_CHARS:
        return ToolResultView(content=tool_row.content_head or "", size_chars=size, workspace_path=None)
    path = tool_row_large_result_path(
        thread_id=tool_row.thread_id, run_id=tool_row.run_id, tool_call_id=tool_row.operation_id
    )
    return ToolResultView(
        content=offloaded_summary(path, tool_row.content_head or "", size),
        size_chars=size,
        workspace_path=path.as_posix(),
    )


def thread_memory_messages(*, thread_id: uuid.UUID, include_tools: bool = False, before_run=None) -> list:
    """:func:`thread_memory` as LangChain message objects, for the agent
    runtime when the checkpointer no longer has the history (R-READ-2)."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    result = []
    for item in thread_memory(thread_id=thread_id, include_tools=include_tools, before_run=before_run):
        if item["type"] == "human":
            result.append(HumanMessage(content=item["content"], id=item["id"]))
        elif item["type"] == "ai":
            result.append(
                AIMessage(
                    content=item["content"],
                    id=item["id"],
                    tool_calls=[
                        {"id": c["id"], "name": c["name"], "args": c.get("args") or {}, "type": "tool_call"}
                        for c in item["tool_calls"]
                    ],
                )
            )
        else:
            result.append(
                ToolMessage(
                    content=item["content"],
                    id=item["id"],
                    tool_call_id=item["tool_call_id"],
                    name=item["name"],
                    status=item["status"],
                )
            )
    return result


def message_feedback_of(user, message_id: int) -> Message:
    """The user's message for feedback; another user's message, or none, is
    :class:`NotFound` (R-READ-5)."""
    message = Message.objects.filter(pk=message_id, thread__user=user).first()
    if message is None:
        raise NotFound("message not found")
    return message
