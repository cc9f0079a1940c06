"""The worker side under a lost lease, in process with the replay model
server: a takeover mid-stream stops the run before any further model step
and the old owner writes nothing more (R-RUN-4, R-MA-3)."""

from __future__ import annotations

import asyncio
import time

import pytest
from django.db import connection
from django.db.models import F

from audit.execution import recorder as recorder_module
from audit.execution.checkpoint import CHECKPOINTER_APPLICATION_NAME
from audit.execution.recorder import LifecycleRecorder
from audit.models import AgentRun
from conversations.models import Message
from tests.conftest import run_in_a_thread
from tests.waiting import WAIT_SECONDS

pytestmark = pytest.mark.django_db(transaction=True)


def _slow_run_in_a_thread(user, owner: str, *, until) -> tuple:
    """A ``slow_tool_then_answer`` run: :func:`tests.conftest.run_in_a_thread`."""
    return run_in_a_thread(user, owner, model="replay:slow_tool_then_answer", until=until)


def test_a_takeover_mid_stream_stops_the_run_before_any_further_model_step_R_RUN_4(user, replay_models):
    run, worker, result = _slow_run_in_a_thread(
        user,
        "worker-old",
        until=lambda run: Message.objects.model_calls().filter(run=run, execution_status="running").exists(),
    )
    # Another owner takes the run over (a newer fencing token).
    AgentRun.objects.filter(pk=run.id).update(lease_owner="worker-new", fencing_token=F("fencing_token") + 1)
    worker.join(30)
    assert result["status"] == "lease_lost"

    run.refresh_from_db()
    assert (run.status, run.lease_owner, run.fencing_token) == ("running", "worker-new", 2), (
        "the old owner wrote nothing"
    )
    rows = list(Message.objects.filter(run=run).exclude(role="user"))
    assert len(rows) == 1, "no tool ran and no second model call started"
    assert rows[0].execution_status == "running" and rows[0].usage is None


def _event(seq, payload, run_id="r1"):
    return {
        "type": "event",
        "method": "messages",
        "seq": seq,
        "params": {"namespace": [], "timestamp": 1_800_000_000_000, "data": (payload, {"run_id": run_id})},
    }


def test_a_replayed_start_keeps_the_original_monotonic_start_and_content_R_MA_3_R_MA_4(monkeypatch):
    now = [10.0]
    calls: list[tuple[str, dict]] = []

    async def recorded(fn, /, **kwargs):
        calls.append((fn.__name__, kwargs))

    monkeypatch.setattr(recorder_module, "write_with_retry", recorded)
    recorder = LifecycleRecorder(lease=None, clock=lambda: now[0])
    start = _event(2, {"event": "message-start", "role": "ai", "id": "lc_run--r1"})

    async def feed():
        await recorder.handle(start)
        await recorder.handle(
            _event(3, {"event": "content-block-delta", "index": 0, "delta": {"type": "text-delta", "text": "Hel"}})
        )
        now[0] = 15.0
        await recorder.handle(start)  # replayed start
        await recorder.handle(
            _event(4, {"event": "content-block-delta", "index": 0, "delta": {"type": "text-delta", "text": "lo"}})
        )
        now[0] = 20.5
        await recorder.handle(
            _event(5, {"event": "message-finish", "usage": {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3}})
        )
        await recorder.handle(
            _event(5, {"event": "message-finish", "usage": {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3}})
        )

    asyncio.run(feed())
    finishes = [kw for name, kw in calls if name == "model_call_finish"]
    assert len(finishes) == 1, "usage is reported once per call"
    assert finishes[0]["content"] == "Hello"
    assert finishes[0]["duration_ms"] == 10500, "duration from the first monotonic start"
    assert [kw["sequence"] for name, kw in calls if name == "model_call_start"] == [2, 2]


def test_a_run_whose_checkpointer_lost_its_connection_reconnects_and_completes_R_RUN_8(user, replay_models, db_name):
    """A dropped connection (a database restart) costs the checkpointer a
    retry on a new connection, not the run: it completes, its State is
    saved, and no audit row stays running."""
    import psycopg

    # Once the second model call streams (for seconds), the checkpointer's
    # connection waits idle for its next write.
    run, worker, result = _slow_run_in_a_thread(
        user, "worker-a", until=lambda run: Message.objects.model_calls().filter(run=run).count() >= 2
    )
    connection.close()
    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres", autocommit=True) as admin:
        ended = admin.execute(
            "SELECT count(*) FILTER (WHERE application_name = %s), count(*) FROM ("
            "  SELECT application_name, pg_terminate_backend(pid) FROM pg_stat_activity"
            "  WHERE datname = %s AND pid <> pg_backend_pid()) AS ended",
            [CHECKPOINTER_APPLICATION_NAME, db_name],
        ).fetchone()
    assert ended[0] == 1, f"the run's checkpointer connection was among those ended: {ended}"
    worker.join(60)
    assert result["status"] == "completed"
    run.refresh_from_db()
    assert (run.status, run.error_type) == ("completed", "")
    assert not Message.objects.filter(run=run, execution_status="running").exists()
    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres") as admin:
        saved = admin.execute(
            "SELECT count(*) FROM checkpoints WHERE thread_id = %s AND metadata->>'step' = %s",
            [str(run.thread_id), str(_last_step(admin, run.thread_id))],
        ).fetchone()[0]
    assert saved == 1


def _last_step(admin, thread_id) -> int:
    return admin.execute(
        "SELECT max((metadata->>'step')::int) FROM checkpoints WHERE thread_id = %s", [str(thread_id)]
    ).fetchone()[0]


def test_a_run_whose_checkpointer_stays_unable_to_write_fails_naming_the_database_R_RUN_8(
    user, replay_models, db_name, monkeypatch
):
    """A checkpointer fault that outlasts the retries fails the run as a
    checkpoint error, not as the agent's, and no audit row stays running.
    The checkpoint table is locked and every checkpointer connection that
    waits on it is ended, again and again, while the audit still writes."""
    import psycopg

    from core.config import get_config

    monkeypatch.setattr(get_config(), "AUDIT_WRITE_ATTEMPTS", 3)
    run, worker, result = _slow_run_in_a_thread(
        user, "worker-a", until=lambda run: Message.objects.model_calls().filter(run=run).count() >= 2
    )
    connection.close()
    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres") as holder:
        holder.execute("LOCK TABLE checkpoints, checkpoint_writes, checkpoint_blobs IN ACCESS EXCLUSIVE MODE")
        with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres", autocommit=True) as admin:
            deadline = time.monotonic() + WAIT_SECONDS
            while worker.is_alive() and time.monotonic() < deadline:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = %s AND application_name = %s AND pid <> pg_backend_pid()",
                    [db_name, CHECKPOINTER_APPLICATION_NAME],
                )
                time.sleep(0.02)
        holder.rollback()
    worker.join(60)
    assert result["status"] == "failed"
    run.refresh_from_db()
    assert run.error_type == "checkpoint_error:OperationalError", run.error_message
    assert not Message.objects.filter(run=run, execution_status="running").exists()
