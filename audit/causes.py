"""The cause of a failure a worker could not write (R-RUN-8, R-RUN-9).

A worker that loses PostgreSQL fails its run with ``audit_write_failed``,
but while the database is down it cannot write that, and once it is back
the lease has often expired: the sweeper then ends the run. So the worker
also leaves the cause in Redis (a key per run, one day), and the sweeper
names it instead of the symptom ``lease_expired``. Redis is only a hint
here: when it is down too, the run still ends, as ``lease_expired``.
"""

from __future__ import annotations

import logging
import uuid

from yuxi_project.config import get_config

log = logging.getLogger(__name__)

CAUSE_TTL_SECONDS = 24 * 3600


def cause_key(run_id: uuid.UUID | str) -> str:
    return f"yuxi:run:{run_id}:failure-cause"


def failure_cause_send(*, run_id: uuid.UUID | str, error_type: str, message: str) -> None:
    """Leave ``error_type`` and ``message`` for the sweeper. Never raises."""
    redis_url = get_config().REDIS_URL
    if not redis_url:
        return
    import redis

    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        try:
            client.set(cause_key(run_id), f"{error_type}\n{message[:2000]}", ex=CAUSE_TTL_SECONDS)
        finally:
            client.close()
    except redis.RedisError as exc:
        log.warning("failure cause of run %s not left in Redis: %s", run_id, exc)


def failure_causes(run_ids: list[uuid.UUID]) -> dict[uuid.UUID, tuple[str, str]]:
    """``{run_id: (error_type, message)}`` for the runs whose worker left a
    cause. Never raises (an unreachable Redis gives ``{}``)."""
    redis_url = get_config().REDIS_URL
    if not redis_url or not run_ids:
        return {}
    import redis

    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        try:
            values = client.mget([cause_key(run_id) for run_id in run_ids])
        finally:
            client.close()
    except redis.RedisError as exc:
        log.warning("failure causes not read from Redis: %s", exc)
        return {}
    causes = {}
    for run_id, value in zip(run_ids, values, strict=True):
        if value:
            error_type, _, message = value.decode(errors="replace").partition("\n")
            causes[run_id] = (error_type[:100], message)
    return causes
