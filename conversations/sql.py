"""SQL pieces for the readers that walk a thread's runs before their rows
(history, memory, timelines; R-READ-1..3, issue 11).

Those readers order rows by their run (creation time, id) and then by the
row's own key inside the run. Written as one ORM query, the order comes
from a join, so PostgreSQL reads and sorts every row of the run or thread
to return one page. Written as ``runs ⋈ LATERAL (rows of one run ORDER BY
… LIMIT n)``, each step is an index scan in the order wanted and the scan
stops once the page is full. The ORM has no LATERAL, so these readers build
that statement here, with the row predicates compiled from the same
``Q`` definitions the ORM readers use (:mod:`conversations.models`), never
re-typed in SQL.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from django.db import connections
from django.db.models import JSONField, Q, QuerySet

from core.db import convert_values, field_converters
from core.storable import json_texts_parsed

from .models import Message

MESSAGE_TABLE = Message._meta.db_table


def message_columns(alias: str = MESSAGE_TABLE, *, exclude: frozenset[str] = frozenset()) -> str:
    """The message table's model columns qualified with ``alias`` (never
    ``*``: the generated ``search_vector`` column is no model field and
    would travel with every row)."""
    qn = connections["default"].ops.quote_name
    return ", ".join(
        f"{qn(alias)}.{qn(f.column)}"
        for f in Message._meta.concrete_fields
        if f.name not in exclude and f.attname not in exclude
    )


def predicate_sql(condition: Q, *, using: str = "default") -> tuple[str, list]:
    """``condition`` on the message table compiled to SQL and its params;
    columns are qualified with the table's own name, so the statement must
    name the table without an alias. Only conditions on the message row
    itself (no joins) compile here."""
    query = Message.objects.using(using).filter(condition).query
    if len(query.alias_map) > 1:
        raise ValueError("predicate_sql takes conditions on the message row only")
    compiler = query.get_compiler(using=using)
    sql, params = compiler.compile(query.where)
    return sql, list(params)


def message_rows(
    sql: str, params: list, *, extra: tuple[str, ...] = (), fields: tuple[str, ...] | None = None
) -> list[Message]:
    """The rows of ``sql`` as :class:`Message` instances, for the paged
    readers (timelines, history; R-READ-1, R-READ-3). ``sql`` selects
    :func:`message_columns` (every model column, in field order; or the
    columns named ``fields``) and then the ``extra`` columns, which become
    attributes of the same names; see :func:`messages_from_values`."""
    from django.db import connection

    with connection.cursor() as cursor:
        native_timestamps(cursor, connection)
        cursor.execute(sql, params)
        return messages_from_values(cursor.fetchall(), extra=extra, fields=fields)


def messages_of(
    rows: QuerySet[Message], *, extra: tuple[str, ...] = (), fields: tuple[str, ...] | None = None
) -> list[Message]:
    """The rows of the ORM query ``rows`` (filtered, ordered, sliced as the
    caller likes), read as :func:`message_rows` reads them: every model
    column (or the attribute names ``fields``, the others deferred as with
    ``only``), then the annotations named ``extra``, made into instances
    without the ORM's per-row work (issue 38: a 20,000-row export spent
    most of its time there)."""
    sql, params = _values_sql(rows, fields, extra)
    return message_rows(sql, params, extra=extra, fields=fields)


def messages_streamed(
    rows: QuerySet[Message],
    *,
    chunk_size: int,
    extra: tuple[str, ...] = (),
    fields: tuple[str, ...] | None = None,
) -> Iterator[Message]:
    """:func:`messages_of` read lazily, ``chunk_size`` rows at a time,
    through a server-side cursor: for readers of more rows than a page
    (the OpenTelemetry export). Each chunk's values become instances at
    once (:func:`messages_from_values`). Closing the iterator closes the
    cursor. With ``DISABLE_SERVER_SIDE_CURSORS`` on the connection (behind
    a transaction pooler such as PgBouncer, as ``QuerySet.iterator``
    honours it) an ordinary cursor, fetched in the same chunks."""
    from django.db import connection

    sql, params = _values_sql(rows, fields, extra)
    server_side = not connection.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS")
    with connection.chunked_cursor() if server_side else connection.cursor() as cursor:
        native_timestamps(cursor, connection)
        cursor.execute(sql, params)
        while chunk := cursor.fetchmany(chunk_size):
            yield from messages_from_values(chunk, fields=fields, extra=extra)


def _values_sql(rows: QuerySet[Message], fields: tuple[str, ...] | None, extra: tuple[str, ...]) -> tuple[str, list]:
    """The SQL and params selecting ``rows``' columns ``fields`` (all model
    columns when None, in field order) and then ``extra``."""
    names = fields if fields is not None else [f.attname for f in Message._meta.concrete_fields]
    sql, params = rows.values_list(*names, *extra).query.sql_with_params()
    return sql, list(params)


def native_timestamps(cursor: Any, db: Any) -> None:
    """Load ``timestamptz`` values on the Django ``cursor`` with psycopg's
    own loader (C) where it gives exactly what Django's gives: when the
    session's time zone is the connection's (both UTC: psycopg then returns
    the same ``datetime.UTC`` tzinfo that Django's loader puts on every
    value). Django's loader is Python and replaces each value's tzinfo:
    ~2.5 µs a value, 6 ms of a 500-row timeline page's 27 (issue 11).
    Anything else keeps Django's loader."""
    if db.vendor != "postgresql":
        return
    raw = cursor.cursor
    if raw.connection.info.timezone is not db.timezone:
        return
    from psycopg.types.datetime import TimestamptzLoader

    raw.adapters.register_loader("timestamptz", TimestamptzLoader)


