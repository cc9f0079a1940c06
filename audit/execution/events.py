"""Live run events: published by the worker, served as Server-Sent Events by
the ASGI process (R-EVT-1).

Transport: one Redis stream per run, ``yuxi:run:<run_id>:events``. The
publisher numbers a run's events 1, 2, 3, ... and uses the number as the
stream entry id (``<sequence>-0``), so the SSE ``id:`` of an event, the
client's ``Last-Event-ID`` and the position to read from are one number:
a reconnecting client resumes with ``XREAD`` after ``<Last-Event-ID>-0``,
with no gap and no repeat. The publisher sends events in short batches
(one round trip each) and the terminal event only after the terminal
transaction committed. The stream expires ``STREAM_TTL_SECONDS`` after
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

from core.config import get_config
from core.db import release_connection
from core.draining import draining
from core.redis_client import redis_client, stream_key

log = logging.getLogger(__name__)

STREAM_TTL_SECONDS = 24 * 3600
TERMINAL_EVENT = "run.finished"
GAP_EVENT = "gap"
ERROR_EVENT = "error"


# Appends a batch of events to a run's stream after its last entry, in one
# round trip and atomically: numbers continue after the stream's tail (so a
# second publisher for the same run never reuses one) and after the caller's
# last number. ARGV: last number, maxlen, ttl seconds (0: keep the TTL),
# then type, data pairs. Returns the last number written.
_APPEND_SCRIPT = """
local sequence = tonumber(ARGV[1])
local tail = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if tail[1] then
    local last = tonumber(string.match(tail[1][1], '^(%d+)'))
    if last > sequence then sequence = last end
end
for i = 4, #ARGV, 2 do
    sequence = sequence + 1
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], sequence .. '-0', 'type', ARGV[i], 'data', ARGV[i + 1])
end
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return sequence
"""

#: Live events wait at most this long (seconds) before they are sent, so a
#: burst of text deltas travels as one batch (one round trip).
FLUSH_INTERVAL_SECONDS = 0.05
#: A batch is sent at once when it holds this many events.
FLUSH_MAX_EVENTS = 256
#: Events kept while Redis does not answer; older ones are dropped (logged):
#: the audit in PostgreSQL is the record, the reader announces the gap.
BUFFER_MAX_EVENTS = 10_000


class RunEventPublisher:
    """Publishes one run's events in order, numbering them 1, 2, 3, ...

    :meth:`publish` puts the event in a batch; the batch is sent in one
    round trip (a Lua script: ``XADD`` per event with the explicit id
    ``<sequence>-0``) at most :data:`FLUSH_INTERVAL_SECONDS` later, at once
    when it reaches :data:`FLUSH_MAX_EVENTS`, on :meth:`flush` and on
    :meth:`close`. The stream's TTL is set with the first batch and again
    by :meth:`close` (not per event). Numbers continue after the stream's
    last entry, so a second publisher for the same run never reuses one.
    The caller publishes the terminal event after the terminal transaction
    committed and then closes the publisher, which sends everything still
    waiting: no event is lost and none is published early. A Redis failure
    is logged and does not fail the run (the database is the record); the
    batch is kept and sent with the next one.
    """

    def __init__(self, run_id: uuid.UUID | str, redis_url: str | None, *, client: Any = None):
        self.run_id = str(run_id)
        self._redis_url = redis_url
        # A client given by the caller (shared with the run's cancel
        # listener) is the caller's to close.
        self._client = client
        self._owns_client = client is None
        self._script = None
        self._pending: list[tuple[str, str]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._ttl_set = False
        self.sequence = 0
        # One batch in flight at a time, so numbers stay in order.
        self._lock = asyncio.Lock()

    async def publish(self, event_type: str, data: dict[str, Any]) -> None:
        """Add one event ``{type, data}`` (``data`` JSON-able) to the batch."""
        if not self._redis_url:
            self.sequence += 1
            return
        self._pending.append((event_type, json.dumps(data, default=str)))
        if len(self._pending) >= FLUSH_MAX_EVENTS:
            await self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_INTERVAL_SECONDS, self._flush_soon)

    def _flush_soon(self) -> None:
        self._timer = None
        task = asyncio.ensure_future(self.flush())
        # Keep a reference until it ends; errors are logged by flush itself.
        self._flushing = task

    async def flush(self, *, refresh_ttl: bool = False) -> bool:
        """Send every event waiting in the batch (one round trip); with
        ``refresh_ttl`` the same round trip sets the stream's TTL again.
        Returns whether a batch was sent."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        async with self._lock:
            if self._pending:
                return await self._send(refresh_ttl=refresh_ttl)
        return False

    async def _send(self, *, refresh_ttl: bool = False) -> bool:
        from redis.exceptions import RedisError

        # A copy: events published while the script runs join the next
        # batch; only what was sent is taken off the list.
        batch = list(self._pending)
        try:
            if self._script is None:
                if self._client is None:
                    self._client = redis_client(self._redis_url)
                self._script = self._client.register_script(_APPEND_SCRIPT)
            ttl = 0 if self._ttl_set and not refresh_ttl else STREAM_TTL_SECONDS
            args: list[Any] = [self.sequence, get_config().EVENT_STREAM_MAXLEN, ttl]
            for event_type, data in batch:
                args += [event_type, data]
            self.sequence = int(await self._script(keys=[stream_key(self.run_id)], args=args))
            self._ttl_set = True
            del self._pending[: len(batch)]
            return True
        except RedisError as exc:
            if len(self._pending) > BUFFER_MAX_EVENTS:
                dropped = len(self._pending) - BUFFER_MAX_EVENTS
                del self._pending[:dropped]
                log.warning("run %s: %s live events dropped while Redis is unreachable", self.run_id, dropped)
            log.warning("run %s: %s events not published yet: %s", self.run_id, len(batch), exc)
            return False

    async def close(self) -> None:
        """Send what waits, set the stream's TTL once more (it counts from
        the run's last event: in the same round trip as the last batch when
        one waits) and close the connection."""
        from redis.exceptions import RedisError

        refreshed = await self.flush(refresh_ttl=True)
        if self._client is not None:
            try:
                if self._ttl_set and not refreshed:
                    await self._client.expire(stream_key(self.run_id), STREAM_TTL_SECONDS)
            except RedisError as exc:
                log.warning("run %s: stream TTL not set: %s", self.run_id, exc)
            if self._owns_client:
                await self._client.aclose()
                self._client = None
                self._script = None


