"""The database connection pool's check (no Django import: settings use it)."""

from __future__ import annotations

import select

import psycopg
from psycopg_pool import ConnectionPool


def pool_check_connection(conn) -> None:
    """The connection pool's check of a connection it hands out, without a
    round trip in the usual case.

    An idle connection has nothing to read. When the server ended it (a
    restart, ``idle_in_transaction_session_timeout``, an administrator) its
    socket becomes readable (end of file or a final error message): only
    then, or when the client already knows it is closed, the full check
    (an empty query) runs and raises, so the pool replaces the connection
    instead of failing the next audit write. A connection lost without a
    word (a network cut) is found by the write itself, which is retried
    (R-RUN-8). Saves one round trip per checkout: the worker checks a
    connection out for every audit write (R-RUN-5)."""
    if conn.closed or conn.broken:
        raise psycopg.OperationalError("the connection is closed")
    if has_input(conn):
        try:
            ConnectionPool.check_connection(conn)
        except psycopg.Error:
            _check_idle_connections(conn)
            raise


def has_input(conn) -> bool:
    """Whether the socket of ``conn`` (a psycopg connection, sync or async)
    has something to read now, without waiting: for an idle connection, the
    sign that the server ended it (end of file or a final error message)."""
    readable, _, _ = select.select([conn.fileno()], [], [], 0)
    return bool(readable)


def _check_idle_connections(conn) -> None:
    """The server ended ``conn``: in a restart it ended every idle
    connection of the pool at once. Check them all now (a round trip each,
    only on this rare path), so the broken ones are replaced together;
    otherwise the checkout meets them one by one, and the pool backs off
    1 s, 2 s, 4 s… after each failed check — a write after a restart waited
    out the whole pool timeout and lost one of its attempts (R-RUN-8)."""
    # psycopg_pool gives the check only the connection; the pool it came
    # from is its ``_pool`` (what putconn() checks the connection against).
    pool = getattr(conn, "_pool", None)
    if isinstance(pool, ConnectionPool) and not pool.closed:
        pool.check()
