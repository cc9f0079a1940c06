"""Content PostgreSQL cannot store as given, and audit writes it refuses
(R-RUN-11).

U+0000 and lone surrogates are stored in the escaped form of
``core.storable`` and read back as the original on every read path;
a write the database refuses for good fails the run at once, naming the
cause, through the minimal fallback terminal transaction."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from django.db import DataError, connection
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from audit.errors import AuditWriteRejected
from audit.execution.runner import run_execute
from audit.execution.writes import write_with_retry
from audit.models import AgentRun
from conversations.models import Conversation, Message
from core.storable import decode_json, decode_text, escape_json, escape_text, fit_text, visible
from tests.conftest import bearer, make_run

# Every code point, lone surrogates included, with the characters of the
# escapes themselves over-represented.
_CHARS = st.one_of(
    st.characters(codec=None, categories=None),
    st.sampled_from(["\\", "u", "0", "5", "c", "d", "8", "f", "\x00", "\ud83d", "\udc00"]),
)
_TEXT = st.text(alphabet=_CHARS, max_size=40)


# --------------------------------------------------------------------------
# The escaped form
# --------------------------------------------------------------------------


@given(_TEXT)
def test_escape_round_trips_and_leaves_nothing_postgresql_refuses_R_RUN_11(text):
    stored = escape_text(text)
    assert decode_text(stored) == text
    assert "\x00" not in stored
    assert not any(0xD800 <= ord(c) <= 0xDFFF for c in stored)
    stored.encode("utf-8")  # strict: no surrogate left


@given(_TEXT, _TEXT)
def test_escape_is_injective_R_RUN_11(a, b):
    if a != b:
        assert escape_text(a) != escape_text(b)


@given(st.text(alphabet=st.characters(exclude_characters="\\\x00", exclude_categories=["Cs"])))
def test_ordinary_text_is_stored_unchanged_R_RUN_11(text):
    assert escape_text(text) is text or escape_text(text) == text


def test_documented_examples_R_RUN_11():
    assert escape_text("Hello\x00world") == "Hello\\u0000world"
    assert escape_text("a\ud83db") == "a\\ud83db"
    # The literal six characters \u0000 keep their backslash distinct.
    assert escape_text("\\u0000") == "\\u005cu0000"
    assert escape_text("C:\\users\\x") == "C:\\users\\x"
    assert escape_json({"city\x00": ["Par\x00is", 1, None, True]}) == {"city\\u0000": ["Par\\u0000is", 1, None, True]}
    assert decode_json(escape_json({"k": "\\u005c\x00"})) == {"k": "\\u005c\x00"}


@given(_TEXT, st.integers(0, 30))
def test_fit_text_keeps_the_longest_prefix_whose_stored_form_fits_R_RUN_11(text, limit):
    fitted = fit_text(text, limit)
    assert text.startswith(fitted) and len(escape_text(fitted)) <= limit
    if fitted != text:
        assert len(escape_text(text[: len(fitted) + 1])) > limit


@pytest.mark.django_db
def test_a_title_of_nul_characters_fits_its_column_R_RUN_11(user):
    response = Client(headers=bearer(user)).post(
        "/api/threads", {"agent_id": "assistant", "title": "\x00" * 200}, content_type="application/json"
    )
    assert response.status_code == 201, response.content
    assert Conversation.objects.get(pk=response.json()["thread_id"]).title == "\x00" * 33


# --------------------------------------------------------------------------
# The model fields: every write escapes, every ORM read decodes
# --------------------------------------------------------------------------

NASTY = "Hello\x00world \ud83d lone \udc00 literal \\u0000 and \\ud83d end"


def _raw(sql: str, params: list) -> tuple:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone()


@pytest.mark.django_db
def test_every_content_field_stores_escaped_and_reads_back_the_original_R_RUN_11(thread):
    run = make_run(thread, text=NASTY)
    json_value = {NASTY: [NASTY, {"x": NASTY}], "n": 5}
    row = Message.objects.create(
        thread=thread,
        run=run,
        role=Message.Role.TOOL,
        message_type=Message.Type.TOOL_AUDIT,
        operation_id="call\x00one",
        tool_name="tool\x00",
        content=NASTY,
        tool_calls=[json_value],
        tool_input=json_value,
        metadata={"raw_output": json_value},
        usage={"input_tokens": 5, "note": NASTY},
    )
    # An update through the QuerySet escapes too.
    AgentRun.objects.filter(pk=run.pk).update(error_message=NASTY, interrupts=[json_value], usage={"k": NASTY})

    row = Message.objects.get(pk=row.pk)
    assert row.content == NASTY and row.operation_id == "call\x00one" and row.tool_name == "tool\x00"
    assert row.tool_input == json_value and row.tool_calls == [json_value]
    assert row.metadata["raw_output"] == json_value and row.usage["note"] == NASTY
    # Lookups escape the same way.
    assert Message.objects.filter(operation_id="call\x00one").get().pk == row.pk
    run = AgentRun.objects.get(pk=run.pk)
    assert run.input == {"text": NASTY} and run.error_message == NASTY
    assert run.interrupts == [json_value] and run.usage == {"k": NASTY}
    assert Message.objects.filter(run=run, role="user").get().content == NASTY
    assert list(Message.objects.filter(pk=row.pk).values_list("tool_input", flat=True)) == [json_value]

    # What PostgreSQL holds is the documented escaped form.
    content, tool_input = _raw("SELECT content, tool_input->>'n' FROM conversations_message WHERE id = %s", [row.pk])
    assert content == escape_text(NASTY) and "\\u0000" in content and tool_input == "5"
    (city,) = _raw("SELECT tool_input::text FROM conversations_message WHERE id = %s", [row.pk])
    assert "\\\\u0000" in city

    # Reading and saving again never escapes twice.
    row.save()
    assert Message.objects.get(pk=row.pk).content == NASTY
    assert _raw("SELECT content FROM conversations_message WHERE id = %s", [row.pk])[0] == escape_text(NASTY)


# --------------------------------------------------------------------------
# Real runs through the replay model server
# --------------------------------------------------------------------------


def _run(user, scenario: str, text: str = "hi") -> AgentRun:
    thread = Conversation.objects.create(user=user, agent_id="assistant", model=f"replay:{scenario}")
    run = make_run(thread, text=text)
    run_execute(run_id=run.id, owner="in-process")
    return AgentRun.objects.select_related("output_message").get(pk=run.pk)


def _assert_ended_cleanly(run: AgentRun) -> None:
    assert run.is_terminal and run.lease_expires_at is None
    assert not Message.objects.filter(run=run, execution_status="running").exists()


@pytest.mark.django_db(transaction=True)
def test_a_nul_in_the_answer_completes_and_reads_back_on_every_path_R_RUN_11(user, replay_models):
    run = _run(user, "unstorable_answer")
    assert run.status == "completed", (run.error_type, run.error_message)
    _assert_ended_cleanly(run)
    answer = run.output_message
    assert answer.content == "Hello\x00world"
    assert answer.usage["input_tokens"] == 5 and answer.usage["output_tokens"] == 9
    assert run.usage["input_tokens"] == 5 and run.usage["output_tokens"] == 9 and run.usage["unknown_calls"] == 0
    assert _raw("SELECT content FROM conversations_message WHERE id = %s", [answer.pk])[0] == "Hello\\u0000world"

    client = Client(headers=bearer(user))
    assert client.get(f"/api/runs/{run.id}").json()["usage"]["output_tokens"] == 9
    history = client.get(f"/api/threads/{run.thread_id}/history").json()["items"]
    assert [item["content"] for item in history] == ["hi", "Hello\x00world"]
    memory = client.get(f"/api/threads/{run.thread_id}/memory").json()
    assert "Hello\x00world" in [m["content"] for m in memory["messages"]]


@pytest.mark.django_db(transaction=True)
def test_a_nul_in_a_tool_argument_completes_R_RUN_11(user, staff_user, replay_models):
    run = _run(user, "unstorable_tool_args")
    assert run.status == "completed", (run.error_type, run.error_message)
    _assert_ended_cleanly(run)
    tool = Message.objects.tool_executions().get(run=run)
    assert tool.tool_input == {"city": "Par\x00is"}
    assert "Par\x00is" in tool.content and tool.execution_status == "failed"  # unknown city, handled
    declared = Message.objects.model_calls().filter(run=run, tool_calls__isnull=False).get()
    assert declared.tool_calls[0]["args"] == {"city": "Par\x00is"}
    assert run.output_message.content == "I could not find the city Par\x00is."
    assert run.usage["input_tokens"] == 90 and run.usage["output_tokens"] == 19

    timeline = Client(headers=bearer(staff_user)).get(f"/api/audit/runs/{run.id}/timeline").json()["items"]
    by_kind = {item["kind"]: item for item in timeline if item["kind"] == "tool"}
    assert by_kind["tool"]["tool_input"] == {"city": "Par\x00is"}
    admin = Client()
    admin.force_login(staff_user)
    page = admin.get(f"/admin/audit/agentrun/{run.id}/change/")
    assert page.status_code == 200 and "Par\\u0000is" in page.content.decode()


@pytest.mark.django_db(transaction=True)
def test_lone_surrogates_end_the_run_at_once_and_are_stored_escaped_R_RUN_11(user, staff_user, replay_models):
    run = _run(user, "unstorable_surrogates")
    assert run.status == "completed", (run.error_type, run.error_message)
    _assert_ended_cleanly(run)
    row = Message.objects.model_calls().get(run=run)
    expected = "Half an emoji: \ud83d, a stray \udc00 and the literal text \\u0000."
    assert row.content == expected
    assert row.usage["input_tokens"] == 7 and row.usage["output_tokens"] == 12
    stored = _raw("SELECT content FROM conversations_message WHERE id = %s", [row.pk])[0]
    assert stored == "Half an emoji: \\ud83d, a stray \\udc00 and the literal text \\u005cu0000."
    # The JSON API carries the surrogates as JSON escapes; HTML the escaped form.
    timeline = Client(headers=bearer(staff_user)).get(f"/api/audit/runs/{run.id}/timeline")
    assert timeline.status_code == 200 and timeline.json()["items"][0]["content"] == expected
    admin = Client()
    admin.force_login(staff_user)
    page = admin.get(f"/admin/audit/agentrun/{run.id}/change/")
    assert page.status_code == 200 and "\\ud83d" in page.content.decode()
    admin_row = admin.get(f"/admin/conversations/message/{row.pk}/change/")
    assert admin_row.status_code == 200


@pytest.mark.django_db(transaction=True)
def test_a_nul_in_the_users_text_is_stored_and_reaches_the_model_R_RUN_11(user, replay_models):
    client = Client(headers=bearer(user))
    thread = client.post(
        "/api/threads", {"agent_id": "assistant", "model": "replay:plain_answer"}, content_type="application/json"
    ).json()
    runs = f"/api/threads/{thread['thread_id']}/runs"
    answer = client.post(
        runs, {"request_id": f"nul-{uuid.uuid4().hex}", "input": {"text": "tell me\x00 more"}}, "application/json"
    )
    assert answer.status_code == 202, answer.content
    run_id = answer.json()["run_id"]
    assert run_execute(run_id=run_id, owner="in-process") == "completed"
    run = AgentRun.objects.get(pk=run_id)
    assert run.input == {"text": "tell me\x00 more"}
    assert Message.objects.get(run=run, role="user").content == "tell me\x00 more"
    history = client.get(f"/api/threads/{thread['thread_id']}/history").json()["items"]
    assert history[0]["content"] == "tell me\x00 more"
    memory = client.get(f"/api/threads/{thread['thread_id']}/memory").json()["messages"]
    assert memory[0]["content"] == "tell me\x00 more"

    # An unpaired surrogate escape is not Unicode text: bad input, nothing stored.
    before = AgentRun.objects.count()
    refused = client.post(
        runs,
        data='{"request_id": "lone-1", "input": {"text": "half \\ud83d"}}',
        content_type="application/json",
    )
    assert refused.status_code == 422, refused.content
    assert AgentRun.objects.count() == before


# --------------------------------------------------------------------------
# Writes the database refuses for good
# --------------------------------------------------------------------------

_REFUSE_COMPLETED = """
CREATE OR REPLACE FUNCTION yx_test_refuse_completed() RETURNS trigger AS $$
BEGIN
  IF NEW.status = 'completed' THEN
    RAISE EXCEPTION 'planted: this database refuses completed runs' USING ERRCODE = '22000';
  END IF;
  RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER yx_test_refuse_completed BEFORE UPDATE ON audit_agentrun
  FOR EACH ROW EXECUTE FUNCTION yx_test_refuse_completed();
