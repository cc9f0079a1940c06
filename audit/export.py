"""Export of the audit as JSON lines or CSV, streamed (R-ADM-2).

A selection — one run, one thread, or the runs matching a filter — is
exported as one record per timeline row, with the fields and JSON forms of
the staff timeline API (:class:`audit.schemas.TimelineItemOut`), in
timeline order: runs by creation, then each run's rows by ``sequence``
(rows without one last), then id.

Memory stays constant whatever the size: runs are read in keyset chunks of
:data:`RUN_CHUNK`, each run's rows in keyset chunks of :data:`ROW_CHUNK`
(index ``message_run_sequence_idx``), and the text is produced as it is
sent. The API, the admin (run page, thread page, run-list action) and
``manage.py export_audit`` share these generators.

Text PostgreSQL cannot hold (a NUL, a lone surrogate, stored escaped,
R-RUN-11) goes out as every other reader shows it (R-RUN-13): a JSON line
or a CSV JSON cell is the API's JSON (:func:`yuxi_project.responses.encode_json`,
which writes a lone surrogate as the ``\\ud800`` escape), and a CSV text
cell is the admin's form (:func:`core.storable.visible`). So every piece
can be encoded as UTF-8: one such character used to cut the download with
``UnicodeEncodeError``.

A CSV text cell that a spreadsheet would run as a formula — its first
character one of :data:`FORMULA_STARTS` — is written with a leading ``'``
(:func:`csv_text`, R-ADM-3): quoting the cell does not stop Excel, LibreOffice
or Google Sheets from running ``=HYPERLINK(...)``. Numbers the export writes
(ids, sequences, durations, costs) and JSON cells are left as they are.
"""

from __future__ import annotations

import csv
import io
import json
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.db.models import Q, QuerySet, Value
from django.http import StreamingHttpResponse

from conversations.models import Message
from conversations.sql import messages_of
from core.db import release_connection
from core.errors import InvalidInput
from core.storable import visible
from yuxi_project.responses import encode_json

from .models import AgentRun, RunRollback
from .reads.selectors import timeline_item
from .schemas import TimelineItemOut

FORMATS = ("jsonl", "csv")
CONTENT_TYPES = {"jsonl": "application/x-ndjson; charset=utf-8", "csv": "text/csv; charset=utf-8"}
COLUMNS = tuple(TimelineItemOut.model_fields)
# Columns that hold JSON: a JSON text in a CSV cell.
_JSON_COLUMNS = {"usage", "tool_calls", "tool_input", "namespace", "metadata", "raw_output"}
# A string column that holds a number the product wrote (a decimal string):
# a number, not text, so never prefixed.
_NUMBER_COLUMNS = {"cost_usd"}
# First characters that make a spreadsheet read a cell as a formula
# (OWASP, "CSV Injection").
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
ROW_CHUNK = 1000
RUN_CHUNK = 200
# Text is sent in pieces of about this many characters.
SEND_CHARS = 64 * 1024


# --------------------------------------------------------------------------
# Rows in timeline order, in bounded chunks
# --------------------------------------------------------------------------


_EXTRA = ("run_rolled_back",)


def run_rows(run_id: uuid.UUID | str) -> Iterator[Message]:
    """The run's model and tool rows in timeline order: first the rows with
    a sequence by ``(sequence, id)``, then those without one by id. Keyset
    chunks of :data:`ROW_CHUNK` rows."""
    rows = Message.objects.audit().filter(run_id=run_id)
    # Each row says whether its run was rolled back (R-API-2): read once.
    rolled_back = RunRollback.objects.filter(run_id=run_id).exists()
    rows = rows.annotate(run_rolled_back=Value(rolled_back))
    last: tuple[int, int] | None = None
    while True:
        chunk = rows.filter(sequence__isnull=False)
        if last is not None:
            # ``sequence >= s`` is the index condition; the OR only filters.
            chunk = chunk.filter(Q(sequence__gte=last[0]) & (Q(sequence__gt=last[0]) | Q(pk__gt=last[1])))
        page = messages_of(chunk.order_by("sequence", "pk")[:ROW_CHUNK], extra=_EXTRA)
        yield from page
        if len(page) < ROW_CHUNK:
            break
        last = (page[-1].sequence, page[-1].pk)
    last_id = 0
    while True:
        page = messages_of(rows.filter(sequence__isnull=True, pk__gt=last_id).order_by("pk")[:ROW_CHUNK], extra=_EXTRA)
        yield from page
        if len(page) < ROW_CHUNK:
            break
        last_id = page[-1].pk


def runs_rows(runs: QuerySet[AgentRun]) -> Iterator[Message]:
    """The rows of every run of ``runs`` (any filtered QuerySet of runs),
    runs in creation order, read in keyset chunks of :data:`RUN_CHUNK`."""
    runs = AgentRun.objects.filter(pk__in=runs.order_by().values("pk"))
    last = None
    while True:
        chunk = runs
        if last is not None:
            created_at, pk = last
            chunk = chunk.filter(Q(created_at__gte=created_at) & (Q(created_at__gt=created_at) | Q(pk__gt=pk)))
        page = list(chunk.order_by("created_at", "pk").values_list("created_at", "pk")[:RUN_CHUNK])
        for _, run_id in page:
            yield from run_rows(run_id)
        if len(page) < RUN_CHUNK:
            return
        last = page[-1]


def thread_rows(thread_id: uuid.UUID | str) -> Iterator[Message]:
    """Every run of the thread in creation order, each run's rows in order."""
    return runs_rows(AgentRun.objects.filter(thread_id=thread_id))


