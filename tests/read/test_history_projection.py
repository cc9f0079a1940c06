"""History shows a large tool result in its projected form — size in
characters, workspace path, preview — exactly as memory does; the full raw
output only in the staff timeline; the history response stays small
whatever the tool returned (R-READ-7, R-READ-2, R-TA-4)."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from conversations.selectors import thread_memory
from core.config import get_config
from core.workspace import PREVIEW_CHARS, large_result_path
from tests.conftest import bearer

from .builders import RunDriver

pytestmark = pytest.mark.django_db


def _lookup_turn(thread, *, size: int, call_id: str = "call_lookup_1"):
    body = ("Results for 'q':\n" + "z" * size)[:size]
    d = RunDriver(thread, text="look it up")
    d.model("lc_run--l1", tool_calls=[{"id": call_id, "name": "lookup_docs", "args": {"query": "q", "size": size}}])
    d.tool(call_id, "lookup_docs", declared_by="lc_run--l1", content=body)
    d.model("lc_run--l2", content="Found it.")
    return d.finish(), body


def _history_executions(user, thread):
    response = Client().get(f"/api/threads/{thread.id}/history", headers=bearer(user))
    assert response.status_code == 200, response.content
    return response, [t for item in response.json()["items"] for t in item["tool_executions"]]


def _memory_tool_contents(user, thread):
    response = Client().get(f"/api/threads/{thread.id}/memory?include_tools=true", headers=bearer(user))
    assert response.status_code == 200
    return [m["content"] for m in response.json()["messages"] if m["type"] == "tool"]


@pytest.mark.parametrize("size", [5000, 1_000_000])
def test_history_shows_a_large_result_projected_exactly_like_memory_R_READ_7(user, thread, staff_user, size):
    assert size > get_config().LARGE_TOOL_RESULT_CHARS
    run, body = _lookup_turn(thread, size=size)
    response, (execution,) = _history_executions(user, thread)
    path = large_result_path(run_id=str(run.id), tool_call_id="call_lookup_1").as_posix()

    assert execution["content"] == _memory_tool_contents(user, thread)[0]
    assert execution["size_chars"] == size and execution["workspace_path"] == path
    assert f"{size} characters" in execution["content"] and path in execution["content"]
    assert execution["content"].endswith(body[:PREVIEW_CHARS])
    assert len(execution["content"]) < PREVIEW_CHARS + 300
    # Bounded whatever the tool returned: well under the threshold's worth.
    assert len(response.content) < 10_000, len(response.content)

    # The staff timeline keeps the full result and the raw output.
    timeline = Client().get(f"/api/audit/runs/{run.id}/timeline", headers=bearer(staff_user)).json()
    (tool,) = [item for item in timeline["items"] if item["kind"] == "tool"]
    assert tool["content"] == body and tool["raw_output"]["content"] == body
    assert tool["workspace_path"] == path


def test_a_result_at_the_threshold_is_shown_whole_in_history_and_memory_R_READ_7(user, thread):
    threshold = get_config().LARGE_TOOL_RESULT_CHARS
    _, body = _lookup_turn(thread, size=threshold)
    _, (execution,) = _history_executions(user, thread)
    assert execution["content"] == body == _memory_tool_contents(user, thread)[0]
    assert execution["size_chars"] == threshold and execution["workspace_path"] is None


def test_history_and_memory_project_with_a_threshold_below_the_preview(user, thread, monkeypatch):
    monkeypatch.setattr(get_config(), "LARGE_TOOL_RESULT_CHARS", 100)
    _, body = _lookup_turn(thread, size=2000)
    _, (execution,) = _history_executions(user, thread)
    assert execution["content"].endswith(body[:PREVIEW_CHARS])
    assert execution["content"] == thread_memory(thread_id=thread.id, include_tools=True)[2]["content"]


def test_history_reads_no_full_tool_result_from_the_database_R_READ_7(user, thread):
    """The history query asks PostgreSQL for the length and the head of a
    tool result, never the whole text nor the raw output envelope: the
    content appears in the select list only as the text that ``length``,
    ``substr``, ``strpos`` and ``regexp_replace`` measure or cut (the real
    length and head of core.storable, R-RUN-13)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    _lookup_turn(thread, size=200_000)
    with CaptureQueriesContext(connection) as queries:
        _history_executions(user, thread)
    tool_queries = [q["sql"] for q in queries.captured_queries if "tool_audit" in q["sql"]]
    assert tool_queries
    for sql in tool_queries:
        select_list = re.sub(
            r'(?i)\b(substring|substr|length|strpos|regexp_replace)\("conversations_message"\."content"',
            "",
            sql.split(" FROM ")[0],
        )
        assert '"conversations_message"."content"' not in select_list, sql
        assert '"conversations_message"."metadata"' not in select_list, sql
