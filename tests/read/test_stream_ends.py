"""A live stream always ends with what the client needs (R-EVT-3): a
``Last-Event-ID`` ahead of a running run's stream still gets the terminal
event, and a reconnect that already holds it is answered 204, so that a
browser's EventSource stops reconnecting — also after a terminal event
rebuilt from the run row, and without Redis."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.test import Client

from audit.execution.events import run_event_stream
from audit.models import AgentRun
from tests.conftest import acquire, bearer, make_run

from .builders import tool_turn
from .test_events import REDIS_URL, frames_of, parse, publish_all

pytestmark = pytest.mark.django_db


def _events(user, run, last_event_id: str | None = None):
    headers = bearer(user) if last_event_id is None else {**bearer(user), "Last-Event-ID": last_event_id}
    return Client().get(f"/api/runs/{run.id}/events", headers=headers)


def _body(response) -> str:
    async def collect():
        return b"".join([chunk async for chunk in response.streaming_content])

    return async_to_sync(collect)().decode()


def _finished_stream(run) -> None:
    publish_all(
        run.id,
        [("run.status", {"status": "running"}), ("model.started", {}), ("run.finished", {"status": "completed"})],
    )


@pytest.mark.parametrize("last_event_id", ["3", "4", "999999999999999999"])
def test_a_reconnect_that_holds_the_terminal_event_is_answered_204_R_EVT_3(user, thread, last_event_id):
    """``run.finished`` is event 3: a reconnect with it, or with any id
    after it, has nothing more to get."""
    run = tool_turn(thread)
    _finished_stream(run)
    response = _events(user, run, last_event_id)
    assert response.status_code == 204 and response.content == b""


def test_a_new_client_or_one_before_the_end_still_gets_the_stream_R_EVT_3(user, thread):
    run = tool_turn(thread)
    _finished_stream(run)
    for last_event_id, expected in ((None, [1, 2, 3]), ("2", [3])):
        response = _events(user, run, last_event_id)
        assert response.status_code == 200
        body = _body(response)
        frames = [frame for frame in body.split("\n\n") if frame.startswith("id: ")]
        assert [parse(frame + "\n\n")[0] for frame in frames] == expected


def test_a_rebuilt_terminal_event_is_recorded_so_the_reconnect_after_it_gets_204_R_EVT_3(user, thread):
    """Redis lost the stream's tail (or the worker died before publishing
    it): the terminal event is rebuilt from the run row once, recorded in
    the stream under its number, and the client's reconnect with that
    number is answered 204 — not sent another rebuilt event, for ever."""
    run = tool_turn(thread)
    publish_all(run.id, [("run.status", {"status": "running"})])
    events = [parse(f) for f in frames_of(run.id, last_event_id=1)]
    assert [(e[0], e[1], e[2]["rebuilt"]) for e in events] == [(2, "run.finished", True)]
    assert _events(user, run, "2").status_code == 204
    assert frames_of(run.id, last_event_id=0)[-1].startswith("id: 2\nevent: run.finished")


def test_a_last_event_id_ahead_of_a_running_runs_stream_still_gets_the_terminal_event_R_EVT_3(thread):
    """The client's id is ahead of everything the stream holds (a bogus
    id, or one from a stream Redis lost): when the run ends, the terminal
    event published after the client came is delivered, under its own
    number, instead of the stream closing with no event at all."""
    run = make_run(thread)
    acquire(run)
    publish_all(run.id, [("run.status", {"status": "running"}), ("model.started", {})])

    async def follow_then_finish():
        async def collect():
            return [f async for f in run_event_stream(run.id, last_event_id=10**6, redis_url=REDIS_URL, block_ms=100)]

        reader = asyncio.ensure_future(collect())
        await asyncio.sleep(0.3)
        assert not reader.done(), "the stream waits while the run runs"
        await sync_to_async(AgentRun.objects.filter(pk=run.pk).update)(status=AgentRun.Status.COMPLETED)
        await sync_to_async(publish_all, thread_sensitive=False)(run.id, [("run.finished", {"status": "completed"})])
        return await asyncio.wait_for(reader, 10)

    frames = [f for f in async_to_sync(follow_then_finish)() if f.startswith("id: ")]
    assert [parse(f)[:2] for f in frames] == [(3, "run.finished")]
    assert parse(frames[0])[2] == {"status": "completed"}


def test_without_redis_a_reconnect_after_the_terminal_event_is_answered_204_R_EVT_3(user, thread, monkeypatch):
    """Embedded defaults: the terminal event, rebuilt from the row, is the
    only one served (id 1); a reconnect with it gets 204."""
    from core.config import get_config

    run = tool_turn(thread)
    monkeypatch.setattr(get_config(), "REDIS_URL", "")
    assert _events(user, run, "1").status_code == 204
    assert _events(user, run).status_code == 200
