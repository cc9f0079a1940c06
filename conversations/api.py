"""Threads API (SPEC §5)."""

from __future__ import annotations

from ninja import Router
from ninja.pagination import LimitOffsetPagination, paginate

from . import selectors, services
from .schemas import ErrorOut, ThreadIn, ThreadOut

router = Router(tags=["threads"])

ERRORS = {401: ErrorOut, 404: ErrorOut, 422: ErrorOut}


@router.post("/threads", response={201: ThreadOut, **ERRORS})
def create_thread(request, payload: ThreadIn):
    """Create a thread for the caller with an agent and a model."""
    thread = services.thread_create(
        user=request.auth, agent_id=payload.agent_id, model=payload.model, title=payload.title
    )
    return 201, thread


@router.get("/threads", response={200: list[ThreadOut], 401: ErrorOut})
@paginate(LimitOffsetPagination)
def list_threads(request):
    """The caller's threads, newest first."""
    return selectors.threads_of(request.auth)
