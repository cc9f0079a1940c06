"""Runs under concurrency, expiry, cancellation and FIFO, on real
PostgreSQL with separate connections (one per thread) and real Redis
(R-RUN-2, R-RUN-3, R-RUN-4, R-RUN-6, R-RUN-7, R-MA-6..9)."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time

import psycopg
import pytest
import redis
from django.conf import settings
from django.db import connection, transaction
from django.test import Client
from django.utils import timezone

from audit import ledger
from audit.errors import LeaseLost, RunNotCancellable, RunNotStartable, RunTerminal
from audit.ledger.cancellation import CancelSignalListener, cancel_key, cancel_signal_send
from audit.ledger.lease import Lease
from audit.ledger.runs import _acquire_checked, run_acquire_with_row
from audit.models import AgentRun, RunCancelRequest, RunRollback
from conversations.models import Conversation, Message
from tests.conftest import acquire, bearer, make_run, prepared_executed_since, prepared_executions, resume_row_of
from tests.waiting import WAIT_SECONDS

pytestmark = pytest.mark.django_db(transaction=True)

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
USAGE = {"input_tokens": 3, "output_tokens": 4, "total_tokens": 7}


def _in_thread(fn, *args, **kwargs):
    """Run ``fn`` in its own thread, hence its own database connection."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed back to the test
            result["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=target)
    thread.start()
    return thread, result


# --------------------------------------------------------------------------
# R-RUN-3 / R-RUN-4: two workers race for one run
# --------------------------------------------------------------------------


def test_two_workers_racing_for_one_run_exactly_one_owns_it_and_the_loser_writes_nothing_R_RUN_3_R_RUN_4(thread):
    run = make_run(thread)
    barrier = threading.Barrier(8)

    def contender(i):
        barrier.wait()
        return ledger.run_acquire(run_id=run.id, owner=f"worker-{i}", ttl_seconds=60)

    started = [_in_thread(contender, i) for i in range(8)]
    for t, _ in started:
        t.join(10)
    leases = [r["value"] for _, r in started if "value" in r]
    refusals = [r["error"] for _, r in started if "error" in r]
    assert len(leases) == 1 and len(refusals) == 7
    assert all(isinstance(e, RunNotStartable) for e in refusals)
    winner = leases[0]
    run.refresh_from_db()
    assert run.lease_owner == winner.owner and run.fencing_token == winner.fencing_token == 1

    # A loser that writes anyway, with its own name and the current token
    # (or the winner's name with a stale token), is refused and leaves no row.
    loser = "worker-7" if winner.owner != "worker-7" else "worker-6"
    for forged in (
        Lease(run.id, run.request_id, run.thread_id, loser, winner.fencing_token),
        Lease(run.id, run.request_id, run.thread_id, winner.owner, winner.fencing_token - 1),
    ):
        with pytest.raises(LeaseLost):
            ledger.model_call_start(lease=forged, operation_id="lc_run--loser", sequence=2, started_at=T0)
    assert not Message.objects.filter(run=run, role="assistant").exists()


# --------------------------------------------------------------------------
# R-RUN-7: lease expiry and the sweeper
# --------------------------------------------------------------------------


@pytest.mark.usefixtures("recovery_fail")
def test_sweeper_fails_expired_runs_and_closes_their_rows_in_one_transaction_R_RUN_7(thread):
    run = make_run(thread)
    lease = acquire(run, ttl=60)
    ledger.model_call_start(lease=lease, operation_id="lc_run--done", sequence=2, started_at=T0)
    ledger.model_call_finish(
        lease=lease,
        operation_id="lc_run--done",
        content="ok",
        tool_calls=[],
        usage=USAGE,
        finished_at=T0,
        duration_ms=5,
    )
    ledger.model_call_start(lease=lease, operation_id="lc_run--cut", sequence=9, started_at=T0)
    live = make_run(thread.__class__.objects.create(user=thread.user, agent_id="assistant", model="replay:x"))
    live_lease = acquire(live, ttl=600)

    assert ledger.run_sweep_expired_leases() == [], "a live lease is not swept"
    swept = ledger.run_sweep_expired_leases(now=timezone.now() + dt.timedelta(seconds=61))
    assert swept == [run.id]

    run.refresh_from_db()
    assert (run.status, run.error_type) == ("failed", "lease_expired")
    assert run.lease_expires_at is None and run.finished_at is not None
    rows = {m.operation_id: m for m in Message.objects.filter(run=run, role="assistant")}
    assert rows["lc_run--done"].execution_status == "completed" and rows["lc_run--done"].usage == USAGE
    assert rows["lc_run--cut"].execution_status == "failed"
    assert rows["lc_run--cut"].usage is None and rows["lc_run--cut"].metadata["usage_unknown"] is True
    assert run.usage == {**USAGE, "unknown_calls": 1}

    # The crashed worker comes back: it can write nothing.
    with pytest.raises(RunTerminal):
        ledger.model_call_finish(
            lease=lease,
            operation_id="lc_run--cut",
            content="late",
            tool_calls=[],
            usage=USAGE,
            finished_at=T0,
            duration_ms=5,
        )
    with pytest.raises(RunTerminal):
        ledger.lease_renew(lease=lease, ttl_seconds=60)
    rows["lc_run--cut"].refresh_from_db()
    assert rows["lc_run--cut"].execution_status == "failed" and rows["lc_run--cut"].content == ""
    live.refresh_from_db()
    assert live.status == "running" and live_lease.fencing_token == live.fencing_token


def test_sweeper_skips_a_run_whose_row_is_locked_and_takes_it_later_R_RUN_7(thread):
    """SKIP LOCKED: a sweep never waits behind an owner's write in progress."""
    run = make_run(thread)
    acquire(run, ttl=60)
    later = timezone.now() + dt.timedelta(seconds=120)
    locked, release = threading.Event(), threading.Event()

    def hold_lock():
        with transaction.atomic():
            AgentRun.objects.select_for_update().get(pk=run.id)
            locked.set()
            release.wait(10)

    holder, _ = _in_thread(hold_lock)
    assert locked.wait(10)
    try:
        assert ledger.run_sweep_expired_leases(now=later) == []
    finally:
        release.set()
        holder.join(10)
    assert ledger.run_sweep_expired_leases(now=later) == [run.id]


# --------------------------------------------------------------------------
# R-RUN-2: FIFO per thread
# --------------------------------------------------------------------------


def test_runs_of_one_thread_start_in_submission_order_R_RUN_2(thread):
    first, second, third = make_run(thread), make_run(thread), make_run(thread)
    with pytest.raises(RunNotStartable):
        acquire(second)
    with pytest.raises(RunNotStartable):
        acquire(third)
    lease = acquire(first)
    with pytest.raises(RunNotStartable):
        acquire(third)
    ledger.run_finish(lease=lease, status="completed")
    with pytest.raises(RunNotStartable):
        acquire(third)  # second was submitted earlier
    ledger.run_finish(lease=acquire(second), status="failed", error_type="agent_error")
    assert acquire(third).fencing_token == 1


# The acquisition's one statement, as pg_prepared_statements shows it.
_ACQUIRE = 'UPDATE "audit_agentrun" AS r SET status = $1, lease_owner = $2%'


def test_the_usual_acquisition_is_one_statement_and_tells_a_threads_first_run_R_RUN_3(
    thread, django_assert_num_queries
):
    first = make_run(thread, text="first")
    before = prepared_executions(_ACQUIRE)
    # One statement, prepared (planned once per connection: planning cost
    # ten times its execution), nothing through the ORM.
    with django_assert_num_queries(1):
        lease, row = run_acquire_with_row(run_id=first.id, owner="worker-a", ttl_seconds=60)
    assert prepared_executed_since(before, _ACQUIRE) == [1]
    assert (row.status, row.lease_owner, row.fencing_token, row.input) == ("running", "worker-a", 1, {"text": "first"})
    assert lease.fencing_token == 1 and row.started_at is not None and row.lease_expires_at > row.started_at
    assert row.thread_has_earlier_run is False
    ledger.run_finish(lease=lease, status="completed")
    second = make_run(thread, text="second")
    before = prepared_executions(_ACQUIRE)
    with django_assert_num_queries(1):
        _, row = run_acquire_with_row(run_id=second.id, owner="worker-a", ttl_seconds=60)
    assert prepared_executed_since(before, _ACQUIRE) == [1]
    assert row.thread_has_earlier_run is True
    assert row.input == {"text": "second"} and row.thread_id == thread.id
    # Not pending any more: the full check names the reason.
    with pytest.raises(RunNotStartable):
        acquire(second)


@pytest.mark.parametrize("path", ["one statement", "full check"])
def test_the_acquisition_tells_whether_a_run_of_the_thread_was_rolled_back_R_API_2(thread, path):
    """The run's start reads the thread's rollbacks only when it has one
    (almost never): the acquisition tells, in the statement that takes the
    run."""

    def acquired(run) -> AgentRun:
        if path == "one statement":
            return run_acquire_with_row(run_id=run.id, owner="worker-a", ttl_seconds=60)[1]
        now = timezone.now()
        return _acquire_checked(run_id=run.id, owner="worker-a", expires_at=now + dt.timedelta(seconds=60), now=now)

    ledger.run_finish(lease=acquire(make_run(thread, text="first")), status="completed")
    second = make_run(thread, text="second")
    row = acquired(second)
    assert (row.thread_has_earlier_run, row.thread_has_rollback) == (True, False)
    AgentRun.objects.filter(pk=second.pk).update(status="completed")  # how it ends does not matter here
    pending = make_run(thread, text="rolled back")
    instead, _ = ledger.run_submit(
        user=thread.user, thread_id=thread.id, request_id="instead", text="instead", multitask_strategy="rollback"
    )
    assert RunRollback.objects.filter(run_id=pending.id, by_run=instead).exists()
    assert acquired(instead).thread_has_rollback is True
    # Only the runs of the thread count.
    other = Conversation.objects.create(user=thread.user, agent_id="assistant", model=thread.model)
    assert acquired(make_run(other, text="elsewhere")).thread_has_rollback is False


@pytest.mark.parametrize("path", ["one statement", "full check"])
def test_a_later_turn_is_never_recorded_as_started_before_the_turn_it_waited_for_ended_R_RUN_2(thread, path):
    """The worker reads its clock before it reaches the run row (a pool
    connection, a row lock may be waited for meanwhile): the turn it waited
    for may end in that gap. Seen in the fault suite: a later turn's
    ``started_at`` a few ms before the earlier turn's ``finished_at``."""
    first, second = make_run(thread, text="first"), make_run(thread, text="second")
    started = timezone.now() - dt.timedelta(seconds=5)
    lease, row = run_acquire_with_row(run_id=first.id, owner="worker-a", ttl_seconds=60, now=started)
    # With no other turn's end after it, the start is the clock's reading.
    assert row.started_at == started
    clock_read = timezone.now()
    ledger.run_finish(lease=lease, status="completed")
    first.refresh_from_db()
    assert first.finished_at > clock_read
    if path == "one statement":
        _, row = run_acquire_with_row(run_id=second.id, owner="worker-b", ttl_seconds=60, now=clock_read)
    else:
        row = _acquire_checked(
            run_id=second.id, owner="worker-b", expires_at=clock_read + dt.timedelta(seconds=60), now=clock_read
        )
    row.refresh_from_db()
    assert row.status == "running" and row.started_at == first.finished_at


def test_a_run_whose_row_lock_was_waited_for_never_starts_before_the_turn_that_ended_meanwhile_R_RUN_2(thread, db_name):
    """The full check locks the pending run's row; its statement reads the
    snapshot taken before it waited for the lock, the blocking check after
    it a later one. A turn that ends while the lock is waited for is over
    for the check, and must be over for the recorded start too."""
    first, second = make_run(thread, text="first"), make_run(thread, text="second")
    lease = acquire(first)
    clock_read = timezone.now()
    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres") as holder:
        # Someone holds the second run's row (the dispatcher, a cancel...).
        holder.execute("SELECT 1 FROM audit_agentrun WHERE id = %s FOR NO KEY UPDATE", [second.id])
        waiter, result = _in_thread(
            _acquire_checked,
            run_id=second.id,
            owner="worker-b",
            expires_at=clock_read + dt.timedelta(seconds=60),
            now=clock_read,
        )
        deadline = time.monotonic() + WAIT_SECONDS
        while not holder.execute(
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone():
            assert time.monotonic() < deadline and waiter.is_alive(), result
            time.sleep(0.01)
        ledger.run_finish(lease=lease, status="completed")  # the first turn ends meanwhile
        holder.rollback()
    waiter.join(10)
    assert "value" in result, result
    first.refresh_from_db()
    second.refresh_from_db()
    assert second.status == "running" and second.started_at == first.finished_at


def test_runs_of_different_threads_proceed_in_parallel_R_RUN_2(thread):
    other = thread.__class__.objects.create(user=thread.user, agent_id="assistant", model="replay:x")
    a, b = make_run(thread), make_run(other)
    assert acquire(a) and acquire(b, owner="worker-b")


def test_an_interrupted_run_holds_the_thread_until_its_resume_ends_R_RUN_2(thread):
    first = make_run(thread)
    lease = acquire(first)
    waiting = make_run(thread)  # submitted while the first still runs
    ledger.run_finish(lease=lease, status="interrupted", interrupts=[{"id": "i1", "value": {}}])
    with pytest.raises(RunNotStartable):
        acquire(waiting)
    # The resume of the first turn was created after ``waiting`` but keeps
    # its turn's place: it starts, ``waiting`` still waits until it ends.
    resume = resume_row_of(first)
    resume_lease = acquire(resume)
    with pytest.raises(RunNotStartable):
        acquire(waiting)
    ledger.run_finish(lease=resume_lease, status="completed")
    assert acquire(waiting)


def test_cancelling_a_waiting_run_cancels_it_without_it_ever_starting_R_RUN_2_R_RUN_6(thread):
    first = make_run(thread)
    lease = acquire(first)
    waiting = make_run(thread)
    cancelled = ledger.run_request_cancel(user=thread.user, run_id=waiting.id)
    assert cancelled.status == "cancelled" and cancelled.started_at is None
    ledger.run_finish(lease=lease, status="completed")
    with pytest.raises(RunNotStartable):
        acquire(waiting)
    waiting.refresh_from_db()
    assert waiting.status == "cancelled" and waiting.started_at is None and waiting.fencing_token == 0


# --------------------------------------------------------------------------
# R-RUN-6: cancellation requests and the Redis signal
# --------------------------------------------------------------------------


def test_cancel_of_a_running_run_requests_it_and_signals_the_worker_R_RUN_6(thread):
    run = make_run(thread)
    lease = acquire(run)
    client = redis.Redis.from_url(settings.CONFIG.REDIS_URL)
    client.delete(cancel_key(run.id))

    async def listen_then_cancel():
        listener = CancelSignalListener(run.id)
        assert await listener.wait(0.05) is False  # nothing yet
        waiter = asyncio.create_task(listener.wait(20))
        await asyncio.sleep(0.2)
        from asgiref.sync import sync_to_async

        await sync_to_async(ledger.run_request_cancel)(user=thread.user, run_id=run.id)
        began = time.monotonic()
        signalled = await waiter
        await listener.close()
        return signalled, time.monotonic() - began

    signalled, waited = asyncio.run(listen_then_cancel())
    assert signalled is True
    print(f"cancel signal reached the listener after {waited * 1000:.0f} ms")
    run.refresh_from_db()
    assert run.status == "cancel_requested" and run.cancel_requested_at is not None
    assert client.exists(cancel_key(run.id))
    # The worker ends it: cancelled, running rows interrupted.
    ledger.model_call_start(lease=lease, operation_id="lc_run--c", sequence=2, started_at=T0)
    ended = ledger.run_finish(lease=lease, status="cancelled", error_type="cancelled")
    row = Message.objects.get(run=run, operation_id="lc_run--c")
    assert ended.status == "cancelled" and row.execution_status == "interrupted"
    assert row.metadata["usage_unknown"] is True


def test_a_signal_sent_before_the_listener_subscribes_is_not_lost_R_RUN_6(thread):
    run = make_run(thread)
    cancel_signal_send(run_id=run.id)

    async def listen():
        listener = CancelSignalListener(run.id)
        try:
            first = await listener.wait(5)
            second = await listener.wait(0.05)  # a stale key is reported once only
            return first, second
        finally:
            await listener.close()

    assert asyncio.run(listen()) == (True, False)


def test_a_first_wait_without_a_signal_lasts_its_timeout_R_RUN_6(thread):
    """The subscription's own confirmation is no signal and no reason to
    return early: the worker's lease keeper would poll the database at the
    start of every run."""
    run = make_run(thread)
    redis.Redis.from_url(settings.CONFIG.REDIS_URL).delete(cancel_key(run.id))

    async def listen():
        listener = CancelSignalListener(run.id)
        try:
            began = time.monotonic()
            signalled = await listener.wait(0.5)
            return signalled, time.monotonic() - began
        finally:
            await listener.close()

    signalled, waited = asyncio.run(listen())
    assert signalled is False
    assert waited >= 0.45, f"the first wait returned after {waited * 1000:.0f} ms"


@pytest.mark.parametrize("status", ["completed", "failed"])
def test_cancel_on_a_run_that_ended_is_refused_and_changes_nothing_R_RUN_6(thread, status):
    run = make_run(thread)
    outcome = {"error_type": "model_error"} if status == "failed" else {}
    ledger.run_finish(lease=acquire(run), status=status, **outcome)
    run.refresh_from_db()
    before = (run.status, run.updated_at, run.error_type)
    with pytest.raises(RunNotCancellable) as refused:
        ledger.run_request_cancel(user=thread.user, run_id=run.id)
    assert refused.value.extra == {"status": status}
    run.refresh_from_db()
    assert (run.status, run.updated_at, run.error_type) == before
    assert not RunCancelRequest.objects.filter(run_id=run.id).exists()
    # Over HTTP: a 409 with a machine-readable body, as resume answers.
    answer = Client().post(f"/api/runs/{run.id}/cancel", headers=bearer(thread.user))
    assert answer.status_code == 409, answer.content
    assert answer.json()["error"]["code"] == "run_not_cancellable"
    assert answer.json()["error"]["status"] == status


def test_cancel_on_an_interrupted_run_that_was_resumed_names_the_resume_R_RUN_6(thread):
    first = make_run(thread)
    ledger.run_finish(lease=acquire(first), status="interrupted", interrupts=[{"id": "i1", "value": {}}])
    resume = resume_row_of(first)
    answer = Client().post(f"/api/runs/{first.id}/cancel", headers=bearer(thread.user))
    assert answer.status_code == 409, answer.content
    error = answer.json()["error"]
    assert (error["code"], error["status"], error["resumed_by"]) == (
        "run_not_cancellable",
        "interrupted",
        str(resume.id),
    )
    first.refresh_from_db()
    assert first.status == "interrupted"


def test_a_repeated_cancel_is_answered_with_the_cancelled_run_R_RUN_6(thread):
    run = make_run(thread)
    headers = bearer(thread.user)
    first = Client().post(f"/api/runs/{run.id}/cancel", headers=headers)
    assert (first.status_code, first.json()["status"]) == (202, "cancelled")
    run.refresh_from_db()
    again = Client().post(f"/api/runs/{run.id}/cancel", headers=headers)
    assert (again.status_code, again.json()) == (202, first.json())
    assert AgentRun.objects.get(pk=run.id).updated_at == run.updated_at


# --------------------------------------------------------------------------
# R-MA-6..9: terminal reconcile
# --------------------------------------------------------------------------


def _call(lease, op, seq, *, content="", usage=USAGE, finish=True, tool_calls=()):
    ledger.model_call_start(lease=lease, operation_id=op, sequence=seq, started_at=T0 + dt.timedelta(seconds=seq))
    if finish:
        ledger.model_call_finish(
            lease=lease,
            operation_id=op,
            content=content,
            tool_calls=list(tool_calls),
            usage=usage,
            finished_at=T0 + dt.timedelta(seconds=seq + 1),
            duration_ms=1000,
        )


def _ai(op, content="", tool_calls=()):
    return ledger.StateMessage(kind="ai", id=op, content=content, tool_calls=list(tool_calls))


def test_second_run_of_a_thread_neither_duplicates_nor_binds_the_first_runs_operations_R_MA_9(thread):
    first = make_run(thread)
    lease = acquire(first)
    _call(lease, "lc_run--one", 2, content="first answer")
    first = ledger.run_finish(lease=lease, status="completed", final_state=[_ai("lc_run--one", "first answer")])
    assert first.output_message.operation_id == "lc_run--one"

    second = make_run(thread)
    lease = acquire(second)
    # The checkpoint still holds the first run's answer. Even when the
    # caller cannot tell which ids were there before (no prior ids), the
    # first run's operation neither binds nor is copied into this run.
    state = [
        ledger.StateMessage(kind="human", id="h1"),
        _ai("lc_run--one", "first answer"),
        ledger.StateMessage(kind="human", id="h2"),
    ]
    second = ledger.run_finish(lease=lease, status="completed", final_state=state)
    assert second.output_message_id is None
    assert not Message.objects.filter(run=second, role="assistant").exists()
    assert Message.objects.filter(thread=thread, operation_id="lc_run--one").count() == 1


def test_reconcile_completes_rows_inserts_missed_calls_and_keeps_stream_timing_R_MA_6(thread):
    run = make_run(thread)
    lease = acquire(run)
    _call(lease, "lc_run--tool", 2, content="", tool_calls=[{"id": "c1", "name": "get_weather", "args": {}}])
    _call(lease, "lc_run--cut", 8, finish=False)  # the stream lost its finish
    row_before = Message.objects.get(run=run, operation_id="lc_run--tool")
    state = [
        ledger.StateMessage(kind="human", id="h"),
        _ai("lc_run--tool", "older text"),
        _ai("lc_run--cut", "the State has it"),
        _ai("lc_run--tool", "let me check", [{"id": "c1", "name": "get_weather", "args": {}}]),  # last one counts
        _ai("lc_run--missed", "final answer"),
    ]
    run = ledger.run_finish(lease=lease, status="completed", final_state=state)
    rows = {m.operation_id: m for m in Message.objects.filter(run=run, role="assistant")}
    assert set(rows) == {"lc_run--tool", "lc_run--cut", "lc_run--missed"}
    tool = rows["lc_run--tool"]
    assert tool.metadata["state_reconciled"] is True and tool.content == "let me check"
    assert (tool.sequence, tool.started_at, tool.duration_ms) == (
        row_before.sequence,
        row_before.started_at,
        row_before.duration_ms,
    )
    assert rows["lc_run--cut"].execution_status == "completed" and rows["lc_run--cut"].sequence == 8
    assert rows["lc_run--cut"].content == "the State has it"
    missed = rows["lc_run--missed"]
    assert missed.execution_status == "completed" and missed.metadata["state_reconciled"] is True
    assert missed.sequence is None and missed.started_at is None
    assert run.output_message_id == missed.id and missed.message_type == "text"
    # Run again (a replayed terminal is refused, nothing inserted twice).
    with pytest.raises(RunTerminal):
        ledger.run_finish(lease=lease, status="completed", final_state=state)
    assert Message.objects.filter(run=run, role="assistant").count() == 3


def test_an_interrupted_run_never_falls_back_to_an_earlier_row_R_MA_8(thread):
    run = make_run(thread)
    lease = acquire(run)
    _call(lease, "lc_run--early", 2, content="early")
    state = [_ai("lc_run--early", "early"), _ai("lc_run--unproven", "")]
    # The last AIMessage of the State is not proven by this run's audit (its
    # id is unstable / from elsewhere): the earlier row is not bound instead.
    Message.objects.create(
        thread=thread,
        role="assistant",
        message_type="model_audit",
        operation_id="lc_run--unproven",
        run=make_run(thread.__class__.objects.create(user=thread.user, agent_id="assistant", model="x")),
        execution_status="completed",
    )
    run = ledger.run_finish(lease=lease, status="interrupted", final_state=state, interrupts=[{"id": "i"}])
    assert run.output_message_id is None
    assert Message.objects.get(run=run, operation_id="lc_run--early").message_type == "model_audit"


@pytest.mark.parametrize(
    ("status", "closed_as"),
    [("failed", "failed"), ("cancelled", "interrupted"), ("interrupted", "interrupted"), ("completed", "abandoned")],
)
def test_terminal_closes_running_rows_by_run_status_R_MA_7(thread, status, closed_as):
    run = make_run(thread)
    lease = acquire(run)
    _call(lease, "lc_run--open", 2, finish=False)
    ledger.run_finish(lease=lease, status=status)
    row = Message.objects.get(run=run, operation_id="lc_run--open")
    assert row.execution_status == closed_as
    assert row.usage is None and row.metadata["usage_unknown"] is True
