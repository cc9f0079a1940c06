"""The worker's audit writes on its event loop's thread (issue 11,
R-RUN-5): the usual lifecycle write is one prepared statement awaited on
the worker loop's own connection, given back idle; the terminal
transaction is prepared statements on a connection from the pool, checked
out for the call and given back; anything that needs the ORM — a write's
locked path, a reconcile that inserts — is made again in a thread, with
its named errors, and nothing is written twice."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import threading

import pytest
from asgiref.sync import sync_to_async
from django.db import DataError, connection, connections, transaction
from psycopg_pool import PoolTimeout

from audit import ledger
from audit.errors import LeaseLost
from audit.execution import recorder, writes
from audit.execution.worker_loop import awaited_connections, run_in_worker_loop
from audit.ledger import StateMessage
from audit.ledger.fenced import FencedWrite, fenced_service
from audit.ledger.lease import Lease, lock_run
from audit.models import AgentRun
from conversations.models import Message
from core.db import (
    AWAITED_APPLICATION_NAME,
    AwaitedConnections,
    NeedsThread,
    call_with_pooled_statements,
    execute_prepared,
)
from dashboard import facts, rollups
from tests.conftest import acquire, make_run
from tests.dashboard.test_rollups import rollup_state
from tests.ops.test_metrics import delta, scrape

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def hops(monkeypatch) -> list[str]:
    """The names of the functions the runner sent to a thread (asgiref's
    ``sync_to_async``, still called: only watched)."""
    sent: list[str] = []

    def watched(fn, *args, **kwargs):
        hop = sync_to_async(fn, *args, **kwargs)

        async def call(*a, **k):
            sent.append(a[0].__name__ if a and callable(a[0]) else fn.__name__)
            return await hop(*a, **k)

        return call

    monkeypatch.setattr(writes, "sync_to_async", watched)
    return sent


def _on_loop(fn, /, **kwargs):
    """``fn`` written as the worker writes it: on this thread's worker loop."""

    async def go():
        return await writes.write_with_retry(fn, **kwargs)

    return run_in_worker_loop(go())


def _awaited_backends(db_name: str) -> list[str]:
    """The states of the awaited-write connections to ``db_name``."""
    import psycopg

    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres") as admin:
        rows = admin.execute(
            "SELECT state FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
            [db_name, AWAITED_APPLICATION_NAME],
        ).fetchall()
    return [state for (state,) in rows]


def _available() -> int:
    return connections["default"].pool.get_stats()["pool_available"]


def test_lifecycle_writes_are_awaited_on_the_loops_connection_and_give_it_back_idle_R_RUN_5(thread, hops, db_name):
    lease = acquire(make_run(thread))
    connection.close()
    available = _available()
    opened = _on_loop(ledger.model_call_start, lease=lease, operation_id="lc_run--a", sequence=1, started_at=T0)
    closed = _on_loop(
        ledger.model_call_finish,
        lease=lease,
        operation_id="lc_run--a",
        content="hi",
        tool_calls=None,
        usage={"input_tokens": 3, "output_tokens": 2},
        finished_at=T0,
        duration_ms=5,
    )
    assert hops == [], "a write that is one statement needs no thread"
    assert opened.pk == closed.pk and closed.execution_status == "completed" and closed.content == "hi"
    row = Message.objects.get(pk=closed.pk)
    assert (row.sequence, row.content, row.usage) == (1, "hi", {"input_tokens": 3, "output_tokens": 2})
    connection.close()
    assert _available() == available, "the pool is not the lifecycle writes'"
    assert _awaited_backends(db_name) == ["idle"], "one connection of the loop, given back idle and kept"


def test_a_write_whose_statement_wrote_nothing_takes_its_locked_path_in_a_thread_R_RUN_4(thread, hops):
    lease = acquire(make_run(thread))
    stale = Lease(lease.run_id, lease.request_id, lease.thread_id, "someone-else", lease.fencing_token)
    with pytest.raises(LeaseLost):
        _on_loop(ledger.model_call_start, lease=stale, operation_id="lc_run--b", sequence=1, started_at=T0)
    assert hops == ["model_call_start"]
    assert not Message.objects.audit().filter(operation_id="lc_run--b").exists()


