"""Inputs that once reached the database or the runtime unchecked answer a
clear 4xx and change nothing; approval edge cases keep the thread usable
(R-READ-6, R-TA-5, R-RUN-2). Found by trying to break a running stack."""

from __future__ import annotations

import base64
import json

import pytest
from django.test import Client

from audit import ledger
from audit.agents.tools import AgentContext, send_email
from audit.models import AgentRun
from conversations.models import Conversation, Message
from tests.conftest import acquire, bearer, make_run

pytestmark = pytest.mark.django_db

INTERRUPT = [
    {
        "id": "intr-1",
        "value": {
            "action_requests": [{"name": "send_email", "args": {"to": "a@b.c", "subject": "s", "body": "b"}}],
            "review_configs": [{"action_name": "send_email", "allowed_decisions": ["approve", "edit", "reject"]}],
        },
    }
]


def _post(client, headers, path, payload, raw: str | None = None):
    return client.post(
        path, data=raw if raw is not None else json.dumps(payload), content_type="application/json", headers=headers
    )


def _interrupted_run(thread) -> AgentRun:
    run = make_run(thread, text="email ops")
    ledger.run_finish(lease=acquire(run), status="interrupted", interrupts=INTERRUPT)
    run.refresh_from_db()
    return run


@pytest.mark.parametrize(
    "path_kind, payload",
    [
        ("threads", {"agent_id": "assistant", "title": "a\u0000b"}),
        ("runs", {"request_id": "nul-1", "input": {"text": "hi\u0000there"}}),
    ],
)
def test_a_nul_character_in_the_body_is_stored_as_written_R_RUN_11(user, thread, path_kind, payload):
    """A NUL once reached PostgreSQL unescaped (500); it was then refused
    (422). Now the storage boundary escapes it: the body is kept as the
    user wrote it and reads back the same (R-RUN-11)."""
    path = "/api/threads" if path_kind == "threads" else f"/api/threads/{thread.id}/runs"
    response = _post(Client(), bearer(user), path, payload)
    assert response.status_code in (201, 202), response.content
    if path_kind == "threads":
        assert Conversation.objects.get(pk=response.json()["thread_id"]).title == "a\x00b"
    else:
        run = AgentRun.objects.get(pk=response.json()["run_id"])
        assert run.input == {"text": "hi\x00there"}
        assert Message.objects.get(run=run, role="user").content == "hi\x00there"


def test_a_nul_character_in_a_query_is_422_R_READ_6(user, thread):
    response = Client().get(f"/api/threads/{thread.id}/history?before=a%00b", headers=bearer(user))
    assert response.status_code == 422 and response.json()["error"]["reason"] == "nul_character"


def test_a_deeply_nested_body_is_422_R_READ_6(user, thread):
    nested: object = "x"
    for _ in range(200):
        nested = {"a": nested}
    response = _post(
        Client(), bearer(user), f"/api/threads/{thread.id}/runs", {"request_id": "deep", "input": {"text": nested}}
    )
    assert response.status_code == 422 and response.json()["error"]["reason"] == "too_deep"
    assert not AgentRun.objects.exists()