"""


@pytest.fixture
def refuse_completed_runs():
    """Plant a trigger that refuses every terminal write to ``completed``
    with a data exception (SQLSTATE 22000: psycopg's ``DataError``)."""
    with connection.cursor() as cursor:
        cursor.execute(_REFUSE_COMPLETED)
    yield
    with connection.cursor() as cursor:
        cursor.execute("DROP TRIGGER IF EXISTS yx_test_refuse_completed ON audit_agentrun")
        cursor.execute("DROP FUNCTION IF EXISTS yx_test_refuse_completed()")


@pytest.mark.django_db(transaction=True)
def test_a_refused_terminal_write_ends_the_run_at_once_with_its_cause_R_RUN_11(
    user, replay_models, refuse_completed_runs
):
    run = _run(user, "unstorable_answer")
    # Ended by the fallback transaction, not left running for the sweeper.
    assert run.status == "failed"
    assert run.error_type == "audit_write_rejected:DataError"
    assert "planted" in run.error_message and "run_finish" in run.error_message
    _assert_ended_cleanly(run)
    assert run.lease_expires_at is None and run.output_message is None
    # The provider's usage, stored by the model call's own write, is kept.
    assert run.usage["input_tokens"] == 5 and run.usage["output_tokens"] == 9
    row = Message.objects.model_calls().get(run=run)
    assert row.content == "Hello\x00world" and row.execution_status == "completed"
    # The thread is free: the next turn runs (and is refused the same way).
    following = make_run(run.thread)
    assert run_execute(run_id=following.id, owner="in-process") == "failed"


@pytest.fixture
def refuse_finished_model_rows():
    """Plant a trigger that refuses (SQLSTATE 22000) every write that
    completes a model row: the mid-run ``model_call_finish`` and the State
    reconcile of the terminal transaction alike."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            CREATE OR REPLACE FUNCTION yx_test_refuse_model_finish() RETURNS trigger AS $$
            BEGIN
              IF NEW.role = 'assistant' AND NEW.execution_status = 'completed' THEN
                RAISE EXCEPTION 'planted: model rows cannot complete' USING ERRCODE = '22000';
              END IF;
              RETURN NEW;
            END $$ LANGUAGE plpgsql;
            CREATE TRIGGER yx_test_refuse_model_finish BEFORE UPDATE OR INSERT ON conversations_message
              FOR EACH ROW EXECUTE FUNCTION yx_test_refuse_model_finish();
            """
        )
    yield
    with connection.cursor() as cursor:
        cursor.execute("DROP TRIGGER IF EXISTS yx_test_refuse_model_finish ON conversations_message")
        cursor.execute("DROP FUNCTION IF EXISTS yx_test_refuse_model_finish()")