def test_a_repeated_write_is_answered_by_its_locked_path_once_and_counts_no_error_R_OPS_1(thread, hops):
    """The repeat's statement writes nothing; the call is made again in a
    thread, where the idempotency rule returns the row unchanged. Stopping
    at the ORM on the loop is no write error."""
    lease = acquire(make_run(thread))
    first = _on_loop(ledger.model_call_start, lease=lease, operation_id="lc_run--c", sequence=4, started_at=T0)
    before = scrape()
    again = _on_loop(ledger.model_call_start, lease=lease, operation_id="lc_run--c", sequence=4, started_at=T0)
    after = scrape()
    assert hops == ["model_call_start"]
    assert again.pk == first.pk and again.sequence == 4
    assert Message.objects.audit().filter(operation_id="lc_run--c").count() == 1
    errors = [key for key in after if key[0] == "yuxi_audit_write_errors_total"]
    assert all(dict(labels).get("error") != "SynchronousOnlyOperation" for _, labels in errors)
    assert delta(before, after, "yuxi_audit_write_duration_seconds_count", kind="model_start") == 1


# The run-end counter's labels of a completed run of the ``thread`` fixture.
_FINISHED = {"status": "completed", "error_type": "", "model": "replay:tool_then_answer"}


def _open_and_close(lease, op: str, *, at: dt.datetime = T0) -> None:
    """A model call of the run at ``at``, opened, started and closed."""
    ledger.model_call_open(lease=lease, operation_id=op, sequence=1, started_at=at)
    ledger.model_call_start(lease=lease, operation_id=op, sequence=1, started_at=at)
    ledger.model_call_finish(
        lease=lease,
        operation_id=op,
        content="answer",
        tool_calls=[],
        usage={"input_tokens": 3, "output_tokens": 2, "total_tokens": 5},
        finished_at=at,
        duration_ms=5,
    )


def test_the_terminal_transaction_is_made_on_the_loop_in_one_transaction_R_RUN_5_R_MA_6(thread, hops):
    """The usual terminal transaction needs no thread: its lock and read,
    its row update and the run's end with the rollup and the commit are
    prepared statements on one pooled connection, one transaction; the
    commit hooks (metrics, the thread's next run) run after the commit, and
    the connection goes back to the pool idle."""
    lease = acquire(make_run(thread))
    _open_and_close(lease, "lc_run--t1")
    waiting = make_run(thread)  # the thread's next turn, pending behind this run
    connection.close()
    available = _available()
    before = scrape()
    state = [
        StateMessage(kind="human", id="h-1", content="hi"),
        StateMessage(kind="ai", id="lc_run--t1", content="answer"),
    ]
    run = _on_loop(ledger.run_finish, lease=lease, status="completed", final_state=state)
    after = scrape()
    assert hops == [], "the usual terminal transaction needs no thread"
    assert run.status == "completed" and run.output_message.operation_id == "lc_run--t1"
    stored = AgentRun.objects.get(pk=lease.run_id)
    # Sealed over its prompt and its one model call.
    assert (stored.status, stored.seal_row_count, stored.lease_expires_at) == ("completed", 2, None)
    assert stored.rolled_up_at is not None, "the rollup commits with the run's end"
    row = Message.objects.get(operation_id="lc_run--t1")
    assert row.metadata["state_reconciled"] and row.message_type == Message.Type.TEXT
    assert delta(before, after, "yuxi_runs_finished_total", **_FINISHED) == 1
    # The pending run of the thread was handed over after the commit (the
    # run's end stamps it in the same statement).
    assert AgentRun.objects.get(pk=waiting.pk).dispatched_at is not None
    connection.close()
    assert _available() == available
    conn = connections["default"].pool.getconn()
    try:
        assert conn.info.transaction_status == conn.info.transaction_status.IDLE
    finally:
        connections["default"].pool.putconn(conn)


