"""Runs API (SPEC §5): submit a turn, read a run, cancel it."""

from __future__ import annotations

import uuid

from ninja import Router

from conversations.schemas import ErrorOut

from . import selectors, services
from .schemas import RunIn, RunOut

router = Router(tags=["runs"])

ERRORS = {401: ErrorOut, 404: ErrorOut, 409: ErrorOut, 422: ErrorOut}


@router.post("/threads/{thread_id}/runs", response={200: RunOut, 202: RunOut, **ERRORS})
def submit_run(request, thread_id: uuid.UUID, payload: RunIn):
    """Submit a user turn (R-RUN-1): 202 with the new run; the same
    ``request_id`` again answers 200 with the same run and starts nothing."""
    run, created = services.run_submit(
        user=request.auth, thread_id=thread_id, request_id=payload.request_id, text=payload.input.text
    )
    return (202 if created else 200), RunOut.from_run(run)


@router.get("/runs/{run_id}", response={200: RunOut, **ERRORS})
def get_run(request, run_id: uuid.UUID):
    """A run's status, error, output message, pending approval and usage."""
    return RunOut.from_run(selectors.run_of(request.auth, run_id))


@router.post("/runs/{run_id}/cancel", response={202: RunOut, **ERRORS})
def cancel_run(request, run_id: uuid.UUID):
    """Request cancellation (R-RUN-6). A terminal run is returned unchanged."""
    return 202, RunOut.from_run(services.run_request_cancel(user=request.auth, run_id=run_id))
