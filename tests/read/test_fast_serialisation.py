"""The large read endpoints build their JSON without a second validation
pass (issue 11): their bytes must stay exactly what the response schemas
dump (SPEC §5 is a public contract). Each endpoint's answer over HTTP is
compared with the schema path on a varied thread: tool calls, a failed
tool, a large result in the workspace, unstorable characters, markup, a
running and an interrupted run, pages with a cursor."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from ninja.responses import NinjaJSONEncoder

from audit.reads.selectors import run_timeline, thread_timeline, timeline_item
from audit.schemas import TimelineOut
from conversations.models import Conversation, Message
from conversations.schemas import HistoryItemOut, HistoryPageOut, MemoryOut
from conversations.selectors import thread_history, thread_memory
from conversations.sql import MESSAGE_TABLE, message_columns, message_rows
from core.config import get_config
from tests.conftest import bearer
from yuxi_project.responses import RENDERER

from .builders import RunDriver, tool_turn

pytestmark = pytest.mark.django_db

ODD = 'nul \x00 lone \ud83d <b>&"quoted"</b> \\u0000 é'


def _schema_bytes(schema, **fields) -> bytes:
    """What ninja answers for ``schema(**fields)``: its dump, encoded by the
    API's renderer; that is the same JSON value as ninja's own encoder
    gives (checked here on every answer)."""
    dumped = schema(**fields).model_dump()
    encoded = RENDERER.render(None, dumped, response_status=200)
    assert json.loads(encoded) == json.loads(json.dumps(dumped, cls=NinjaJSONEncoder))
    return encoded


@pytest.fixture
def varied(thread, monkeypatch):
    monkeypatch.setattr(get_config(), "LARGE_TOOL_RESULT_CHARS", 100)
    runs = [tool_turn(thread, prefix="a")]
    d = RunDriver(thread, text=f"odd {ODD}")
    d.model("lc_run--o1", content=ODD, tool_calls=[{"id": "call_o", "name": "get_weather", "args": {"q": ODD}}])
    d.tool("call_o", declared_by="lc_run--o1", content="x" * 500)  # large: workspace path, preview
    d.model("lc_run--o2", tool_calls=[{"id": "call_f", "name": "lookup", "args": None}], usage={"total_tokens": 3})
    d.tool("call_f", "lookup", declared_by="lc_run--o2", content="boom", status="failed")
    d.model("lc_run--o3", content="answer after a failure")
    runs.append(d.finish())
    runs.append(tool_turn(thread, prefix="b"))
    d = RunDriver(thread, text="approve?")
    d.model("lc_run--i1", tool_calls=[{"id": "call_i", "name": "send_email", "args": {"to": "x"}}])
    runs.append(d.finish("interrupted", interrupts=[{"value": {"action_requests": [{"name": "send_email"}]}}]))
    # A run still running (another thread of the user: this one now waits
    # for the approval).
    other = Conversation.objects.create(user=thread.user, agent_id="assistant", model="replay:tool_then_answer")
    d = RunDriver(other, text="still running")
    d.model("lc_run--r1", finish=False)
    runs.append(d.run)
    return thread, runs


def _timeline_schema_bytes(page) -> bytes:
    return _schema_bytes(
        TimelineOut,
        items=[timeline_item(row, include_raw_output=True) for row in page.items],
        truncated=page.truncated,
        next_before=page.next_before,
    )


def test_timeline_json_is_the_schema_dump_R_READ_3(client, staff_user, varied):
    thread, runs = varied
    auth = bearer(staff_user)
    for run in runs:
        answer = client.get(f"/api/audit/runs/{run.id}/timeline", headers=auth)
        assert answer.status_code == 200
        assert answer.content == _timeline_schema_bytes(run_timeline(run_id=run.id))
    before, pages = None, 0
    while True:
        query = "?limit=4" + (f"&before={before}" if before else "")
        answer = client.get(f"/api/audit/threads/{thread.id}/timeline{query}", headers=auth)
        assert answer["Content-Type"] == "application/json; charset=utf-8"
        page = thread_timeline(thread_id=thread.id, limit=4, before=before)
        assert answer.content == _timeline_schema_bytes(page)
        pages += 1
        before = page.next_before
        if before is None:
            break
    assert pages > 2


def test_history_json_is_the_schema_dump_R_READ_1(client, user, varied):
    thread, _ = varied
    before, pages = None, 0
    while True:
        query = "?limit=3" + (f"&before={before}" if before else "")
        answer = client.get(f"/api/threads/{thread.id}/history{query}", headers=bearer(user))
        assert answer.status_code == 200
        page = thread_history(thread=thread, limit=3, before=before)
        expected = _schema_bytes(
            HistoryPageOut,
            items=[HistoryItemOut.from_entry(e) for e in page.items],
            has_more=page.has_more,
            next_before=page.next_before,
        )
        assert answer.content == expected
        pages += 1
        before = page.next_before
        if before is None:
            break
    assert pages > 2


@pytest.mark.parametrize("include_tools", [False, True])
def test_memory_json_is_the_schema_dump_R_READ_2(client, user, varied, include_tools):
    thread, _ = varied
    flag = "true" if include_tools else "false"
    answer = client.get(f"/api/threads/{thread.id}/memory?include_tools={flag}", headers=bearer(user))
    assert answer.status_code == 200
    messages = thread_memory(thread_id=thread.id, include_tools=include_tools)
    assert any(m["type"] == "tool" for m in messages) is include_tools
    # The stored escapes are decoded (R-RUN-11).
    assert f"odd {ODD}" in {m["content"] for m in messages if m["type"] == "human"}
    assert any(m["content"] == ODD for m in messages) is include_tools
    assert answer.content == _schema_bytes(MemoryOut, thread_id=thread.id, messages=messages)


def test_message_rows_are_the_orm_rows_R_RUN_11(varied):
    """The paged readers' rows, built without Model.__init__, hold what the
    ORM loads: every field, the stored escapes decoded."""
    thread, _ = varied
    sql = f"SELECT {message_columns()}, 7 AS extra FROM {MESSAGE_TABLE} WHERE thread_id = %s ORDER BY id"
    rows = message_rows(sql, [thread.id], extra=("extra",))
    expected = list(Message.objects.filter(thread=thread).order_by("id"))
    assert len(rows) == len(expected) > 10
    names = [f.attname for f in Message._meta.concrete_fields]
    for row, orm in zip(rows, expected, strict=True):
        assert {n: getattr(row, n) for n in names} == {n: getattr(orm, n) for n in names}
        assert row.extra == 7 and not row._state.adding and row._state.db == connection.alias
        assert not row.get_deferred_fields()
    assert any(row.content == ODD for row in rows)
