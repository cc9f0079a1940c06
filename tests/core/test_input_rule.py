"""One input rule for every endpoint that takes text (R-RUN-13): a lone
surrogate anywhere in a body is refused with 422 ``lone_surrogate`` naming
where, and nothing changes; a NUL is taken everywhere and stored escaped
(R-RUN-11). Resume edit args, free JSON, once let a lone surrogate through
(202) that every string field refused, and the resume run then failed
``model_unreachable``."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from audit.models import AgentRun
from conversations.models import Conversation, Message, MessageFeedback
from tests.conftest import bearer
from tests.read.builders import tool_turn

from .test_hardening import _interrupted_run

pytestmark = pytest.mark.django_db

# A JSON body with "\ud83d" alone: json.loads makes it a lone surrogate.
LONE = "half \\ud83d"


def _post(user, path: str, body: str):
    return Client().post(path, data=body, content_type="application/json", headers=bearer(user))


def _state() -> tuple:
    """What any of these requests could have changed."""
    return (
        Conversation.objects.count(),
        AgentRun.objects.count(),
        Message.objects.count(),
        list(MessageFeedback.objects.values_list("rating", "reason")),
        list(Conversation.objects.order_by("id").values_list("title", flat=True)),
    )


def _endpoints(thread) -> list[tuple[str, str, str, list]]:
    """(name, path, body with a lone surrogate, path of the field in the body)."""
    answer = tool_turn(thread)
    interrupted = _interrupted_run(thread)
    resume = f"/api/runs/{interrupted.id}/resume"
    request = '"request_id": "r-1"'
    return [
        (
            "turn input",
            f"/api/threads/{thread.id}/runs",
            f'{{{request}, "input": {{"text": "{LONE}"}}}}',
            ["input", "text"],
        ),
        ("title", "/api/threads", f'{{"agent_id": "assistant", "title": "{LONE}"}}', ["title"]),
        (
            "feedback reason",
            f"/api/messages/{answer.output_message_id}/feedback",
            f'{{"rating": "dislike", "reason": "{LONE}"}}',
            ["reason"],
        ),
        (
            "resume edit args",
            resume,
            f'{{{request}, "decisions": [{{"type": "edit", "args": {{"to": "a@b.c", "subject": "{LONE}", "body": "b"}}}}]}}',
            ["decisions", 0, "args", "subject"],
        ),
        (
            "resume edit args key",
            resume,
            f'{{{request}, "decisions": [{{"type": "edit", "args": {{"{LONE}": "x"}}}}]}}',
            ["decisions", 0, "args"],
        ),
        (
            "resume reject message",
            resume,
            f'{{{request}, "decisions": [{{"type": "reject", "message": "{LONE}"}}]}}',
            ["decisions", 0, "message"],
        ),
    ]


def test_a_lone_surrogate_is_refused_by_every_text_endpoint_and_changes_nothing_R_RUN_13(user, thread):
    endpoints = _endpoints(thread)
    before = _state()
    for name, path, body, where in endpoints:
        json.loads(body)  # the body itself is valid JSON
        response = _post(user, path, body)
        assert response.status_code == 422, (name, response.content)
        error = response.json()["error"]
        assert (error["code"], error["reason"], error["path"]) == ("invalid_input", "lone_surrogate", where), name
    assert _state() == before


def test_a_surrogate_pair_is_text_R_RUN_13(user, thread):
    """A pair escaped in JSON is one character (U+1F600), not a lone surrogate."""
    response = _post(user, "/api/threads", '{"agent_id": "assistant", "title": "smile \\ud83d\\ude00"}')
    assert response.status_code == 201, response.content
    assert Conversation.objects.get(pk=response.json()["thread_id"]).title == "smile \U0001f600"


def test_a_nul_in_resume_edit_args_is_taken_and_kept_as_written_R_RUN_13(user, thread):
    interrupted = _interrupted_run(thread)
    body = {
        "request_id": "nul-edit",
        "decisions": [{"type": "edit", "args": {"to": "a@b.c", "subject": "s\x00t", "body": "b"}}],
    }
    response = _post(user, f"/api/runs/{interrupted.id}/resume", json.dumps(body))
    assert response.status_code == 202, response.content
    resume = AgentRun.objects.get(pk=response.json()["run_id"])
    assert resume.input["decisions"][0]["edited_action"]["args"]["subject"] == "s\x00t"


@pytest.mark.django_db(transaction=True)
def test_a_nul_in_resume_edit_args_reads_the_same_on_every_path_R_RUN_13(user, staff_user, replay_models):
    """The approver edits the recipient to hold a NUL; the tool echoes it.
    History showed that output escaped (``\\u0000``, six characters) while
    the timeline showed it decoded; every path now shows the same text,
    and the model's next request carries it in its replacement form."""
    from audit.execution.runner import run_execute

    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:approval_send_email")
    client = Client(headers=bearer(user))
    submitted = client.post(
        f"/api/threads/{thread.id}/runs", {"request_id": "email-1", "input": {"text": "email ops"}}, "application/json"
    )
    first = submitted.json()["run_id"]
    assert run_execute(run_id=first, owner="in-process") == "interrupted"
    edit = {"type": "edit", "args": {"to": "ops\x00@example.com", "subject": "Report", "body": "All good"}}
    resumed = client.post(
        f"/api/runs/{first}/resume", {"request_id": "resume-1", "decisions": [edit]}, "application/json"
    )
    assert resumed.status_code == 202, resumed.content
    resume = resumed.json()["run_id"]
    assert run_execute(run_id=resume, owner="in-process") == "completed"

    tool = Message.objects.tool_executions().get(run_id=resume)
    assert tool.tool_input["to"] == "ops\x00@example.com"
    expected = tool.content
    assert expected.startswith("Email to ops\x00@example.com recorded as ")
    timeline = Client(headers=bearer(staff_user)).get(f"/api/audit/runs/{resume}/timeline").json()["items"]
    assert next(item for item in timeline if item["kind"] == "tool")["content"] == expected
    history = client.get(f"/api/threads/{thread.id}/history").json()["items"]
    executions = [execution for item in history for execution in item.get("tool_executions") or []]
    assert [(execution["content"], execution["size_chars"]) for execution in executions] == [(expected, len(expected))]
    memory = client.get(f"/api/threads/{thread.id}/memory?include_tools=true").json()["messages"]
    assert [message["content"] for message in memory if message["type"] == "tool"] == [expected]
