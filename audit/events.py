"""Live run events published by the worker (R-EVT-1).

Events go to a Redis stream per run; the ASGI process serves them as
Server-Sent Events. Under the embedded defaults (no Redis) nothing is
published and clients read the run's state from the database.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from yuxi_project.config import get_config

STREAM_TTL_SECONDS = 24 * 3600
STREAM_MAXLEN = 50_000


def stream_key(run_id: uuid.UUID | str) -> str:
    return f"yuxi:run:{run_id}:events"


class RunEventPublisher:
    """Publishes one run's events in order, numbering them 1, 2, 3, ...

    Live delivery is best effort (the audit in PostgreSQL is the record), but
    each publish is awaited, never queued in memory.
    """

    def __init__(self, run_id: uuid.UUID | str, redis_url: str | None):
        self.run_id = str(run_id)
        self._redis_url = redis_url
        self._client = None
        self.sequence = 0

    @classmethod
    def for_run(cls, run_id: uuid.UUID | str) -> RunEventPublisher:
        return cls(run_id, get_config().REDIS_URL or None)

    async def publish(self, event_type: str, data: dict[str, Any]) -> None:
        self.sequence += 1
        if not self._redis_url:
            return
        if self._client is None:
            from redis import asyncio as aioredis

            self._client = aioredis.from_url(self._redis_url)
        key = stream_key(self.run_id)
        await self._client.xadd(
            key,
            {"seq": self.sequence, "type": event_type, "data": json.dumps(data, default=str)},
            maxlen=STREAM_MAXLEN,
            approximate=True,
        )
        if self.sequence == 1 or event_type == "run.finished":
            await self._client.expire(key, STREAM_TTL_SECONDS)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
