"""The model audit under the paths a deployment meets, end to end with real
processes: cancellation mid-stream, a worker killed mid-stream, a model
error mid-stream, the database unreachable for the worker, two runs in one
thread (R-RUN-2, R-RUN-6, R-RUN-7, R-RUN-8, R-MA-7, R-MA-9).

The test drives HTTP and reads PostgreSQL; the worker, web server and
replay model server are separate processes."""

from __future__ import annotations

import os
import time

import psycopg
import pytest
import redis
from django.conf import settings
from django.db import connection

from audit.execution.events import stream_key
from audit.models import AgentRun
from audit.replay.scenarios import load_scenarios
from conversations.models import Message
from core.db import WORKER_APPLICATION_NAME, session_tag_of
from tests.conftest import bearer

from .stack import Process, wait_for_status

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TERMINAL = {"completed", "failed", "cancelled", "interrupted"}


def _thread(client, model: str) -> str:
    created = client.post("/api/threads", json={"agent_id": "assistant", "model": model})
    assert created.status_code == 201, created.text
    return created.json()["thread_id"]


def _submit(client, thread_id: str, request_id: str, text: str = "hello") -> str:
    submitted = client.post(f"/api/threads/{thread_id}/runs", json={"request_id": request_id, "input": {"text": text}})
    assert submitted.status_code == 202, submitted.text
    return submitted.json()["run_id"]


def _wait_for_running_model_row(run_id: str, timeout: float = 60.0) -> Message:
    """Poll PostgreSQL until the run has a ``running`` model row (the worker
    wrote message-start and the model is streaming)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = Message.objects.model_calls().filter(run_id=run_id, execution_status="running").first()
        if row is not None:
            return row
        time.sleep(0.05)
    raise TimeoutError(f"run {run_id} never had a running model row")


def _wait_for_first_text_chunk(run_id: str, timeout: float = 30.0) -> None:
    """Wait until the worker has published the run's first text delta on
    its live event stream (deltas go to Redis only, never to PostgreSQL)."""
    client = redis.Redis.from_url(settings.CONFIG.REDIS_URL)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if any(f.get(b"type") == b"model.delta" for _, f in client.xrange(stream_key(run_id))):
                return
            time.sleep(0.02)
    finally:
        client.close()
    raise TimeoutError(f"run {run_id} streamed no text")


def _replay_lines(stack, needle: str) -> list[str]:
    return [line for line in stack.replay.output().splitlines() if needle in line]


def _owner_worker(stack, run_id: str) -> Process:
    """The worker process whose child holds the run's lease (the owner name
    is ``host:pid:random``; a prefork child is in its worker's group)."""
    owner = AgentRun.objects.get(pk=run_id).lease_owner
    pid = int(owner.split(":")[1])
    group = os.getpgid(pid)
    return next(w for w in stack.workers if w.popen.pid == group)


def _maintenance_connection() -> psycopg.Connection:
    """An autocommit connection to the server's ``postgres`` database."""
    s = connection.settings_dict
    return psycopg.connect(
        host=s.get("HOST") or "127.0.0.1",
        port=s.get("PORT") or 5432,
        user=s.get("USER") or None,
        password=s.get("PASSWORD") or None,
        dbname="postgres",
        autocommit=True,
    )