@pytest.mark.django_db(transaction=True)
def test_a_refused_mid_run_write_fails_the_run_at_once_naming_the_cause_R_RUN_11(
    user, replay_models, refuse_finished_model_rows
):
    """``model_call_finish`` is refused: the run fails at once with the
    refusal as its cause (not ``agent_error``, not retried), its open row
    closed ``failed`` by the terminal transaction, lease released, the
    call's usage unknown."""
    run = _run(user, "unstorable_answer")
    assert run.status == "failed"
    assert run.error_type == "audit_write_rejected:DataError"
    assert run.error_message.startswith("model_call_finish was refused by the database: DataError: planted")
    _assert_ended_cleanly(run)
    row = Message.objects.model_calls().get(run=run)
    assert row.execution_status == "failed" and row.usage is None
    assert run.usage["unknown_calls"] == 1


@pytest.mark.django_db(transaction=True)
def test_a_refused_audit_write_is_not_retried_and_names_the_cause_R_RUN_11(thread):
    calls = []

    def refused(**kwargs):
        calls.append(kwargs)
        with connection.cursor() as cursor:
            cursor.execute("SELECT '{\"a\": NaN}'::jsonb")

    with pytest.raises(AuditWriteRejected) as caught:
        asyncio.run(write_with_retry(refused, x=1))
    assert len(calls) == 1
    assert caught.value.code == "audit_write_rejected:DataError"
    assert isinstance(caught.value.__cause__, DataError)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | _TEXT,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_TEXT, children, max_size=4),
    max_leaves=12,
)