# --------------------------------------------------------------------------
# Records and text
# --------------------------------------------------------------------------


def records(rows: Iterable[Message]) -> Iterator[dict[str, Any]]:
    """One dict per row: the timeline API's item
    (:func:`~audit.reads.selectors.timeline_item`, which is what its schema
    ``TimelineItemOut`` dumps: ``tests/read/test_fast_serialisation.py``);
    written out with the API's JSON encoder (:func:`as_json`), its values
    are the API's, byte for byte (ISO 8601 times to the millisecond in
    UTC, ``Z``). Not validated again row by row (issue 38)."""
    for row in rows:
        yield timeline_item(row, include_raw_output=True)


def as_json(value: Any) -> str:
    """JSON text of ``value`` as the API writes it (the same encoder, so
    the same bytes); always encodable as UTF-8, a lone surrogate included
    (R-RUN-13)."""
    return encode_json(value).decode()


def render(items: Iterable[dict[str, Any]], fmt: str) -> Iterator[str]:
    """Text of ``items`` in ``fmt``, in pieces of about :data:`SEND_CHARS`.

    ``jsonl``: one JSON object per line. ``csv``: a header of
    :data:`COLUMNS`, then one line per item; JSON-valued fields are JSON
    texts, a null is an empty cell, text is in the admin's form
    (:func:`core.storable.visible`: a NUL or lone surrogate as its
    six-character escape, R-RUN-13) with a ``'`` in front of what a
    spreadsheet would run as a formula (:func:`csv_text`, R-ADM-3).

    Raises:
        InvalidInput: an unknown format (``field: format``).
    """
    check_format(fmt)
    pending: list[str] = []
    size = 0
    for line in _jsonl_lines(items) if fmt == "jsonl" else _csv_lines(items):
        pending.append(line)
        size += len(line)
        if size >= SEND_CHARS:
            yield "".join(pending)
            pending, size = [], 0
    if pending:
        yield "".join(pending)


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise InvalidInput(f"format must be one of {', '.join(FORMATS)}", extra={"field": "format"})


def _jsonl_lines(items: Iterable[dict[str, Any]]) -> Iterator[str]:
    for item in items:
        yield as_json(item) + "\n"


def _csv_lines(items: Iterable[dict[str, Any]]) -> Iterator[str]:
    buffer = io.StringIO()
    # Lines end with CRLF (RFC 4180): the writer quotes a cell holding a
    # character of the line terminator, and with "\n" a lone "\r" (a cell
    # such as "\rcmd") went out unquoted, a line break to every reader.
    writer = csv.writer(buffer, lineterminator="\r\n")

    def line(values) -> str:
        buffer.seek(0)
        buffer.truncate()
        writer.writerow(values)
        return buffer.getvalue()

    yield line(COLUMNS)
    for item in items:
        yield line([_cell(name, item.get(name)) for name in COLUMNS])


def _cell(name: str, value: Any) -> str:
    if value is None:
        return ""
    if name in _JSON_COLUMNS:
        return as_json(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if name in _NUMBER_COLUMNS else csv_text(value)
    if isinstance(value, int):
        return str(value)
    # Times and ids exactly as in the JSON, without the quotes.
    return json.loads(as_json(value))


def csv_text(value: str) -> str:
    """``value`` as a CSV text cell: the admin's form (a NUL or lone
    surrogate as its six-character escape, R-RUN-13), with a ``'`` in front
    when it starts with one of :data:`FORMULA_STARTS`, so a spreadsheet
    shows it as text instead of running it as a formula (R-ADM-3).
    ``"-1 apples"`` gets the ``'`` too: it is text, whoever wrote it.
    A reader that needs the original strips one leading ``'`` from a text
    cell whose second character is in :data:`FORMULA_STARTS` (text that
    itself began with such a ``'`` reads the same: OWASP's trade-off).

    JSON cells do not go through here: a JSON text starts with ``{``,
    ``[``, ``"``, a digit, a letter or, for a negative number, ``-`` —
    which a spreadsheet reads as that number — so it never runs as a
    formula, and it stays JSON.
    """
    text = visible(value)
    return "'" + text if text.startswith(FORMULA_STARTS) else text


# --------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------


def streaming_response(request, pieces: Iterator[str], *, fmt: str, filename: str) -> StreamingHttpResponse:
    """A download of ``pieces`` that streams under both servers.

    Django consumes a synchronous iterator whole before sending it under
    ASGI (and an asynchronous one under WSGI), so the iterator matches the
    request: under ASGI each piece is produced in the request's sync thread
    (where its database connection lives) and sent before the next is read.
    """
    content: Iterator[str] | AsyncIterator[str]
    content = _async_pieces(pieces) if isinstance(request, ASGIRequest) else pieces
    response = StreamingHttpResponse(content, content_type=CONTENT_TYPES[fmt])
    response["Content-Disposition"] = f'attachment; filename="{filename}.{fmt}"'
    response["Cache-Control"] = "no-store"
    response["X-Accel-Buffering"] = "no"
    return response


async def _async_pieces(pieces: Iterator[str]) -> AsyncIterator[str]:
    step = sync_to_async(lambda: next(pieces, None), thread_sensitive=True)
    try:
        while (piece := await step()) is not None:
            yield piece
    finally:
        await sync_to_async(release_connection, thread_sensitive=True)()


def export_filename(kind: str, ident: uuid.UUID | str | None = None) -> str:
    return f"audit-{kind}-{ident}" if ident else f"audit-{kind}"
