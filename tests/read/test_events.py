"""The run event publisher and the SSE reader on real Redis (R-EVT-1)."""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings

from audit.execution.events import RunEventPublisher, run_event_stream, stream_key

from .builders import tool_turn

pytestmark = pytest.mark.django_db

REDIS_URL = settings.CONFIG.REDIS_URL


def frames_of(run_id, last_event_id=0):
    async def collect():
        return [
            f async for f in run_event_stream(run_id, last_event_id=last_event_id, redis_url=REDIS_URL, block_ms=200)
        ]

    return [f for f in async_to_sync(collect)() if f.startswith("id: ")]


def parse(frame: str):
    lines = dict(line.split(": ", 1) for line in frame.strip().splitlines())
    return int(lines["id"]), lines["event"], json.loads(lines["data"])


def publish_all(run_id, events, *, concurrent=False):
    async def go():
        publisher = RunEventPublisher(run_id, REDIS_URL)
        if concurrent:
            await asyncio.gather(*(publisher.publish(t, d) for t, d in events))
        else:
            for t, d in events:
                await publisher.publish(t, d)
        await publisher.close()

    asyncio.run(go())


def test_concurrent_publishes_get_consecutive_ids_and_a_second_publisher_continues_R_EVT_1(thread):
    run = tool_turn(thread)
    publish_all(run.id, [("model.delta", {"text": str(i)}) for i in range(20)], concurrent=True)
    publish_all(run.id, [("run.finished", {"status": "completed"})])
    events = [parse(f) for f in frames_of(run.id)]
    assert [e[0] for e in events] == list(range(1, 22))
    assert sorted(int(e[2]["text"]) for e in events[:-1]) == list(range(20))
    assert events[-1][1:] == ("run.finished", {"status": "completed"})


def test_reader_resumes_after_last_event_id_and_ends_after_terminal_R_EVT_1(thread):
    run = tool_turn(thread)
    publish_all(
        run.id,
        [
            ("run.status", {"status": "running"}),
            ("model.started", {}),
            ("model.delta", {"text": "a"}),
            ("run.finished", {"status": "completed"}),
        ],
    )
    assert [parse(f)[0] for f in frames_of(run.id, last_event_id=2)] == [3, 4]
    assert frames_of(run.id, last_event_id=4) == []  # already has the terminal event


def test_lost_tail_rebuilds_terminal_event_from_the_database_R_EVT_1(thread):
    """The worker died (or Redis trimmed the tail) after event 2: the run is
    terminal in PostgreSQL, so the reader ends with a rebuilt terminal event
    numbered after the last one."""
    run = tool_turn(thread)
    publish_all(run.id, [("run.status", {"status": "running"}), ("model.started", {})])
    events = [parse(f) for f in frames_of(run.id)]
    assert [(e[0], e[1]) for e in events] == [(1, "run.status"), (2, "model.started"), (3, "run.finished")]
    assert events[-1][2]["status"] == "completed" and events[-1][2]["rebuilt"] is True
    assert events[-1][2]["output_message_id"] == run.output_message_id


def test_stream_expires_R_EVT_1(thread):
    import redis

    run = tool_turn(thread)
    publish_all(run.id, [("run.status", {"status": "running"})])
    ttl = redis.Redis.from_url(REDIS_URL).ttl(stream_key(run.id))
    assert 0 < ttl <= 24 * 3600


def test_without_redis_the_stream_serves_the_terminal_status_from_the_database_R_EVT_1(thread):
    """Embedded defaults (no Redis): nothing is published; the stream waits
    on the run row and ends with its terminal status."""
    run = tool_turn(thread)

    async def collect():
        return [f async for f in run_event_stream(run.id, redis_url=None, block_ms=50)]

    frames = [f for f in async_to_sync(collect)() if f.startswith("id: ")]
    assert [parse(f)[:2] for f in frames] == [(1, "run.finished")]
    assert parse(frames[0])[2]["status"] == "completed"


@pytest.mark.django_db(transaction=True)
def test_a_waiting_stream_holds_no_database_connection_R_EVT_1(thread):
    """While the run is not terminal the stream waits on Redis; the short
    status read between waits gives its connection back at once."""
    from django.db import connection

    from .builders import RunDriver

    driver = RunDriver(thread)
    driver.model("lc_run--m1", finish=False)

    async def wait_once():
        stream = run_event_stream(driver.run.id, redis_url=REDIS_URL, block_ms=50)
        async for frame in stream:
            if frame.startswith(": keep-alive"):
                break
        await stream.aclose()

    connection.ensure_connection()
    assert connection.connection is not None
    async_to_sync(wait_once)()
    assert connection.connection is None
