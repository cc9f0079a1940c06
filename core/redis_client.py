"""Options shared by every Redis client of the product outside Celery: the
live event streams (``audit.execution.events``), the cancel signal
(``audit.ledger.cancellation``) and the worker loop's connections; and the key of
a run's live event stream, which the erasure deletes too (R-EVT-1,
R-GOV-2)."""

from __future__ import annotations

from typing import Any

#: No ``CLIENT SETINFO`` (library name and version) on each new connection,
#: and a bounded connect: Redis is a hint, never something a run waits on.
REDIS_CLIENT_OPTIONS: dict[str, Any] = {"driver_info": None, "socket_connect_timeout": 2}


def stream_key(run_id) -> str:
    """The Redis key of run ``run_id``'s live event stream (a UUID or its
    text): ``yuxi:run:<run id>:events``."""
    return f"yuxi:run:{run_id}:events"


def redis_client(url: str):
    """An asyncio Redis client (its own connection pool) for one run's
    events and cancel signal, or one event stream reader."""
    from redis import asyncio as aioredis

    return aioredis.from_url(url, **REDIS_CLIENT_OPTIONS)
