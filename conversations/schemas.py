from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

from ninja import Field, Schema
from pydantic import ConfigDict, StrictBool, StrictStr

from audit import catalogue
from governance.payloads import payload_note
from yuxi_project.api_types import Cursor, explained

from .services import not_blank_pattern


def _enum_of(names) -> Callable[[dict], None]:
    """Name the allowed values in the OpenAPI document, read when the document
    is built (the models come from settings). The server keeps its own check,
    whose 422 lists them too (``unknown_agent``, ``unknown_model``)."""

    def extra(schema: dict) -> None:
        for branch in schema.get("anyOf", [schema]):
            if branch.get("type") == "string":
                branch["enum"] = list(names())

    return extra


class ThreadIn(Schema):
    agent_id: str = Field(..., min_length=1, max_length=100, json_schema_extra=_enum_of(lambda: catalogue.AGENTS))
    model: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="A chat model (default: the first configured one).",
        json_schema_extra=_enum_of(catalogue.available_models),
    )
    title: str = Field(
        "",
        max_length=200,
        description="Blank: the thread takes the first eight words of its first turn as its title.",
    )


class ThreadPatchIn(Schema):
    """What ``PATCH /api/threads/{thread_id}`` may change (R-API-1): only the
    fields given; an unknown field, a null, or a value of another type is
    refused (422), so that a typo never reads as "change nothing"."""

    model_config = ConfigDict(extra="forbid")

    # Not nullable: absent means "leave as it is"; the default is never validated.
    title: StrictStr = Field(
        None,
        min_length=1,
        max_length=200,
        pattern=explained(not_blank_pattern(), "must not be blank (only white space)"),
        description="A new title: not blank (not only white space), at most 200 characters.",
    )
    archived: StrictBool = Field(None, description="true archives the thread, false restores it.")


class ThreadListQuery(Schema):
    # Bounded: an unbounded number overflows PostgreSQL's bigint and must
    # answer 422, not 500 (R-READ-6).
    limit: int = Field(100, ge=1, le=500)
    offset: int = Field(0, ge=0, le=1_000_000_000)
    # Absent means all; never null in a query string, so typed boolean only.
    archived: bool = Field(
        None,
        description="true: only archived threads; false: only the others (a chat sidebar's list); absent: all of them.",
    )
    q: str = Field(
        "", max_length=200, description="Only threads whose title contains this text, ignoring case; blank: all."
    )


class ThreadDeleteQuery(Schema):
    cancel: bool = Field(
        False,
        description="true: cancel the thread's pending or running runs and delete it; false: a thread with such "
        "a run answers 409 `run_active`.",
    )


class ThreadDeletedOut(Schema):
    """The answer to ``DELETE /api/threads/{thread_id}`` (R-API-1)."""

    thread_id: uuid.UUID
    erased: bool = Field(
        ...,
        description="true (200): the thread's content is erased; false (202): the thread is deleted and its "
        "content is erased once its cancelled runs have ended.",
    )
    cancelled_runs: list[uuid.UUID] = Field(..., description="The runs this deletion cancelled.")


class ThreadOut(Schema):
    thread_id: uuid.UUID = Field(..., alias="id")
    agent_id: str
    model: str
    title: str
    status: Literal["active", "archived"]
    archived: bool = Field(..., description="The owner archived the thread (`status` is `archived`).")
    created_at: datetime
    updated_at: datetime


class PagedThreadOut(Schema):
    items: list[ThreadOut]
    count: int = Field(..., description="Every matching thread, not only this page's.")


class ErrorDetail(Schema):
    code: str
    message: str


class ErrorOut(Schema):
    """Every error answer: ``{"error": {"code", "message", ...}}``."""

    error: ErrorDetail


_PAYLOAD_NOTE = '"payload purged on <date>" or "payload erased on <date>" (R-GOV-1, R-GOV-2), else null.'


class ToolCallOut(Schema):
    """A tool call the model declared."""

    id: str | None
    name: str | None
    # Usually an object; a model may declare arguments that are not valid
    # JSON, and the history still shows them as declared.
    args: Any = None


def tool_call_dict(call: Any) -> dict[str, Any]:
    """What :class:`ToolCallOut` dumps for one declared call, built directly
    for a well-formed call (a dict with ``id`` and ``name``, each a string
    or null); anything else goes through the schema, which refuses what it
    refused before."""
    if type(call) is dict and "id" in call and "name" in call:
        call_id, name = call["id"], call["name"]
        if (call_id is None or type(call_id) is str) and (name is None or type(name) is str):
            return {"id": call_id, "name": name, "args": call.get("args")}
    return ToolCallOut.model_validate(call).model_dump()


