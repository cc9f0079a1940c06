"""History, memory and the staff timeline of real runs, over HTTP with real
processes (R-READ-1, R-READ-2, R-READ-3): after a page refresh the chat
still shows the tool calls of a finished run, also across an approval
interrupt and its resume."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.conftest import bearer

from .stack import wait_for_status

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TERMINAL = {"completed", "failed", "cancelled", "interrupted"}


def submit(client, thread_id: str, text: str) -> str:
    response = client.post(
        f"/api/threads/{thread_id}/runs", json={"request_id": f"h-{uuid.uuid4().hex}", "input": {"text": text}}
    )
    assert response.status_code == 202, response.text
    return response.json()["run_id"]


def test_finished_tool_run_keeps_its_tool_display_after_refresh_R_READ_1_R_READ_2_R_READ_3(stack, user, staff_user):
    with stack.client(bearer(user)) as client:
        thread_id = client.post(
            "/api/threads", json={"agent_id": "assistant", "model": "replay:tool_then_answer"}
        ).json()["thread_id"]
        run_id = submit(client, thread_id, "Weather in Paris?")
        assert wait_for_status(client, run_id, TERMINAL)["status"] == "completed"

        history = client.get(f"/api/threads/{thread_id}/history").json()
        assert [i["kind"] for i in history["items"]] == ["user", "tool_carrier", "answer"]
        carrier = history["items"][1]
        assert [(t["id"], t["name"], t["status"]) for t in carrier["tool_executions"]] == [
            ("call_weather_paris", "get_weather", "completed")
        ]
        assert "sunny" in carrier["tool_executions"][0]["content"]
        assert "raw_output" not in json.dumps(history) and "state_reconciled" not in json.dumps(history)

        memory = client.get(f"/api/threads/{thread_id}/memory", params={"include_tools": "true"}).json()
        assert [m["type"] for m in memory["messages"]] == ["human", "ai", "tool", "ai"]

        assert client.get(f"/api/audit/runs/{run_id}/timeline").status_code == 403
    with stack.client(bearer(staff_user)) as staff:
        timeline = staff.get(f"/api/audit/runs/{run_id}/timeline").json()
        assert [(i["kind"], i["status"]) for i in timeline["items"]] == [
            ("model", "completed"),
            ("tool", "completed"),
            ("model", "completed"),
        ]
        assert timeline["items"][1]["raw_output"]["tool_call_id"] == "call_weather_paris"
        assert timeline["truncated"] is False


def test_interrupt_then_approved_resume_shows_the_tool_under_its_call_R_READ_1(stack, user):
    with stack.client(bearer(user)) as client:
        thread_id = client.post(
            "/api/threads", json={"agent_id": "assistant", "model": "replay:approval_send_email"}
        ).json()["thread_id"]
        run_id = submit(client, thread_id, "Mail Bob")
        assert wait_for_status(client, run_id, TERMINAL)["status"] == "interrupted"
        before = client.get(f"/api/threads/{thread_id}/history").json()["items"]
        assert before[-1]["tool_calls"][0]["name"] == "send_email" and before[-1]["tool_executions"] == []
        assert before[-1]["kind"] == "tool_carrier"  # it asks for a tool, it answers nothing yet

        resumed = client.post(
            f"/api/runs/{run_id}/resume",
            json={"request_id": f"r-{uuid.uuid4().hex}", "decisions": [{"type": "approve"}]},
        )
        assert resumed.status_code == 202, resumed.text
        assert wait_for_status(client, resumed.json()["run_id"], TERMINAL)["status"] == "completed"

        items = client.get(f"/api/threads/{thread_id}/history").json()["items"]
        assert items[0]["kind"] == "user"
        call_items = [i for i in items if i["tool_calls"]]
        assert len(call_items) == 1
        assert [(t["name"], t["status"]) for t in call_items[0]["tool_executions"]] == [("send_email", "completed")]
        assert items[-1]["kind"] == "answer" and items[-1]["content"]