def test_a_terminal_transaction_that_reaches_the_orm_on_the_loop_is_undone_and_made_in_a_thread_R_MA_6(thread, hops):
    """The State proves a call the stream never saw: inserting it needs the
    ORM. What the pooled transaction did before is rolled back, its commit
    hooks dropped, and the whole terminal transaction made again in a
    thread: the call is inserted once, the run ends once, its figures are
    rolled up once."""
    lease = acquire(make_run(thread))
    now = dt.datetime.now(dt.UTC)
    _open_and_close(lease, "lc_run--seen", at=now)
    before = scrape()
    state = [
        StateMessage(kind="human", id="h-1", content="hi"),
        StateMessage(kind="ai", id="lc_run--seen", content="answer"),
        StateMessage(kind="ai", id="lc_run--unseen", content="from the State"),
    ]
    run = _on_loop(ledger.run_finish, lease=lease, status="completed", final_state=state)
    after = scrape()
    assert hops == ["run_finish"]
    assert run.status == "completed"
    assert Message.objects.audit().filter(run_id=lease.run_id, operation_id="lc_run--unseen").count() == 1
    assert delta(before, after, "yuxi_runs_finished_total", **_FINISHED) == 1, "metrics once, after commit"
    incremental = rollup_state()
    rollups.rollups_rebuild(since=now.date())
    assert rollup_state() == incremental, "the run's figures are rolled up once"


def test_a_run_ending_on_the_loop_while_a_rollup_row_is_held_ends_at_once_unrolled_R_DASH_1(thread, hops, db_name):
    """A worker frozen in its terminal transaction holds the rollup rows of
    the hour: the run ending on the loop is not held up. Its rollup is undone
    to the savepoint, the commit that was queued behind it (and never ran)
    is sent again with the look for the thread's pending runs, and the run
    ends completed, not rolled up, its next turn handed over."""
    import psycopg

    from conversations.models import Conversation

    # A run of the same hour and model ended first: its rollup rows exist.
    earlier = acquire(make_run(Conversation.objects.create(user=thread.user, agent_id="assistant", model=thread.model)))
    _open_and_close(earlier, "lc_run--e")
    ledger.run_finish(lease=earlier, status="completed")
    lease = acquire(make_run(thread))
    _open_and_close(lease, "lc_run--h")
    waiting = make_run(thread)
    connection.close()
    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres") as frozen:
        frozen.execute(f"SELECT 1 FROM {facts.HOUR_TABLE} FOR UPDATE")
        frozen.execute(f"SELECT 1 FROM {facts.LATENCY_TABLE} FOR UPDATE")
        state = [StateMessage(kind="ai", id="lc_run--h", content="answer")]
        run = _on_loop(ledger.run_finish, lease=lease, status="completed", final_state=state)
        frozen.rollback()
    assert hops == [] and run.status == "completed"
    stored = AgentRun.objects.get(pk=lease.run_id)
    assert (stored.status, stored.rolled_up_at) == ("completed", None)
    assert AgentRun.objects.get(pk=waiting.pk).dispatched_at is not None
    assert rollups.rollups_catch_up() >= 1
    assert AgentRun.objects.get(pk=lease.run_id).rolled_up_at is not None


def test_a_terminal_transaction_that_fails_on_the_loop_leaves_the_run_as_it_was_R_RUN_5(thread, hops, monkeypatch):
    """An error after the run's rows were updated rolls the whole pooled
    transaction back: the rows and the run are as before, nothing is rolled
    up, no hook runs, and the connection goes back idle."""
    from audit.ledger import terminal

    lease = acquire(make_run(thread))
    _open_and_close(lease, "lc_run--f")
    connection.close()
    available = _available()
    before = scrape()

    def refuse(*args, **kwargs):
        raise RuntimeError("the seal failed")

    monkeypatch.setattr(terminal, "seal_run", refuse)
    state = [StateMessage(kind="ai", id="lc_run--f", content="answer")]
    with pytest.raises(RuntimeError, match="the seal failed"):
        _on_loop(ledger.run_finish, lease=lease, status="completed", final_state=state)
    after = scrape()
    assert hops == []
    stored = AgentRun.objects.get(pk=lease.run_id)
    assert (stored.status, stored.rolled_up_at, stored.sealed_at) == ("running", None, None)
    row = Message.objects.get(operation_id="lc_run--f")
    assert "state_reconciled" not in row.metadata and row.message_type == Message.Type.MODEL_AUDIT
    assert delta(before, after, "yuxi_runs_finished_total", **_FINISHED) == 0
    connection.close()
    assert _available() == available


async def _blocking(fn, kwargs):
    return call_with_pooled_statements(fn, kwargs)