class ToolExecutionOut(Schema):
    """One tool execution as the chat shows it: the projected content, never
    the raw output envelope."""

    id: str = Field(..., description="The tool call id.")
    name: str
    status: Literal["completed", "failed", "interrupted", "abandoned", "rejected"]
    content: str = Field(
        ...,
        description="The result; above LARGE_TOOL_RESULT_CHARS its size, workspace path and a preview, "
        "exactly as memory shows it (R-READ-7).",
    )
    size_chars: int = Field(..., description="Length of the full result in characters.")
    workspace_path: str | None = Field(None, description="Workspace file of a large result, else null.")

    @staticmethod
    def from_row(row) -> ToolExecutionOut:
        from .selectors import tool_result_view

        view = tool_result_view(row)
        return ToolExecutionOut(
            id=row.operation_id,
            name=row.tool_name,
            status=row.execution_status,
            content=view.content,
            size_chars=view.size_chars,
            workspace_path=view.workspace_path,
        )

    @staticmethod
    def dict_from_row(row) -> dict[str, Any]:
        """What :meth:`from_row` dumps, built without validating (issue 11)."""
        from .selectors import tool_result_view

        view = tool_result_view(row)
        return {
            "id": row.operation_id,
            "name": row.tool_name,
            "status": row.execution_status,
            "content": view.content,
            "size_chars": view.size_chars,
            "workspace_path": view.workspace_path,
        }


class HistoryFeedbackOut(Schema):
    rating: Literal["like", "dislike"]
    reason: str


class HistoryItemOut(Schema):
    id: int
    run_id: uuid.UUID | None
    turn_id: uuid.UUID | None
    role: Literal["user", "assistant"]
    kind: Literal["user", "answer", "tool_carrier"]
    content: str
    tool_calls: list[ToolCallOut] | None
    tool_executions: list[ToolExecutionOut]
    metadata: dict[str, Any] = Field(..., description="Public operation metadata only (model name, finish reason).")
    created_at: datetime
    payload_note: str | None = Field(None, description=_PAYLOAD_NOTE)
    feedback: HistoryFeedbackOut | None = Field(
        None,
        description="On an answer the thread's owner rated (`POST /api/messages/{id}/feedback`): the rating and "
        "reason; null otherwise.",
    )

    @staticmethod
    def from_entry(entry) -> HistoryItemOut:
        row = entry.message
        return HistoryItemOut(
            id=row.id,
            run_id=row.run_id,
            turn_id=row.turn,
            role=row.role,
            kind=entry.kind,
            content=row.content,
            tool_calls=row.tool_calls or None,
            tool_executions=[ToolExecutionOut.from_row(t) for t in entry.tool_executions],
            metadata=entry.public_metadata(),
            created_at=row.created_at,
            payload_note=payload_note(row.metadata),
            feedback=entry.feedback,
        )

    @staticmethod
    def dict_from_entry(entry) -> dict[str, Any]:
        """What :meth:`from_entry` dumps (same keys, order and values),
        built without validating: the history endpoint encodes it as it is
        (issue 11; equality tested in ``tests/read/test_fast_serialisation.py``)."""
        row = entry.message
        return {
            "id": row.id,
            "run_id": row.run_id,
            "turn_id": row.turn,
            "role": row.role,
            "kind": entry.kind,
            "content": row.content,
            "tool_calls": [tool_call_dict(call) for call in row.tool_calls] if row.tool_calls else None,
            "tool_executions": [ToolExecutionOut.dict_from_row(t) for t in entry.tool_executions],
            "metadata": entry.public_metadata(),
            "created_at": row.created_at,
            "payload_note": payload_note(row.metadata),
            "feedback": entry.feedback,
        }


class HistoryPageOut(Schema):
    items: list[HistoryItemOut] = Field(..., description="The newest items of the page, oldest first.")
    has_more: bool
    next_before: str | None = Field(None, description="Pass as `before` to read older items.")


class HistoryQuery(Schema):
    limit: int = Field(50, ge=1, le=200)
    before: Cursor | None = Field(None, description="`next_before` of the newer page.")


class MemoryQuery(Schema):
    include_tools: bool = False


class MemoryMessageOut(Schema):
    type: Literal["human", "ai", "tool"]
    id: str
    content: str
    tool_calls: list[ToolCallOut] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    status: Literal["success", "error"] | None = None


class MemoryOut(Schema):
    thread_id: uuid.UUID
    messages: list[MemoryMessageOut]


class MessageFeedbackIn(Schema):
    rating: Literal["like", "dislike"]
    reason: str = Field("", max_length=2000)


class MessageFeedbackOut(Schema):
    message_id: int
    rating: str
    reason: str
    created_at: datetime
    updated_at: datetime
