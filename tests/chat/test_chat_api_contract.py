"""What the chat page's script relies on in the JSON API (R-UI-1), without a
browser: an interrupted run's approval as ``GET /threads/{id}/runs`` gives
it, the resume, the history items' ``id``, ``kind`` and ``turn_id`` that
place the feedback buttons and the turn's cost, and the runs' ``turn_id``
and ``cost`` that the cost per turn sums. The run is executed in this
process against the replay server (``approval_send_email``)."""

from __future__ import annotations

import json
import re
import uuid
from decimal import Decimal

import pytest
from django.test import Client

from audit.execution.runner import run_execute
from audit.models import AgentRun
from conversations.models import Conversation, MessageFeedback
from tests.conftest import bearer

pytestmark = pytest.mark.django_db(transaction=True)


def _post(client, headers, path, body):
    return client.post(path, json.dumps(body), content_type="application/json", headers=headers)


def test_an_approval_edited_then_rated_as_the_chat_page_does_it_R_UI_1(user, replay_models):
    client, headers = Client(), bearer(user)
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:approval_send_email")
    submitted = _post(
        client, headers, f"/api/threads/{thread.id}/runs", {"request_id": "r1", "input": {"text": "Mail Bob"}}
    )
    assert submitted.status_code == 202, submitted.content
    run_execute(run_id=uuid.UUID(submitted.json()["run_id"]), owner="in-process")

    # The page loads the thread: its newest run is interrupted and carries
    # the approval it shows.
    newest = client.get(f"/api/threads/{thread.id}/runs?limit=1", headers=headers).json()["items"][0]
    assert newest["status"] == "interrupted"
    assert newest["approval"]["status"] == "pending"
    [request] = newest["approval"]["action_requests"]
    assert request["name"] == "send_email" and request["allowed_decisions"] == ["approve", "edit", "reject"]
    assert request["args"] == {"to": "ops@example.com", "subject": "Report", "body": "All good"}

    # Edit: the arguments the page's textarea sends.
    edited = {**request["args"], "to": "bob@example.com"}
    resumed = _post(
        client,
        headers,
        f"/api/runs/{newest['run_id']}/resume",
        {"request_id": "r2", "decisions": [{"type": "edit", "args": edited}]},
    )
    assert resumed.status_code == 202, resumed.content
    run_execute(run_id=uuid.UUID(resumed.json()["run_id"]), owner="in-process")
    [decision] = AgentRun.objects.get(pk=resumed.json()["run_id"]).input["decisions"]
    assert decision["type"] == "edit" and decision["edited_action"]["args"] == edited  # LangChain's form

    # The history: one turn; the carrier's tool ran with the edited
    # arguments; the final answer is the message feedback takes.
    items = client.get(f"/api/threads/{thread.id}/history?limit=200", headers=headers).json()["items"]
    assert [i["kind"] for i in items] == ["user", "tool_carrier", "answer"]
    assert len({i["turn_id"] for i in items}) == 1 and items[0]["turn_id"]
    [execution] = items[1]["tool_executions"]
    assert execution["name"] == "send_email" and execution["status"] == "completed"
    assert re.match(r"Email to bob@example\.com recorded as ", execution["content"])
    assert items[2]["content"] == "The email was sent."

    # The turn's runs (the interrupted one and its resume) carry its
    # turn_id and a cost each: the page sums them.
    runs = client.get(f"/api/threads/{thread.id}/runs?limit=100", headers=headers).json()["items"]
    assert [r["status"] for r in runs] == ["completed", "interrupted"]
    assert {r["turn_id"] for r in runs} == {items[0]["turn_id"]}
    assert all(r["cost"]["total_usd"] is not None and r["usage"]["total_tokens"] > 0 for r in runs)
    assert sum(Decimal(r["cost"]["total_usd"]) for r in runs) > 0

    # Like, then dislike: the second updates the first.
    answer_id = items[2]["id"]
    assert _post(client, headers, f"/api/messages/{answer_id}/feedback", {"rating": "like"}).status_code == 201
    assert _post(client, headers, f"/api/messages/{answer_id}/feedback", {"rating": "dislike"}).status_code == 200
    assert list(MessageFeedback.objects.filter(message_id=answer_id).values_list("rating", flat=True)) == ["dislike"]
    # The tool carrier takes no feedback: the page offers none there.
    carrier = _post(client, headers, f"/api/messages/{items[1]['id']}/feedback", {"rating": "like"})
    assert carrier.status_code == 422


def test_the_page_has_the_approval_form_hidden_R_UI_1(client, user):
    client.force_login(user)
    html = client.get("/chat/").content.decode()
    assert '<form id="yc-approval" class="yc-approval" aria-label="Approval" hidden></form>' in html
