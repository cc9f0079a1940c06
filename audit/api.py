"""Runs API (SPEC §5): submit a turn, read a run, cancel it, resume it."""

from __future__ import annotations

import uuid

from asgiref.sync import sync_to_async
from django.http import HttpResponse, StreamingHttpResponse
from ninja import Query, Router

from conversations.models import Conversation
from conversations.schemas import ErrorOut
from conversations.selectors import thread_of
from core.config import get_config
from core.db import release_connection
from core.errors import Conflict, InvalidInput, NotFound, PermissionDenied
from costs.schemas import BudgetExceededOut
from costs.selectors import run_costs
from ops.metrics import track_sse
from yuxi_project.api_types import EVENT_ID_SCHEMA
from yuxi_project.auth import staff_auth
from yuxi_project.responses import json_response

from . import export, ledger
from .execution.events import client_holds_terminal_event, run_event_stream
from .models import AgentRun
from .reads import search, selectors
from .replay.export import RunNotFound, export_scenario
from .schemas import (
    ExportQuery,
    RunIn,
    RunListExportQuery,
    RunListOut,
    RunListQuery,
    RunOut,
    RunResumeIn,
    RunSummaryOut,
    ScenarioOut,
    ThreadRunListOut,
    ThreadRunListQuery,
    TimelineOut,
    TimelineQuery,
)

router = Router(tags=["runs"])

ERRORS = {401: ErrorOut, 404: ErrorOut, 409: ErrorOut, 422: ErrorOut}
# Writes that lock a thread or run row give up quickly with 503 run_busy
# while a worker holds it (R-RUN-10).
WRITE_ERRORS = {**ERRORS, 503: ErrorOut}
# A submit or resume naming a webhook the server will not call: 403
# webhook_not_allowed (R-API-3).
SUBMIT_ERRORS = {**WRITE_ERRORS, 403: ErrorOut}


@router.post("/threads/{thread_id}/runs", response={200: RunOut, 202: RunOut, 402: BudgetExceededOut, **SUBMIT_ERRORS})
def submit_run(request, thread_id: uuid.UUID, payload: RunIn):
    """Submit a user turn (R-RUN-1): 202 with the new run; the same
    ``request_id`` again answers 200 with the same run and starts nothing.
    402 ``budget_exceeded`` when the user's budget has no room (R-COST-3).
    With ``webhook``, the run's end is POSTed there (R-API-3); 403
    ``webhook_not_allowed`` for a host the server does not allow."""
    run, created = ledger.run_submit(
        user=request.auth,
        thread_id=thread_id,
        request_id=payload.request_id,
        text=payload.input.text,
        multitask_strategy=payload.multitask_strategy,
        webhook=payload.webhook or "",
    )
    return (202 if created else 200), RunOut.from_run(run)


@router.get("/threads/{thread_id}/runs", response={200: ThreadRunListOut, **ERRORS})
def list_thread_runs(request, thread_id: uuid.UUID, query: Query[ThreadRunListQuery]):
    """The runs of one of the caller's threads (resume runs included),
    newest first, keyset-paginated (``before=next_before``, R-API-1); each
    the body of ``GET /api/runs/{run_id}``. Another user's thread answers
    404."""
    thread = thread_of(request.auth, thread_id)
    page = selectors.thread_runs_page(thread_id=thread.id, limit=query.limit, before=query.before)
    # One query for the page's costs and one for its approvals' answers,
    # however many runs and interrupted runs it holds.
    costs = run_costs([run.id for run in page.items])
    resumes = selectors.resumes_of(page.items)
    return ThreadRunListOut(
        items=[RunOut.from_run(run, cost=costs[run.id], resumes=resumes) for run in page.items],
        has_more=page.has_more,
        next_before=page.next_before,
    )


@router.get("/runs/{run_id}", response={200: RunOut, **ERRORS})
def get_run(request, run_id: uuid.UUID):
    """A run's status, error, output message, pending approval, usage and
    cost (summed from its model rows, R-COST-2)."""
    return RunOut.from_run(selectors.run_of(request.auth, run_id))