def messages_from_values(
    fetched: list, *, extra: tuple[str, ...] = (), fields: tuple[str, ...] | None = None
) -> list[Message]:
    """Rows of values — every concrete column of :class:`Message` in field
    order, then the ``extra`` columns — as loaded :class:`Message`
    instances (``_state.adding`` false; ``extra`` become attributes). Shared
    by the paged readers, the fenced audit writes' ``RETURNING`` and the
    OpenTelemetry export. ``fields``: the attribute names of the model
    columns the rows hold instead, in their order (the others are deferred,
    loaded on access as with ``QuerySet.only``).

    The values are converted as the ORM converts them (the stored escapes
    decoded, R-RUN-11; JSON parsed), but the instances are built without
    ``Model.__init__``: its per-field work cost more than the statement
    itself on a 500-row page. No ``pre_init``/``post_init`` receiver exists
    for ``Message``; one that is added must be called here too."""
    from django.db import connection
    from django.db.models.base import ModelState

    attnames, converters, batched = _message_converters(connection.alias, fields)
    names = [*attnames, *extra]
    if len(fetched) > 1 and batched:
        # JSON columns parsed per column, by one json.loads of all their
        # values (StorableJSONField.from_db_values): on a 500-row page the
        # parser's work per call cost more than the parsing.
        fetched = [list(values) for values in fetched]
        for i, _, load_many in batched:
            present = [values for values in fetched if values[i] is not None]
            for values, value in zip(present, load_many([v[i] for v in present], connection), strict=True):
                values[i] = value
    else:
        converters = [*converters, *((i, None, [f.from_db_value]) for i, f, _ in batched)]
    new = Message.__new__
    rows = []
    for values in fetched:
        values = convert_values(values, converters, connection)
        row = new(Message)
        state = row._state = ModelState()
        state.adding, state.db = False, connection.alias
        row.__dict__.update(zip(names, values, strict=True))
        rows.append(row)
    return rows


@functools.cache
def _message_converters(
    alias: str, only: tuple[str, ...] | None = None
) -> tuple[list[str], list[tuple[int, Any, list]], list[tuple[int, Any, Any]]]:
    """The attribute names of :class:`Message`'s concrete fields (or of
    the fields named ``only``, in that order); per field that has any, ``(index, column, converters)`` as the ORM applies them on
    the database ``alias``; and apart from those, ``(index, field,
    load_many)`` of the fields whose only converter is their own
    ``from_db_value`` and whose values convert many at once: the storable
    JSON fields (``from_db_values``) and plain JSON fields (one parse of
    all, :func:`~core.storable.json_texts_parsed`). Static, computed once
    (a fenced audit write converts one row, and finding them cost more than
    applying them)."""
    fields = Message._meta.concrete_fields
    if only is not None:
        by_attname = {f.attname: f for f in fields}
        fields = [by_attname[name] for name in only]
    converters, batched = [], []
    for i, column, functions in field_converters(fields, MESSAGE_TABLE, connections[alias]):
        f = fields[i]
        if functions != [f.from_db_value]:
            converters.append((i, column, functions))
        elif hasattr(f, "from_db_values"):
            batched.append((i, f, f.from_db_values))
        elif type(f) is JSONField and f.decoder is None:
            # A plain JSON column (``namespace``: "[]" on almost every row).
            batched.append((i, f, functools.partial(_json_values, f)))
        else:
            converters.append((i, column, functions))
    return [f.attname for f in fields], converters, batched


def _json_values(field: JSONField, texts: list[str], db: Any) -> list[Any]:
    """A plain JSON column's values, parsed at once where they can be."""
    parsed = json_texts_parsed(texts)
    return parsed if parsed is not None else [field.from_db_value(text, None, db) for text in texts]