def test_an_oversized_body_is_413_json_R_READ_6(user, thread, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    response = _post(
        Client(), bearer(user), f"/api/threads/{thread.id}/runs", {"request_id": "big", "input": {"text": "x" * 20_000}}
    )
    assert response.status_code == 413 and response.json()["error"]["code"] == "payload_too_large"
    assert not AgentRun.objects.exists()


def test_a_cursor_with_an_out_of_range_time_zone_is_a_bad_cursor_R_READ_6(user, staff_user, thread):
    run = make_run(thread)
    raw = json.dumps(["9999-12-31T23:59:59-23:59", str(run.id), 1, 26, 6]).encode()
    cursor = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    history = Client().get(f"/api/threads/{thread.id}/history?before={cursor}", headers=bearer(user))
    assert history.status_code == 422 and history.json()["error"]["reason"] == "bad_cursor"
    raw4 = json.dumps(["9999-12-31T23:59:59-23:59", 1, 26, 6]).encode()
    cursor4 = base64.urlsafe_b64encode(raw4).decode().rstrip("=")
    timeline = Client().get(f"/api/audit/runs/{run.id}/timeline?before={cursor4}", headers=bearer(staff_user))
    assert timeline.status_code == 422, timeline.content


def test_last_event_id_must_be_ascii_digits_R_EVT_1(user, thread):
    run = make_run(thread)
    response = Client().get(f"/api/runs/{run.id}/events", headers={**bearer(user), "Last-Event-ID": "²"})
    assert response.status_code == 422 and response.json()["error"]["reason"] == "bad_last_event_id"


def test_cancelling_a_resume_run_before_it_starts_gives_the_approval_up_R_TA_5(user):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:approval_send_email")
    origin = _interrupted_run(thread)
    resume, _ = ledger.run_resume(user=user, run_id=origin.id, request_id="resume-1", decisions=[{"type": "approve"}])
    ledger.run_request_cancel(user=user, run_id=resume.id)
    origin.refresh_from_db()
    resume.refresh_from_db()
    assert resume.status == "cancelled"
    # Not left "interrupted" with an approval nobody can answer any more.
    assert origin.status == "cancelled" and origin.interrupts is None
    # The thread takes new turns again.
    run, created = ledger.run_submit(user=user, thread_id=thread.id, request_id="after", text="next")
    assert created and run.status == "pending"


def test_an_unanswered_approval_holds_the_thread_even_behind_a_queued_turn_R_TA_5_R_RUN_2(user):
    from audit.errors import ThreadInterrupted

    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:approval_send_email")
    first = make_run(thread, text="email ops")
    make_run(thread, text="queued while the first still ran")  # accepted: nothing waits yet
    ledger.run_finish(lease=acquire(first), status="interrupted", interrupts=INTERRUPT)
    with pytest.raises(ThreadInterrupted) as exc:
        ledger.run_submit(user=user, thread_id=thread.id, request_id="third", text="third")
    assert exc.value.code == "thread_interrupted" and exc.value.http_status == 409
    assert exc.value.extra["reason"] == "thread_interrupted" and exc.value.extra["run_id"] == str(first.id)
    assert str(first.id) in exc.value.message  # "resume or cancel run <id> first"


def test_send_email_names_its_outbox_file_safely_whatever_the_call_id(tmp_path):
    from langgraph.prebuilt.tool_node import ToolRuntime

    runtime = ToolRuntime(
        state={},
        context=AgentContext(thread_id="t", run_id="r", workspace=str(tmp_path)),
        config={},
        stream_writer=None,
        tool_call_id="../../etc/evil",
        store=None,
    )
    send_email.func(to="a@b.c", subject="s", body="b", runtime=runtime)
    written = list(tmp_path.rglob("*.json"))
    assert len(written) == 1 and written[0].parent == tmp_path / "outbox" / "r"
    assert ".." not in written[0].name and "/" not in written[0].name


def test_memory_feeds_a_large_tool_result_back_as_path_and_preview_R_TA_4_R_READ_2(thread):
    import datetime as dt

    from conversations.selectors import thread_memory
    from core.config import get_config

    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    lease = acquire(make_run(thread))
    call = {"id": "call_lookup_1", "name": "lookup_docs", "args": {"query": "retention", "size": 20000}}
    ledger.model_call_start(lease=lease, operation_id="lc_run--m1", sequence=2, started_at=t0)
    ledger.model_call_finish(
        lease=lease, operation_id="lc_run--m1", content="", tool_calls=[call], usage=None, finished_at=t0, duration_ms=1
    )
    ledger.tool_call_start(
        lease=lease,
        tool_call_id="call_lookup_1",
        tool_name="lookup_docs",
        tool_input=call["args"],
        sequence=5,
        started_at=t0,
        declared_by_operation_id="lc_run--m1",
    )
    full = "x" * (get_config().LARGE_TOOL_RESULT_CHARS + 5000)
    ledger.tool_call_finish(
        lease=lease,
        tool_call_id="call_lookup_1",
        status="completed",
        content=full,
        raw_output={"content": full},
        finished_at=t0,
        duration_ms=1,
    )
    state = [
        ledger.StateMessage(kind="ai", id="lc_run--m1", tool_calls=[call]),
        ledger.StateMessage(kind="ai", id="lc_run--m2", content="done"),
    ]
    ledger.run_finish(lease=lease, status="completed", final_state=state)
    (tool,) = [m for m in thread_memory(thread_id=thread.id, include_tools=True) if m["type"] == "tool"]
    assert tool["tool_call_id"] == "call_lookup_1"
    path = f"outputs/large_tool_results/{lease.run_id}/call_lookup_1"
    assert path in tool["content"] and len(tool["content"]) < 1000
    # The audit row keeps the full result.
    assert Message.objects.get(operation_id="call_lookup_1").content == full


def test_the_web_lock_limit_holds_for_its_block_only_inside_a_transaction_R_RUN_10(db):
    """web_lock_wait shares core.db.local_setting with serial_plans:
    inside an outer transaction the limit is set back when the block ends."""
    from django.db import connection, transaction

    from audit.ledger.locks import web_lock_wait

    def limit() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('lock_timeout')")
            return cursor.fetchone()[0]

    with transaction.atomic():
        before = limit()
        with web_lock_wait(1234):
            assert limit() == "1234ms"
        assert limit() == before
