"""A web server asked to stop while a client follows a run ends the
client's live event stream and exits, instead of waiting for the run to
end (issue 37, ``core.draining``); the client resumes on another server
with ``Last-Event-ID`` and misses nothing, repeats nothing (R-EVT-1)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid

import httpx
import pytest

from tests.conftest import bearer
from tests.waiting import WAIT_SECONDS

from .stack import free_port, start_web, wait_for_status

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

#: The server ends its streams within one wait (1.5 s) of the signal; the
#: bound only decides when a server that never ends them fails the test.
EXIT_BOUND_SECONDS = WAIT_SECONDS


def follow(base_url: str, headers: dict, run_id: str, *, events: list, comments: list, last_event_id=None):
    """Read the run's stream into ``events`` (``(id, type, data)``, as they
    come) and ``comments`` until the stream ends."""
    extra = {"Last-Event-ID": str(last_event_id)} if last_event_id else {}
    fields: dict = {}
    with httpx.stream(
        "GET", f"{base_url}/api/runs/{run_id}/events", headers={**headers, **extra}, timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith(":"):
                comments.append(line)
            elif line:
                name, _, value = line.partition(": ")
                fields[name] = value
            elif "id" in fields:
                events.append((int(fields["id"]), fields["event"], json.loads(fields["data"])))
                fields = {}


def following(base_url: str, headers: dict, run_id: str, **kwargs) -> tuple[threading.Thread, list, list]:
    events: list = []
    comments: list = []
    reader = threading.Thread(
        target=follow, args=(base_url, headers, run_id), kwargs={"events": events, "comments": comments, **kwargs}
    )
    reader.daemon = True
    reader.start()
    return reader, events, comments


def test_a_stopping_web_server_ends_its_live_streams_and_the_client_resumes_elsewhere(stack, user):
    headers = bearer(user)
    port = free_port()
    draining_web = start_web("web-draining", port, stack.env)
    try:
        with stack.client(headers) as client:
            thread = client.post("/api/threads", json={"agent_id": "assistant", "model": "replay:long_answer"})
            run = client.post(
                f"/api/threads/{thread.json()['thread_id']}/runs",
                json={"request_id": f"drain-{uuid.uuid4().hex}", "input": {"text": "take your time"}},
            )
            run_id = run.json()["run_id"]
            wait_for_status(client, run_id, {"running"})

        reader, before, comments = following(f"http://127.0.0.1:{port}", headers, run_id)
        # Some text has streamed through this server before it is stopped.
        _wait_for(lambda: any(event[1] == "model.delta" for event in before), "a model delta on the run")

        os.killpg(draining_web.popen.pid, signal.SIGTERM)
        _wait_for(lambda: draining_web.popen.poll() is not None, "the web server to exit")
        reader.join(timeout=EXIT_BOUND_SECONDS)
        assert not reader.is_alive(), "the client's stream did not end"

        with stack.client(headers) as client:
            # The server did not wait for the run: it is still streaming.
            assert client.get(f"/api/runs/{run_id}").json()["status"] == "running"
        assert comments[-1] == ": the server is restarting"
        assert before and [e[0] for e in before] == list(range(before[0][0], before[0][0] + len(before)))

        # Resume on the other server from the last event held; then cancel.
        continuation, after, _ = following(stack.base_url, headers, run_id, last_event_id=before[-1][0])
        _wait_for(lambda: len(after) > 0, "an event after the reconnect")
        with stack.client(headers) as client:
            assert client.post(f"/api/runs/{run_id}/cancel").status_code == 202
        continuation.join(timeout=EXIT_BOUND_SECONDS)
        assert after[0][0] == before[-1][0] + 1, "a gap or a repeat at the reconnect"
        assert [e[0] for e in after] == list(range(after[0][0], after[0][0] + len(after)))
        assert after[-1][1] == "run.finished" and after[-1][2]["status"] == "cancelled"
    finally:
        draining_web.stop()


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + EXIT_BOUND_SECONDS
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"waited {EXIT_BOUND_SECONDS}s for {what}")
