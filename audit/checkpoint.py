"""The LangGraph checkpointer: PostgreSQL (langgraph-checkpoint-postgres) on
the product's own database, or an in-process memory saver under the embedded
defaults (a quick-start process only; it forgets on restart)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from django.db import connections
from langgraph.checkpoint.memory import InMemorySaver
from psycopg.conninfo import make_conninfo

_memory_saver = InMemorySaver()


def postgres_conninfo(alias: str = "default") -> str | None:
    """libpq connection string of Django's database, or None off PostgreSQL."""
    connection = connections[alias]
    if connection.vendor != "postgresql":
        return None
    s = connection.settings_dict
    params = {
        "dbname": s["NAME"],
        "user": s.get("USER") or None,
        "password": s.get("PASSWORD") or None,
        "host": s.get("HOST") or None,
        "port": str(s["PORT"]) if s.get("PORT") else None,
    }
    return make_conninfo(**{k: v for k, v in params.items() if v})


@contextlib.asynccontextmanager
async def open_checkpointer(conninfo: str | None) -> AsyncIterator[object]:
    """Yield a checkpointer for one run; closes its connection afterwards."""
    if conninfo is None:
        yield _memory_saver
        return
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    async with AsyncPostgresSaver.from_conn_string(conninfo) as saver:
        yield saver


def setup_postgres_checkpointer(conninfo: str) -> None:
    """Create or upgrade the checkpointer's tables (idempotent). Called by a
    Django migration so that migrations own the whole schema (R-SCH-1)."""
    from langgraph.checkpoint.postgres import PostgresSaver

    with PostgresSaver.from_conn_string(conninfo) as saver:
        saver.setup()