@router.post("/runs/{run_id}/cancel", response={202: RunOut, **WRITE_ERRORS})
def cancel_run(request, run_id: uuid.UUID):
    """Request cancellation (R-RUN-6). Answers at once, also while a worker
    holds the run (R-RUN-10): the request is recorded and applied by the
    worker or the dispatcher. A cancelled run is returned unchanged; 409
    ``run_not_cancellable`` (with the run's ``status``, and ``resumed_by``
    for an interrupted run that was resumed) when it already ended
    otherwise."""
    return 202, RunOut.from_run(ledger.run_request_cancel(user=request.auth, run_id=run_id))


@router.post("/runs/{run_id}/resume", response={200: RunOut, 202: RunOut, 402: BudgetExceededOut, **SUBMIT_ERRORS})
def resume_run(request, run_id: uuid.UUID, payload: RunResumeIn):
    """Answer a pending approval (R-TA-5): 202 with the new resume run of the
    same turn; the same ``request_id`` again answers 200 with the same run.
    409 when the run is not interrupted or was already resumed; 402 over
    budget (R-COST-3)."""
    run, created = ledger.run_resume(
        user=request.auth,
        run_id=run_id,
        request_id=payload.request_id,
        decisions=[d.model_dump(exclude_none=True) for d in payload.decisions],
        webhook=payload.webhook or "",
    )
    return (202 if created else 200), RunOut.from_run(run)


# --------------------------------------------------------------------------
# Audit timeline (staff) and live events
# --------------------------------------------------------------------------

STAFF_ERRORS = {401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 422: ErrorOut}


# Staff-only operations: 403 before their parameters are read (yuxi_project.auth.staff_auth).
AUDIT_STAFF = staff_auth("the audit timeline is for staff")


def _require_staff(request) -> None:
    if not getattr(request.auth, "is_staff", False):
        raise PermissionDenied("the audit timeline is for staff")


def timeline_body(page: selectors.TimelinePage) -> dict:
    """What ``TimelineOut`` dumps for ``page``, built directly: the items
    are already the schema's dicts (:func:`selectors.timeline_item`), and
    validating 500 of them again cost more than reading them (issue 11)."""
    return {
        "items": [selectors.timeline_item(row, include_raw_output=True) for row in page.items],
        "truncated": page.truncated,
        "next_before": page.next_before,
    }


@router.get(
    "/audit/runs/{run_id}/timeline", response={200: TimelineOut, **STAFF_ERRORS}, tags=["audit"], auth=AUDIT_STAFF
)
def run_timeline(request, run_id: uuid.UUID, query: Query[TimelineQuery]):
    """Staff only (R-READ-3): the run's model and tool rows by sequence, with
    raw tool output; the newest ``limit`` (≤ 500), ``truncated`` when older
    rows exist. Readable while the run is running."""
    _require_staff(request)
    page = selectors.run_timeline(run_id=run_id, limit=query.limit, before=query.before)
    # A page with rows has its run; only an empty one asks whether it exists.
    if not page.items and not AgentRun.objects.filter(pk=run_id).exists():
        raise NotFound("run not found")
    return json_response(timeline_body(page))


@router.get(
    "/audit/threads/{thread_id}/timeline", response={200: TimelineOut, **STAFF_ERRORS}, tags=["audit"], auth=AUDIT_STAFF
)
def thread_timeline(request, thread_id: uuid.UUID, query: Query[TimelineQuery]):
    """Staff only (R-READ-3): every run of the thread in creation order,
    each run's rows by sequence; the newest ``limit`` (≤ 500) rows."""
    _require_staff(request)
    page = selectors.thread_timeline(thread_id=thread_id, limit=query.limit, before=query.before)
    if not page.items and not Conversation.objects.filter(pk=thread_id).exists():
        raise NotFound("thread not found")
    return json_response(timeline_body(page))


# --------------------------------------------------------------------------
# Finding and exporting runs (staff, R-ADM-2)
# --------------------------------------------------------------------------