def test_a_blocking_call_that_reaches_the_orm_on_the_loop_changes_nothing(thread):
    def orm_write():
        execute_prepared("SELECT 1", [])
        Message.objects.create(thread=thread, role=Message.Role.USER, content="never")

    async def go():
        with pytest.raises(NeedsThread):
            await _blocking(orm_write, {})

    asyncio.run(go())
    assert not Message.objects.filter(content="never").exists()


@fenced_service("probe")
def _reaches_the_orm(*, thread):
    """Steps that write nothing, then take a locked path (the ORM)."""
    found = yield FencedWrite("SELECT 1 WHERE false", [], load=False)
    assert found is None
    Message.objects.create(thread=thread, role=Message.Role.USER, content="never")


def test_awaited_steps_that_reach_the_orm_on_the_loop_change_nothing_and_go_to_a_thread(thread, hops):
    """The service's steps stop at the ORM on the loop (Django's safety
    net) before it changed anything: the whole call is made again in a
    thread, once."""
    _on_loop(_reaches_the_orm, thread=thread)
    assert hops == ["_reaches_the_orm"]
    assert Message.objects.filter(content="never").count() == 1


def test_database_errors_are_translated_as_djangos_on_either_path_R_RUN_11():
    def refused():
        execute_prepared("""SELECT '{"a": NaN}'::jsonb""", [])

    async def blocking():
        with pytest.raises(DataError):
            await _blocking(refused, {})

    async def awaited():
        with pytest.raises(DataError):
            await awaited_connections().execute_prepared("""SELECT '{"a": NaN}'::jsonb""", [])

    asyncio.run(blocking())
    run_in_worker_loop(awaited())


def test_no_call_on_the_loop_inside_an_orm_transaction_or_without_the_safety_net(monkeypatch):
    """Its statements would not see the transaction's writes; and without
    Django's check, an ORM call would run here instead of stopping."""

    async def awaited():
        await awaited_connections().execute_prepared("SELECT 1", [])

    with transaction.atomic(), pytest.raises(NeedsThread):
        call_with_pooled_statements(lambda: None, {})
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with pytest.raises(NeedsThread):
        call_with_pooled_statements(lambda: None, {})
    with pytest.raises(NeedsThread):
        run_in_worker_loop(awaited())


def test_outside_a_worker_loop_a_lifecycle_write_is_made_in_a_thread(thread, hops):
    """Only a worker loop keeps connections for awaited writes (one kept
    elsewhere would outlive its loop): on any other loop the write goes to
    a thread, and is made there once."""
    lease = acquire(make_run(thread))

    async def go():
        return await writes.write_with_retry(
            ledger.model_call_start, lease=lease, operation_id="lc_run--o", sequence=1, started_at=T0
        )

    assert asyncio.run(go()).sequence == 1
    assert hops == ["model_call_start"]


def test_the_loop_keeps_its_awaited_connections_from_write_to_write_R_RUN_5(thread, hops, db_name):
    """Ten writes in a row, and two at once, open no more connections than
    were in flight together, and keep them idle for the next run."""
    lease = acquire(make_run(thread))
    for i in range(10):
        _on_loop(ledger.model_call_start, lease=lease, operation_id=f"lc_run--k{i}", sequence=i + 1, started_at=T0)
    assert _awaited_backends(db_name) == ["idle"]

    async def two_at_once():
        await asyncio.gather(
            *(
                writes.write_with_retry(
                    ledger.model_call_start, lease=lease, operation_id=f"lc_run--t{i}", sequence=20 + i, started_at=T0
                )
                for i in range(2)
            )
        )

    run_in_worker_loop(two_at_once())
    assert hops == []
    assert sorted(_awaited_backends(db_name)) == ["idle", "idle"]
    assert Message.objects.audit().filter(run_id=lease.run_id).count() == 12


class _RowHolder:
    """Another transaction holding the run row (a terminal transaction or
    a takeover in progress), in a thread of its own until released."""

    def __init__(self, lease):
        self.locked, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._hold, args=(lease,), daemon=True)

    def _hold(self, lease) -> None:
        try:
            with transaction.atomic():
                lock_run(lease)
                self.locked.set()
                self.release.wait(5)
        finally:
            connection.close()

    def __enter__(self):
        self.thread.start()
        assert self.locked.wait(5)
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.thread.join(10)


