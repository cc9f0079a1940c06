"""A tool result whose stored form holds escapes (U+0000, a lone surrogate,
a backslash that starts an escape) reads back the same on every path:
history and memory read its size and head through SQL, and must give the
real characters and the real length, as the staff timeline does through
the ORM (R-RUN-13, R-RUN-11, R-READ-7)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import Client
from hypothesis import given, settings
from hypothesis import strategies as st

from conversations.models import Message
from core.config import get_config
from core.storable import (
    StoredHead,
    StoredLength,
    decode_head,
    decode_text,
    escape_text,
    stored_head_sql,
    stored_length_sql,
)
from core.workspace import PREVIEW_CHARS, large_result_path, offloaded_summary
from tests.conftest import bearer

from .builders import RunDriver

pytestmark = pytest.mark.django_db

# Every code point, with the characters of the escapes over-represented.
_CHARS = st.one_of(
    st.characters(codec=None, categories=None),
    st.sampled_from(["\\", "u", "0", "5", "c", "d", "8", "f", "\x00", "\ud83d", "\udc00"]),
)
_TEXT = st.text(alphabet=_CHARS, max_size=40)

# Small results (under the default threshold of 4,000 characters).
SMALL = {
    # The attack of issue 32: 22 characters, 27 stored.
    "surrogate": "ValueError: bad \ud800 city",
    "nul": "sunny\x00 in Paris",
    "literal": "the literal \\u0000 and \\ud800 and \\u005c",
    "mixed": "\x00\ud83d\\u0000\udc00\\\\u005c\\x",
}


def _tool_turn(thread, content: str, *, call_id: str = "call_w"):
    d = RunDriver(thread, text="weather?")
    d.model("lc_run--w1", tool_calls=[{"id": call_id, "name": "get_weather", "args": {"city": "Paris"}}])
    d.tool(call_id, "get_weather", declared_by="lc_run--w1", content=content, status="failed")
    d.model("lc_run--w2", content="Sorry.")
    return d.finish()


def _reads(client, user, staff_user, thread, run):
    """(the history execution, the memory tool message, the timeline tool item)."""
    history = client.get(f"/api/threads/{thread.id}/history", headers=bearer(user))
    assert history.status_code == 200, history.content
    (execution,) = [t for item in history.json()["items"] for t in item["tool_executions"]]
    memory = client.get(f"/api/threads/{thread.id}/memory?include_tools=true", headers=bearer(user))
    assert memory.status_code == 200, memory.content
    (tool_message,) = [m for m in memory.json()["messages"] if m["type"] == "tool"]
    timeline = client.get(f"/api/audit/runs/{run.id}/timeline", headers=bearer(staff_user))
    assert timeline.status_code == 200, timeline.content
    (tool,) = [item for item in timeline.json()["items"] if item["kind"] == "tool"]
    return execution, tool_message, tool


@pytest.mark.parametrize("content", SMALL.values(), ids=SMALL.keys())
def test_a_small_escaped_result_reads_the_same_everywhere_R_RUN_13(user, staff_user, thread, content):
    assert len(escape_text(content)) > len(content)
    run = _tool_turn(thread, content)
    execution, tool_message, tool = _reads(Client(), user, staff_user, thread, run)

    assert tool["content"] == content
    assert execution["content"] == tool_message["content"] == content
    assert execution["size_chars"] == len(content)
    assert execution["workspace_path"] is None and tool["workspace_path"] is None


def test_the_issue_32_result_has_22_characters_in_history_R_RUN_13(user, staff_user, thread):
    run = _tool_turn(thread, SMALL["surrogate"])
    execution, _, _ = _reads(Client(), user, staff_user, thread, run)
    assert execution["size_chars"] == 22


@pytest.mark.parametrize("threshold", [100, 600])
def test_a_result_at_the_threshold_in_real_characters_is_shown_whole_R_RUN_13(
    user, staff_user, thread, monkeypatch, threshold
):
    """Its stored form is longer than the threshold; its real size is not."""
    monkeypatch.setattr(get_config(), "LARGE_TOOL_RESULT_CHARS", threshold)
    content = ("\ud800\x00\\u0000x" * threshold)[:threshold]
    run = _tool_turn(thread, content)
    execution, tool_message, tool = _reads(Client(), user, staff_user, thread, run)

    assert tool["content"] == content and tool["workspace_path"] is None
    assert execution["content"] == tool_message["content"] == content
    assert execution["size_chars"] == threshold and execution["workspace_path"] is None


LARGE = {
    # Escapes all through the preview and the head.
    "dense": "\ud800\x00\\u0000ab" * 2000,
    # The head of 6n stored characters ends inside an escape.
    "cut": "y" * (PREVIEW_CHARS - 1) + "\x00" + "z" * 20 + "\ud800" * 5000,
    # Plain head, escapes only after it.
    "late": "p" * 9000 + "\x00\ud83d\\u005c" * 50,
    # Only literal backslash-u text.
    "literal": "the literal \\u0000 " * 600,
}


@pytest.mark.parametrize("threshold", [100, None])
@pytest.mark.parametrize("content", LARGE.values(), ids=LARGE.keys())
def test_a_large_escaped_result_is_projected_the_same_everywhere_R_RUN_13(
    user, staff_user, thread, monkeypatch, content, threshold
):
    if threshold is not None:
        monkeypatch.setattr(get_config(), "LARGE_TOOL_RESULT_CHARS", threshold)
    assert len(content) > get_config().LARGE_TOOL_RESULT_CHARS
    run = _tool_turn(thread, content)
    execution, tool_message, tool = _reads(Client(), user, staff_user, thread, run)
    path = large_result_path(run_id=str(run.id), tool_call_id="call_w")

    assert tool["content"] == content and tool["workspace_path"] == path.as_posix()
    assert execution["size_chars"] == len(content)
    assert execution["workspace_path"] == path.as_posix()
    assert execution["content"] == tool_message["content"] == offloaded_summary(path, content, len(content))
    assert execution["content"].endswith(content[:PREVIEW_CHARS])


# --------------------------------------------------------------------------
# The SQL expressions against decode_text, through PostgreSQL
# --------------------------------------------------------------------------


def _select(sql: str, params: list, stored: str):
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {sql} FROM (SELECT CAST(%s AS text) AS col) v", [*params, stored])
        return cursor.fetchone()[0]


@settings(max_examples=150, deadline=None)
@given(text=_TEXT, chars=st.integers(0, 45))
def test_the_sql_length_and_head_are_the_decoded_ones_R_RUN_13(text, chars):
    stored = escape_text(text)
    assert decode_text(stored) == text
    assert _select(stored_length_sql("v.col"), [], stored) == len(text)
    sql, params = stored_head_sql("v.col", chars)
    assert decode_head(_select(sql, params, stored), chars) == text[:chars]


@pytest.mark.parametrize(
    "text",
    ["", "plain", "\x00", "\ud800", "\\u0000", "\\\\u005c", "a\\u00zz\\ud7ff\\udfff\\uD800", *SMALL.values()],
)
def test_the_django_expressions_are_the_sql_text_on_a_stored_row_R_RUN_13(thread, text):
    row = Message.objects.create(thread=thread, role=Message.Role.USER, content=text)
    for chars in (0, 1, 5, 7, 100):
        read = Message.objects.filter(pk=row.pk).annotate(
            size=StoredLength("content"), head=StoredHead("content", chars)
        )
        (size, head) = read.values_list("size", "head").get()
        assert size == len(text)
        assert decode_head(head, chars) == text[:chars]


def test_a_plain_text_head_is_read_as_stored_R_RUN_13():
    """The ordinary path: no escape, the head is the first n characters."""
    sql, params = stored_head_sql("v.col", 3)
    assert _select(sql, params, "abcdef") == "abc"
    assert _select(stored_length_sql("v.col"), [], "abcdef") == 6
    assert decode_head(None, 3) is None
