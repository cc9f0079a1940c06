"""Audit rows written by one statement fenced by the lease (R-RUN-4, R-RUN-5).

The lifecycle writes of a run — a model row opened, started and closed, a
tool row opened and closed — are each one SQL statement:

    WITH leased_run AS (<lock the run row, check the lease>)
    [, updated AS (UPDATE <message> SET … FROM leased_run WHERE <its key and state> RETURNING …)]
    [, inserted AS (INSERT INTO <message> … SELECT … FROM leased_run
                    [WHERE NOT EXISTS (SELECT FROM updated)] ON CONFLICT DO NOTHING RETURNING …)]
    SELECT … FROM updated UNION ALL SELECT … FROM inserted

``leased_run`` is :func:`leased_run_sql`: the run row locked
``FOR NO KEY UPDATE`` only while the lease holds, so the write happens
under the lock and the checks of R-RUN-4 or not at all. Lock, checks and
write are one round trip and one transaction (the statement's own, or the
caller's when one is open), and the row lock is released at its end
(R-RUN-5). The statement writes only when the row is in the state the write
expects (absent, running, awaiting its first chunk); when it writes
nothing, the service takes its locked path (:func:`audit.ledger.lease.lock_run`),
which names the lease error or applies the idempotency and conflict rules.

A write is compiled once per shape — the columns it sets and how, its
conditions, whether the row comes back — into a statement kept for the
process (and prepared once per connection): a call then prepares only its
own values (issue 11: building the statement had cost the worker as much as
its round trip). A new row is every concrete field of
:class:`~conversations.models.Message`: the values the write gives, the
run, thread and attempt of the locked run, and for every other field its
model default, compiled into the statement as a literal — so a column
added to the model is written here without change. Values go through each field's own preparation (the escaped form of
:mod:`core.storable`, JSON), and rows come back through its
converters, exactly as the ORM would
(:func:`conversations.sql.messages_from_values`, shared with the readers).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from conversations.models import Message
from conversations.sql import messages_from_values
from core.db import execute_prepared
from ops import metrics

from ..models import AgentRun
from .lease import Lease


def leased_run_sql(lease: Lease, *, now: datetime) -> tuple[str, list]:
    """The lock and the checks of :func:`~audit.ledger.lease.lock_run` as one
    SQL query, and its parameters: ``SELECT id, thread_id, attempt FROM
    <run table> WHERE id = … AND``
    request id, thread id, owner and fencing token equal the lease's, the
    status is not terminal and the lease expires after ``now`` ``FOR NO KEY
    UPDATE``. It yields the run's one row while the lease holds, else none.

    A write names it in a ``WITH leased_run AS (…)`` clause and takes its
    rows from ``leased_run``, so it writes only under the lease, with the
    row locked until the statement's transaction ends. ``FOR NO KEY
    UPDATE`` waits for a transaction that holds the row (a terminal
    transaction, a takeover) and then re-evaluates the checks on the row it
    committed (PostgreSQL's READ COMMITTED re-check of a locked row), so a
    write never lands in a run that ended or changed hands meanwhile.
    When the write touched nothing,
    :func:`~audit.ledger.lease.lease_check` names the reason.
    Implements R-RUN-4.
    """
    return _LEASED_RUN_SQL(), [lease.run_id, lease.request_id, lease.thread_id, lease.owner, lease.fencing_token, now]


def leased_run_query() -> str:
    """The SQL of :func:`leased_run_sql` alone, for a statement compiled
    before its parameters are known; they are the ones
    :func:`leased_run_sql` returns, in that order."""
    return _LEASED_RUN_SQL()


@functools.cache
def _LEASED_RUN_SQL() -> str:  # noqa: N802 - a constant, built once the connection is known
    table = connections[DEFAULT_DB_ALIAS].ops.quote_name(AgentRun._meta.db_table)
    # The terminal statuses are constants of the code: literals, so the
    # statement's text never changes (it is prepared once per connection).
    terminal = ", ".join(f"'{status}'" for status in AgentRun.TERMINAL_STATUSES)
    return (
        f"SELECT id, thread_id, attempt FROM {table} WHERE id = %s AND request_id = %s AND thread_id = %s "
        f"AND lease_owner = %s AND fencing_token = %s AND status NOT IN ({terminal}) "
        "AND lease_expires_at > %s FOR NO KEY UPDATE"
    )


@dataclass
class Assign:
    """Column assignments of an UPDATE: ``{field name: (sql, values)}``
    where ``sql`` is an expression over the row ``m`` (``"m.metadata ||
    %s"``) and each of ``values`` is prepared by the field ``name`` when the
    write is made."""

    columns: dict[str, tuple[str, tuple]] = field(default_factory=dict)

    def value(self, name: str, value: Any) -> Assign:
        """``name = value``, prepared by the model field ``name``."""
        return self.sql(name, "%s", value)

    def sql(self, name: str, expression: str, *values: Any) -> Assign:
        """``name = expression``; ``values`` are prepared by the field
        ``name`` (for a JSON patch: ``sql("metadata", "m.metadata || %s", patch)``)."""
        self.columns[name] = (expression, values)
        return self


@functools.cache
def _field(name: str) -> tuple[Any, str]:
    """The message field ``name`` and its quoted column (static)."""
    f = Message._meta.get_field(name)
    return f, connections[DEFAULT_DB_ALIAS].ops.quote_name(f.column)


def _literal(value: Any) -> str | None:
    """A field's default, as the field prepares it for the database, as an
    SQL literal; None for a kind of value written as a parameter instead.
    Only the model's own defaults pass here, never a caller's value."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int | Decimal):
        return str(value)
    if isinstance(value, str) and "\\" not in value:
        return "'" + value.replace("'", "''") + "'"
    # JSONField prepares a value as psycopg's Jsonb (``.obj``): an empty
    # dict or list is all the model's JSON defaults are.
    if type(value).__name__ == "Jsonb" and type(getattr(value, "obj", None)) in (dict, list) and not value.obj:
        return f"'{json.dumps(value.obj)}'"
    return None


# What a parameter of an inserted row is (see _Statement.insert_params).
_KEY, _NOW, _GIVEN, _STATIC, _SQL = range(5)


@dataclass(frozen=True)
class _Statement:
    """One shape of write, compiled (see :func:`_compile`)."""

    sql: str
    # The parameters of the INSERT's values, in the order of the statement:
    # (_KEY,) the operation id; (_NOW,) the write's time; (_GIVEN, field)
    # a value the call gives; (_STATIC, value) a default that is no
    # literal; (_SQL, column) the parameters of an expression the call
    # gives for that column.
    insert_params: tuple[tuple, ...] = ()


@functools.cache
def _compile(
    role: str,
    update: tuple[tuple[str, str], ...] | None,
    update_when: str,
    insert: tuple[str, ...] | None,
    insert_sql: tuple[tuple[str, str], ...],
    insert_when: str | None,
    load: bool,
) -> _Statement:
    """The statement of one shape of write: ``update`` is ``((field name,
    expression), …)``, ``insert`` the names of the fields the call gives,
    ``insert_sql`` ``((column, expression), …)``; see
    :func:`write_operation_row`. Placeholders are psycopg's ``%s``."""
    db = connections[DEFAULT_DB_ALIAS]
    qn = db.ops.quote_name
    table = qn(Message._meta.db_table)
    fields = Message._meta.concrete_fields if load else [Message._meta.pk]
    returning = ", ".join(f"m.{qn(f.column)}" for f in fields)
    parts = [f"WITH leased_run AS ({leased_run_query()})"]
    selects = []
    role_sql = _literal(str(role))
    if role_sql is None:
        raise ValueError(f"role {role!r} cannot be a literal")
    if update is not None:
        sets = [f"{_field(name)[1]} = {expression}" for name, expression in update]
        sets.append(f"{_field('updated_at')[1]} = %s")
        parts.append(
            f", updated AS (UPDATE {table} AS m SET {', '.join(sets)} FROM leased_run "
            # The row of the locked run's attempt: an earlier attempt's row of
            # the same operation is never changed by a later one (R-RUN-15).
            f"WHERE m.run_id = leased_run.id AND m.role = {role_sql} AND m.operation_id = %s "
            f"AND m.attempt = leased_run.attempt AND ({update_when}) "
            f"RETURNING {returning})"
        )
        selects.append("SELECT * FROM updated")
    params: list[tuple] = []
    if insert is not None:
        given, overrides, template = set(insert), dict(insert_sql), Message()
        columns, values = [], []
        for f in Message._meta.concrete_fields:
            if f.primary_key:
                continue
            columns.append(qn(f.column))
            # No length or scale in a cast: a cast to varchar(n) would cut
            # the value; the column's own check must refuse it.
            cast = f.db_type(db).split("(", 1)[0]
            if f.column in overrides:
                values.append(overrides[f.column])
                params.append((_SQL, f.column))
            elif f.name == "run":
                values.append("leased_run.id")
            elif f.name == "thread":
                values.append("leased_run.thread_id")
            elif f.name == "attempt":
                # The run attempt that writes the row, read under the lock
                # (R-RUN-15): never a value the caller could get wrong.
                values.append("leased_run.attempt")
            elif f.name == "role":
                values.append(role_sql)
            elif f.name == "operation_id":
                values.append(f"CAST(%s AS {cast})")
                params.append((_KEY,))
            elif f.name in ("created_at", "updated_at"):
                values.append(f"CAST(%s AS {cast})")
                params.append((_NOW,))
            elif f.name in given:
                values.append(f"CAST(%s AS {cast})")
                params.append((_GIVEN, f))
            else:
                default = f.get_db_prep_save(getattr(template, f.attname), db)
                literal = _literal(default)
                values.append(f"CAST({literal if literal is not None else '%s'} AS {cast})")
                if literal is None:
                    params.append((_STATIC, default))
        conditions = ["NOT EXISTS (SELECT FROM updated)"] if update is not None else []
        if insert_when is not None:
            conditions.append(f"({insert_when})")
        guard = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        parts.append(
            f", inserted AS (INSERT INTO {table} AS m ({', '.join(columns)}) "
            f"SELECT {', '.join(values)} FROM leased_run{guard} "
            "ON CONFLICT (run_id, role, operation_id, attempt) WHERE operation_id IS NOT NULL DO NOTHING "
            f"RETURNING {returning})"
        )
        selects.append("SELECT * FROM inserted")
    return _Statement(" ".join(parts) + " " + " UNION ALL ".join(selects), tuple(params))


def fenced_write(
    lease: Lease,
    *,
    role: str,
    operation_id: str,
    now: datetime,
    update: Assign | None = None,
    update_when: tuple[str, list] = ("TRUE", []),
    insert: dict[str, Any] | None = None,
    insert_sql: dict[str, tuple[str, list]] | None = None,
    insert_when: tuple[str, list] | None = None,
    load: bool = True,
) -> FencedWrite:
    """The write of the row ``(lease.run_id, role, operation_id)`` of the
    run's current attempt as one
    statement fenced by the lease (see the module docstring), not sent:
    :func:`write_operation_row` sends it, a :func:`fenced_service` yields it.
    Its result (:meth:`FencedWrite.result`) is the row, or None when nothing
    was written: the lease does not hold, or the row is not in the state the
    write expects.

    Args:
        update: assignments to the existing row (``updated_at = now`` is
            added), made only when ``update_when`` (SQL over ``m``, params)
            holds for it.
        insert: a new row, ``{field name: value}`` of the fields it gives;
            every other field takes its model default (run, thread, role
            and operation id are set here, ``attempt`` is the locked run's;
            ``created_at``/``updated_at`` are ``now``). Inserted only when
            the update changed nothing and no row has the key (``ON
            CONFLICT … DO NOTHING``).
        insert_sql: SQL for some inserted columns instead,
            ``{column: (sql, params)}``; it may name ``leased_run``.
        insert_when: a further condition of the insert, ``(sql, params)``
            (the user's budget has room, say): when it does not hold,
            nothing is inserted.
        load: return the row as stored (a :class:`Message`); False: only
            ``True`` once it is written, the row's key alone coming back.

    The SQL of ``update``, ``update_when``, ``insert_sql`` and
    ``insert_when`` must be constants of the code (their text is part of
    the compiled statement); their values go in the params.

    Sent, it must not be inside a failed transaction; it raises what the
    database raises (a lock timeout, a value the column refuses).
    """
    db = connections[DEFAULT_DB_ALIAS]
    overrides = insert_sql or {}
    statement = _compile(
        role,
        None if update is None else tuple((name, expr) for name, (expr, _) in update.columns.items()),
        update_when[0],
        None if insert is None else tuple(insert),
        tuple((column, sql) for column, (sql, _) in overrides.items()),
        None if insert_when is None else insert_when[0],
        load,
    )
    _, params = leased_run_sql(lease, now=now)
    if update is not None:
        for name, (_, values) in update.columns.items():
            f = _field(name)[0]
            params += [None if v is None else f.get_db_prep_save(v, db) for v in values]
        params += [now, _prepared_key(operation_id, db), *update_when[1]]
    if insert is not None:
        for kind, *what in statement.insert_params:
            if kind == _GIVEN:
                value = insert[what[0].name]
                params.append(None if value is None else what[0].get_db_prep_save(value, db))
            elif kind == _KEY:
                params.append(_prepared_key(operation_id, db))
            elif kind == _NOW:
                params.append(now)
            elif kind == _SQL:
                params += overrides[what[0]][1]
            else:
                params.append(what[0])
        if insert_when is not None:
            params += insert_when[1]
    return FencedWrite(statement.sql, params, load)


def write_operation_row(lease: Lease, **write: Any) -> Message | bool | None:
    """Send :func:`fenced_write`'s statement (same arguments) on this
    thread's connection, in its transaction if one is open, and return its
    result: the row (``load``), True, or None when nothing was written."""
    return send(fenced_write(lease, **write))


@dataclass(frozen=True)
class FencedWrite:
    """One write as its statement, not yet sent: ``sql`` (psycopg
    placeholders), its ``params`` and whether the whole row comes back
    (``load``). The text depends only on the shape of the write, never on
    its values: it is prepared once per connection, so a write costs one
    round trip and little CPU on either side."""

    sql: str
    params: list
    load: bool

    def result(self, found: tuple | None) -> Message | bool | None:
        """The write's result from the row the statement returned
        (``found``, None when it wrote nothing)."""
        if found is None:
            return None
        return messages_from_values([found])[0] if self.load else True


def send(write: FencedWrite) -> Message | bool | None:
    """Send ``write`` on this thread's connection (:func:`core.db.execute_prepared`)
    and return its result."""
    return write.result(execute_prepared(write.sql, write.params))


#: A fenced service's steps: a generator that yields each write it sends
#: and receives that write's result (:meth:`FencedWrite.result`).
Steps = Generator[FencedWrite, Any, Any]


def fenced_service[**P](kind: str) -> Callable[[Callable[P, Steps]], Callable[P, Any]]:
    """Make a lifecycle service of its steps: a generator function that
    yields the :class:`FencedWrite` of its usual path and receives its
    result, then goes on (its locked path when nothing was written).

    The decorated name is the synchronous service (every caller's): it
    sends each yielded write on this thread's connection and returns what
    the steps return, its latency and errors observed as
    ``yuxi_audit_write_*{kind}`` (:func:`ops.metrics.audit_write`). The
    steps stay reachable as ``service.steps`` and ``service.kind`` for the
    worker, which awaits the same writes on its event loop
    (:func:`audit.execution.writes.write_with_retry`): one body, two
    drivers, no second copy of a service."""

    def decorate(steps: Callable[P, Steps]) -> Callable[P, Any]:
        @metrics.audit_write(kind)
        @functools.wraps(steps)
        def service(*args: P.args, **kwargs: P.kwargs) -> Any:
            return drive(steps(*args, **kwargs), send)

        service.steps = steps  # type: ignore[attr-defined]
        service.kind = kind  # type: ignore[attr-defined]
        return service

    return decorate


def drive(steps: Steps, send_write: Callable[[FencedWrite], Any]) -> Any:
    """Run ``steps`` to its end, each write it yields sent by
    ``send_write`` and its result sent back; returns what the steps return."""
    try:
        write = next(steps)
        while True:
            write = steps.send(send_write(write))
    except StopIteration as done:
        return done.value


def _prepared_key(operation_id: str, db: Any) -> Any:
    return _field("operation_id")[0].get_db_prep_save(operation_id, db)


def json_param(value: Any) -> Any:
    """``value`` as a ``jsonb`` parameter in the stored (escaped) form, for
    conditions such as ``m.metadata @> %s``."""
    return Message._meta.get_field("metadata").get_db_prep_save(value, connections[DEFAULT_DB_ALIAS])


def operation_row(run: AgentRun, role: str, operation_id: str) -> Message | None:
    """The row of one operation of ``run``'s current attempt (a run locked
    by the caller), or None (the unique key's index, R-RUN-15)."""
    return Message.objects.filter(run_id=run.pk, role=role, operation_id=operation_id, attempt=run.attempt).first()
