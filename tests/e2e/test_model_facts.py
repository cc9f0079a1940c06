"""Every model fact exact, end to end with real processes (web, Celery
worker, replay model server), driven over HTTP and checked in PostgreSQL:

- a call cancelled before its first chunk keeps its row (R-MA-10);
- usage reported as running totals is stored as the bill (R-MA-11);
- a model server outage mid-batch: requests refused before any byte are
  retried and their runs recover; only streams cut mid-answer fail, as
  ``model_stream_broken`` (R-RUN-12)."""

from __future__ import annotations

import sys
import time
from collections import Counter

import pytest
import redis
from django.conf import settings

from audit.execution.events import stream_key
from audit.models import AgentRun
from conversations.models import Message
from tests.conftest import bearer

from .stack import TERMINAL_STATUSES, create_thread, start, start_stack, wait_for_status

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def _submit(client, thread_id: str, request_id: str, text: str) -> str:
    submitted = client.post(f"/api/threads/{thread_id}/runs", json={"request_id": request_id, "input": {"text": text}})
    assert submitted.status_code == 202, submitted.text
    return submitted.json()["run_id"]


def _wait_for_event(run_id: str, event_type: str, timeout: float = 30.0) -> None:
    """Wait until the worker published ``event_type`` on the run's live stream."""
    client = redis.Redis.from_url(settings.CONFIG.REDIS_URL)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if any(f.get(b"type") == event_type.encode() for _, f in client.xrange(stream_key(run_id))):
                return
            time.sleep(0.02)
    finally:
        client.close()
    raise TimeoutError(f"run {run_id} published no {event_type}")


def test_a_call_cancelled_before_its_first_chunk_keeps_its_row_R_MA_10(stack, user, staff_user):
    """Issue 10 finding 1: turn 0 a fast tool call, turn 1 an answer whose
    first chunk takes 2 s; cancel 1 s after tool.finished."""
    with stack.client(bearer(user)) as client, stack.client(bearer(staff_user)) as staff:
        thread_id = create_thread(client, "replay:tool_then_slow_answer")
        run_id = _submit(client, thread_id, "before-first-chunk-1", "Weather in Paris?")
        _wait_for_event(run_id, "tool.finished")
        time.sleep(1.0)
        cancelled = client.post(f"/api/runs/{run_id}/cancel")
        assert cancelled.status_code == 202, cancelled.text
        body = wait_for_status(client, run_id, TERMINAL_STATUSES)
        timeline = staff.get(f"/api/audit/runs/{run_id}/timeline").json()["items"]

    assert body["status"] == "cancelled", body
    assert body["usage"]["unknown_calls"] == 1
    assert body["usage"]["total_tokens"] == 61, "the first call's usage only"
    first, second = Message.objects.model_calls().filter(run_id=run_id).order_by("sequence")
    assert first.execution_status == "completed"
    assert second.execution_status == "interrupted" and second.usage is None
    assert second.metadata["usage_unknown"] is True and second.metadata["awaiting_first_chunk"] is True
    assert second.duration_ms is not None and second.duration_ms >= 900
    assert [(i["kind"], i["status"]) for i in timeline] == [
        ("model", "completed"),
        ("tool", "completed"),
        ("model", "interrupted"),
    ], "the timeline shows the call"
    # The replay server saw the second request and its client went away.
    stack.replay.wait_for_line("the client closed the stream")


def test_running_usage_totals_are_stored_as_the_final_totals_R_MA_11(stack, user):
    """Issue 10 finding 2: 15 chunks of running totals, final 100 / 12 / 112."""
    with stack.client(bearer(user)) as client:
        thread_id = create_thread(client, "replay:usage_cumulative")
        run_id = _submit(client, thread_id, "cumulative-1", "hello")
        body = wait_for_status(client, run_id, TERMINAL_STATUSES)
    assert body["status"] == "completed", body
    (row,) = Message.objects.model_calls().filter(run_id=run_id)
    assert row.usage == {"input_tokens": 100, "output_tokens": 12, "total_tokens": 112}
    assert body["usage"] == {"input_tokens": 100, "output_tokens": 12, "total_tokens": 112, "unknown_calls": 0}


