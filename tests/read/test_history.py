"""History, memory and feedback over the API, against runs in every state
(R-READ-1, R-READ-2, R-READ-4, R-READ-5, R-READ-6)."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from conversations.models import Message, MessageFeedback
from tests.conftest import bearer

from .builders import RunDriver, resume_run_of, tool_turn

pytestmark = pytest.mark.django_db

WEATHER = [{"id": "call_w", "name": "get_weather", "args": {"city": "Paris"}}]


def history(thread, headers=None, **params):
    response = Client().get(f"/api/threads/{thread.id}/history", params, headers=headers or bearer(thread.user))
    assert response.status_code == 200, response.content
    return response.json()


def memory(thread, include_tools: bool):
    response = Client().get(
        f"/api/threads/{thread.id}/memory", {"include_tools": str(include_tools).lower()}, headers=bearer(thread.user)
    )
    assert response.status_code == 200, response.content
    return response.json()["messages"]


def shape(body):
    return [(i["kind"], i["content"], [(t["id"], t["status"]) for t in i["tool_executions"]]) for i in body["items"]]


def test_running_run_shows_only_the_user_message_R_READ_1(thread):
    d = RunDriver(thread, text="hi")
    d.model("lc_run--m1", tool_calls=WEATHER).tool("call_w", declared_by="lc_run--m1")
    d.model("lc_run--m2", finish=False)
    assert shape(history(thread)) == [("user", "hi", [])]
    assert memory(thread, include_tools=True) == [
        {
            "type": "human",
            "id": memory(thread, False)[0]["id"],
            "content": "hi",
            "tool_calls": None,
            "tool_call_id": None,
            "name": None,
            "status": None,
        }
    ]


def test_completed_run_shows_carrier_with_its_tool_after_refresh_R_READ_1(thread):
    tool_turn(thread, prefix="a", text="weather?")
    body = history(thread)
    assert shape(body) == [
        ("user", "weather?", []),
        ("tool_carrier", "", [("call_a", "completed")]),
        ("answer", "It is sunny (a).", []),
    ]
    carrier = body["items"][1]
    assert carrier["tool_calls"] == [{"id": "call_a", "name": "get_weather", "args": {"city": "Paris"}}]
    assert carrier["tool_executions"][0] == {
        "id": "call_a",
        "name": "get_weather",
        "status": "completed",
        "content": '{"conditions": "sunny"}',
        "size_chars": 23,
        "workspace_path": None,
    }
    # Only allowlisted operation metadata; no lifecycle metadata, no raw envelope.
    assert carrier["metadata"] == {"model_name": "replay", "finish_reason": "stop"}
    text = json.dumps(body)
    for secret in ("raw-envelope", "state_reconciled", "namespace", "model_run_id", "raw_output"):
        assert secret not in text


def test_unproven_model_rows_never_appear_R_READ_1(thread):
    # Failed with no final State: nothing reconciled, so no carrier.
    d = RunDriver(thread, text="q1")
    d.model("lc_run--m1", tool_calls=WEATHER).tool("call_w", declared_by="lc_run--m1")
    d.state = []
    d.finish("failed", error_type="model_http_error")
    assert shape(history(thread)) == [("user", "q1", [])]


def test_failed_run_with_state_shows_proven_carrier_R_READ_1(thread):
    d = RunDriver(thread, text="q1")
    d.model("lc_run--m1", tool_calls=WEATHER).tool(
        "call_w", declared_by="lc_run--m1", status="failed", content="city unknown"
    )
    d.model("lc_run--m2", finish=False, in_state=False)
    d.finish("failed", error_type="model_stream_error")
    assert shape(history(thread)) == [("user", "q1", []), ("tool_carrier", "", [("call_w", "failed")])]
    rows = dict(Message.objects.filter(run=d.run).values_list("operation_id", "execution_status"))
    assert rows["lc_run--m2"] == "failed"  # closed by the terminal transaction, never shown


def test_cancelled_run_during_tool_shows_interrupted_tool_R_READ_1(thread):
    d = RunDriver(thread, text="q1")
    d.model("lc_run--m1", tool_calls=WEATHER).tool("call_w", declared_by="lc_run--m1", finish=False)
    d.finish("cancelled")
    assert shape(history(thread)) == [("user", "q1", []), ("tool_carrier", "", [("call_w", "interrupted")])]


def test_a_run_cancelled_mid_answer_leaves_its_words_out_of_history_and_memory_R_READ_1_R_READ_2(thread):
    """What the streamed words of a cut answer are: audit, not an answer.
    The staff timeline keeps them (``content_partial``); the history, the
    memory and so the agent's next turn never see them."""
    from audit import ledger

    d = RunDriver(thread, text="tell me a long story")
    d.model("lc_run--m1", finish=False, in_state=False)
    d.run = ledger.run_finish(
        lease=d.lease, status="cancelled", final_state=[], partial_content={"lc_run--m1": "Once upon a"}
    )
    row = Message.objects.get(run=d.run, operation_id="lc_run--m1")
    assert (row.execution_status, row.content, row.metadata["content_partial"]) == ("interrupted", "Once upon a", True)
    assert shape(history(thread)) == [("user", "tell me a long story", [])]
    for include_tools in (True, False):
        assert [m["content"] for m in memory(thread, include_tools)] == ["tell me a long story"]


