"""Export closed runs as OpenTelemetry spans, exactly once, behind a durable
cursor (R-OTEL-1).

:func:`export_closed_runs` is one export pass, shared by ``manage.py
export_otel`` and the beat task ``otel_export.export``:

1. take the exporter lock (a PostgreSQL advisory lock: one pass at a time;
   a second one returns at once with ``busy``);
2. compute the horizon (:func:`otel_export.selectors.export_horizon`);
3. read closed runs after the cursor in ``(finished_at, id)`` order, pages
   of :data:`RUN_PAGE` runs, the audit rows of a page in one query
   (:func:`otel_export.selectors.runs_audit_rows_read`), and turn each run into spans
   (:class:`otel_export.spans.SpanFactory`);
4. send the spans in requests of at most ``OTEL_EXPORT_BATCH_SPANS`` spans
   with the SDK's OTLP/HTTP exporter; after each request the receiver
   answered with a 2xx, move the cursor (compare-and-set) past the runs
   whose spans have all been accepted.

A receiver that is down, slow (past ``OTEL_EXPORTER_OTLP_TIMEOUT``) or
answers anything but 2xx ends the pass with the cursor where it was: the
next pass sends the same runs again, with the same trace and span ids, so a
receiver that had accepted part of them keeps one copy (Phoenix keeps the
first span of an id). The run path never waits for the export: the exporter
only reads terminal runs, without locks.

An ``interrupted`` run that is later cancelled while it waited for approval
gets a new ``finished_at`` and is exported again with its final status and
the same ids.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from itertools import groupby
from operator import attrgetter

import requests
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.util.re import parse_env_headers

from conversations.models import Message
from core.config import get_config
from core.db import commit_without_disk_wait

from .models import ExportCursor
from .selectors import closed_runs, export_horizon, runs_audit_rows_read
from .spans import SdkDisabled, SpanFactory

log = logging.getLogger(__name__)

__all__ = ["CursorMoved", "ExportNotConfigured", "ReceiverError", "SdkDisabled", "export_closed_runs"]

DEFAULT_CURSOR = "otlp"
# Runs read per query; the rows of a page of runs are read by one query
# more, fetched ROW_CHUNK rows at a time (issue 38: a query per run made
# the export 15 times slower than reading the same rows in one).
RUN_PAGE = 100
ROW_CHUNK = 2000


class ExportNotConfigured(RuntimeError):
    """``OTEL_EXPORTER_OTLP_ENDPOINT`` is not set."""


class ReceiverError(RuntimeError):
    """The receiver did not accept a request (no answer, timeout, non-2xx)."""


class CursorMoved(RuntimeError):
    """The cursor is not where this pass read it: another exporter moved it."""


@dataclass
class ExportProgress:
    """What one pass did so far (runs and spans accepted by the receiver)."""

    backlog: int = 0
    runs: int = 0
    spans: int = 0
    requests: int = 0
    caught_up: bool = False
    busy: bool = False
    error: str = ""
    # Why runs that finished were not read yet: a transaction still open,
    # or a terminal run with a running row.
    waiting_for: str = ""
    cursor: tuple = field(default=(None, None))


# --------------------------------------------------------------------------
# Receiver
# --------------------------------------------------------------------------


def traces_endpoint(base: str) -> str:
    """The OTLP/HTTP traces URL for ``OTEL_EXPORTER_OTLP_ENDPOINT``: the
    base URL plus ``/v1/traces``, as the OpenTelemetry specification says
    (a URL that already ends so is used as is)."""
    base = base.rstrip("/")
    return base if base.endswith("/v1/traces") else f"{base}/v1/traces"


class OtlpReceiver:
    """The SDK's :class:`OTLPSpanExporter` (protobuf over HTTP, with its own
    retries of 429/502/503/504 within the timeout), plus the check that the
    final answer was a 2xx: the SDK counts any status below 400 as success.

    Args:
        endpoint: base URL (``OTEL_EXPORTER_OTLP_ENDPOINT``).
        headers: request headers (``OTEL_EXPORTER_OTLP_HEADERS``, parsed).
        timeout: seconds for one request including the SDK's retries.
    """

    def __init__(self, *, endpoint: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> None:
        self.endpoint = traces_endpoint(endpoint)
        self._last_status: int | None = None
        session = requests.Session()
        session.hooks["response"].append(self._remember_status)
        self._exporter = OTLPSpanExporter(
            endpoint=self.endpoint, headers=headers or {}, timeout=timeout, session=session
        )

    def _remember_status(self, response: requests.Response, *args, **kwargs) -> None:
        self._last_status = response.status_code

    def send(self, spans: list[ReadableSpan]) -> None:
        """Send one request. Raises :class:`ReceiverError` unless the
        receiver answered it with a 2xx."""
        self._last_status = None
        result = self._exporter.export(spans)
        status = self._last_status
        if result is not SpanExportResult.SUCCESS or status is None or not 200 <= status < 300:
            raise ReceiverError(
                f"{self.endpoint} did not accept {len(spans)} spans "
                f"({'HTTP ' + str(status) if status else 'no answer'})"
            )

    def close(self) -> None:
        self._exporter.shutdown()


def receiver_from_settings() -> OtlpReceiver:
    """The receiver configured by ``OTEL_EXPORTER_OTLP_ENDPOINT``,
    ``OTEL_EXPORTER_OTLP_HEADERS`` and ``OTEL_EXPORTER_OTLP_TIMEOUT``.
    Raises :class:`ExportNotConfigured` without an endpoint."""
    config = get_config()
    if not config.OTEL_EXPORTER_OTLP_ENDPOINT:
        raise ExportNotConfigured("OTEL_EXPORTER_OTLP_ENDPOINT is not set: there is nowhere to export to")
    return OtlpReceiver(
        endpoint=config.OTEL_EXPORTER_OTLP_ENDPOINT,
        headers=dict(parse_env_headers(config.OTEL_EXPORTER_OTLP_HEADERS, liberal=True)),
        timeout=config.OTEL_EXPORTER_OTLP_TIMEOUT,
    )


# --------------------------------------------------------------------------
# One pass
# --------------------------------------------------------------------------


def export_closed_runs(
    *,
    receiver: OtlpReceiver | None = None,
    cursor_name: str = DEFAULT_CURSOR,
    max_seconds: float | None = None,
    progress: Callable[[ExportProgress], None] | None = None,
) -> ExportProgress:
    """Export the closed runs after the cursor, until caught up, the
    receiver fails, or ``max_seconds`` (seconds, checked between runs) ran
    out. Must not be called inside ``transaction.atomic()`` on PostgreSQL
    in production: the horizon reads the clock and other sessions.

    Args:
        receiver: where to send; default :func:`receiver_from_settings`.
        cursor_name: which cursor to move (one per receiver).
        max_seconds: time budget of the pass.
        progress: called after every accepted request.

    Returns the pass's :class:`ExportProgress`; ``error`` says why it
    stopped early (the cursor stays at the last accepted run), ``busy``
    that another pass holds the exporter lock.

    Raises:
        ExportNotConfigured: no receiver given and no endpoint configured.
        SdkDisabled: ``OTEL_SDK_DISABLED=true``.
        CursorMoved: the cursor changed under this pass (nothing is lost:
            the runs are exported again with the same ids).
    """
    config = get_config()
    own_receiver = receiver is None
    receiver = receiver or receiver_from_settings()
    try:
        with _exporter_lock(cursor_name) as acquired:
            if not acquired:
                return ExportProgress(busy=True)
            return _export(
                receiver=receiver,
                cursor_name=cursor_name,
                factory=SpanFactory(content=config.OTEL_EXPORT_CONTENT, max_chars=config.OTEL_EXPORT_MAX_PAYLOAD_CHARS),
                batch_spans=config.OTEL_EXPORT_BATCH_SPANS,
                settle_seconds=config.OTEL_EXPORT_SETTLE_SECONDS,
                deadline=None if max_seconds is None else time.monotonic() + max_seconds,
                progress=progress,
            )
    finally:
        if own_receiver:
            receiver.close()


def _export(
    *,
    receiver: OtlpReceiver,
    cursor_name: str,
    factory: SpanFactory,
    batch_spans: int,
    settle_seconds: float,
    deadline: float | None,
    progress: Callable[[ExportProgress], None] | None,
) -> ExportProgress:
    cursor, _ = ExportCursor.objects.get_or_create(name=cursor_name)
    position = (cursor.finished_at, cursor.run_id)
    horizon, waiting_for = export_horizon(settle_seconds=settle_seconds)
    result = ExportProgress(cursor=position, waiting_for=waiting_for)
    result.backlog = closed_runs(after=position, horizon=horizon).count()

    pending: list[ReadableSpan] = []
    # Runs whose spans are all in `pending` or already sent, not yet behind the cursor.
    completed: list[tuple] = []

    unaccounted_spans = 0  # sent since the cursor last moved

    def flush() -> None:
        """Send what is pending, then move the cursor past the runs whose
        spans have all been accepted."""
        nonlocal position, unaccounted_spans
        if not pending and not completed:
            return
        if pending:
            receiver.send(pending)
            result.requests += 1
            result.spans += len(pending)
            pending.clear()
        if completed:
            new_position = completed[-1]
            with transaction.atomic():
                # A move lost to a crash of PostgreSQL sends its runs again
                # with the same ids: its commit need not wait for the disk
                # (one flush per request cost a loaded machine 50 ms).
                commit_without_disk_wait()
                moved = ExportCursor.objects.filter(
                    name=cursor_name, finished_at=position[0], run_id=position[1]
                ).update(
                    finished_at=new_position[0],
                    run_id=new_position[1],
                    exported_runs=F("exported_runs") + len(completed),
                    exported_spans=F("exported_spans") + unaccounted_spans,
                    updated_at=timezone.now(),
                )
            if moved != 1:
                raise CursorMoved(f"export cursor {cursor_name!r} moved away from {position}")
            result.runs += len(completed)
            position = new_position
            result.cursor = position
            completed.clear()
            unaccounted_spans = 0
        if progress:
            progress(result)

    scan = position
    try:
        while True:
            page = list(closed_runs(after=scan, horizon=horizon).select_related("output_message")[:RUN_PAGE])
            if not page:
                result.caught_up = True
                break
            stop = False
            # Closed at the end of the page, read or not (the rest of its rows are not needed).
            rows = runs_audit_rows_read([run.id for run in page], content=factory.content, chunk_size=ROW_CHUNK)
            with closing(_rows_by_run(page, rows)) as rows_of:
                for run, rows in rows_of:
                    if run.has_open_rows:
                        # Cannot happen through the services (the terminal
                        # transaction closes every row); never pass it silently.
                        result.waiting_for = f"run {run.id} is {run.status} but has running audit rows"
                        log.warning("OpenTelemetry export waits: %s", result.waiting_for)
                        stop = True
                        break
                    for span in factory.run_spans(run, rows):
                        pending.append(span)
                        unaccounted_spans += 1
                        if len(pending) >= batch_spans:
                            flush()
                    completed.append((run.finished_at, run.id))
                    scan = (run.finished_at, run.id)
                    if not pending:  # its last span was in an accepted request
                        flush()
                    if deadline is not None and time.monotonic() >= deadline:
                        stop = True
                        break
            if stop:
                break
        flush()
    except ReceiverError as exc:
        result.error = str(exc)
        result.caught_up = False
        log.warning("OpenTelemetry export stopped, cursor kept at %s: %s", position, exc)
    return result


def _rows_by_run(runs: list, rows: Iterator[Message]) -> Iterator[tuple]:
    """``(run, its rows)`` for each of ``runs`` in order, from ``rows``
    grouped by run in the same order and read lazily
    (:func:`otel_export.selectors.runs_audit_rows_read`): a run's rows must
    be read before the next pair is asked for. A run without rows gets
    none. Closing it closes ``rows``."""
    groups = groupby(rows, key=attrgetter("run_id"))
    try:
        current = next(groups, None)
        for run in runs:
            if current is not None and current[0] == run.id:
                yield run, current[1]
                current = next(groups, None)
            else:
                yield run, iter(())
    finally:
        close = getattr(rows, "close", None)
        if close is not None:
            close()


def exporter_lock_key(cursor_name: str) -> int:
    """The 64-bit advisory lock key of one cursor's exporter."""
    return int.from_bytes(hashlib.sha256(f"yuxi.otel_export:{cursor_name}".encode()).digest()[:8], "big", signed=True)


@contextmanager
def _exporter_lock(cursor_name: str) -> Iterator[bool]:
    """A session-level advisory lock per cursor on PostgreSQL (released in
    ``finally``, or by PostgreSQL when the session ends); always granted on
    SQLite, where the embedded defaults run one process."""
    if connection.vendor != "postgresql":
        yield True
        return
    key = exporter_lock_key(cursor_name)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [key])
        acquired = cursor.fetchone()[0]
    try:
        yield acquired
    finally:
        if acquired:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