def test_cancel_after_the_first_chunk_stops_the_model_call_R_RUN_6_R_MA_7(stack, user):
    with stack.client(bearer(user)) as client:
        thread_id = _thread(client, "replay:slow_answer")
        requests_before = len(_replay_lines(stack, "scenario=slow_answer"))
        closed_before = len(_replay_lines(stack, "the client closed the stream"))
        run_id = _submit(client, thread_id, "cancel-1")

        row = _wait_for_running_model_row(run_id)
        assert row.operation_id.startswith("lc_run--") and row.finished_at is None
        assert client.get(f"/api/runs/{run_id}").json()["status"] == "running"
        _wait_for_first_text_chunk(run_id)

        cancelled = client.post(f"/api/runs/{run_id}/cancel")
        assert cancelled.status_code == 202, cancelled.text
        assert cancelled.json()["status"] == "cancel_requested"
        body = wait_for_status(client, run_id, TERMINAL)

    assert body["status"] == "cancelled", body
    assert body["error_type"] == "cancelled" and body["output_message_id"] is None
    rows = list(Message.objects.model_calls().filter(run_id=run_id))
    assert len(rows) == 1, "no further model call happened"
    row = rows[0]
    assert row.execution_status == "interrupted"
    assert row.usage is None and row.metadata["usage_unknown"] is True
    assert row.duration_ms is not None, "cut off mid-stream, it still has its duration (R-MA-10)"
    # What the model said before the cancel is kept, marked partial.
    full_text = load_scenarios()["slow_answer"].turns[0].text
    assert row.content and full_text.startswith(row.content) and len(row.content) < len(full_text)
    assert row.metadata["content_partial"] is True
    assert not Message.objects.filter(run_id=run_id, execution_status="running").exists()
    assert body["usage"]["unknown_calls"] == 1 and body["usage"]["total_tokens"] == 0
    # The model server saw one request for the run, and the client (the
    # worker) closed that stream before it ended: the call really stopped.
    stack.replay.wait_for_line("the client closed the stream")
    assert len(_replay_lines(stack, "the client closed the stream")) > closed_before
    assert len(_replay_lines(stack, "scenario=slow_answer")) == requests_before + 1


def test_a_worker_killed_mid_stream_leaves_its_run_to_another_worker_and_the_thread_goes_on_R_RUN_15_R_RUN_2(
    stack, user
):
    extra = stack.start_worker(name="doomed")
    with stack.client(bearer(user)) as client:
        thread_id = _thread(client, "replay:slow_answer")
        run_id = _submit(client, thread_id, "sigkill-1")
        _wait_for_running_model_row(run_id)
        victim = _owner_worker(stack, run_id)
        victim.kill()  # SIGKILL the worker's whole process group mid-stream
        stack.workers.remove(victim)
        assert stack.workers, "another worker (with the sweeper) stays up"
        assert extra is victim or extra in stack.workers

        # The sweeper puts the run back (RUN_RECOVERY=resume, the default);
        # the other worker continues it as attempt 2 and it completes.
        body = wait_for_status(client, run_id, TERMINAL)
        assert (body["status"], body["error_type"], body["attempt"]) == ("completed", "", 2), body
        assert body["output_message_id"] is not None
        assert not Message.objects.filter(run_id=run_id, execution_status="running").exists()
        cut, answer = Message.objects.model_calls().filter(run_id=run_id).order_by("attempt")
        assert (cut.attempt, cut.execution_status, cut.metadata["closed_by"]) == (1, "interrupted", "recovery")
        assert cut.usage is None and cut.metadata["usage_unknown"] is True
        assert (answer.attempt, answer.execution_status) == (2, "completed") and answer.usage
        assert body["usage"]["unknown_calls"] == 1 and body["usage"]["output_tokens"] == answer.usage["output_tokens"]

        # A second run of the same thread then completes.
        second = _submit(client, thread_id, "sigkill-2")
        body = wait_for_status(client, second, TERMINAL)
        assert body["status"] == "completed", body
        assert body["output_message_id"] is not None


def test_a_model_error_mid_stream_fails_the_run_and_its_row_R_MA_7(stack, user):
    with stack.client(bearer(user)) as client:
        thread_id = _thread(client, "replay:model_error_midstream")
        run_id = _submit(client, thread_id, "midstream-1")
        body = wait_for_status(client, run_id, TERMINAL)
    assert body["status"] == "failed", body
    assert body["error_type"] == "model_stream_broken", body
    (row,) = Message.objects.model_calls().filter(run_id=run_id)
    assert row.execution_status == "failed"
    assert row.usage is None and row.metadata["usage_unknown"] is True
    assert body["output_message_id"] is None
    # The chunks that arrived before the break are kept, marked partial.
    full_text = load_scenarios()["model_error_midstream"].turns[0].text
    assert row.content and full_text.startswith(row.content) and row.metadata["content_partial"] is True


