"""Audit rows written by one statement fenced by the lease (R-RUN-4, R-RUN-5).

The lifecycle writes of a run — a model row opened, started and closed, a
tool row opened and closed — are each one SQL statement:

    WITH leased_run AS (<lock the run row, check the lease>)
    [, updated AS (UPDATE <message> SET … FROM leased_run WHERE <its key and state> RETURNING …)]
    [, inserted AS (INSERT INTO <message> … SELECT … FROM leased_run
                    [WHERE NOT EXISTS (SELECT FROM updated)] ON CONFLICT DO NOTHING RETURNING …)]
    SELECT … FROM updated UNION ALL SELECT … FROM inserted

``leased_run`` is :func:`audit.lease.leased_run_sql`: the run row locked
``FOR NO KEY UPDATE`` only while the lease holds, so the write happens
under the lock and the checks of R-RUN-4 or not at all. Lock, checks and
write are one round trip and one transaction (the statement's own, or the
caller's when one is open), and the row lock is released at its end
(R-RUN-5). The statement writes only when the row is in the state the write
expects (absent, running, awaiting its first chunk); when it writes
nothing, the service takes its locked path (:func:`audit.lease.lock_run`),
which names the lease error or applies the idempotency and conflict rules.

Rows are built as unsaved :class:`~conversations.models.Message` objects
and every concrete field is written, so a column added to the model is
written here without change. Values go through each field's own
preparation (the escaped form of :mod:`yuxi_project.storable`, JSON), and
rows come back through its converters, exactly as the ORM would.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import connection

from conversations.models import Message

from ..lease import Lease, leased_run_sql


@dataclass
class Assign:
    """Column assignments of an UPDATE: ``{column: (sql, params)}`` where
    ``sql`` is an expression over the row ``m`` (``"m.metadata || %s"``)."""

    columns: dict[str, tuple[str, list]] = field(default_factory=dict)

    def value(self, name: str, value: Any) -> Assign:
        """``name = value``, prepared by the model field ``name``."""
        f = Message._meta.get_field(name)
        self.columns[f.column] = ("%s", [f.get_db_prep_save(value, connection)])
        return self

    def sql(self, name: str, expression: str, *values: Any) -> Assign:
        """``name = expression``; ``values`` are prepared by the field
        ``name`` (for a JSON patch: ``sql("metadata", "m.metadata || %s", patch)``)."""
        f = Message._meta.get_field(name)
        self.columns[f.column] = (expression, [f.get_db_prep_save(v, connection) for v in values])
        return self


@functools.cache
def _fields() -> tuple[list, list[str], str]:
    """Concrete fields of Message but the primary key, their SQL casts (for
    an ``INSERT … SELECT``: a bare literal there has no column type yet),
    and the quoted table name."""
    fields = [f for f in Message._meta.concrete_fields if not f.primary_key]
    casts = []
    for f in fields:
        db_type = f.db_type(connection)
        # No length or scale in the cast: an explicit cast to varchar(n)
        # would cut the value; the column's own check must refuse it.
        casts.append(db_type.split("(", 1)[0])
    return fields, casts, connection.ops.quote_name(Message._meta.db_table)


@functools.cache
def _returning() -> tuple[list, str]:
    """All concrete fields (the key first) and their ``m.`` column list."""
    fields = list(Message._meta.concrete_fields)
    return fields, ", ".join(f"m.{connection.ops.quote_name(f.column)}" for f in fields)


def _message_from_row(values: tuple) -> Message:
    fields, _ = _returning()
    converted = []
    for f, value in zip(fields, values, strict=True):
        for converter in f.get_db_converters(connection):
            value = converter(value, None, connection)
        converted.append(value)
    return Message.from_db(connection.alias, [f.attname for f in fields], converted)


def write_operation_row(
    lease: Lease,
    *,
    role: str,
    operation_id: str,
    now: datetime,
    update: Assign | None = None,
    update_when: tuple[str, list] = ("TRUE", []),
    insert: Message | None = None,
    insert_sql: dict[str, tuple[str, list]] | None = None,
) -> Message | None:
    """Write the row ``(lease.run_id, role, operation_id)`` in one statement
    fenced by the lease (see the module docstring) and return it, or None
    when nothing was written: the lease does not hold, or the row is not in
    the state the write expects.

    Args:
        update: assignments to the existing row (``updated_at = now`` is
            added), made only when ``update_when`` (SQL over ``m``, params)
            holds for it.
        insert: a new row (run, thread, role and operation id are set
            here; ``created_at``/``updated_at`` are ``now``), inserted only
            when the update changed nothing and no row has the key
            (``ON CONFLICT … DO NOTHING``).
        insert_sql: SQL for some inserted columns instead of the row's
            value, ``{column: (sql, params)}``; it may name ``leased_run``.

    Must not be inside a failed transaction; raises what the database
    raises (a lock timeout, a value the column refuses).
    """
    lease_sql, params = leased_run_sql(lease, now=now)
    table = _fields()[2]
    _, returning = _returning()
    parts = [f"WITH leased_run AS ({lease_sql})"]
    selects = []
    if update is not None:
        assign = dict(update.columns)
        assign["updated_at"] = ("%s", [Message._meta.get_field("updated_at").get_db_prep_save(now, connection)])
        sets = []
        for column, (expression, values) in assign.items():
            sets.append(f"{connection.ops.quote_name(column)} = {expression}")
            params += values
        parts.append(
            f", updated AS (UPDATE {table} AS m SET {', '.join(sets)} FROM leased_run "
            f"WHERE m.run_id = leased_run.id AND m.role = %s AND m.operation_id = %s AND ({update_when[0]}) "
            f"RETURNING {returning})"
        )
        params += [role, operation_id, *update_when[1]]
        selects.append("SELECT * FROM updated")
    if insert is not None:
        fields, casts, _ = _fields()
        insert.run_id, insert.thread_id = lease.run_id, lease.thread_id
        insert.role, insert.operation_id = role, operation_id
        insert.created_at = insert.updated_at = now
        overrides = insert_sql or {}
        columns, exprs = [], []
        for f, cast in zip(fields, casts, strict=True):
            columns.append(connection.ops.quote_name(f.column))
            if f.column in overrides:
                expression, values = overrides[f.column]
                exprs.append(expression)
                params += values
            else:
                exprs.append(f"CAST(%s AS {cast})")
                params.append(f.get_db_prep_save(getattr(insert, f.attname), connection))
        guard = " WHERE NOT EXISTS (SELECT FROM updated)" if update is not None else ""
        parts.append(
            f", inserted AS (INSERT INTO {table} AS m ({', '.join(columns)}) "
            f"SELECT {', '.join(exprs)} FROM leased_run{guard} "
            "ON CONFLICT (run_id, role, operation_id) WHERE operation_id IS NOT NULL DO NOTHING "
            f"RETURNING {returning})"
        )
        selects.append("SELECT * FROM inserted")
    sql = " ".join(parts) + " " + " UNION ALL ".join(selects)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        found = cursor.fetchone()
    return None if found is None else _message_from_row(found)


def json_param(value: Any) -> Any:
    """``value`` as a ``jsonb`` parameter in the stored (escaped) form, for
    conditions such as ``m.metadata @> %s``."""
    return Message._meta.get_field("metadata").get_db_prep_save(value, connection)


def operation_row(run_id: uuid.UUID, role: str, operation_id: str) -> Message | None:
    """The row of one operation of a run, or None (the unique key's index)."""
    return Message.objects.filter(run_id=run_id, role=role, operation_id=operation_id).first()