def test_interrupted_then_resumed_turn_R_READ_1_R_READ_2(thread):
    email = [{"id": "call_mail", "name": "send_email", "args": {"to": "a@b.c", "subject": "s", "body": "b"}}]
    first = RunDriver(thread, text="mail bob")
    first.model("lc_run--m1", tool_calls=email)
    interrupted = first.finish("interrupted", interrupts=[{"action_requests": [{"name": "send_email"}]}])
    assert interrupted.status == "interrupted"
    # Interrupted: the pending call shows with no execution, as a tool
    # carrier — the message asks for a tool, it answers nothing (R-READ-1).
    body = history(thread)
    assert [(i["kind"], i["tool_executions"]) for i in body["items"]] == [("user", []), ("tool_carrier", [])]
    assert body["items"][1]["tool_calls"][0]["id"] == "call_mail"
    assert memory(thread, include_tools=True)[1:] == []  # no tool call without its result

    resume = RunDriver(thread, run=resume_run_of(interrupted, decisions=[{"type": "approve"}]))
    resume.state = []
    resume.tool("call_mail", name="send_email", content="sent")
    # While the resume run is running its tool row stays hidden.
    assert history(thread)["items"][1]["tool_executions"] == []
    resume.model("lc_run--m2", content="Mail sent.")
    resume.finish()
    assert shape(history(thread)) == [
        ("user", "mail bob", []),
        ("tool_carrier", "", [("call_mail", "completed")]),
        ("answer", "Mail sent.", []),
    ]
    with_tools = memory(thread, include_tools=True)
    assert [(m["type"], m["content"]) for m in with_tools] == [
        ("human", "mail bob"),
        ("ai", ""),
        ("tool", "sent"),
        ("ai", "Mail sent."),
    ]
    assert with_tools[2]["tool_call_id"] == "call_mail" and with_tools[2]["status"] == "success"
    assert [(m["type"], m["content"]) for m in memory(thread, include_tools=False)] == [
        ("human", "mail bob"),
        ("ai", "Mail sent."),
    ]


def test_memory_tool_carriers_only_with_include_tools_R_READ_2(thread):
    tool_turn(thread, prefix="a", text="weather?")
    plain = memory(thread, include_tools=False)
    assert [(m["type"], m["content"], m["tool_calls"]) for m in plain] == [
        ("human", "weather?", None),
        ("ai", "It is sunny (a).", []),
    ]
    full = memory(thread, include_tools=True)
    assert [m["type"] for m in full] == ["human", "ai", "tool", "ai"]
    assert full[1]["tool_calls"] == [{"id": "call_a", "name": "get_weather", "args": {"city": "Paris"}}]
    assert full[2]["tool_call_id"] == "call_a" and "raw-envelope" not in json.dumps(full)


def test_memory_selector_gives_langchain_messages_for_the_runtime_R_READ_2(thread):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from conversations.selectors import thread_memory_messages

    tool_turn(thread, prefix="a")
    messages = thread_memory_messages(thread_id=thread.id, include_tools=True)
    assert [type(m) for m in messages] == [HumanMessage, AIMessage, ToolMessage, AIMessage]
    assert messages[1].tool_calls[0]["id"] == messages[2].tool_call_id == "call_a"


def test_later_run_in_same_thread_orders_by_run_R_READ_1(thread):
    tool_turn(thread, prefix="a", text="first")
    tool_turn(thread, prefix="b", text="second")
    body = history(thread)
    assert [i["content"] for i in body["items"] if i["kind"] != "tool_carrier"] == [
        "first",
        "It is sunny (a).",
        "second",
        "It is sunny (b).",
    ]
    assert [t["id"] for i in body["items"] for t in i["tool_executions"]] == ["call_a", "call_b"]


def test_history_cursor_pages_back_exactly_once_R_READ_1(thread):
    for prefix in "abc":
        tool_turn(thread, prefix=prefix, text=f"q-{prefix}")
    everything = [i["id"] for i in history(thread)["items"]]
    assert len(everything) == 9
    seen, before = [], None
    while True:
        params = {"limit": 2} | ({"before": before} if before else {})
        page = history(thread, **params)
        seen = [i["id"] for i in page["items"]] + seen
        if not page["has_more"]:
            assert page["next_before"] is None
            break
        before = page["next_before"]
    assert seen == everything