@router.get("/audit/runs", response={200: RunListOut, **STAFF_ERRORS}, tags=["audit"], auth=AUDIT_STAFF)
def list_runs(request, query: Query[RunListQuery]):
    """Staff only (R-ADM-2): runs matching every given filter, newest first,
    keyset-paginated (``before=next_before``), with model-call and
    tool-execution counts. ``q`` finds a run by its run, thread or turn id
    (or their first 8+ hex digits), request id, operation id, or by words of
    its messages and audit rows (PostgreSQL full-text search)."""
    _require_staff(request)
    page = search.run_list_page(query.as_filters(), limit=query.limit, before=query.before)
    return RunListOut(
        items=[RunSummaryOut.from_run(run) for run in page.items], has_more=page.has_more, next_before=page.next_before
    )


def _export_doc(what: str) -> dict:
    return {
        "responses": {
            200: {
                "description": f"{what}: one record per timeline row (the fields of the timeline API), streamed.",
                "content": {
                    export.CONTENT_TYPES["jsonl"].split(";")[0]: {"schema": {"type": "string"}},
                    export.CONTENT_TYPES["csv"].split(";")[0]: {"schema": {"type": "string"}},
                },
            }
        }
    }


@router.get(
    "/audit/runs/export",
    response=STAFF_ERRORS,
    tags=["audit"],
    auth=AUDIT_STAFF,
    openapi_extra=_export_doc("The matching runs"),
)
def export_runs(request, query: Query[RunListExportQuery]):
    """Staff only (R-ADM-2): the audit of every run matching the filters of
    ``GET /api/audit/runs``, runs in creation order, as JSON lines or CSV."""
    _require_staff(request)
    runs = search.filter_runs(AgentRun.objects.all(), query.as_filters())
    pieces = export.render(export.records(export.runs_rows(runs)), query.format)
    return export.streaming_response(request, pieces, fmt=query.format, filename=export.export_filename("runs"))


@router.get(
    "/audit/runs/{run_id}/export",
    response=STAFF_ERRORS,
    tags=["audit"],
    auth=AUDIT_STAFF,
    openapi_extra=_export_doc("The run"),
)
def export_run(request, run_id: uuid.UUID, query: Query[ExportQuery]):
    """Staff only (R-ADM-2): the run's audit timeline, every row, as JSON
    lines or CSV (``format=jsonl|csv``), streamed."""
    _require_staff(request)
    if not AgentRun.objects.filter(pk=run_id).exists():
        raise NotFound("run not found")
    pieces = export.render(export.records(export.run_rows(run_id)), query.format)
    return export.streaming_response(request, pieces, fmt=query.format, filename=export.export_filename("run", run_id))


@router.get(
    "/audit/threads/{thread_id}/export",
    response=STAFF_ERRORS,
    tags=["audit"],
    auth=AUDIT_STAFF,
    openapi_extra=_export_doc("Every run of the thread"),
)
def export_thread(request, thread_id: uuid.UUID, query: Query[ExportQuery]):
    """Staff only (R-ADM-2): every run of the thread in creation order, each
    run's rows in order, as JSON lines or CSV, streamed."""
    _require_staff(request)
    if not Conversation.objects.filter(pk=thread_id).exists():
        raise NotFound("thread not found")
    pieces = export.render(export.records(export.thread_rows(thread_id)), query.format)
    return export.streaming_response(
        request, pieces, fmt=query.format, filename=export.export_filename("thread", thread_id)
    )


@router.get(
    "/audit/runs/{run_id}/scenario",
    response={200: ScenarioOut, 409: ErrorOut, **STAFF_ERRORS},
    tags=["audit"],
    auth=AUDIT_STAFF,
)
def run_scenario(request, run_id: uuid.UUID):
    """Staff only (R-REPLAY-1): the run's turn (its first run and every
    resume up to this run) as a replay scenario that the replay model
    server plays: the root model calls as ``turns``, each subagent's as
    ``subagents``, tool results, decisions and the end in ``recorded``.
    Save it as ``<name>.json`` in a scenario directory to replay it. 404
    for an unknown run; 409 ``nothing_to_export`` when the turn made no
    model call (a refusal by the run's state, not a malformed request)."""
    _require_staff(request)
    try:
        scenario = export_scenario(run_id)
    except RunNotFound:
        raise NotFound("run not found") from None
    except ValueError as exc:
        raise Conflict(str(exc), extra={"reason": "nothing_to_export"}) from None
    # Built and validated by the exporter's own format (audit.replay.scenarios):
    # encoded as it is, so a lone surrogate travels \u-escaped, exactly.
    return json_response(scenario)


