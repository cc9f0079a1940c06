"""The cause of a failure a worker could not write (R-RUN-8, R-RUN-9).

A worker that loses PostgreSQL fails its run with ``audit_write_failed``,
but while the database is down it cannot write that, and once it is back
the lease has often expired: the sweeper then ends the run. So the worker
also leaves the cause in Redis (a key per run, one day), and the sweeper
names it instead of the symptom ``lease_expired``. Redis is only a hint
here: when it is down too, the run still ends, as ``lease_expired``.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator
from typing import Any

from core.config import get_config

log = logging.getLogger(__name__)

CAUSE_TTL_SECONDS = 24 * 3600


def cause_key(run_id: uuid.UUID | str) -> str:
    return f"yuxi:run:{run_id}:failure-cause"


@contextlib.contextmanager
def _redis(failure: str) -> Iterator[Any]:
    """A short-lived Redis client, or None without ``REDIS_URL``; a Redis
    error inside is logged with ``failure`` and not raised."""
    redis_url = get_config().REDIS_URL
    if not redis_url:
        yield None
        return
    import redis

    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        try:
            yield client
        finally:
            client.close()
    except redis.RedisError as exc:
        log.warning("%s: %s", failure, exc)


def failure_cause_send(*, run_id: uuid.UUID | str, error_type: str, message: str) -> None:
    """Leave ``error_type`` and ``message`` for the sweeper. Never raises."""
    with _redis(f"failure cause of run {run_id} not left in Redis") as client:
        if client is not None:
            client.set(cause_key(run_id), f"{error_type}\n{message[:2000]}", ex=CAUSE_TTL_SECONDS)


def failure_cause_clear(*, run_id: uuid.UUID | str) -> None:
    """Take back the cause left for ``run_id`` (its worker reached the
    database again in time). Never raises."""
    with _redis(f"failure cause of run {run_id} not taken back from Redis") as client:
        if client is not None:
            client.delete(cause_key(run_id))


def failure_causes(run_ids: list[uuid.UUID]) -> dict[uuid.UUID, tuple[str, str]]:
    """``{run_id: (error_type, message)}`` for the runs whose worker left a
    cause. Never raises (an unreachable Redis gives ``{}``)."""
    values: list = []
    if run_ids:
        with _redis("failure causes not read from Redis") as client:
            if client is not None:
                values = client.mget([cause_key(run_id) for run_id in run_ids])
    causes = {}
    for run_id, value in zip(run_ids, values, strict=False):
        if value:
            error_type, _, message = value.decode(errors="replace").partition("\n")
            causes[run_id] = (error_type[:100], message)
    return causes
