"""A worker told to stop hands its runs over at once (R-RUN-15): each run
stops at its next step boundary — a running tool is waited for, so that
its outcome is known — and goes back to ``pending`` as its next attempt in
one lease-fenced transaction; another worker continues it from its last
checkpoint. The real runner, agent and replay model server, in process;
the stop is this process's hand-over flag, or the signal a stopping
worker's main process sends its pool processes."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from audit.execution import shutdown
from audit.execution.runner import run_execute
from audit.models import AgentRun
from conversations.models import Message
from core.config import get_config
from core.redis_client import stream_key
from tests.conftest import run_in_a_thread
from tests.waiting import WAIT_SECONDS

pytestmark = pytest.mark.django_db(transaction=True)

Status = AgentRun.Status


@pytest.fixture(autouse=True)
def no_handover_left():
    shutdown.clear_handover()
    yield
    shutdown.clear_handover()


def _rows(run, **filters):
    return Message.objects.audit().filter(run=run, **filters)


def _wait(worker, result: dict, timeout: float = 60) -> str:
    worker.join(timeout)
    assert not worker.is_alive(), "the run did not stop"
    return result["status"]


def _streamed(run) -> bool:
    """Whether the run's live events have a chunk of its answer."""
    client = redis.Redis.from_url(get_config().REDIS_URL)
    try:
        return any(fields[b"type"] == b"model.delta" for _, fields in client.xrange(stream_key(run.id)))
    finally:
        client.close()


def test_a_stopping_worker_hands_a_streaming_run_over_and_another_worker_completes_it_R_RUN_15(user, replay_models):
    run, worker, result = run_in_a_thread(user, "worker-a", model="replay:slow_answer", until=_streamed)
    shutdown.request_handover()
    assert _wait(worker, result) == "handed_over"
    run.refresh_from_db()
    assert (run.status, run.attempt, run.lease_owner, run.lease_expires_at) == (Status.PENDING, 2, None, None)
    (cut,) = _rows(run, role="assistant")
    assert cut.execution_status == "interrupted" and cut.metadata["closed_by"] == "recovery"
    # What the cut call streamed before the hand-over is kept (R-MA-10).
    assert cut.content and cut.metadata["content_partial"] is True and cut.duration_ms is not None

    shutdown.clear_handover()  # another worker, not stopping
    assert run_execute(run_id=run.id, owner="worker-b") == "completed"
    run.refresh_from_db()
    assert run.attempt == 2 and run.output_message.attempt == 2


def test_a_running_tool_is_waited_for_before_the_run_is_handed_over_and_is_not_run_again_R_RUN_15_R_EFF_1(
    user, replay_models
):
    run, worker, result = run_in_a_thread(
        user, "worker-a", model="replay:slow_lookup_then_slow_answer", until=lambda r: _rows(r, role="tool").exists()
    )
    shutdown.request_handover()
    assert _wait(worker, result) == "handed_over"
    run.refresh_from_db()
    assert (run.status, run.attempt) == (Status.PENDING, 2)
    (lookup,) = _rows(run, role="tool")
    # Not cut: its outcome is known, so the next attempt never runs it blindly.
    assert lookup.execution_status == "completed" and "outcome_unknown" not in lookup.metadata

    shutdown.clear_handover()
    assert run_execute(run_id=run.id, owner="worker-b") == "completed"
    executions = _rows(run, role="tool", operation_id="call_lookup_slow", replayed_from__isnull=True)
    assert executions.count() == 1


def test_with_RUN_RECOVERY_fail_a_stopping_worker_finishes_its_run_R_RUN_15(user, replay_models, monkeypatch):
    monkeypatch.setattr(get_config(), "RUN_RECOVERY", "fail")
    run, worker, result = run_in_a_thread(
        user, "worker-a", model="replay:slow_answer", until=lambda r: _rows(r, role="assistant").exists()
    )
    shutdown.request_handover()
    assert _wait(worker, result) == "completed"
    run.refresh_from_db()
    assert run.attempt == 1


def test_the_stopping_workers_signal_asks_this_process_to_hand_its_runs_over_R_RUN_15():
    previous = signal.getsignal(shutdown.HANDOVER_SIGNAL)
    try:
        shutdown.install_handover_handler()
        assert shutdown.signal_pool_processes([os.getpid()]) == [], "a process never signals itself"
        os.kill(os.getpid(), shutdown.HANDOVER_SIGNAL)
        deadline = time.monotonic() + WAIT_SECONDS
        while not shutdown.handover_requested():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        signal.signal(shutdown.HANDOVER_SIGNAL, previous)
