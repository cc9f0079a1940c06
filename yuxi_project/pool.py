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
    readable, _, _ = select.select([conn.fileno()], [], [], 0)
    if readable:
        ConnectionPool.check_connection(conn)
