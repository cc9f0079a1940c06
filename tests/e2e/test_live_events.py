"""Live run events over SSE from the real ASGI server, fed by a real Celery
worker through Redis (R-EVT-1).

A client that disconnects mid-run and reconnects with ``Last-Event-ID``
gets exactly the events an uninterrupted client gets: no gap, no repeat."""

from __future__ import annotations

import json
import threading
import uuid

import pytest

from audit.models import AgentRun
from tests.conftest import bearer

from .stack import wait_for_status

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def read_events(client, run_id: str, *, last_event_id: str | None = None, stop_after_deltas: int | None = None):
    """Read SSE events ``(id, event, data)`` until ``run.finished``, or
    disconnect after ``stop_after_deltas`` text deltas."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    events, deltas, fields = [], 0, {}
    with client.stream("GET", f"/api/runs/{run_id}/events", headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                name, _, value = line.partition(": ")
                fields[name] = value
                continue
            if "id" in fields:
                events.append((int(fields["id"]), fields["event"], json.loads(fields["data"])))
                deltas += fields["event"] == "model.delta"
                if fields["event"] == "run.finished":
                    return events
                if stop_after_deltas is not None and deltas >= stop_after_deltas:
                    return events  # leaving the block disconnects
            fields = {}
    return events


def submit(client, model: str, text: str) -> str:
    thread = client.post("/api/threads", json={"agent_id": "assistant", "model": model})
    assert thread.status_code == 201, thread.text
    run = client.post(
        f"/api/threads/{thread.json()['thread_id']}/runs",
        json={"request_id": f"sse-{uuid.uuid4().hex}", "input": {"text": text}},
    )
    assert run.status_code == 202, run.text
    return run.json()["run_id"]


def test_reconnect_with_last_event_id_resumes_without_gap_or_repeat_R_EVT_1(stack, user):
    headers = bearer(user)
    with stack.client(headers) as client:
        run_id = submit(client, "replay:slow_answer", "talk slowly")
        uninterrupted: list = []
        reader = threading.Thread(
            target=lambda: uninterrupted.extend(read_events(stack.client(headers), run_id)), daemon=True
        )
        reader.start()

        first = read_events(client, run_id, stop_after_deltas=5)
        assert first[-1][1] == "model.delta" and all(e[1] != "run.finished" for e in first)
        assert AgentRun.objects.get(pk=run_id).status == "running"  # it really was mid-run
        rest = read_events(client, run_id, last_event_id=str(first[-1][0]))
        reader.join(timeout=60)

        assert first + rest == uninterrupted
        ids = [e[0] for e in uninterrupted]
        assert ids == list(range(1, len(ids) + 1))
        assert uninterrupted[0][1:] == ("run.status", {"status": "running"})
        finished = uninterrupted[-1]
        assert finished[1] == "run.finished" and finished[2]["status"] == "completed"
        run = AgentRun.objects.get(pk=run_id)
        # The deltas travel live only; together they are the stored answer.
        text = "".join(e[2]["text"] for e in uninterrupted if e[1] == "model.delta")
        assert text == run.output_message.content
        assert finished[2]["output_message_id"] == run.output_message_id

        # Reconnecting after the end is answered 204: nothing more will
        # come, and a browser's EventSource stops reconnecting (R-EVT-3).
        again = client.get(f"/api/runs/{run_id}/events", headers={"Last-Event-ID": str(finished[0])})
        assert again.status_code == 204 and again.content == b""


def test_stream_carries_tool_lifecycle_and_interrupt_action_requests_R_EVT_1(stack, user):
    with stack.client(bearer(user)) as client:
        tool_run = submit(client, "replay:tool_then_answer", "weather")
        events = read_events(client, tool_run)
        lifecycle = [e[1] for e in events if e[1] != "model.delta"]
        assert lifecycle == [
            "run.status",
            "model.started",
            "model.finished",
            "tool.started",
            "tool.finished",
            "model.started",
            "model.finished",
            "run.finished",
        ]
        first_finish = next(e for e in events if e[1] == "model.finished")
        assert [c["id"] for c in first_finish[2]["tool_calls"]] == ["call_weather_paris"]
        tool_finished = next(e for e in events if e[1] == "tool.finished")
        assert tool_finished[2] == {"tool_call_id": "call_weather_paris", "status": "completed"}
        assert any(e[1] == "model.delta" for e in events)

        approval_run = submit(client, "replay:approval_send_email", "mail bob")
        events = read_events(client, approval_run)
        finished = events[-1][2]
        assert finished["status"] == "interrupted"
        assert "send_email" in json.dumps(finished["interrupts"])
        assert wait_for_status(client, approval_run, {"interrupted"})["pending_approval"] == finished["interrupts"]


def test_cancel_shows_as_status_change_then_terminal_event_R_EVT_1_R_RUN_6(stack, user):
    with stack.client(bearer(user)) as client:
        run_id = submit(client, "replay:slow_answer", "talk, then stop")
        first = read_events(client, run_id, stop_after_deltas=3)
        assert client.post(f"/api/runs/{run_id}/cancel").status_code == 202
        rest = read_events(client, run_id, last_event_id=str(first[-1][0]))
        events = first + rest
        assert [e[0] for e in events] == list(range(1, len(events) + 1))
        statuses = [e[2]["status"] for e in events if e[1] in ("run.status", "run.finished")]
        if statuses != ["running", "cancel_requested", "cancelled"]:
            run = AgentRun.objects.get(pk=run_id)
            worker_lines = [line for w in stack.workers for line in w.output().splitlines() if run_id in line]
            pytest.fail(
                f"statuses {statuses}; last events {events[-3:]}; the run ended {run.status} ({run.error_type}:"
                f" {run.error_message}); worker lines of the run: {worker_lines[-20:]}"
            )