def _restart_replay(stack) -> None:
    """The replay server again on its port, started without Django (the
    same ``serve`` the management command calls) so it is back quickly."""
    port = int(stack.env["REPLAY_MODEL_URL"].rsplit(":", 1)[1].split("/")[0])
    stack.replay = start(
        "replay-restarted",
        [sys.executable, "-c", f"from audit.replay.server import serve; serve('127.0.0.1', {port})"],
        stack.env,
    )
    stack.replay.wait_for_line("replay model server listening")


@pytest.fixture
def outage_stack(e2e_database_url, monkeypatch):
    """A stack of its own (its replay server gets killed) with two workers
    (four runs at once) and a retry window wide enough for the restart on
    a loaded machine: 12 attempts, waits capped at 4 s (about 40 s); a
    20 s lease, so a starved worker is not mistaken for a dead one."""
    monkeypatch.setenv("MODEL_RETRY_ATTEMPTS", "12")
    monkeypatch.setenv("MODEL_RETRY_MAX_DELAY_SECONDS", "4")
    own = start_stack(database_url=e2e_database_url, redis_url=settings.CONFIG.REDIS_URL, lease_ttl=20.0)
    try:
        own.start_worker(name="outage-worker", beat=False)
        yield own
    finally:
        own.stop()


def test_a_model_server_outage_mid_batch_is_ridden_out_by_retries_R_RUN_12(outage_stack, user):
    """Issue 9 finding 8: the model server is killed mid-batch and restarted
    on the same port about 3 s later."""
    stack = outage_stack
    runs: list[str] = []
    with stack.client(bearer(user)) as client:
        for i in range(8):
            thread_id = create_thread(client, "replay:outage_batch")
            runs.append(_submit(client, thread_id, f"outage-{i}", f"Weather in Paris? ({i})"))
        # Mid-batch: some runs have streamed a model call already.
        deadline = time.monotonic() + 60
        while not Message.objects.filter(run_id__in=runs, role="tool").exists():
            assert time.monotonic() < deadline, "the batch never got going"
            time.sleep(0.05)
        stack.replay.kill()
        killed_at = time.monotonic()
        time.sleep(3.0)
        _restart_replay(stack)
        down_for = time.monotonic() - killed_at
        bodies = [wait_for_status(client, run_id, TERMINAL_STATUSES) for run_id in runs]

    outcomes = Counter((b["status"], b["error_type"]) for b in bodies)
    rows = list(Message.objects.model_calls().filter(run_id__in=runs))
    retried = [r for r in rows if r.metadata.get("attempts", 1) > 1]
    recovered = [r for r in retried if r.execution_status == "completed"]
    print(
        f"\noutage {down_for:.1f}s: runs={len(runs)} outcomes={dict(outcomes)} "
        f"retried calls={len(retried)} recovered={len(recovered)} "
        f"attempts={sorted(r.metadata['attempts'] for r in retried)}"
    )
    assert ("failed", "model_unreachable") not in outcomes, "every refused request was retried"
    for body in bodies:
        assert body["status"] == "completed" or body["error_type"] == "model_stream_broken", body
    for row in rows:
        if row.execution_status == "failed":
            # Only a stream cut mid-answer fails, keeping what it streamed.
            assert (
                row.metadata["error"].startswith("model_stream_broken") and "awaiting_first_chunk" not in row.metadata
            )
    assert recovered, "some request was refused during the outage and recovered by a retry"
    for row in recovered:
        assert all(not e["connected"] for e in row.metadata["attempt_errors"]), "refused before any byte"
    # No call left running, and run usage is the sum of its rows.
    assert not Message.objects.filter(run_id__in=runs, execution_status="running").exists()
    for run in AgentRun.objects.filter(pk__in=runs):
        own = [r.usage for r in rows if r.run_id == run.id]
        assert run.usage["total_tokens"] == sum(u["total_tokens"] for u in own if u)
        assert run.usage["unknown_calls"] == sum(1 for u in own if not u)