def test_two_runs_in_one_thread_run_in_order_and_keep_their_own_operations_R_RUN_2_R_MA_9(stack, user):
    with stack.client(bearer(user)) as client:
        thread_id = _thread(client, "replay:tool_then_answer")
        first = _submit(client, thread_id, "fifo-1", "Weather in Paris?")
        second = _submit(client, thread_id, "fifo-2", "And again?")
        first_body = wait_for_status(client, first, TERMINAL)
        second_body = wait_for_status(client, second, TERMINAL)
    assert first_body["status"] == "completed", first_body
    one, two = AgentRun.objects.get(pk=first), AgentRun.objects.get(pk=second)
    # FIFO: the second run started only after the first ended.
    assert two.started_at >= one.finished_at
    ops_one = set(Message.objects.model_calls().filter(run=one).values_list("operation_id", flat=True))
    ops_two = set(Message.objects.model_calls().filter(run=two).values_list("operation_id", flat=True))
    assert len(ops_one) == 2 and ops_one.isdisjoint(ops_two), "no operation of run 1 copied into run 2"
    assert Message.objects.filter(run=one).exclude(role="user").count() == 3  # 2 model rows + 1 tool row
    assert one.output_message.run_id == one.id
    if second_body["status"] == "completed":
        assert two.output_message is not None and two.output_message.run_id == two.id
        assert two.output_message.operation_id in ops_two


def test_database_unreachable_for_the_worker_fails_the_run_with_audit_write_failed_R_RUN_8(stack, user):
    """The database really goes away for the worker: new connections to the
    test database are refused (``ALLOW_CONNECTIONS false``) and the
    worker's existing sessions are terminated (``pg_terminate_backend``). The worker's writes
    fail, are retried (bounded), and the run fails ``audit_write_failed``
    once the database is back for the terminal transaction.

    Runs on a worker of its own with a short pool timeout and a long lease,
    so the lease cannot expire during the outage (that path is R-RUN-7)."""
    db = connection.settings_dict["NAME"]
    for worker in list(stack.workers):
        worker.stop()
        stack.workers.remove(worker)
    stack.start_worker(name="r-run-8", env={"DB_POOL_TIMEOUT_SECONDS": "1", "LEASE_TTL_SECONDS": "60"})
    worker = stack.workers[-1]
    try:
        with stack.client(bearer(user)) as client:
            thread_id = _thread(client, "replay:slow_answer")
            run_id = _submit(client, thread_id, "db-down-1")
            _wait_for_running_model_row(run_id)
            # The worker's Django sessions: named after the session tag its
            # lease owner names (R-RUN-14).
            owner = AgentRun.objects.values_list("lease_owner", flat=True).get(pk=run_id)
            app_name = f"{WORKER_APPLICATION_NAME} {session_tag_of(owner)}"
            # A database cannot refuse connections to itself from inside:
            # switch it from the maintenance database.
            with _maintenance_connection() as admin:
                admin.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS false')
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
                    [db, app_name],
                )
                try:
                    worker.wait_for_line("terminal write failed, retrying while the lease lasts")
                finally:
                    admin.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS true')
            body = wait_for_status(client, run_id, TERMINAL)
    finally:
        worker.stop()
        stack.workers.remove(worker)
        stack.start_worker()
    assert (body["status"], body["error_type"]) == ("failed", "audit_write_failed"), body
    assert "OperationalError" in body["error_message"]
    (row,) = Message.objects.model_calls().filter(run_id=run_id)
    assert row.execution_status == "failed" and row.metadata["usage_unknown"] is True
