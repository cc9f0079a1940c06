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
rows come back through its converters, exactly as the ORM would
(:func:`conversations.sql.messages_from_values`, shared with the readers).
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from conversations.models import Message
from conversations.sql import messages_from_values
from yuxi_project.db import execute_prepared

from ..lease import Lease, leased_run_sql


@dataclass
class Assign:
    """Column assignments of an UPDATE: ``{column: (sql, params)}`` where
    ``sql`` is an expression over the row ``m`` (``"m.metadata || %s"``)."""

    columns: dict[str, tuple[str, list]] = field(default_factory=dict)

    def value(self, name: str, value: Any) -> Assign:
        """``name = value``, prepared by the model field ``name``."""
        return self.sql(name, "%s", value)

    def sql(self, name: str, expression: str, *values: Any) -> Assign:
        """``name = expression``; ``values`` are prepared by the field
        ``name`` (for a JSON patch: ``sql("metadata", "m.metadata || %s", patch)``)."""
        f, column = _field_and_column(name)
        db = connections[DEFAULT_DB_ALIAS] if values else None
        self.columns[column] = (expression, [None if v is None else f.get_db_prep_save(v, db) for v in values])
        return self


@functools.cache
def _field_and_column(name: str) -> tuple[Any, str]:
    """The message field ``name`` and its quoted column (static)."""
    f = Message._meta.get_field(name)
    return f, connections[DEFAULT_DB_ALIAS].ops.quote_name(f.column)


@dataclass(frozen=True)
class _Table:
    """What the statements need of the message table, computed once."""

    name: str  # quoted table name
    fields: list  # concrete fields but the primary key, for INSERT
    columns: list[str]  # their quoted columns
    casts: list[str]  # their SQL types, for ``CAST(%s AS …)``
    returned: list  # every concrete field, the key first
    returning: str  # "m.<column>, …" of ``returned``


@functools.cache
def _table() -> _Table:
    db = connections[DEFAULT_DB_ALIAS]
    fields = [f for f in Message._meta.concrete_fields if not f.primary_key]
    returned = list(Message._meta.concrete_fields)
    return _Table(
        name=db.ops.quote_name(Message._meta.db_table),
        fields=fields,
        columns=[db.ops.quote_name(f.column) for f in fields],
        # In an INSERT … SELECT a bare parameter has no column type yet. No
        # length or scale in the cast: an explicit cast to varchar(n) would
        # cut the value; the column's own check must refuse it.
        casts=[f.db_type(db).split("(", 1)[0] for f in fields],
        returned=returned,
        returning=", ".join(f"m.{db.ops.quote_name(f.column)}" for f in returned),
    )


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
    insert_when: tuple[str, list] | None = None,
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
        insert_when: a further condition of the insert, ``(sql, params)``
            (the user's budget has room, say): when it does not hold,
            nothing is inserted.

    Must not be inside a failed transaction; raises what the database
    raises (a lock timeout, a value the column refuses).
    """
    db = connections[DEFAULT_DB_ALIAS]
    table = _table()
    lease_sql, params = leased_run_sql(lease, now=now)
    parts = [f"WITH leased_run AS ({lease_sql})"]
    selects = []
    if update is not None:
        sets = []
        for column, (expression, values) in update.columns.items():
            sets.append(f"{column} = {expression}")
            params += values
        sets.append("updated_at = %s")
        params.append(now)
        parts.append(
            f", updated AS (UPDATE {table.name} AS m SET {', '.join(sets)} FROM leased_run "
            f"WHERE m.run_id = leased_run.id AND m.role = %s AND m.operation_id = %s AND ({update_when[0]}) "
            f"RETURNING {table.returning})"
        )
        params += [role, operation_id, *update_when[1]]
        selects.append("SELECT * FROM updated")
    if insert is not None:
        insert.run_id, insert.thread_id = lease.run_id, lease.thread_id
        insert.role, insert.operation_id = role, operation_id
        insert.created_at = insert.updated_at = now
        overrides = insert_sql or {}
        exprs = []
        for f, cast in zip(table.fields, table.casts, strict=True):
            if f.column in overrides:
                expression, values = overrides[f.column]
                exprs.append(expression)
                params += values
                continue
            value = getattr(insert, f.attname)
            exprs.append(f"CAST(%s AS {cast})")
            params.append(None if value is None else f.get_db_prep_save(value, db))
        conditions = ["NOT EXISTS (SELECT FROM updated)"] if update is not None else []
        if insert_when is not None:
            conditions.append(f"({insert_when[0]})")
            params += insert_when[1]
        guard = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        parts.append(
            f", inserted AS (INSERT INTO {table.name} AS m ({', '.join(table.columns)}) "
            f"SELECT {', '.join(exprs)} FROM leased_run{guard} "
            "ON CONFLICT (run_id, role, operation_id) WHERE operation_id IS NOT NULL DO NOTHING "
            f"RETURNING {table.returning})"
        )
        selects.append("SELECT * FROM inserted")
    sql = " ".join(parts) + " " + " UNION ALL ".join(selects)
    # Prepared once per connection — the text depends only on the kind of
    # write, never on the values — so a write costs one round trip and
    # little CPU on either side.
    found = execute_prepared(sql, params)
    return None if found is None else messages_from_values([found])[0]


def json_param(value: Any) -> Any:
    """``value`` as a ``jsonb`` parameter in the stored (escaped) form, for
    conditions such as ``m.metadata @> %s``."""
    return Message._meta.get_field("metadata").get_db_prep_save(value, connections[DEFAULT_DB_ALIAS])


def operation_row(run_id: uuid.UUID, role: str, operation_id: str) -> Message | None:
    """The row of one operation of a run, or None (the unique key's index)."""
    return Message.objects.filter(run_id=run_id, role=role, operation_id=operation_id).first()