def _owned_run_id(user, run_id: uuid.UUID) -> uuid.UUID:
    try:
        return selectors.run_of(user, run_id).id
    finally:
        # The event stream holds no database connection while it waits.
        release_connection()


_SSE_DOC = {
    "responses": {
        200: {
            "description": (
                "Server-Sent Events (`id:` = the run's event sequence), ending with `run.finished`. "
                "Events: `run.status`, `model.started`, `model.delta`, `model.finished`, `tool.started`, "
                "`tool.finished`, `tool.error`, `run.finished`; and from the reader itself: "
                "`gap` when events the client should get next are no longer retained (a `Last-Event-ID` "
                "older than the retained window, a new client on a trimmed stream): data "
                "`{first_retained_id, missed_from, missed_to, state}` where `state` is the run rebuilt "
                "from PostgreSQL (`status`, `error_type`, `usage`, `output_message_id`, `interrupts`, "
                "`operations`: the root model and tool calls so far), sent before the first retained "
                'event and with `id:` the event before it; `error` with `{error: "run_not_found"}` '
                "when the run no longer exists, which ends the stream (R-EVT-2)."
            ),
            "content": {
                "text/event-stream": {
                    "schema": {
                        "type": "object",
                        "description": "One event: `id` the run's event sequence, `event` its type, `data` JSON.",
                        "properties": {
                            "id": {"type": "string"},
                            "event": {"type": "string"},
                            "data": {"type": "string"},
                        },
                    }
                }
            },
        },
        204: {
            "description": (
                "The client's `Last-Event-ID` is at or after the run's `run.finished`: nothing more will come, "
                "and a browser's EventSource stops reconnecting (R-EVT-3)."
            )
        },
    },
    "parameters": [
        {
            "in": "header",
            "name": "Last-Event-ID",
            "required": False,
            "schema": EVENT_ID_SCHEMA,
            "description": "The last event id the client received (digits): the stream resumes after it.",
        }
    ],
}


@router.get("/runs/{run_id}/events", response=ERRORS, openapi_extra=_SSE_DOC)
async def run_events(request, run_id: uuid.UUID):
    """Follow a run live (R-EVT-1): status changes, model start/text
    deltas/finish, tool start/finish, and a final ``run.finished`` with the
    terminal status and, when interrupted, the action requests. Reconnect
    with ``Last-Event-ID`` to resume without gap or repeat; events no longer
    retained are announced by a ``gap`` event carrying the run's state from
    PostgreSQL, and a run deleted meanwhile ends the stream with an
    ``error`` event (R-EVT-2). A reconnect that already holds
    ``run.finished`` is answered 204, so a browser's EventSource stops;
    a ``Last-Event-ID`` ahead of a running run's stream still gets the
    terminal event (R-EVT-3)."""
    # No header: from the start. An empty one is malformed, as the schema
    # says (a browser with no event id yet sends none).
    raw = request.headers.get("Last-Event-ID")
    raw = "0" if raw is None else raw.strip()
    # ASCII digits only: str.isdigit() also accepts "²", which int() refuses.
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise InvalidInput("Last-Event-ID must be a non-negative integer", extra={"reason": "bad_last_event_id"})
    run_id = await sync_to_async(_owned_run_id)(request.auth, run_id)
    redis_url = get_config().REDIS_URL or None
    if await client_holds_terminal_event(run_id, last_event_id=int(raw), redis_url=redis_url):
        return HttpResponse(status=204)
    response = StreamingHttpResponse(
        track_sse(run_event_stream(run_id, last_event_id=int(raw), redis_url=redis_url)),
        content_type="text/event-stream",
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response
