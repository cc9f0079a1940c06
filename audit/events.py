"""Live run events: published by the worker, served as Server-Sent Events by
the ASGI process (R-EVT-1).

Transport: one Redis stream per run, ``yuxi:run:<run_id>:events``. The
publisher numbers a run's events 1, 2, 3, ... and uses the number as the
stream entry id (``<sequence>-0``), so the SSE ``id:`` of an event, the
client's ``Last-Event-ID`` and the position to read from are one number:
a reconnecting client resumes with ``XREAD`` after ``<Last-Event-ID>-0``,
with no gap and no repeat. The stream expires ``STREAM_TTL_SECONDS`` after
its last event and keeps about the newest ``EVENT_STREAM_MAXLEN`` events
(a setting; Redis trims older ones).

Gaps are explicit (R-EVT-2). Ids are consecutive, so a reader knows when
events it should get next were trimmed: a reconnect whose ``Last-Event-ID``
is older than the first retained event, a new client on a trimmed stream,
or a slow reader overtaken by the trimming. It then first sends a ``gap``
event (``id:`` the event before the first retained one, so a reconnect
resumes there) with ``{first_retained_id, missed_from, missed_to, state}``:
``state`` is the run as PostgreSQL has it now (status, error type, usage,
and the root model and tool calls so far with their stored content,
declared tool calls, usage and status — what the missed events carried),
then continues with the first retained event. A stream whose run no longer
exists (deleted while a client follows it) ends with an ``error`` event
``{error: "run_not_found"}``.

Text deltas travel only here, never to PostgreSQL (R-MA-4). Live delivery is
best effort: the audit in PostgreSQL is the record, so when Redis lost a
run's stream (expired, flushed) the terminal event is rebuilt from the run
row. Under the embedded defaults (no Redis) nothing is published and the
stream serves the terminal status from the database.

Event types: ``run.status`` {status} (``running``, ``cancel_requested``), ``model.started`` {operation_id},
``model.delta`` {operation_id, text}, ``model.finished`` {operation_id,
tool_calls, usage}, ``tool.started`` {tool_call_id, tool_name},
``tool.finished`` {tool_call_id, status}, ``tool.error`` {tool_call_id},
and last ``run.finished`` {status, error_type, output_message_id,
interrupts} where ``interrupts`` are the pending approval's action
requests when the run stopped at an interrupt. The reader adds ``gap`` and
``error`` (above).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from asgiref.sync import sync_to_async

from yuxi_project.config import get_config
from yuxi_project.db import release_connection

log = logging.getLogger(__name__)

STREAM_TTL_SECONDS = 24 * 3600
TERMINAL_EVENT = "run.finished"
GAP_EVENT = "gap"
ERROR_EVENT = "error"


def stream_key(run_id: uuid.UUID | str) -> str:
    return f"yuxi:run:{run_id}:events"


def _redis(url: str):
    from redis import asyncio as aioredis

    return aioredis.from_url(url)


class RunEventPublisher:
    """Publishes one run's events in order, numbering them 1, 2, 3, ...

    Each publish is awaited (one round trip: ``XADD`` with the explicit id
    ``<sequence>-0`` plus ``EXPIRE``), never queued in memory. The first
    publish continues after the stream's last entry, so a second publisher
    for the same run never reuses a number. A Redis failure is logged and
    does not fail the run: the database is the record.
    """

    def __init__(self, run_id: uuid.UUID | str, redis_url: str | None):
        self.run_id = str(run_id)
        self._redis_url = redis_url
        self._client = None
        self._synced = False
        self.sequence = 0
        # The stream task and the lease keeper publish concurrently: one
        # number, one XADD at a time, so ids stay consecutive.
        self._lock = asyncio.Lock()

    @classmethod
    def for_run(cls, run_id: uuid.UUID | str) -> RunEventPublisher:
        return cls(run_id, get_config().REDIS_URL or None)

    async def publish(self, event_type: str, data: dict[str, Any]) -> None:
        """Append one event ``{type, data}`` (``data`` JSON-able)."""
        if not self._redis_url:
            self.sequence += 1
            return
        async with self._lock:
            await self._publish(event_type, data)

    async def _publish(self, event_type: str, data: dict[str, Any]) -> None:
        from redis.exceptions import RedisError

        key = stream_key(self.run_id)
        try:
            if self._client is None:
                self._client = _redis(self._redis_url)
            if not self._synced:
                last = await self._client.xrevrange(key, count=1)
                self.sequence = max(self.sequence, _sequence_of(last[0][0]) if last else 0)
                self._synced = True
            sequence = self.sequence + 1
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.xadd(
                    key,
                    {"type": event_type, "data": json.dumps(data, default=str)},
                    id=f"{sequence}-0",
                    maxlen=get_config().EVENT_STREAM_MAXLEN,
                    approximate=True,
                )
                pipe.expire(key, STREAM_TTL_SECONDS)
                await pipe.execute()
            self.sequence = sequence
        except RedisError as exc:
            # Resynchronise from the stream's tail next time: the XADD may
            # have landed before the error.
            self._synced = False
            log.warning("run %s: event %s not published: %s", self.run_id, event_type, exc)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _sequence_of(entry_id: bytes | str) -> int:
    if isinstance(entry_id, bytes):
        entry_id = entry_id.decode()
    return int(entry_id.split("-", 1)[0])


def sse_frame(sequence: int, event_type: str, data: dict[str, Any] | str) -> str:
    """One Server-Sent Event: ``id:`` the run's event sequence, ``event:``
    the type, ``data:`` one line of JSON."""
    payload = data if isinstance(data, str) else json.dumps(data, default=str)
    return f"id: {sequence}\nevent: {event_type}\ndata: {payload}\n\n"


_RUN_GONE = {"error": "run_not_found", "message": "the run no longer exists"}


def _terminal_event_data(run_id: uuid.UUID) -> dict[str, Any] | None:
    """The run's terminal event rebuilt from its row, or ``None`` while the
    run is not terminal, or :data:`_RUN_GONE` when the run no longer exists.
    Gives the connection back at once: the stream must not hold one while
    it waits (R-EVT-1)."""
    from .models import AgentRun

    try:
        row = (
            AgentRun.objects.filter(pk=run_id).values("status", "error_type", "output_message_id", "interrupts").first()
        )
    finally:
        release_connection()
    if row is None:
        return _RUN_GONE
    if row["status"] not in AgentRun.TERMINAL_STATUSES:
        return None
    return {
        "status": row["status"],
        "error_type": row["error_type"],
        "output_message_id": row["output_message_id"],
        "interrupts": row["interrupts"] if row["status"] == AgentRun.Status.INTERRUPTED else None,
        "rebuilt": True,
    }


def _gap_event_data(run_id: uuid.UUID, *, missed_from: int, first_retained: int) -> dict[str, Any]:
    """The ``gap`` event's data, with the run's state rebuilt from
    PostgreSQL (:func:`audit.selectors.run_live_state`), or
    :data:`_RUN_GONE`. Gives the connection back at once (R-EVT-2)."""
    from .selectors import run_live_state

    try:
        state = run_live_state(run_id)
    finally:
        release_connection()
    if state is None:
        return _RUN_GONE
    return {
        "first_retained_id": first_retained,
        "missed_from": missed_from,
        "missed_to": first_retained - 1,
        "state": state,
    }


async def run_event_stream(
    run_id: uuid.UUID,
    *,
    last_event_id: int = 0,
    redis_url: str | None = None,
    block_ms: int = 1500,
) -> AsyncIterator[str]:
    """Yield SSE frames of one run after ``last_event_id`` until (and
    including) its ``run.finished`` event.

    Waits on Redis with ``XREAD BLOCK`` (``block_ms``, ms) and holds no
    database connection while it waits; when a wait ends empty it looks at
    the run row (one short query). A run that is terminal in the database
    but whose stream has no terminal event (Redis lost the tail, or the
    worker died) gets one rebuilt from the row, numbered after the last
    event, after one more empty wait so a terminal event still in flight
    wins. Comments (``: keep-alive``) keep idle connections open.

    Events the stream no longer retains are announced by one ``gap`` event
    before the first retained one, and a run that no longer exists ends the
    stream with an ``error`` event (R-EVT-2; see the module docstring).
    """
    last = max(0, last_event_id)
    key = stream_key(run_id)
    client = _redis(redis_url) if redis_url else None
    terminal_seen = 0
    try:
        yield "retry: 1000\n\n"
        while True:
            entries = []
            if client is not None:
                answer = await client.xread({key: f"{last}-0"}, count=500, block=block_ms)
                entries = answer[0][1] if answer else []
            for entry_id, fields in entries:
                sequence = _sequence_of(entry_id)
                if sequence <= last:
                    continue
                if sequence > last + 1:
                    # Events last+1 .. sequence-1 were trimmed (R-EVT-2).
                    gap = await sync_to_async(_gap_event_data)(run_id, missed_from=last + 1, first_retained=sequence)
                    if gap is _RUN_GONE:
                        yield sse_frame(last + 1, ERROR_EVENT, _RUN_GONE)
                        return
                    yield sse_frame(sequence - 1, GAP_EVENT, gap)
                last = sequence
                event_type = fields[b"type"].decode()
                yield sse_frame(sequence, event_type, fields[b"data"].decode())
                if event_type == TERMINAL_EVENT:
                    return
            if entries:
                terminal_seen = 0
                continue
            rebuilt = await sync_to_async(_terminal_event_data)(run_id)
            if rebuilt is _RUN_GONE:
                yield sse_frame(last + 1, ERROR_EVENT, _RUN_GONE)
                return
            if rebuilt is None:
                yield ": keep-alive\n\n"
                if client is None:
                    await asyncio.sleep(block_ms / 1000)
                continue
            terminal_seen += 1
            tail = await client.xrevrange(key, count=1) if client is not None else []
            if tail and tail[0][1].get(b"type") == TERMINAL_EVENT.encode() and _sequence_of(tail[0][0]) <= last:
                return  # the client already has the terminal event
            if not tail or terminal_seen >= 2:
                yield sse_frame(last + 1, TERMINAL_EVENT, rebuilt)
                return
    finally:
        if client is not None:
            await client.aclose()
