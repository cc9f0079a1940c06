"""Live-event gaps are explicit (R-EVT-2): a reader that needs events the
Redis stream no longer retains gets a ``gap`` event with the run's state
from PostgreSQL first; a stream whose run no longer exists ends with an
``error`` event. Real Redis, a small retention."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings

from audit.execution.events import RunEventPublisher, run_event_stream
from audit.models import AgentRun
from core.config import get_config

from .builders import RunDriver, tool_turn
from .test_events import frames_of, parse, publish_all

pytestmark = pytest.mark.django_db

REDIS_URL = settings.CONFIG.REDIS_URL


@pytest.fixture
def small_retention(monkeypatch):
    monkeypatch.setattr(get_config(), "EVENT_STREAM_MAXLEN", 10)


def _trimmed_run(thread, total: int = 600):
    """A finished run whose stream held ``total`` events and retains only
    the newest few (Redis trims whole nodes of 100 entries)."""
    run = tool_turn(thread)
    events = [("run.status", {"status": "running"})]
    events += [("model.delta", {"operation_id": "lc_run--m1", "text": str(i)}) for i in range(total - 2)]
    events += [("run.finished", {"status": "completed"})]
    publish_all(run.id, events)
    return run


def test_a_reconnect_older_than_the_retained_window_gets_a_gap_first_R_EVT_2(thread, small_retention):
    run = _trimmed_run(thread)
    events = [parse(f) for f in frames_of(run.id, last_event_id=100)]
    gap_id, kind, gap = events[0]
    assert kind == "gap"
    first = gap["first_retained_id"]
    assert 101 < first <= 600 - 9  # trimmed past the client's position, the newest kept
    assert (gap["missed_from"], gap["missed_to"], gap_id) == (101, first - 1, first - 1)
    # Then every retained event, in order, with no repeat, up to the end.
    assert [e[0] for e in events[1:]] == list(range(first, 601))
    assert events[-1][1] == "run.finished"
    # The state is the run as PostgreSQL has it.
    state = gap["state"]
    assert state["status"] == "completed" and state["output_message_id"] == run.output_message_id
    assert state["usage"] == run.usage
    kinds = [(op["kind"], op["operation_id"], op["status"]) for op in state["operations"]]
    assert kinds == [
        ("model", "lc_run--a1", "completed"),
        ("tool", "call_a", "completed"),
        ("model", "lc_run--a2", "completed"),
    ]
    assert state["operations"][0]["tool_calls"][0]["id"] == "call_a"
    assert state["operations"][2]["content"] == run.output_message.content


def test_a_new_client_on_a_trimmed_stream_gets_the_same_gap_R_EVT_2(thread, small_retention):
    run = _trimmed_run(thread)
    events = [parse(f) for f in frames_of(run.id)]
    assert events[0][1] == "gap" and events[0][2]["missed_from"] == 1
    assert events[1][0] == events[0][2]["first_retained_id"]
    # Reconnecting with the gap's id resumes at the first retained event, silently.
    again = [parse(f) for f in frames_of(run.id, last_event_id=events[0][0])]
    assert again == events[1:]


def test_within_the_retained_window_there_is_no_gap_R_EVT_2(thread, small_retention):
    run = _trimmed_run(thread)
    last = parse(frames_of(run.id)[-2])[0]  # the event before run.finished
    assert [parse(f)[1] for f in frames_of(run.id, last_event_id=last)] == ["run.finished"]


def test_a_running_run_s_gap_state_has_its_rows_so_far_R_EVT_2(thread, small_retention):
    """Mid-run: the finished call with its usage, the open one running with
    no content yet; usage sums the finished calls."""
    driver = RunDriver(thread)
    driver.model("lc_run--m1", tool_calls=[{"id": "call_a", "name": "get_weather", "args": {"city": "Paris"}}])
    driver.model("lc_run--m2", finish=False)

    async def publish_then_read():
        publisher = RunEventPublisher(driver.run.id, REDIS_URL)
        for i in range(400):
            await publisher.publish("model.delta", {"operation_id": "lc_run--m2", "text": str(i)})
        await publisher.close()
        frames = []
        async for frame in run_event_stream(driver.run.id, last_event_id=5, redis_url=REDIS_URL, block_ms=100):
            if frame.startswith(": keep-alive"):
                break  # caught up; the run is still running
            if frame.startswith("id: "):
                frames.append(parse(frame))
        return frames

    frames = async_to_sync(publish_then_read)()
    assert frames[0][1] == "gap"
    state = frames[0][2]["state"]
    assert state["status"] == "running"
    assert [(op["operation_id"], op["status"]) for op in state["operations"]] == [
        ("lc_run--m1", "completed"),
        ("lc_run--m2", "running"),
    ]
    assert state["usage"] == {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15, "unknown_calls": 0}
    assert [f[0] for f in frames[1:]] == list(range(frames[0][2]["first_retained_id"], 401))


@pytest.mark.django_db(transaction=True)
def test_a_stream_whose_run_was_deleted_ends_with_an_error_event_R_EVT_2(thread):
    driver = RunDriver(thread)
    driver.model("lc_run--m1", finish=False)
    publish_all(driver.run.id, [("run.status", {"status": "running"}), ("model.started", {})])

    async def follow_then_delete():
        frames = []
        stream = run_event_stream(driver.run.id, last_event_id=0, redis_url=REDIS_URL, block_ms=100)
        async for frame in stream:
            if frame.startswith(": keep-alive") and len(frames) == 2:
                await asyncio.to_thread(_delete_run, driver.run.pk)
            if frame.startswith("id: "):
                frames.append(parse(frame))
        return frames

    frames = async_to_sync(follow_then_delete)()
    assert [f[:2] for f in frames] == [(1, "run.status"), (2, "model.started"), (3, "error")]
    assert frames[-1][2]["error"] == "run_not_found"


def _delete_run(run_id) -> None:
    from django.db import connection

    from governance.bypass import audited_bypass

    # Runs are append-only (R-GOV-3): the loss is simulated deliberately,
    # through the recorded bypass.
    with audited_bypass(reason="test: a followed run is lost"):
        AgentRun.objects.filter(pk=run_id).delete()
    connection.close()


def test_the_retention_is_a_setting_R_EVT_2(monkeypatch):
    from core.config import Config

    monkeypatch.setenv("EVENT_STREAM_MAXLEN", "123")
    assert Config().EVENT_STREAM_MAXLEN == 123
    assert Config.model_fields["EVENT_STREAM_MAXLEN"].default == 50_000