def test_a_lifecycle_write_waiting_for_postgresql_leaves_the_loop_free_R_RUN_5(thread, hops):
    """While a write's statement waits (here for the run row, which another
    transaction holds), the loop runs the run's other tasks — the model's
    stream, LangGraph's checkpoint writes — instead of standing still."""
    lease = acquire(make_run(thread))
    connection.close()

    async def go(holder):
        write = asyncio.ensure_future(
            writes.write_with_retry(
                ledger.model_call_start, lease=lease, operation_id="lc_run--w", sequence=1, started_at=T0
            )
        )
        ticks = 0
        for _ in range(20):
            await asyncio.sleep(0.01)
            ticks += 1
        waiting = not write.done()
        holder.release.set()
        return ticks, waiting, await write

    with _RowHolder(lease) as holder:
        ticks, waiting, row = run_in_worker_loop(go(holder))
    assert (ticks, waiting) == (20, True), "the loop ticked while the write waited"
    assert hops == [] and row.sequence == 1
    assert Message.objects.audit().filter(operation_id="lc_run--w").count() == 1


def test_a_lifecycle_write_cancelled_while_its_statement_waits_ends_its_statement_first_R_RUN_5(thread, hops, db_name):
    """A run stopped while a write's statement is on its way (a cancel
    request, a lost lease) does not abandon the statement: the write is
    waited for to its end — written once, the loop's connection back and
    idle — and then the cancellation goes on."""
    lease = acquire(make_run(thread))
    connection.close()

    async def go(holder):
        write = asyncio.ensure_future(
            writes.write_with_retry(
                ledger.model_call_start, lease=lease, operation_id="lc_run--x", sequence=2, started_at=T0
            )
        )
        await asyncio.sleep(0.1)
        write.cancel()
        await asyncio.sleep(0.1)
        still_waiting = not write.done()
        holder.release.set()
        with pytest.raises(asyncio.CancelledError):
            await write
        return still_waiting

    with _RowHolder(lease) as holder:
        assert run_in_worker_loop(go(holder)), "the cancelled write waits for its statement"
    assert hops == []
    assert Message.objects.audit().filter(operation_id="lc_run--x", sequence=2).count() == 1
    assert _awaited_backends(db_name) == ["idle"]


def _every_free_connection(pool) -> list:
    """Every connection ``pool`` can give now, growing it up to its size:
    until it has none left to give (other threads of the test session may
    hold some for good). The caller gives them back."""
    held = []
    with contextlib.suppress(PoolTimeout):
        while True:
            held.append(pool.getconn(timeout=0.5))
    return held


def test_no_connection_at_hand_is_no_write_error_R_OPS_1(thread, hops, monkeypatch):
    """Every connection of the pool is in use (a burst, or the pool
    refilling after PostgreSQL ended its idle connections), or every
    awaited connection of the loop is: the call goes to a thread before it
    did anything. That is no write error either, and the write is made
    there once."""
    lease = acquire(make_run(thread))
    connection.close()
    before = scrape()
    pool = connections["default"].pool
    held = []
    try:
        held += _every_free_connection(pool)

        async def go():
            with pytest.raises(NeedsThread):
                call_with_pooled_statements(
                    ledger.model_call_start,
                    {"lease": lease, "operation_id": "lc_run--d", "sequence": 1, "started_at": T0},
                )

        asyncio.run(go())
    finally:
        for conn in held:
            pool.putconn(conn)
    monkeypatch.setattr(AwaitedConnections, "MOST", 0)
    _on_loop(ledger.model_call_start, lease=lease, operation_id="lc_run--d", sequence=1, started_at=T0)
    after = scrape()
    assert hops == ["model_call_start"]
    errors = [key for key in after if key[0] == "yuxi_audit_write_errors_total" and after[key] != before.get(key, 0)]
    assert errors == [], "a call sent to a thread is no write error"
    assert delta(before, after, "yuxi_audit_write_duration_seconds_count", kind="model_start") == 1
    assert Message.objects.audit().filter(operation_id="lc_run--d").count() == 1


