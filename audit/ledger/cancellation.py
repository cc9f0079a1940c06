"""The Redis cancel signal: how a worker learns within a moment that its
run is to be cancelled (R-RUN-6).

The database stays the source of truth (``AgentRun.status ==
cancel_requested``); the signal only wakes the worker so that it checks the
database now instead of at its next periodic poll. A lost signal therefore
delays a cancel by at most one poll interval, and a spurious one costs one
status read. Under the embedded defaults (no Redis) nothing is signalled.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from core.config import get_config
from core.redis_client import REDIS_CLIENT_OPTIONS, redis_client

log = logging.getLogger(__name__)

# The key survives a worker that subscribes after the publish; the TTL only
# bounds garbage, the worker never needs it longer than a run lasts.
SIGNAL_TTL_SECONDS = 24 * 3600


def cancel_key(run_id: uuid.UUID | str) -> str:
    return f"yuxi:run:{run_id}:cancel"


def cancel_channel(run_id: uuid.UUID | str) -> str:
    return f"yuxi:run:{run_id}:cancel-channel"


def cancel_signal_send(*, run_id: uuid.UUID | str) -> None:
    """Set the run's cancel key and publish on its channel (web side, after
    the ``cancel_requested`` commit). Redis being down is logged, not
    raised: the worker's database poll still sees the request."""
    redis_url = get_config().REDIS_URL
    if not redis_url:
        return
    import redis

    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=2, **REDIS_CLIENT_OPTIONS)
        try:
            client.set(cancel_key(run_id), "1", ex=SIGNAL_TTL_SECONDS)
            client.publish(cancel_channel(run_id), "cancel")
        finally:
            client.close()
    except redis.RedisError as exc:
        log.warning("cancel signal for run %s not sent (the worker's database poll will see it): %s", run_id, exc)


class CancelSignalListener:
    """Worker side: ``await listener.wait(timeout)`` returns True as soon as
    a cancel signal for the run arrives (or is already set), False when
    ``timeout`` seconds pass without one. Never raises on Redis errors: it
    then just sleeps, and the caller's database check decides."""

    def __init__(
        self, run_id: uuid.UUID | str, redis_url: str | None = None, *, client: Any = None, shared: Any = None
    ):
        """``client``: a Redis client of the caller's (the run's event
        publisher's: the key check then reuses its connection), the
        caller's to close. ``shared``: the worker loop's connections
        (:class:`~audit.execution.worker_loop.LoopRedis`): the key check uses its
        client, and its subscription connection subscribes to this run's
        channel until :meth:`close` unsubscribes it. Without either, the
        listener makes its own client and subscription."""
        self.run_id = str(run_id)
        self._redis_url = redis_url if redis_url is not None else (get_config().REDIS_URL or None)
        self._shared = shared
        self._client = shared.client if shared is not None else client
        self._owns_client = self._client is None
        self._pubsub = None
        self._key_reported = False
        self._channel = cancel_channel(self.run_id)

    async def _ensure(self) -> None:
        if self._pubsub is not None or not self._redis_url:
            return
        if self._client is None:
            self._client = redis_client(self._redis_url)
        self._pubsub = self._shared.pubsub() if self._shared is not None else self._client.pubsub()
        await self._pubsub.subscribe(self._channel)

    async def wait(self, timeout: float) -> bool:
        import asyncio

        if not self._redis_url:
            await asyncio.sleep(timeout)
            return False
        try:
            await self._ensure()
            # Subscribe first, then read the key: a signal sent in between
            # is seen by one of the two.
            # The key is reported once; after that only new publishes count,
            # so a stale key cannot make the caller poll in a loop.
            if not self._key_reported and await self._client.exists(cancel_key(self.run_id)):
                self._key_reported = True
                return True
            # get_message returns None at once when what it read was the
            # subscription's own confirmation: wait out the rest of the
            # timeout, or the caller polls the database at every run's start.
            deadline = asyncio.get_running_loop().time() + timeout
            while (left := deadline - asyncio.get_running_loop().time()) > 0:
                message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
                # A shared subscription may still deliver an earlier run's
                # signal: only this run's channel counts.
                if message is not None and _text(message.get("channel")) == self._channel:
                    return True
            return False
        except Exception as exc:  # Redis is a hint only; the database decides
            log.warning("cancel listener for run %s: %s", self.run_id, exc)
            await self.close(broken=True)
            await asyncio.sleep(timeout)
            return False

    async def close(self, *, broken: bool = False) -> None:
        pubsub, client = self._pubsub, self._client if self._owns_client else None
        self._pubsub = None
        if self._shared is not None:
            # The worker loop's subscription stays for its next run, without
            # this run's channel; one that failed is dropped.
            if pubsub is not None and not broken:
                try:
                    await pubsub.unsubscribe(self._channel)
                    return
                except Exception:
                    pass
            if pubsub is not None:
                await self._shared.discard_pubsub()
            return
        if self._owns_client:
            self._client = None
        if pubsub is not None:
            try:
                await pubsub.aclose()
            except Exception:  # closing a broken connection
                pass
        if client is not None:
            try:
                await client.aclose()
            except Exception:
                pass


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
