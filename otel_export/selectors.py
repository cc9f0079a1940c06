"""Reads of the OpenTelemetry export (R-OTEL-1): which runs are closed and
safe to export, and their audit rows."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta

from django.db import connection
from django.db.models import Exists, F, OuterRef, Q, QuerySet
from django.utils import timezone

from audit.models import AgentRun
from conversations.models import Message
from conversations.sql import messages_streamed

# Writers whose open transaction may still commit a terminal run. A terminal
# transaction (run_finish, cancel, the lease sweeper) locks the run row
# before it reads its clock for finished_at, so it holds a transaction id
# (backend_xid) from then until it commits; read-only sessions never hold
# the horizon back.
_OPEN_WRITERS_SQL = """
SELECT clock_timestamp(), min(xact_start), (array_agg(pid ORDER BY xact_start))[1]
FROM pg_stat_activity
WHERE datname = current_database()
  AND pid <> pg_backend_pid()
  AND backend_xid IS NOT NULL
  AND xact_start IS NOT NULL
"""


def export_horizon(*, settle_seconds: float) -> tuple[datetime, str]:
    """The newest ``finished_at`` that is safe to export, and why it is not
    later (``""`` when only the settle time holds it back).

    A run whose terminal transaction has not committed yet is invisible to
    the exporter; if its ``finished_at`` were below the cursor when it
    commits, the cursor would have passed it for ever. So only runs with
    ``finished_at`` before the horizon are read: the earlier of now and the
    start of the oldest open writing transaction of this database, minus
    ``settle_seconds`` (seconds; covers clock skew between workers and the
    database and the sweeper, which reads its clock just before its
    transaction). Every transaction still open then started before the
    horizon's source, so every run finishing before the horizon has
    committed: the query that reads runs after this one sees it.

    On PostgreSQL the open transactions come from ``pg_stat_activity``: the
    exporter's database role must see the workers' sessions (the same role,
    or ``pg_read_all_stats``). On SQLite (embedded defaults, one writer at a
    time) the horizon is now minus the settle time.
    """
    settle = timedelta(seconds=settle_seconds)
    if connection.vendor != "postgresql":
        return timezone.now() - settle, ""
    with connection.cursor() as cursor:
        cursor.execute(_OPEN_WRITERS_SQL)
        now, oldest, pid = cursor.fetchone()
    if oldest is not None and oldest < now:
        return oldest - settle, f"a transaction of pid {pid} open since {oldest.isoformat()}"
    return now - settle, ""


def closed_runs(*, after: tuple[datetime | None, uuid.UUID | None], horizon: datetime) -> QuerySet[AgentRun]:
    """Terminal runs after the cursor position ``(finished_at, run id)`` that
    finished before ``horizon``, in ``(finished_at, id)`` order, each
    annotated with ``has_open_rows`` (a running audit row: the run is not
    closed yet) and ``has_earlier_runs`` (its thread has a run created
    before it). Index ``run_finished_idx`` serves the order and range."""
    finished_at, run_id = after
    runs = AgentRun.objects.filter(
        status__in=AgentRun.TERMINAL_STATUSES, finished_at__isnull=False, finished_at__lt=horizon
    )
    if finished_at is not None:
        runs = runs.filter(Q(finished_at__gt=finished_at) | Q(finished_at=finished_at, id__gt=run_id))
    return runs.annotate(
        has_open_rows=Exists(Message.objects.filter(run=OuterRef("pk")).running()),
        # Whether a chat span's rebuilt input leaves earlier turns out
        # (R-OTEL-2, otel_export.spans); index run_thread_created_idx.
        has_earlier_runs=Exists(
            AgentRun.objects.filter(thread_id=OuterRef("thread_id"), created_at__lt=OuterRef("created_at"))
        ),
    ).order_by("finished_at", "id")


# The columns a span is made of (otel_export.spans); content columns only
# when content is exported. A column read by the spans but left out here
# would be fetched again per row by Django: keep the two in step.
SPAN_COLUMNS = (
    "id",
    "run_id",
    "role",
    "operation_id",
    "started_at",
    "finished_at",
    "created_at",
    "sequence",
    "execution_status",
    "usage",
    "cost_usd",
    "metadata",
    "tool_name",
    "declared_by_id",
    "namespace",
    "parent_operation_id",
)
CONTENT_COLUMNS = ("content", "tool_calls", "tool_input")


def runs_audit_rows(run_ids: list[uuid.UUID], *, content: bool) -> QuerySet[Message]:
    """The audit rows of several runs in one query (R-OTEL-1, issue 38):
    by run in :func:`closed_runs`' order (``finished_at``, id), each run's
    rows by sequence (nulls last) then id, annotated with
    ``declared_by_run_id``. Only :data:`SPAN_COLUMNS` are read, plus
    :data:`CONTENT_COLUMNS` with ``content``. The index
    ``message_run_sequence_idx`` finds the rows; the order is a sort of one
    page of rows."""
    columns = SPAN_COLUMNS + (CONTENT_COLUMNS if content else ())
    return (
        Message.objects.audit()
        .filter(run_id__in=run_ids)
        .only(*columns)
        .annotate(declared_by_run_id=F("declared_by__run_id"))
        # The runs' own order, (finished_at, id) as closed_runs reads them,
        # then each run's rows by sequence. (A CASE over the page's ids
        # cost more to compile than the query took to run.)
        .order_by("run__finished_at", "run_id", F("sequence").asc(nulls_last=True), "id")
    )


def runs_audit_rows_read(run_ids: list[uuid.UUID], *, content: bool, chunk_size: int) -> Iterator[Message]:
    """The rows of :func:`runs_audit_rows`, in its order, read lazily
    ``chunk_size`` rows at a time by
    :func:`~conversations.sql.messages_streamed` (a server-side cursor;
    each chunk's values made into :class:`Message` instances at once, not
    row by row by the ORM, which cost the export a third of its pass,
    issue 38). The columns left out are deferred, as with ``only``.
    Closing the iterator closes the cursor."""
    columns = SPAN_COLUMNS + (CONTENT_COLUMNS if content else ())
    return messages_streamed(
        runs_audit_rows(run_ids, content=content),
        chunk_size=chunk_size,
        fields=columns,
        extra=("declared_by_run_id",),
    )