def test_a_run_whose_pooled_connections_the_server_ended_between_writes_ends_exactly_once_R_RUN_8(
    user, replay_models, db_name, monkeypatch
):
    """PostgreSQL ends every idle connection of the pool and of the loop's
    awaited writes (a restart, an administrator) before each lifecycle
    write of a run: each write still lands once — on a fresh connection, or
    in a thread while the pool refills — and the run completes with its
    rows, none twice, none left running, and no write error counted for a
    call sent to a thread."""
    from audit.execution.runner import run_execute
    from conversations.models import Conversation

    ended: list[int] = []

    def end_idle_pooled_connections() -> None:
        ended.append(_end_idle_pooled_connections(db_name))

    lifecycle = {"model_call_open", "model_call_start", "model_call_finish", "tool_call_start", "tool_call_finish"}
    write = writes.write_with_retry

    async def after_ending(fn, /, **kwargs):
        if fn.__name__ in lifecycle:
            end_idle_pooled_connections()
        return await write(fn, **kwargs)

    monkeypatch.setattr(recorder, "write_with_retry", after_ending)
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:tool_then_answer")
    run = make_run(thread)
    connection.close()
    before = scrape()
    assert run_execute(run_id=run.id, owner="in-process") == "completed"
    after = scrape()
    assert len(ended) == 8 and sum(ended) > 0
    errors = {
        dict(labels).get("error")
        for key in after
        if key[0] == "yuxi_audit_write_errors_total" and after[key] != before.get(key, 0)
        for labels in [key[1]]
    }
    assert not errors & {"NeedsThread", "SynchronousOnlyOperation"}, errors
    rows = list(Message.objects.filter(run=run).exclude(role="user").values_list("role", "execution_status"))
    assert sorted(rows) == [("assistant", "completed"), ("assistant", "completed"), ("tool", "completed")]
    run.refresh_from_db()
    assert run.output_message_id is not None


def _end_idle_pooled_connections(db_name: str) -> int:
    """End every idle connection of the pool, and the idle connections of
    the awaited writes, as PostgreSQL does in a restart (or an administrator
    would), and wait until the server let them go (their sockets then read
    end of file, which the pool's check and the loop's see). Returns how
    many. The checkpointer's connections are neither."""
    import time

    import psycopg

    pids = [conn.info.backend_pid for conn in list(connections["default"].pool._pool)]
    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres", autocommit=True) as admin:
        pids += [
            pid
            for (pid,) in admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = %s AND state = 'idle'",
                [db_name, AWAITED_APPLICATION_NAME],
            )
        ]
        admin.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", [pids])
        for _ in range(500):
            if not admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", [pids]).fetchone()[0]:
                break
            time.sleep(0.01)
    return len(pids)


def test_a_write_after_the_server_ended_the_pools_idle_connections_gets_a_new_one_at_once_R_RUN_8(thread, db_name):
    """After a PostgreSQL restart every idle connection of a grown pool is
    dead. The first checkout that meets one must not meet the others one by
    one — the pool backs off 1 s, 2 s, 4 s… between failed checks, so the
    write waited the whole pool timeout and failed an attempt (R-RUN-8
    allows AUDIT_WRITE_ATTEMPTS of them for the whole run)."""
    lease = acquire(make_run(thread))
    connection.close()
    pool = connections["default"].pool
    held = _every_free_connection(pool)  # the pool grown as far as it can
    for conn in held:
        pool.putconn(conn)
    before = scrape()
    connection.close()
    assert _end_idle_pooled_connections(db_name) == len(held) >= 2
    _on_loop(ledger.model_call_start, lease=lease, operation_id="lc_run--e", sequence=1, started_at=T0)
    after = scrape()
    errors = [key for key in after if key[0] == "yuxi_audit_write_errors_total" and after[key] != before.get(key, 0)]
    assert errors == [], "the write met the dead connections one by one and waited for the pool"
    assert Message.objects.audit().filter(operation_id="lc_run--e").count() == 1


