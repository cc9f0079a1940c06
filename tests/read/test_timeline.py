"""Audit timeline selector and API (R-READ-3, R-READ-5)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from audit.reads.selectors import run_timeline, thread_timeline, timeline_item
from conversations.models import Message
from core.errors import InvalidInput
from tests.conftest import bearer

from .builders import RunDriver, tool_turn

pytestmark = pytest.mark.django_db


def test_timeline_orders_model_and_tool_rows_with_shared_id_separate_R_READ_3(thread):
    d = RunDriver(thread)
    # A model row and a tool row share the id "same": two items.
    d.model("same", tool_calls=[{"id": "same", "name": "get_weather", "args": {}}])
    d.tool("same", declared_by="same")
    d.model("lc_run--answer", content="done")
    run = d.finish()
    page = run_timeline(run_id=run.id)
    assert [(i.role, i.operation_id) for i in page.items] == [
        ("assistant", "same"),
        ("tool", "same"),
        ("assistant", "lc_run--answer"),
    ]
    assert page.truncated is False and page.next_before is None
    kinds = [timeline_item(i, include_raw_output=True)["kind"] for i in page.items]
    assert kinds == ["model", "tool", "model"]
    assert timeline_item(page.items[1], include_raw_output=True)["raw_output"]["secret"] == "raw-envelope"
    assert "raw_output" not in timeline_item(page.items[1], include_raw_output=False)
    assert "raw_output" not in timeline_item(page.items[1], include_raw_output=False)["metadata"]


def test_timeline_readable_while_running_R_READ_3(thread):
    d = RunDriver(thread)
    d.model("lc_run--m1", finish=False)
    page = run_timeline(run_id=d.run.id)
    assert [(i.operation_id, i.execution_status) for i in page.items] == [("lc_run--m1", "running")]


def test_thread_timeline_runs_in_creation_order_R_READ_3(thread):
    first = tool_turn(thread, prefix="a")
    second = tool_turn(thread, prefix="b")
    page = thread_timeline(thread_id=thread.id)
    assert [i.run_id for i in page.items] == [first.id] * 3 + [second.id] * 3
    assert [i.operation_id for i in page.items][:3] == ["lc_run--a1", "call_a", "lc_run--a2"]


def test_timeline_cap_500_truncated_and_paging_back_returns_rest_once_R_READ_3(thread):
    d = RunDriver(thread)
    for i in range(260):
        d.model(f"m{i}", content=f"c{i}", in_state=False)
        d.tool(f"t{i}", declared_by=f"m{i}")
    run = d.finish("failed")
    first = run_timeline(run_id=run.id)
    assert len(first.items) == 500 and first.truncated is True and first.next_before
    # The newest 500: the last row of the run is the last item.
    assert first.items[-1].operation_id == "t259"
    assert first.items[0].sequence == 21
    second = run_timeline(run_id=run.id, before=first.next_before)
    assert len(second.items) == 20 and second.truncated is False and second.next_before is None
    ids = [i.id for i in second.items] + [i.id for i in first.items]
    assert len(ids) == len(set(ids)) == Message.objects.audit().filter(run=run).count()
    assert [i.sequence for i in second.items + first.items] == list(range(1, 521))
    # Same through the thread timeline, with a small limit.
    seen, before = [], None
    while True:
        page = thread_timeline(thread_id=thread.id, limit=200, before=before)
        seen = [i.id for i in page.items] + seen
        if not page.truncated:
            break
        before = page.next_before
    assert seen == ids


@pytest.mark.parametrize("limit", [0, 501, -1])
def test_timeline_limit_out_of_range_is_invalid_input_R_READ_6(thread, limit):
    with pytest.raises(InvalidInput):
        run_timeline(run_id=tool_turn(thread).id, limit=limit)


@pytest.mark.parametrize("cursor", ["!!!", "W10", "WzEsMiwzLDRd", "eyJhIjoxfQ"])
def test_timeline_malformed_cursor_is_invalid_input_R_READ_6(thread, cursor):
    with pytest.raises(InvalidInput):
        thread_timeline(thread_id=thread.id, before=cursor)


def test_timeline_api_staff_sees_raw_output_and_cap_flag_R_READ_3(thread, staff_user):
    from django.test import Client

    run = tool_turn(thread)
    response = Client().get(f"/api/audit/runs/{run.id}/timeline?limit=2", headers=bearer(staff_user))
    assert response.status_code == 200, response.content
    body = response.json()
    assert [i["kind"] for i in body["items"]] == ["tool", "model"]
    assert body["truncated"] is True and body["next_before"]
    assert body["items"][0]["raw_output"]["secret"] == "raw-envelope"
    assert body["items"][1]["is_final_answer"] is True
    older = (
        Client()
        .get(f"/api/audit/runs/{run.id}/timeline", {"before": body["next_before"]}, headers=bearer(staff_user))
        .json()
    )
    assert [i["operation_id"] for i in older["items"]] == ["lc_run--a1"] and older["truncated"] is False
    bad = Client().get(f"/api/audit/threads/{thread.id}/timeline?before=zzz", headers=bearer(staff_user))
    assert bad.status_code == 422 and bad.json()["error"]["reason"] == "bad_cursor"


def test_timeline_query_count_does_not_grow_with_rows_R_READ_3(thread, staff_user):
    from django.test import Client

    headers = bearer(staff_user)
    tool_turn(thread, prefix="a")
    Client().get(f"/api/audit/threads/{thread.id}/timeline", headers=headers)  # token first use
    with CaptureQueriesContext(connection) as few:
        Client().get(f"/api/audit/threads/{thread.id}/timeline", headers=headers)
    for prefix in "bcdefg":
        tool_turn(thread, prefix=prefix)
    with CaptureQueriesContext(connection) as many:
        body = Client().get(f"/api/audit/threads/{thread.id}/timeline", headers=headers).json()
    assert len(body["items"]) == 21
    assert len(many) == len(few) <= 4, [q["sql"] for q in many]


def test_timeline_of_an_unknown_run_or_thread_is_not_found_and_of_an_empty_one_is_empty_R_READ_3(thread, staff_user):
    """A page with rows proves its run or thread exists (one statement
    fewer); only an empty page asks whether it exists."""
    import uuid

    from django.test import Client

    from conversations.models import Conversation
    from tests.conftest import make_run

    headers = bearer(staff_user)
    for path in (f"/api/audit/runs/{uuid.uuid4()}/timeline", f"/api/audit/threads/{uuid.uuid4()}/timeline"):
        missing = Client().get(path, headers=headers)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found", missing.content
    quiet = Conversation.objects.create(user=thread.user, agent_id=thread.agent_id, model=thread.model)
    empty_run = make_run(quiet)
    for path in (f"/api/audit/runs/{empty_run.id}/timeline", f"/api/audit/threads/{quiet.id}/timeline"):
        empty = Client().get(path, headers=headers)
        assert empty.status_code == 200 and empty.json() == {"items": [], "truncated": False, "next_before": None}
    run = tool_turn(thread)
    Client().get(f"/api/audit/runs/{run.id}/timeline", headers=headers)  # token first use
    with CaptureQueriesContext(connection) as queries:
        assert Client().get(f"/api/audit/runs/{run.id}/timeline", headers=headers).status_code == 200
    assert len(queries) == 2, [q["sql"] for q in queries]  # the token, the page
