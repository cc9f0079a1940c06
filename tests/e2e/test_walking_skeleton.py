"""A turn submitted over HTTP runs the real agent in a Celery worker and
leaves ordered model and tool audit rows (issue: walking skeleton).

Real processes: uvicorn (ASGI), a Celery worker, the replay model server,
PostgreSQL and Redis. The test drives HTTP and checks the database."""

from __future__ import annotations

import contextlib
import math
import time

import pytest
from django.db import connection

from audit.models import AgentRun
from audit.replay.scenarios import load_scenarios
from conversations.models import Message
from tests.conftest import bearer

from .stack import wait_for_status

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@contextlib.contextmanager
def message_write_log():
    """Record every INSERT/UPDATE on the message table with a trigger, so the
    test can count database writes per audit row (no write per token)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            CREATE TABLE IF NOT EXISTS e2e_message_writes (op text, message_id bigint, at timestamptz default now());
            TRUNCATE e2e_message_writes;
            CREATE OR REPLACE FUNCTION e2e_log_message_write() RETURNS trigger AS $$
            BEGIN INSERT INTO e2e_message_writes(op, message_id) VALUES (TG_OP, NEW.id); RETURN NEW; END $$
            LANGUAGE plpgsql;
            DROP TRIGGER IF EXISTS e2e_message_writes_trg ON conversations_message;
            CREATE TRIGGER e2e_message_writes_trg AFTER INSERT OR UPDATE ON conversations_message
                FOR EACH ROW EXECUTE FUNCTION e2e_log_message_write();
            """
        )

    def writes() -> dict[int, int]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT message_id, count(*) FROM e2e_message_writes GROUP BY message_id")
            return dict(cursor.fetchall())

    try:
        yield writes
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "DROP TRIGGER IF EXISTS e2e_message_writes_trg ON conversations_message;"
                "DROP TABLE IF EXISTS e2e_message_writes;"
            )


def test_tool_turn_over_http_leaves_ordered_audit_R_RUN_1_R_MA_3_R_MA_4_R_TA_1(stack, user):
    scenario = load_scenarios()["tool_then_answer"]
    answer = scenario.turns[1]
    answer_chunks = math.ceil(len(answer.text) / answer.chunk_chars)
    assert answer_chunks >= 20

    with message_write_log() as writes, stack.client(bearer(user)) as client:
        created = client.post("/api/threads", json={"agent_id": "assistant", "model": "replay:tool_then_answer"})
        assert created.status_code == 201, created.text
        thread_id = created.json()["thread_id"]

        submitted = client.post(
            f"/api/threads/{thread_id}/runs",
            json={"request_id": "req-weather-1", "input": {"text": "Weather in Paris?"}},
        )
        assert submitted.status_code == 202, submitted.text
        run_id = submitted.json()["run_id"]
        body = wait_for_status(client, run_id, {"completed", "failed", "cancelled", "interrupted"})
        assert body["status"] == "completed", body

        run = AgentRun.objects.get(pk=run_id)
        model_rows = list(Message.objects.model_calls().filter(run=run).order_by("sequence"))
        tool_rows = list(Message.objects.filter(run=run, message_type=Message.Type.TOOL_AUDIT))

        # Two model rows, in sequence order, completed, each with exactly the
        # usage the scenario sent.
        assert len(model_rows) == 2
        assert [r.execution_status for r in model_rows] == ["completed", "completed"]
        assert model_rows[0].sequence < model_rows[1].sequence
        for row, turn in zip(model_rows, scenario.turns, strict=True):
            prompt, completion = turn.usage.prompt_tokens, turn.usage.completion_tokens
            assert row.usage["input_tokens"] == prompt
            assert row.usage["output_tokens"] == completion
            assert row.usage["total_tokens"] == prompt + completion
            assert row.operation_id.startswith("lc_run--")
            assert row.duration_ms is not None and row.started_at and row.finished_at
        assert model_rows[0].tool_calls == [
            {"id": "call_weather_paris", "name": "get_weather", "args": {"city": "Paris"}}
        ]
        assert model_rows[1].content == answer.text

        # One tool row for the call id, with the tool's output, declared by
        # the first model call and ordered between the two model calls.
        assert len(tool_rows) == 1
        tool = tool_rows[0]
        assert tool.operation_id == "call_weather_paris"
        assert tool.tool_name == "get_weather" and tool.tool_input == {"city": "Paris"}
        assert tool.execution_status == "completed"
        assert '"conditions": "sunny"' in tool.content
        assert tool.metadata["raw_output"]["tool_call_id"] == "call_weather_paris"
        assert tool.declared_by_id == model_rows[0].id
        assert model_rows[0].sequence < tool.sequence < model_rows[1].sequence

        # The final answer is the second model row.
        assert run.output_message_id == model_rows[1].id
        assert run.usage["total_tokens"] == sum(r.usage["total_tokens"] for r in model_rows)

        # No write per token: each model row is written a handful of times
        # (open at request start — R-MA-10 —, message-start, finish,
        # reconcile, bind), not once per streamed chunk.
        counts = writes()
        for row in model_rows:
            assert counts[row.id] <= 5, counts
        assert counts[model_rows[1].id] < answer_chunks
        assert sum(counts.values()) <= 2 * 4 + 3 + 1

        # The same request_id again: the same run, and nothing starts.
        again = client.post(
            f"/api/threads/{thread_id}/runs",
            json={"request_id": "req-weather-1", "input": {"text": "Weather in Paris?"}},
        )
        assert again.status_code == 200, again.text
        assert again.json()["run_id"] == run_id
        time.sleep(1.0)
        assert AgentRun.objects.filter(thread_id=thread_id).count() == 1
        assert writes() == counts
        worker_log = "".join(w.output() for w in stack.workers)
        assert worker_log.count(f"[{run_id}]") <= 2  # received + succeeded of one delivery