def test_the_loops_connections_take_djangos_parameters_and_the_workers_session_limits_R_RUN_10(monkeypatch):
    """A worker's connections carry its session limits (``lock_timeout``,
    ``statement_timeout``, ``idle_in_transaction_session_timeout``: a
    frozen worker's transaction is ended, R-RUN-10) and plan prepared
    statements once: the loop's awaited-write connections as Django's own,
    named in ``pg_stat_activity``, in Django's session time zone."""
    from core.config import get_config
    from core.db import worker_session_options

    options = connections["default"].settings_dict["OPTIONS"]
    limits = worker_session_options(get_config().model_copy(update={"WORKER_LOCK_TIMEOUT_MS": 1234}))
    monkeypatch.setitem(options, "options", f"{options.get('options', '')} {limits}".strip())

    async def settings():
        return await awaited_connections().execute_prepared(
            "SELECT (SELECT array_agg(setting ORDER BY name) FROM pg_settings WHERE name = ANY(%s)),"
            " current_setting('application_name'), current_setting('TimeZone')",
            [["idle_in_transaction_session_timeout", "lock_timeout", "plan_cache_mode", "statement_timeout"]],
        )

    config = get_config()
    assert run_in_worker_loop(settings()) == (
        [
            str(config.WORKER_IDLE_IN_TRANSACTION_TIMEOUT_MS),
            "1234",
            "force_generic_plan",
            str(config.WORKER_STATEMENT_TIMEOUT_MS),
        ],
        AWAITED_APPLICATION_NAME,
        "UTC",
    )


@pytest.fixture
def worker_database(monkeypatch):
    """This process's database connections set up as a Celery worker's
    (:func:`core.db.configure_worker_database`, as ``worker_init`` does) on
    a new pool, with an ``idle_in_transaction_session_timeout`` of 4321 ms;
    Django's own settings and pool again afterwards."""
    import copy

    from core import db as core_db
    from core.config import get_config

    default = connections["default"]
    monkeypatch.setitem(default.settings_dict, "OPTIONS", copy.deepcopy(default.settings_dict["OPTIONS"]))
    monkeypatch.setattr(core_db, "_sessions_named", False)  # name_worker_sessions sets it
    connection.close()
    default.close_pool()
    config = get_config().model_copy(update={"WORKER_IDLE_IN_TRANSACTION_TIMEOUT_MS": 4321})
    core_db.configure_worker_database(default.settings_dict, config)
    yield
    connection.close()
    default.close_pool()


def test_every_connection_a_worker_opens_ends_a_frozen_transaction_R_RUN_10(worker_database):
    """Issue 35: worker connections without
    ``idle_in_transaction_session_timeout`` were noticed by a slow fault
    test only. Each kind of connection a worker's run uses carries it:
    Django's (the lease keeper, the locked paths), a pooled call's (the
    terminal transaction), the loop's awaited writes and the
    checkpointer's."""
    from audit.execution.checkpoint import open_checkpointer, postgres_conninfo

    query = "SELECT current_setting('idle_in_transaction_session_timeout')"

    def djangos() -> str:
        with connection.cursor() as cursor:
            cursor.execute(query)
            return cursor.fetchone()[0]

    async def awaited() -> str:
        return (await awaited_connections().execute_prepared(query, []))[0]

    async def checkpointers() -> str:
        async with open_checkpointer(postgres_conninfo()) as saver, saver.conn.cursor() as cursor:
            await cursor.execute(query)
            return next(iter((await cursor.fetchone()).values()))

    kinds = {
        "django": djangos(),  # opens the new pool
        "pooled": call_with_pooled_statements(lambda: execute_prepared(query, [])[0], {}),
        "awaited": run_in_worker_loop(awaited()),
        "checkpointer": run_in_worker_loop(checkpointers()),
    }
    assert kinds == dict.fromkeys(kinds, "4321ms")


def test_a_refused_connection_is_tried_again_for_as_long_as_a_write_waits_for_one_R_RUN_8(thread, hops, monkeypatch):
    """A short outage (a restart): PostgreSQL refuses connections for a
    moment. The loop's connect is tried again for as long as one write
    attempt waits for a connection (as a write waiting for the pool does),
    not given up at once: five refusals cost no attempt of the write, which
    lands once, on the loop."""
    import psycopg

    real = psycopg.AsyncConnection.connect
    refusals = [5]

    async def refusing(*args, **kwargs):
        if refusals[0]:
            refusals[0] -= 1
            raise psycopg.OperationalError("connection refused (a restart)")
        return await real(*args, **kwargs)

    monkeypatch.setattr(psycopg.AsyncConnection, "connect", refusing)
    lease = acquire(make_run(thread))
    row = _on_loop(ledger.model_call_start, lease=lease, operation_id="lc_run--r", sequence=1, started_at=T0)
    assert refusals == [0] and hops == [] and row.sequence == 1
    assert Message.objects.audit().filter(operation_id="lc_run--r").count() == 1
