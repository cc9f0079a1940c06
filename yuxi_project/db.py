"""Database connection handling shared by the worker and the event stream."""

from __future__ import annotations

from django.db import connection


def release_connection() -> None:
    """Give this thread's database connection back (to the pool) after a
    short transaction or read, unless the caller is inside an outer atomic
    block. The worker calls it after every audit write (R-RUN-5); the event
    stream calls it so that it holds no connection while it waits (R-EVT-1)."""
    if not connection.in_atomic_block:
        connection.close()
