"""Database connection handling shared by the worker and the event stream."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from django.db import connection


def release_connection() -> None:
    """Give this thread's database connection back (to the pool) after a
    short transaction or read, unless the caller is inside an outer atomic
    block. The worker calls it after every audit write (R-RUN-5); the event
    stream calls it so that it holds no connection while it waits (R-EVT-1)."""
    if not connection.in_atomic_block:
        connection.close()


def execute_prepared(sql: str, params: Sequence[Any] | Mapping[str, Any]) -> tuple | None:
    """Run one statement on this thread's Django connection (its transaction,
    its adapters; errors translated as Django's are) with server-side
    binding, prepared once per connection, and return its first row.

    For hot statements whose text never changes (audit writes, the run's
    rollup): PostgreSQL then plans them once, not on every call — for a
    statement of several CTEs the planning costs more than the execution.
    Placeholders are psycopg's (``%s`` or ``%(name)s``). Without prepared
    statements (``DB_PREPARED_STATEMENTS=false``, or not PostgreSQL) the
    statement is only sent with server-side binding."""
    return _prepared(sql, params, lambda cursor: cursor.fetchone())


def execute_prepared_all(sql: str, params: Sequence[Any] | Mapping[str, Any]) -> list[tuple]:
    """:func:`execute_prepared`, returning every row."""
    return _prepared(sql, params, lambda cursor: cursor.fetchall())


def _prepared(sql: str, params: Sequence[Any] | Mapping[str, Any], fetch: Callable[[Any], Any]) -> Any:
    import psycopg

    connection.ensure_connection()
    if connection.vendor != "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return fetch(cursor)
    with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(sql, params, prepare=True)
        return fetch(cursor)


def field_converters(fields: Sequence[Any], table: str, db: Any) -> list[tuple[int, Any, list]]:
    """The converters the ORM applies to values read from ``table`` on the
    connection ``db``: ``(index, column, functions)`` for each of ``fields``
    (model fields in the order of the selected columns) that has any. For
    the readers that build model instances from raw rows; static per
    model, so callers compute it once."""
    converters = []
    for i, f in enumerate(fields):
        column = f.get_col(table)
        functions = db.ops.get_db_converters(column) + f.get_db_converters(db)
        if functions:
            converters.append((i, column, functions))
    return converters


def convert_values(values: Sequence[Any], converters: list[tuple[int, Any, list]], db: Any) -> list:
    """``values`` (one raw row) with :func:`field_converters`' converters
    applied, as a new list."""
    values = list(values)
    for i, column, functions in converters:
        value = values[i]
        for convert in functions:
            value = convert(value, column, db)
        values[i] = value
    return values


def worker_session_options(config) -> str:
    """The libpq ``options`` of a worker's connections (R-RUN-10):
    ``lock_timeout`` (no lock wait without bound), ``statement_timeout`` and
    ``idle_in_transaction_session_timeout`` — the last ends the transaction
    of a worker frozen while it holds a run row, so PostgreSQL releases the
    lock and the sweeper and the dispatcher get to the run."""
    return (
        f"-c lock_timeout={config.WORKER_LOCK_TIMEOUT_MS}"
        f" -c statement_timeout={config.WORKER_STATEMENT_TIMEOUT_MS}"
        f" -c idle_in_transaction_session_timeout={config.WORKER_IDLE_IN_TRANSACTION_TIMEOUT_MS}"
    )


def configure_worker_database(settings_dict: dict, config) -> None:
    """Give a Celery worker's database connections their session limits and
    a pool wait that fits inside the lease: ``AUDIT_WRITE_ATTEMPTS`` waits of
    at most a sixth of the lease each (R-RUN-8), so a run that loses the
    database fails ``audit_write_failed`` while its lease still holds.
    Call before the process opens its first connection."""
    options = settings_dict.setdefault("OPTIONS", {})
    if "pool" not in options:  # not PostgreSQL
        return
    existing = options.get("options", "")
    options["options"] = f"{existing} {worker_session_options(config)}".strip()
    pool = options["pool"] if isinstance(options["pool"], dict) else {}
    bounded = config.LEASE_TTL_SECONDS / (2 * config.AUDIT_WRITE_ATTEMPTS)
    options["pool"] = {**pool, "timeout": max(0.5, min(config.DB_POOL_TIMEOUT_SECONDS, bounded))}
