"""Every endpoint × {owner, other user, staff, anonymous} (R-READ-5,
R-READ-6): another user's thread, run or message answers 404; audit and
dashboard need staff; raw tool output reaches no non-staff response; every
error has the machine-readable body."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import async_to_sync
from django.test import Client

from conversations.models import Message
from tests.conftest import bearer
from yuxi_project.api import api

from .builders import tool_turn

pytestmark = pytest.mark.django_db

ROLES = ("owner", "other", "staff", "anonymous")


def body_of(response) -> bytes:
    """The whole body, also of an (async) event stream."""
    if not response.streaming:
        return response.content
    if not response.is_async:  # the exports stream synchronously under WSGI
        return b"".join(response.streaming_content)

    async def collect():
        return b"".join([chunk async for chunk in response.streaming_content])

    return async_to_sync(collect)()


def _same(status):
    return {"owner": status, "other": status, "staff": status, "anonymous": 401}


OWNED = {"owner": None, "other": 404, "staff": 404, "anonymous": 401}  # owner: per endpoint
SCENARIO = "/api/audit/runs/{run_id}/scenario"
STAFF_ONLY = {"owner": 403, "other": 403, "staff": 200, "anonymous": 401}

# (method, OpenAPI path) -> (concrete path template, JSON body, expected status per role)
MATRIX = {
    ("post", "/api/threads"): ("/api/threads", {"agent_id": "assistant"}, _same(201)),
    ("get", "/api/threads"): ("/api/threads", None, _same(200)),
    ("post", "/api/threads/{thread_id}/runs"): (
        "/api/threads/{thread_id}/runs",
        {"request_id": "REQ", "input": {"text": "hi"}},
        {**OWNED, "owner": 202},
    ),
    ("get", "/api/threads/{thread_id}/runs"): ("/api/threads/{thread_id}/runs", None, {**OWNED, "owner": 200}),
    ("get", "/api/threads/{thread_id}/history"): ("/api/threads/{thread_id}/history", None, {**OWNED, "owner": 200}),
    ("get", "/api/threads/{thread_id}/memory"): (
        "/api/threads/{thread_id}/memory?include_tools=true",
        None,
        {**OWNED, "owner": 200},
    ),
    ("post", "/api/messages/{message_id}/feedback"): (
        "/api/messages/{message_id}/feedback",
        {"rating": "like"},
        {**OWNED, "owner": 201},
    ),
    ("get", "/api/runs/{run_id}"): ("/api/runs/{run_id}", None, {**OWNED, "owner": 200}),
    # The run is completed, so the owner's cancel and resume are conflicts.
    ("post", "/api/runs/{run_id}/cancel"): ("/api/runs/{run_id}/cancel", None, {**OWNED, "owner": 409}),
    ("post", "/api/runs/{run_id}/resume"): (
        "/api/runs/{run_id}/resume",
        {"request_id": "RES", "decisions": [{"type": "approve"}]},
        {**OWNED, "owner": 409},
    ),
    ("get", "/api/runs/{run_id}/events"): ("/api/runs/{run_id}/events", None, {**OWNED, "owner": 200}),
    ("get", "/api/audit/runs/{run_id}/timeline"): ("/api/audit/runs/{run_id}/timeline", None, STAFF_ONLY),
    ("get", "/api/audit/threads/{thread_id}/timeline"): ("/api/audit/threads/{thread_id}/timeline", None, STAFF_ONLY),
    ("get", "/api/audit/runs/{run_id}/scenario"): ("/api/audit/runs/{run_id}/scenario", None, STAFF_ONLY),
    ("get", "/api/threads/{thread_id}"): ("/api/threads/{thread_id}", None, {**OWNED, "owner": 200}),
    ("patch", "/api/threads/{thread_id}"): ("/api/threads/{thread_id}", {"title": "renamed"}, {**OWNED, "owner": 200}),
    # The owner's deletion comes first; the others were refused before it too
    # (tests/governance/test_thread_delete.py).
    ("delete", "/api/threads/{thread_id}"): ("/api/threads/{thread_id}", None, {**OWNED, "owner": 200}),
    ("get", "/api/audit/runs"): ("/api/audit/runs", None, STAFF_ONLY),
    ("get", "/api/audit/runs/export"): ("/api/audit/runs/export", None, STAFF_ONLY),
    ("get", "/api/audit/runs/{run_id}/export"): ("/api/audit/runs/{run_id}/export?format=csv", None, STAFF_ONLY),
    ("get", "/api/audit/threads/{thread_id}/export"): ("/api/audit/threads/{thread_id}/export", None, STAFF_ONLY),
    ("get", "/api/dashboard/overview"): ("/api/dashboard/overview", None, STAFF_ONLY),
    ("get", "/api/dashboard/models"): ("/api/dashboard/models", None, STAFF_ONLY),
    ("get", "/api/dashboard/tools"): ("/api/dashboard/tools", None, STAFF_ONLY),
    ("get", "/api/dashboard/timeseries"): ("/api/dashboard/timeseries", None, STAFF_ONLY),
    ("get", "/api/dashboard/feedback"): ("/api/dashboard/feedback", None, STAFF_ONLY),
    ("get", "/api/dashboard/costs"): ("/api/dashboard/costs", None, STAFF_ONLY),
}


def test_matrix_covers_every_endpoint_of_the_schema_R_READ_5():
    endpoints = {(method, path) for path, ops in api.get_openapi_schema()["paths"].items() for method in ops}
    assert endpoints - set(MATRIX) == set(), "add the new endpoints to the access matrix"


@pytest.mark.parametrize("endpoint", sorted(MATRIX), ids=lambda e: f"{e[0]} {e[1]}")
def test_access_matrix_R_READ_5_R_READ_6(endpoint, thread, other_user, staff_user):
    if endpoint[1] not in api.get_openapi_schema()["paths"]:
        pytest.skip("endpoint not in this build")
    run = tool_turn(thread)
    ids = {"thread_id": thread.id, "run_id": run.id, "message_id": run.output_message_id}
    template, body, expected = MATRIX[endpoint]
    headers = {"owner": bearer(thread.user), "other": bearer(other_user), "staff": bearer(staff_user), "anonymous": {}}
    for role in ROLES:
        path = template.format(**ids)
        if body is not None and "request_id" in body:
            body = {**body, "request_id": f"{body['request_id']}-{role}"}
        client = Client()
        if endpoint[0] == "get":
            response = client.get(path, headers=headers[role])
        else:
            send = getattr(client, endpoint[0])
            response = send(path, body, content_type="application/json", headers=headers[role])
        assert response.status_code == expected[role], (role, path, response.status_code)
        content = body_of(response)
        if response.status_code >= 400:
            error = json.loads(content)["error"]
            assert isinstance(error["code"], str) and error["message"]
        if role != "staff":
            assert b"raw-envelope" not in content and b"raw_output" not in content, (role, path)
        else:
            # Staff do see the raw tool output (timelines, exports); a replay
            # scenario holds what the tools gave the model, not their raw output.
            if endpoint[1].startswith("/api/audit/") and endpoint[1] not in ("/api/audit/runs", SCENARIO):
                assert b"raw-envelope" in content
    # No refused request changed anything: the other user and the anonymous
    # caller left no rows in the owner's thread.
    assert not Message.objects.filter(thread=thread).exclude(run__user=thread.user).exists()


def test_run_events_for_a_finished_run_end_with_terminal_status_R_EVT_1(thread):
    """With Redis holding no events for the run (lost or never published),
    the stream still ends with the terminal status, rebuilt from the row."""
    run = tool_turn(thread)
    response = Client().get(f"/api/runs/{run.id}/events", headers=bearer(thread.user))
    assert response.status_code == 200 and response["Content-Type"] == "text/event-stream"
    frames = body_of(response).decode()
    assert frames.endswith(
        f'id: 1\nevent: run.finished\ndata: {{"status": "completed", "error_type": "", '
        f'"output_message_id": {run.output_message_id}, "interrupts": null, "rebuilt": true}}\n\n'
    )


# "": the schema's pattern refuses an empty header, and so does the server
# (it read it as 0; found by schemathesis).
@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "9" * 30, "", " "])
def test_run_events_bad_last_event_id_is_422_R_READ_6(thread, value):
    run = tool_turn(thread)
    response = Client().get(f"/api/runs/{run.id}/events", headers={**bearer(thread.user), "Last-Event-ID": value})
    assert response.status_code == 422
    assert response.json()["error"]["reason"] == "bad_last_event_id"
