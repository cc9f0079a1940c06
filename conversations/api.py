"""Threads API (SPEC §5)."""

from __future__ import annotations

import uuid

from ninja import Query, Router

from governance.services import thread_delete
from yuxi_project.responses import json_response

from . import selectors, services
from .schemas import (
    ErrorOut,
    HistoryItemOut,
    HistoryPageOut,
    HistoryQuery,
    MemoryOut,
    MemoryQuery,
    MessageFeedbackIn,
    MessageFeedbackOut,
    PagedThreadOut,
    ThreadDeletedOut,
    ThreadDeleteQuery,
    ThreadIn,
    ThreadListQuery,
    ThreadOut,
    ThreadPatchIn,
    tool_call_dict,
)

router = Router(tags=["threads"])


ERRORS = {401: ErrorOut, 404: ErrorOut, 422: ErrorOut}


@router.post("/threads", response={201: ThreadOut, **ERRORS})
def create_thread(request, payload: ThreadIn):
    """Create a thread for the caller with an agent and a model."""
    thread = services.thread_create(
        user=request.auth, agent_id=payload.agent_id, model=payload.model, title=payload.title
    )
    return 201, thread


@router.get("/threads", response={200: PagedThreadOut, 401: ErrorOut, 422: ErrorOut})
def list_threads(request, query: Query[ThreadListQuery]):
    """The caller's threads, newest first: all of them, or with
    ``archived=false`` those a chat sidebar shows, ``archived=true`` the
    archived ones; ``q`` keeps those whose title contains it, ignoring
    case (R-API-1). ``count`` counts every match, ``items`` are the page."""
    # Paged by hand, not with ninja's @paginate: its wrapper hides the
    # view's filter parameters from ninja (string annotations resolved in
    # ninja's module). Same body and schema name as before.
    threads = selectors.threads_of(request.auth, archived=query.archived, q=query.q)
    return {"items": list(threads[query.offset : query.offset + query.limit]), "count": threads.count()}


@router.get("/threads/{thread_id}", response={200: ThreadOut, **ERRORS})
def get_thread(request, thread_id: uuid.UUID):
    """One of the caller's threads; another user's thread answers 404."""
    return selectors.thread_of(request.auth, thread_id)


@router.patch("/threads/{thread_id}", response={200: ThreadOut, **ERRORS, 503: ErrorOut})
def update_thread(request, thread_id: uuid.UUID, payload: ThreadPatchIn):
    """Rename, archive or restore one of the caller's threads (R-API-1):
    only the fields given change. Another user's thread answers 404; an
    unknown field, a null, a blank or too long title, or a value of another
    type 422, and nothing changes."""
    given = payload.model_dump(include=payload.model_fields_set)
    return services.thread_update(user=request.auth, thread_id=thread_id, **given)


@router.delete(
    "/threads/{thread_id}",
    response={200: ThreadDeletedOut, 202: ThreadDeletedOut, **ERRORS, 409: ErrorOut, 503: ErrorOut},
)
def delete_thread(request, thread_id: uuid.UUID, query: Query[ThreadDeleteQuery]):
    """Delete one of the caller's threads (R-API-1): it is gone from the API
    at once, and its content is erased as a user's erasure does (R-GOV-2),
    its anonymous facts kept for statistics. 200 when the content is
    erased; 202 when the erasure follows (cancelled runs still ending, or
    another erasure in progress). A run pending or running answers 409
    `run_active` (its ids in `runs`) unless `cancel=true`, which cancels it
    first. Another user's thread, or one already deleted, answers 404."""
    deletion = thread_delete(
        user=request.auth, thread_id=thread_id, actor=f"api user #{request.auth.pk}", cancel=query.cancel
    )
    return (200 if deletion.erased else 202), deletion


@router.get("/threads/{thread_id}/history", response={200: HistoryPageOut, **ERRORS})
def thread_history(request, thread_id: uuid.UUID, query: Query[HistoryQuery]):
    """The chat history (R-READ-1): user messages, final answers and, for
    finished runs, the model calls that carried tool calls with their tool
    executions. Newest page first; ``next_before`` pages back."""
    thread = selectors.thread_of(request.auth, thread_id)
    page = selectors.thread_history(thread=thread, limit=query.limit, before=query.before)
    # The dict HistoryPageOut dumps, built directly: validating a page of
    # items again cost more than reading it (issue 11).
    return json_response(
        {
            "items": [HistoryItemOut.dict_from_entry(e) for e in page.items],
            "has_more": page.has_more,
            "next_before": page.next_before,
        }
    )


@router.get("/threads/{thread_id}/memory", response={200: MemoryOut, **ERRORS})
def thread_memory(request, thread_id: uuid.UUID, query: Query[MemoryQuery]):
    """The history as LangChain-style messages (R-READ-2); tool carriers and
    tool messages only with ``include_tools=true``."""
    thread = selectors.thread_of(request.auth, thread_id)
    # The dict MemoryOut dumps, built directly by the selector (issue 11).
    messages = selectors.thread_memory(thread_id=thread.id, include_tools=query.include_tools, call_dict=tool_call_dict)
    return json_response({"thread_id": thread.id, "messages": messages})


@router.post("/messages/{message_id}/feedback", response={200: MessageFeedbackOut, 201: MessageFeedbackOut, **ERRORS})
def message_feedback(request, message_id: int, payload: MessageFeedbackIn):
    """Like or dislike a final answer of one's own thread: 201 the first
    time, 200 when it updates the earlier feedback. Audit rows and user
    messages answer 422; another user's message 404."""
    feedback, created = services.message_feedback_submit(
        user=request.auth, message_id=message_id, rating=payload.rating, reason=payload.reason
    )
    return (201 if created else 200), MessageFeedbackOut(
        message_id=feedback.message_id,
        rating=feedback.rating,
        reason=feedback.reason,
        created_at=feedback.created_at,
        updated_at=feedback.updated_at,
    )
