"""Databases of their own for the benchmarks that build large datasets
(``bench_read_paths``, ``performance_report``): created and dropped through
the server's ``postgres`` database, with the configured connection's host,
port and user; Django's default connection switched between them. Also how a
benchmark deletes its throw-away user and what it ran."""

from __future__ import annotations

import psycopg
from django.db import connection, connections


def _admin_connection():
    settings = connection.settings_dict
    return psycopg.connect(
        host=settings["HOST"] or None,
        port=settings["PORT"] or None,
        user=settings["USER"] or None,
        password=settings["PASSWORD"] or None,
        dbname="postgres",
        autocommit=True,
    )


def create_database(name: str, *, drop_first: bool) -> bool:
    """Create ``name`` unless it exists; True when created."""
    with _admin_connection() as admin:
        if drop_first:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            return False
        admin.execute(f'CREATE DATABASE "{name}"')
        return True


def drop_database(name: str) -> None:
    """Drop ``name`` if it exists, closing its sessions (``WITH (FORCE)``)."""
    with _admin_connection() as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def use_database(name: str) -> None:
    """Point Django's default connection (and its pool) at ``name``: the
    next query opens a connection there."""
    conn = connections["default"]
    conn.close()
    # A connection pool keeps the database it was opened on: without
    # closing it, the next connection would still be the old database's.
    if conn.settings_dict.get("OPTIONS", {}).get("pool"):
        conn.close_pool()
    conn.settings_dict["NAME"] = name


def throwaway_user_delete(user, *, bench: str, since) -> None:
    """Delete a benchmark's throw-away ``user`` with its threads, runs and
    rows, through the recorded bypass (the audit is append-only, R-GOV-3),
    then recompute the dashboard's rollups from the day ``since`` (a date),
    to which their terminal transactions had added them."""
    from dashboard.rollups import rollups_rebuild
    from governance.bypass import audited_bypass

    with audited_bypass(reason=f"{bench}: delete its throw-away user, threads and runs"):
        user.delete()
    rollups_rebuild(since=since)