def test_history_query_count_does_not_grow_with_turns_R_READ_1(thread):
    tool_turn(thread, prefix="a")
    headers = bearer(thread.user)
    history(thread, headers)  # the token's first use writes last_used_at
    with CaptureQueriesContext(connection) as one:
        history(thread, headers)
    for prefix in "bcdef":
        tool_turn(thread, prefix=prefix)
    with CaptureQueriesContext(connection) as six:
        body = history(thread, headers)
    assert len(body["items"]) == 18
    # The token, the thread, the page, its tool executions and the feedback
    # on its answers.
    assert len(six) == len(one) <= 5, [q["sql"] for q in six]


# -- feedback ------------------------------------------------------------------


def test_feedback_on_final_answer_once_per_user_R_READ_4(thread):
    run = tool_turn(thread)
    client, headers = Client(), bearer(thread.user)
    url = f"/api/messages/{run.output_message_id}/feedback"
    first = client.post(url, {"rating": "like"}, content_type="application/json", headers=headers)
    assert first.status_code == 201, first.content
    second = client.post(
        url, {"rating": "dislike", "reason": "too short"}, content_type="application/json", headers=headers
    )
    assert second.status_code == 200, second.content
    assert second.json()["rating"] == "dislike" and second.json()["reason"] == "too short"
    assert list(MessageFeedback.objects.values_list("rating", flat=True)) == ["dislike"]


def test_history_carries_the_owners_feedback_on_each_answer_R_READ_1_R_READ_4(thread, other_user):
    first, second, third = (tool_turn(thread, prefix=p) for p in "abc")
    client, headers = Client(), bearer(thread.user)
    for run, body in ((first, {"rating": "like"}), (third, {"rating": "dislike", "reason": "too short"})):
        url = f"/api/messages/{run.output_message_id}/feedback"
        assert client.post(url, body, content_type="application/json", headers=headers).status_code == 201
    # Someone else's feedback on the same answer (a row the API cannot
    # make: it answers 404 to another user) is not the owner's.
    MessageFeedback.objects.create(message_id=second.output_message_id, user=other_user, rating="like")

    items = history(thread, headers)["items"]
    feedback = {i["id"]: i["feedback"] for i in items if i["kind"] == "answer"}
    assert feedback == {
        first.output_message_id: {"rating": "like", "reason": ""},
        second.output_message_id: None,
        third.output_message_id: {"rating": "dislike", "reason": "too short"},
    }
    assert all(i["feedback"] is None for i in items if i["kind"] != "answer")
    # Paging back keeps each answer's.
    page = history(thread, headers, limit=1)
    assert [i["feedback"] for i in page["items"]] == [{"rating": "dislike", "reason": "too short"}]
    older = history(thread, headers, limit=6, before=page["next_before"])
    assert [(i["kind"], i["feedback"]) for i in older["items"] if i["kind"] == "answer"] == [
        ("answer", {"rating": "like", "reason": ""}),
        ("answer", None),
    ]


def test_feedback_refuses_audit_rows_user_messages_and_others_R_READ_4_R_READ_5(thread, other_user):
    run = tool_turn(thread)
    carrier = Message.objects.get(run=run, operation_id="lc_run--a1")
    tool_row = Message.objects.get(run=run, operation_id="call_a")
    user_message = Message.objects.get(run=run, role="user")
    client = Client()
    for message, headers, status, code in [
        (carrier, bearer(thread.user), 422, "invalid_input"),
        (tool_row, bearer(thread.user), 422, "invalid_input"),
        (user_message, bearer(thread.user), 422, "invalid_input"),
        (run.output_message, bearer(other_user), 404, "not_found"),
    ]:
        response = client.post(
            f"/api/messages/{message.id}/feedback", {"rating": "like"}, content_type="application/json", headers=headers
        )
        assert response.status_code == status, (message, response.content)
        assert response.json()["error"]["code"] == code
    bad = client.post(
        f"/api/messages/{run.output_message_id}/feedback",
        {"rating": "meh"},
        content_type="application/json",
        headers=bearer(thread.user),
    )
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_input"
    assert MessageFeedback.objects.count() == 0


@pytest.mark.parametrize("params", ["limit=1337493691689347842048", "offset=99999999999999999999", "limit=0"])
def test_thread_list_out_of_range_paging_is_422_R_READ_6(user, params):
    response = Client().get(f"/api/threads?{params}", headers=bearer(user))
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_input"


def test_history_shows_tool_calls_with_arguments_that_are_not_an_object_R_READ_1(thread):
    d = RunDriver(thread, text="calc")
    d.model("lc_run--m1", tool_calls=[{"id": "call_x", "name": "calculator", "args": "{2+2"}])
    d.tool("call_x", name="calculator", declared_by="lc_run--m1", status="failed", content="bad arguments")
    d.model("lc_run--m2", content="Sorry.")
    d.finish()
    body = history(thread)
    assert body["items"][1]["tool_calls"] == [{"id": "call_x", "name": "calculator", "args": "{2+2"}]
    assert [t["status"] for t in body["items"][1]["tool_executions"]] == ["failed"]