@pytest.mark.django_db
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_TEXT, value=_JSON)
def test_any_text_and_json_round_trip_through_postgresql_R_RUN_11(thread, text, value):
    row = Message.objects.create(thread=thread, role=Message.Role.USER, content=text, metadata={"v": value})
    again = Message.objects.get(pk=row.pk)
    assert again.content == text and again.metadata == {"v": value}
    assert list(Message.objects.filter(pk=row.pk).values_list("metadata__v", flat=True)) == [value]


@pytest.mark.django_db
@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers(-(2**80), 2**80)
            | st.floats(allow_nan=False, allow_infinity=False)
            | _TEXT,
            lambda children: st.lists(children, max_size=3) | st.dictionaries(_TEXT, children, max_size=3),
            max_leaves=8,
        ),
        max_size=6,
    )
)
def test_many_json_values_read_at_once_are_what_the_field_reads_one_by_one_R_RUN_11(values):
    """The memory reader parses a thread's declared tool calls in one go
    (``StorableJSONField.from_db_values``): the same values as
    ``from_db_value`` on each, for the text PostgreSQL writes for jsonb."""
    field = Message._meta.get_field("tool_calls")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT v::text FROM jsonb_array_elements(%s::jsonb) v",
            [json.dumps([field.get_prep_value(v) for v in values])],
        )
        stored = [text for (text,) in cursor.fetchall()]
    one_by_one = [field.from_db_value(text, None, connection) for text in stored]
    assert field.from_db_values(stored, connection) == one_by_one