async def _append_rebuilt(client: Any, run_id: uuid.UUID, last: int, data: dict[str, Any]) -> int:
    """Append the terminal event rebuilt from the run row to the run's
    stream (numbered after its tail and after ``last``, with the stream's
    TTL) and return its number: a client that reconnects after it then
    finds it in the stream and is answered 204, instead of being sent
    another one every time (R-EVT-3). When Redis does not answer, the
    number after ``last``, unrecorded."""
    from redis.exceptions import RedisError

    try:
        script = client.register_script(_APPEND_SCRIPT)
        args = [
            last,
            get_config().EVENT_STREAM_MAXLEN,
            STREAM_TTL_SECONDS,
            TERMINAL_EVENT,
            json.dumps(data, default=str),
        ]
        return int(await script(keys=[stream_key(run_id)], args=args))
    except RedisError as exc:
        log.warning("run %s: rebuilt terminal event not recorded: %s", run_id, exc)
        return last + 1


async def client_holds_terminal_event(run_id: uuid.UUID, *, last_event_id: int, redis_url: str | None) -> bool:
    """Whether a client that reconnects with ``last_event_id`` already holds
    the run's terminal event: the stream ends with ``run.finished`` numbered
    at or before it (without Redis, where the terminal event is the only
    one served: the run is terminal and the client holds an event). The
    event stream then answers 204 so that a browser's EventSource stops
    reconnecting (R-EVT-3). A new client (``last_event_id`` 0) never does.
    Raises what Redis raises."""
    if last_event_id <= 0:
        return False
    if redis_url is None:
        rebuilt = await sync_to_async(_terminal_event_data)(run_id)
        return rebuilt is not None and rebuilt is not _RUN_GONE
    client = redis_client(redis_url)
    try:
        tail = await client.xrevrange(stream_key(run_id), count=1)
    finally:
        await client.aclose()
    return (
        bool(tail) and tail[0][1].get(b"type") == TERMINAL_EVENT.encode() and _sequence_of(tail[0][0]) <= last_event_id
    )


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
    from ..models import AgentRun

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
    PostgreSQL (:func:`audit.reads.selectors.run_live_state`), or
    :data:`_RUN_GONE`. Gives the connection back at once (R-EVT-2)."""
    from ..reads.selectors import run_live_state

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
    wins. Comments (``: keep-alive``) keep idle connections open. A
    process that is stopping (:func:`core.draining.draining`) ends the
    stream after the current wait; the client resumes elsewhere.

    Events the stream no longer retains are announced by one ``gap`` event
    before the first retained one, and a run that no longer exists ends the
    stream with an ``error`` event (R-EVT-2; see the module docstring).
    """
    last = max(0, last_event_id)
    key = stream_key(run_id)
    client = redis_client(redis_url) if redis_url else None
    terminal_seen = 0
    # The stream's last event when the client came: an event numbered
    # after it is one the client cannot hold, even when its Last-Event-ID
    # is ahead of the stream (R-EVT-3).
    tail_at_start = 0
    try:
        yield "retry: 1000\n\n"
        if client is not None:
            tail = await client.xrevrange(key, count=1)
            tail_at_start = _sequence_of(tail[0][0]) if tail else 0
        while True:
            if draining():
                # The server is stopping: end here; the client reconnects
                # with its Last-Event-ID (core.draining).
                yield ": the server is restarting\n\n"
                return
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
                sequence = _sequence_of(tail[0][0])
                if sequence > tail_at_start:
                    # Published after the client came, under its
                    # Last-Event-ID (ahead of the stream): delivered.
                    yield sse_frame(sequence, TERMINAL_EVENT, tail[0][1][b"data"].decode())
                return  # else the client already has the terminal event
            if not tail or terminal_seen >= 2:
                sequence = await _append_rebuilt(client, run_id, last, rebuilt) if client is not None else last + 1
                yield sse_frame(sequence, TERMINAL_EVENT, rebuilt)
                return
    finally:
        if client is not None:
            await client.aclose()
