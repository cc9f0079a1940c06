"""Unstorable content, refused terminal writes and trimmed live events with
real processes (web, Celery worker, replay model server) over HTTP
(R-RUN-11, R-EVT-2)."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
import redis
from django.conf import settings
from django.db import connection

from audit.execution.events import stream_key
from audit.models import AgentRun
from conversations.models import Message
from governance.bypass import audited_bypass
from tests.conftest import bearer

from .stack import TERMINAL_STATUSES, create_thread, wait_for_status
from .test_live_events import read_events

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def submit(client, thread_id: str, text: str) -> str:
    response = client.post(
        f"/api/threads/{thread_id}/runs", json={"request_id": f"u-{uuid.uuid4().hex}", "input": {"text": text}}
    )
    assert response.status_code == 202, response.text
    return response.json()["run_id"]


def _stored(sql: str, params: list):
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone()[0]


def test_nul_in_answer_tool_argument_and_user_text_complete_and_read_back_R_RUN_11(stack, user, staff_user):
    with stack.client(bearer(user)) as client:
        thread_id = create_thread(client, "replay:unstorable_answer")
        run_id = submit(client, thread_id, "say\u0000hello")
        events = read_events(client, run_id)
        run = wait_for_status(client, run_id, TERMINAL_STATUSES)
        assert run["status"] == "completed", run
        assert run["usage"]["input_tokens"] == 5 and run["usage"]["output_tokens"] == 9
        history = client.get(f"/api/threads/{thread_id}/history").json()["items"]
        assert [i["content"] for i in history] == ["say\u0000hello", "Hello\u0000world"]
        # The live deltas and the stored answer agree.
        assert "".join(e[2]["text"] for e in events if e[1] == "model.delta") == "Hello\u0000world"
        answer = AgentRun.objects.get(pk=run_id).output_message_id
        assert _stored("SELECT content FROM conversations_message WHERE id = %s", [answer]) == "Hello\\u0000world"

        tool_thread = create_thread(client, "replay:unstorable_tool_args")
        tool_run = submit(client, tool_thread, "weather")
        assert wait_for_status(client, tool_run, TERMINAL_STATUSES)["status"] == "completed"
    with stack.client(bearer(staff_user)) as staff:
        items = staff.get(f"/api/audit/runs/{tool_run}/timeline").json()["items"]
        tool = next(i for i in items if i["kind"] == "tool")
        assert tool["tool_input"] == {"city": "Par\u0000is"} and "Par\u0000is" in tool["content"]
        assert items[0]["tool_calls"][0]["args"] == {"city": "Par\u0000is"}


def test_lone_surrogates_in_the_answer_complete_R_RUN_11(stack, user):
    with stack.client(bearer(user)) as client:
        run_id = submit(client, create_thread(client, "replay:unstorable_surrogates"), "emoji")
        started = time.monotonic()
        run = wait_for_status(client, run_id, TERMINAL_STATUSES)
        assert run["status"] == "completed", run
        assert time.monotonic() - started < 15
    row = Message.objects.model_calls().get(run_id=run_id)
    assert row.content == "Half an emoji: \ud83d, a stray \udc00 and the literal text \\u0000."
    assert row.usage["output_tokens"] == 12


@pytest.fixture
def refused_completion():
    """Plant a trigger that refuses, with a data exception (SQLSTATE 22000,
    psycopg's DataError), every write that makes a run of one chosen thread
    ``completed``: a terminal write the database will not take."""
    thread_ids: list[str] = []

    def plant(thread_id: str) -> None:
        thread_ids.append(thread_id)
        with connection.cursor() as cursor:
            cursor.execute(
                f"""
                CREATE OR REPLACE FUNCTION yx_e2e_refuse_completed() RETURNS trigger AS $$
                BEGIN
                  IF NEW.status = 'completed' AND NEW.thread_id = '{uuid.UUID(thread_id)}' THEN
                    RAISE EXCEPTION 'planted refusal' USING ERRCODE = '22000';
                  END IF;
                  RETURN NEW;
                END $$ LANGUAGE plpgsql;
                CREATE TRIGGER yx_e2e_refuse_completed BEFORE UPDATE ON audit_agentrun
                  FOR EACH ROW EXECUTE FUNCTION yx_e2e_refuse_completed();
                """
            )

    yield plant
    with connection.cursor() as cursor:
        cursor.execute("DROP TRIGGER IF EXISTS yx_e2e_refuse_completed ON audit_agentrun")
        cursor.execute("DROP FUNCTION IF EXISTS yx_e2e_refuse_completed()")


def test_a_refused_terminal_write_fails_the_run_at_once_with_its_cause_R_RUN_11(stack, user, refused_completion):
    with stack.client(bearer(user)) as client:
        thread_id = create_thread(client, "replay:unstorable_answer")
        refused_completion(thread_id)
        run_id = submit(client, thread_id, "hi")
        started = time.monotonic()
        run = wait_for_status(client, run_id, TERMINAL_STATUSES)
        elapsed = time.monotonic() - started
        print(f"\nrefused terminal write: run ended {run['status']} ({run['error_type']}) after {elapsed:.2f} s")
        # Not the sweeper (it would say lease_expired after the 6 s lease).
        assert run["status"] == "failed" and run["error_type"] == "audit_write_rejected:DataError", run
        assert "planted refusal" in run["error_message"]
        assert run["usage"]["input_tokens"] == 5 and run["usage"]["output_tokens"] == 9
        assert not Message.objects.filter(run_id=run_id, execution_status="running").exists()
        assert AgentRun.objects.get(pk=run_id).lease_expires_at is None
        # The thread is not blocked: its next turn runs at once.
        following = submit(client, thread_id, "again")
        assert wait_for_status(client, following, TERMINAL_STATUSES)["error_type"] != "lease_expired"


def test_reconnect_to_a_trimmed_stream_gets_a_gap_with_the_state_R_EVT_2(stack, user):
    with stack.client(bearer(user)) as client:
        run_id = submit(client, create_thread(client, "replay:tool_then_answer"), "weather")
        events = read_events(client, run_id)
        last = events[-1][0]
        # Redis trims the stream to its newest 5 events (the retention).
        redis.Redis.from_url(settings.CONFIG.REDIS_URL).xtrim(stream_key(run_id), maxlen=5, approximate=False)

        again = read_events(client, run_id, last_event_id="3")
        assert again[0][1] == "gap"
        gap = again[0][2]
        assert gap["first_retained_id"] == last - 4 and (gap["missed_from"], gap["missed_to"]) == (4, last - 5)
        assert again[1:] == events[-5:]
        state = gap["state"]
        assert state["status"] == "completed"
        assert [(o["kind"], o["status"]) for o in state["operations"]] == [
            ("model", "completed"),
            ("tool", "completed"),
            ("model", "completed"),
        ]
        assert state["usage"] == client.get(f"/api/runs/{run_id}").json()["usage"]
        # A new client from the start gets the same.
        fresh = read_events(client, run_id)
        assert fresh[0][1] == "gap" and fresh[0][2]["missed_from"] == 1 and fresh[1:] == events[-5:]


def test_a_followed_run_that_is_deleted_ends_the_stream_with_an_error_event_R_EVT_2(stack, user):
    with stack.client(bearer(user)) as client:
        run_id = submit(client, create_thread(client, "replay:slow_answer"), "talk")
        first = read_events(client, run_id, stop_after_deltas=2)
        collected: list = []
        reader = threading.Thread(
            target=lambda: collected.extend(_read_until_end(client, run_id, first[-1][0])), daemon=True
        )
        reader.start()
        time.sleep(0.5)
        # Runs are append-only (R-GOV-3): the loss is simulated deliberately,
        # through the recorded bypass.
        with audited_bypass(reason="test: a followed run is lost"):
            AgentRun.objects.filter(pk=run_id).delete()
        reader.join(timeout=30)
        assert not reader.is_alive()
        assert collected[-1][1] == "error" and collected[-1][2]["error"] == "run_not_found"


def _read_until_end(client, run_id: str, last_event_id: int) -> list:
    events, fields = [], {}
    with client.stream(
        "GET", f"/api/runs/{run_id}/events", headers={"Last-Event-ID": str(last_event_id)}, timeout=60
    ) as response:
        for line in response.iter_lines():
            if line:
                name, _, value = line.partition(": ")
                fields[name] = value
                continue
            if "id" in fields:
                events.append((int(fields["id"]), fields["event"], json.loads(fields["data"])))
            fields = {}
    return events