def test_text_that_is_not_one_json_value_each_is_read_one_by_one():
    field = Message._meta.get_field("tool_calls")
    for texts in (["1, 2", "3"], ["{", "[]"], ['"a"', "1 2"]):
        assert field.from_db_values(texts, None) == [field.from_db_value(t, None, None) for t in texts]
    assert field.from_db_values([], None) == []


def test_a_page_of_rows_reads_plain_json_columns_as_the_orm_does():
    """``namespace`` (a plain JSON column) is parsed for the whole page at
    once; values orjson does not read (an integer beyond 64 bits) and text
    that is not one value each fall back to the ORM's parse, value by value."""
    from conversations.sql import _json_values

    field = Message._meta.get_field("namespace")
    for texts in (["[]", '["tools:a"]', "[]"], [str(2**70), "[]"], ["1, 2", "3"], ['"\\u0000"', "-0.0"]):
        assert _json_values(field, texts, connection) == [field.from_db_value(t, None, connection) for t in texts]


_VISIBLE_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TEXT,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_TEXT, children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(value=_VISIBLE_JSON)
def test_visible_is_the_escaped_form_of_any_json_value_R_RUN_11(value):
    """The admin's display form: its shortcut (nothing to escape: the value
    as it is) must give exactly what the full walk gives."""
    assert visible(value) == escape_json(value)
    assert json.dumps(visible(value)) == json.dumps(escape_json(value))


# --------------------------------------------------------------------------
# The provider edge (R-RUN-13)
# --------------------------------------------------------------------------


def test_every_text_of_a_request_is_sent_in_its_replacement_form_R_RUN_13():
    """A lone surrogate or NUL anywhere in a request (user text, an earlier
    answer, a declared call's arguments, a tool's output and name) is sent
    as its six-character escape: the request encodes as UTF-8."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    from audit.agents.provider import AuditedChatOpenAI

    model = AuditedChatOpenAI(model="m", api_key="k", base_url="http://127.0.0.1:9/v1", configured_name="replay:m")
    messages = [
        HumanMessage("weather in Par\x00is?"),
        AIMessage(
            "half \ud83d",
            tool_calls=[{"id": "call_\udc00", "name": "get_weather", "args": {"city": "Par\ud800is"}}],
        ),
        ToolMessage("unknown city: Par\ud800is", tool_call_id="call_\udc00", name="get_weather"),
    ]
    with pytest.raises(UnicodeEncodeError):
        json.dumps(ChatOpenAI._get_request_payload(model, messages), ensure_ascii=False).encode()
    payload = model._get_request_payload(messages)
    json.dumps(payload, ensure_ascii=False).encode("utf-8")  # strict: it can be sent
    sent = payload["messages"]
    assert sent[0]["content"] == "weather in Par\\u0000is?"
    assert sent[1]["content"] == "half \\ud83d" and sent[1]["tool_calls"][0]["id"] == "call_\\udc00"
    assert json.loads(sent[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Par\ud800is"}
    assert sent[2]["content"] == "unknown city: Par\\ud800is" and sent[2]["tool_call_id"] == "call_\\udc00"
    plain = [HumanMessage("ordinary text, a backslash \\u0000 as written")]
    assert (
        model._get_request_payload(plain)["messages"][0]["content"] == "ordinary text, a backslash \\u0000 as written"
    )


@pytest.mark.django_db(transaction=True)
def test_a_lone_surrogate_in_a_tools_output_reaches_the_next_model_call_R_RUN_13(user, replay_models):
    """get_weather echoes a city holding a lone surrogate in its error: the
    next model call once failed ``model_unreachable`` (the request could
    not be encoded, none was sent)."""
    run = _run(user, "unstorable_tool_surrogate")
    assert run.status == "completed", (run.error_type, run.error_message)
    _assert_ended_cleanly(run)
    tool = Message.objects.tool_executions().get(run=run)
    assert tool.tool_input == {"city": "Par\ud800is"}
    assert tool.content == "unknown city: Par\ud800is" and tool.execution_status == "failed"
    calls = list(Message.objects.model_calls().filter(run=run).order_by("sequence"))
    assert [call.execution_status for call in calls] == ["completed", "completed"]
    assert calls[1].usage["input_tokens"] == 60 and calls[1].usage["output_tokens"] == 7
    assert run.output_message.content == "I could not find that city."
