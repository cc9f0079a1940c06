"""ReconnectingPostgresSaver against the real database: concurrent writes of
one run meeting a killed connection, and what it does once closed (R-RUN-8)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import psycopg
import pytest
from django.db import connection
from langgraph.checkpoint.base import empty_checkpoint

from audit.execution.checkpoint import CHECKPOINTER_APPLICATION_NAME, open_checkpointer, postgres_conninfo
from tests.waiting import WAIT_SECONDS

pytestmark = pytest.mark.django_db(transaction=True)


def _admin(db_name):
    # On the server's own database: the tests may close theirs to connections.
    return psycopg.connect(dbname="postgres", host="127.0.0.1", user="postgres", autocommit=True)


def _checkpointer_pids(db_name) -> list[int]:
    with _admin(db_name) as admin:
        return [
            r[0]
            for r in admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
                [db_name, CHECKPOINTER_APPLICATION_NAME],
            ).fetchall()
        ]


def _waiting_on_a_lock(db_name) -> bool:
    with _admin(db_name) as admin:
        return bool(
            admin.execute(
                "SELECT 1 FROM pg_stat_activity WHERE datname = %s AND application_name = %s"
                " AND wait_event_type = 'Lock'",
                [db_name, CHECKPOINTER_APPLICATION_NAME],
            ).fetchone()
        )


def _kill(db_name, pids) -> None:
    with _admin(db_name) as admin:
        for pid in pids:
            admin.execute("SELECT pg_terminate_backend(%s)", [pid])


@contextlib.contextmanager
def _state_write_blocked(user, db_name, model: str, *, owner: str | None):
    """A run of ``model`` executed (by ``owner``) in a thread, yielded as
    ``(run, worker thread, result dict, the connection holding the lock)``
    once LangGraph's write of its State waits on a lock of the checkpoint
    tables (taken while its first model call streams); the lock is
    released when the block ends."""
    import time

    from conversations.models import Message
    from tests.conftest import run_in_a_thread

    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres") as holder:
        run, worker, result = run_in_a_thread(
            user, owner, model=model, until=lambda run: Message.objects.model_calls().filter(run=run).exists()
        )
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            try:
                holder.execute("LOCK TABLE checkpoints, checkpoint_writes, checkpoint_blobs IN ACCESS EXCLUSIVE MODE")
                break
            except psycopg.errors.DeadlockDetected:
                # The tables are locked one by one: a State write holding one
                # of them while it waits for another chose this lock to fail.
                holder.rollback()
        with _admin(db_name) as admin:
            while not admin.execute(
                "SELECT 1 FROM pg_stat_activity WHERE datname = %s AND application_name = %s"
                " AND wait_event_type = 'Lock'",
                [db_name, CHECKPOINTER_APPLICATION_NAME],
            ).fetchone():
                assert time.monotonic() < deadline and worker.is_alive(), result
                time.sleep(0.01)
        try:
            yield run, worker, result, holder
        finally:
            holder.rollback()


def _state_rows(conn, thread_id) -> tuple[int, int, int]:
    """The thread's rows in the checkpoint tables (checkpoints, writes,
    blobs), read on ``conn`` (the lock holder's, while it holds them)."""
    return tuple(
        conn.execute(f"SELECT count(*) FROM {table} WHERE thread_id = %s", [str(thread_id)]).fetchone()[0]
        for table in ("checkpoints", "checkpoint_writes", "checkpoint_blobs")
    )


def _state_rows_once_unlocked(db_name, thread_id) -> tuple[int, int, int]:
    """:func:`_state_rows` after the lock went, once a State write it held
    would have had time to commit."""
    import time

    time.sleep(3.0)
    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres", autocommit=True) as conn:
        return _state_rows(conn, thread_id)


def _config(thread_id: str, checkpoint_id: str | None = None) -> dict:
    c = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
    if checkpoint_id:
        c["configurable"]["checkpoint_id"] = checkpoint_id
    return c


def test_concurrent_writes_meeting_a_killed_connection_all_land_on_one_new_connection(db_name):
    conninfo = postgres_conninfo()
    connection.close()
    thread_id = str(uuid.uuid4())

    async def scenario():
        async with open_checkpointer(conninfo) as saver:
            checkpoint = empty_checkpoint()
            saved = await saver.aput(_config(thread_id), checkpoint, {"step": 0}, {})
            first = saver.conn
            await asyncio.to_thread(_kill, db_name, _checkpointer_pids(db_name))
            await asyncio.sleep(0.2)
            checkpoint_id = saved["configurable"]["checkpoint_id"]
            writes = [
                saver.aput_writes(_config(thread_id, checkpoint_id), [(f"ch{i}", i)], task_id=f"task-{i}")
                for i in range(4)
            ]
            second = empty_checkpoint()
            await asyncio.gather(*writes, saver.aput(saved, second, {"step": 1}, {}))
            pids = await asyncio.to_thread(_checkpointer_pids, db_name)
            got = await saver.aget_tuple(_config(thread_id, checkpoint_id))
            return first, saver.conn, pids, got

    first, last, pids, got = asyncio.run(scenario())
    assert first is not last and first.closed
    assert len(pids) == 1, f"one checkpointer connection after the reconnect, not {pids}"
    assert sorted(w[1] for w in got.pending_writes) == ["ch0", "ch1", "ch2", "ch3"]
    assert _checkpointer_pids(db_name) == []


def test_a_call_after_the_checkpointer_was_closed_opens_no_connection(db_name):
    """``open_checkpointer`` closes its connection when the run ends; a call
    that comes later (a background write still retrying) must not open a new
    connection that nobody closes."""
    conninfo = postgres_conninfo()
    connection.close()
    thread_id = str(uuid.uuid4())

    async def scenario():
        async with open_checkpointer(conninfo) as saver:
            saved = await saver.aput(_config(thread_id), empty_checkpoint(), {"step": 0}, {})
        error = None
        try:
            await saver.aput_writes(saved, [("late", 1)], task_id="late")
        except Exception as exc:  # noqa: BLE001
            error = exc
        pids = await asyncio.to_thread(_checkpointer_pids, db_name)
        conn = saver.conn
        leaked = not conn.closed
        if leaked:
            await conn.close()
        return error, pids, leaked

    error, pids, leaked = asyncio.run(scenario())
    assert not leaked and pids == [], f"a connection was opened after close: {pids} (error {error!r})"


def test_an_error_on_a_good_connection_is_raised_at_once_not_retried(db_name, caplog):
    """Only a lost connection is worth another attempt: a lock timeout (the
    connection still good) and a call after close are raised at once."""
    import logging

    conninfo = postgres_conninfo()
    connection.close()
    thread_id = str(uuid.uuid4())

    async def scenario():
        async with open_checkpointer(conninfo) as saver:
            saved = await saver.aput(_config(thread_id), empty_checkpoint(), {"step": 0}, {})
            await saver.conn.execute("SET lock_timeout = '50ms'")
            with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres") as holder:
                holder.execute("LOCK TABLE checkpoint_writes IN ACCESS EXCLUSIVE MODE")
                with pytest.raises(psycopg.errors.LockNotAvailable):
                    await saver.aput_writes(saved, [("blocked", 1)], task_id="blocked")
            good = saver.conn
        with pytest.raises(psycopg.OperationalError):
            await saver.aput_writes(saved, [("late", 1)], task_id="late")
        return good

    with caplog.at_level(logging.WARNING, logger="audit.execution.checkpoint"):
        good = asyncio.run(scenario())
    assert good.closed  # the connection it had, closed by the run's end, not replaced
    assert not [r for r in caplog.records if "attempt" in r.getMessage()], "no call was made again"


def test_a_cancel_is_honoured_while_a_checkpoint_write_waits_on_a_lock_R_RUN_6(
    user, replay_models, db_name, monkeypatch
):
    """A run is cancelled while LangGraph's background write of its State
    waits on a lock of the checkpoint tables (a VACUUM FULL, a prune, a
    migration). The cancel must end the run within seconds, not leave its
    worker waiting on the lock while the lease runs out. The lease here is
    shorter than the wait before the stuck write is cancelled: the worker
    keeps renewing it while the run ends, so its own terminal write ends
    the run (no sweeper runs here), not an expiry (R-RUN-7). No State of
    the ended run is written once the lock goes: LangGraph pipelines a
    State write as several statements committed one by one, and cancelling
    the running one let the next commit (1 run in 3)."""
    from audit import ledger
    from audit.execution.runner import STOP_GRACE_SECONDS
    from audit.models import AgentRun
    from core.config import get_config

    monkeypatch.setattr(get_config(), "LEASE_TTL_SECONDS", STOP_GRACE_SECONDS * 0.75)
    blocked = _state_write_blocked(user, db_name, "replay:tool_then_slow_answer", owner=None)
    with blocked as (run, worker, result, holder):
        ledger.run_request_cancel(user=user, run_id=run.id)
        worker.join(10)
        ended_in_time = not worker.is_alive()
        at_end = _state_rows(holder, run.thread_id)
    worker.join(60)
    assert ended_in_time, "the cancelled run's worker still waited on the checkpoint lock after 10 s"
    assert result["status"] == "cancelled", result
    assert _state_rows_once_unlocked(db_name, run.thread_id) == at_end, "State written after the run ended"
    run = AgentRun.objects.get(pk=run.id)
    assert (run.status, run.error_type, run.error_message) == ("cancelled", "cancelled", "cancelled on request")


def test_a_run_stopped_by_a_failed_audit_write_leaves_no_checkpointer_connection_behind_R_RUN_8(
    user, replay_models, db_name
):
    """The run's drive ends on an exception from an audit write (here a
    takeover: the next fenced write raises) while LangGraph's background
    write of its State still waits (a lock on the checkpoint tables). The
    run's checkpointer is closed as the drive ends; the write, failing on
    the closed connection, must not reopen one — which nobody would close,
    and through which the State of an ended run would still be written. Nor
    may the waiting write itself commit once the lock goes: closing the
    client leaves the server's statement waiting (R-RUN-4: the old owner
    writes nothing after the takeover)."""
    from django.db.models import F

    from audit.models import AgentRun

    blocked = _state_write_blocked(user, db_name, "replay:slow_tool_then_answer", owner="worker-old")
    with blocked as (run, worker, result, holder):
        # Taken over: the next fenced audit write raises in the drive.
        AgentRun.objects.filter(pk=run.id).update(lease_owner="worker-new", fencing_token=F("fencing_token") + 1)
        worker.join(30)
        assert result.get("status") == "lease_lost", result
        at_end = _state_rows(holder, run.thread_id)
    assert _state_rows_once_unlocked(db_name, run.thread_id) == at_end, "the old owner's State written after its end"
    assert _checkpointer_pids(db_name) == [], "a checkpointer connection outlived its run"


def test_a_checkpointer_write_outlasts_an_outage_an_audit_write_outlasts_R_RUN_8(db_name, monkeypatch):
    """The database refuses connections for 1.5 s (a restart) just as the
    checkpointer writes: an audit write waits up to its pool timeout
    (LEASE_TTL / (2 * AUDIT_WRITE_ATTEMPTS), 1.33 s here) at each of its
    attempts, so it outlasts such an outage; the checkpointer's write, made
    "as the audit writes are", must too, not fail after its 0.6 s of
    backoff."""
    import threading
    import time

    from core.config import get_config

    monkeypatch.setattr(get_config(), "AUDIT_WRITE_ATTEMPTS", 3)
    monkeypatch.setattr(get_config(), "LEASE_TTL_SECONDS", 8.0)
    monkeypatch.setattr(get_config(), "DB_POOL_TIMEOUT_SECONDS", 3.0)
    conninfo = postgres_conninfo()
    connection.close()
    thread_id = str(uuid.uuid4())

    def allow(allowed: bool) -> None:
        with psycopg.connect(dbname="postgres", host="127.0.0.1", user="postgres", autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{db_name}" ALLOW_CONNECTIONS {str(allowed).lower()}')

    async def scenario():
        async with open_checkpointer(conninfo) as saver:
            saved = await saver.aput(_config(thread_id), empty_checkpoint(), {"step": 0}, {})
            await asyncio.to_thread(allow, False)
            await asyncio.to_thread(_kill, db_name, _checkpointer_pids(db_name))
            threading.Timer(1.5, allow, [True]).start()
            began = time.monotonic()
            await saver.aput(saved, empty_checkpoint(), {"step": 1}, {})
            return time.monotonic() - began

    try:
        took = asyncio.run(scenario())
    finally:
        time.sleep(1.6)
        allow(True)
    assert took >= 1.4


@pytest.mark.parametrize("close", ["interrupt", "aclose", "cut"])
def test_closing_a_checkpointer_under_a_waiting_state_write_does_not_kill_the_process_R_RUN_6(db_name, close):
    """A stopped run's checkpointer is interrupted, an ended run's closed,
    while a write of its State waits on a lock (``cut``: interrupted while
    the database refuses connections, so its connection is cut under the
    wait): the connection must not be freed under the waiting fetch (psycopg's C fetch keeps libpq's pointer
    across the wait), which killed the worker — and CI's pytest — with a
    segmentation fault. In a process of its own, with freed memory
    overwritten (``MALLOC_PERTURB_``) so a use after free crashes every
    time."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    conninfo = postgres_conninfo()
    connection.close()
    done = subprocess.run(
        [sys.executable, "-m", "tests.audit.close_under_a_wait", close, conninfo, "3"],
        cwd=Path(__file__).resolve().parents[2],
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "yuxi_project.settings",
            "MALLOC_PERTURB_": "165",
            "PYTHONFAULTHANDLER": "1",
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    assert _checkpointer_pids(db_name) == []


def _allow_connections(db_name, allowed: bool) -> None:
    with _admin(db_name) as admin:
        admin.execute(f'ALTER DATABASE "{db_name}" ALLOW_CONNECTIONS {str(allowed).lower()}')


def _writes_of(db_name, thread_id, task_id: str) -> int:
    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres") as conn:
        return conn.execute(
            "SELECT count(*) FROM checkpoint_writes WHERE thread_id = %s AND task_id = %s", [thread_id, task_id]
        ).fetchone()[0]


async def _pids_gone_within(db_name, seconds: float) -> list[int]:
    """The checkpointer's server sessions still there after at most
    ``seconds`` (read on the server's own database)."""
    import time

    deadline = time.monotonic() + seconds
    while (pids := await asyncio.to_thread(_checkpointer_pids, db_name)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return pids


@contextlib.asynccontextmanager
async def _write_waiting_while_connections_refused(db_name, conninfo, thread_id):
    """A checkpointer whose write (task ``waiting``) waits on a lock of
    ``checkpoint_writes`` while the database refuses new connections, so
    its session cannot be ended (no ``pg_terminate_backend``): yields
    ``(saver, saved config, the waiting task, the lock holder)``; on exit
    connections are allowed again and the lock released."""
    saver = None
    holder = await psycopg.AsyncConnection.connect(dbname=db_name, host="127.0.0.1", user="postgres")
    try:
        async with open_checkpointer(conninfo) as saver:
            saved = await saver.aput(_config(thread_id), empty_checkpoint(), {"step": 0}, {})
            await holder.execute("LOCK TABLE checkpoint_writes IN ACCESS EXCLUSIVE MODE")
            waiting = asyncio.create_task(saver.aput_writes(saved, [("waiting", 1)], task_id="waiting"))
            while not await asyncio.to_thread(_waiting_on_a_lock, db_name):
                await asyncio.sleep(0.01)
            await asyncio.to_thread(_allow_connections, db_name, False)
            try:
                yield saver, saved, waiting, holder
            finally:
                await asyncio.to_thread(_allow_connections, db_name, True)
                await holder.rollback()
                with contextlib.suppress(psycopg.OperationalError):
                    await waiting
    finally:
        await holder.close()


@pytest.mark.parametrize("lock_released_after", [0.3, 1.0, 1.8])
def test_an_interrupted_checkpointer_stops_a_statement_it_could_not_end_R_RUN_6(db_name, caplog, lock_released_after):
    """``interrupt()`` cannot end the session of a State write waiting on a
    lock when the database refuses connections (a restart, a full
    ``max_connections``, a partition). A call made meanwhile must fail at
    once (the run is over) instead of queueing behind that statement; the
    statement is cancelled (a cancel request needs no session) and the
    connection cut at once, so the write fails and commits nothing however
    soon the lock goes — before, it waited 2 s for the statement, which
    committed and returned when the lock went meanwhile — and neither the
    connection nor its server session stays."""
    import logging
    import time

    from audit.execution.checkpoint import CheckpointerClosed

    conninfo = postgres_conninfo()
    connection.close()
    thread_id = str(uuid.uuid4())

    async def scenario():
        async with _write_waiting_while_connections_refused(db_name, conninfo, thread_id) as (
            saver,
            saved,
            waiting,
            holder,
        ):
            began = time.monotonic()
            interrupting = asyncio.create_task(saver.interrupt())
            await asyncio.sleep(0)
            late_error = None
            try:
                await asyncio.wait_for(saver.aput_writes(saved, [("late", 1)], task_id="late"), 1.0)
            except (CheckpointerClosed, TimeoutError) as exc:
                late_error = exc
            refused_in = time.monotonic() - began
            await asyncio.sleep(max(0.0, began + lock_released_after - time.monotonic()))
            await holder.rollback()  # the lock goes
            await interrupting
            interrupt_took = time.monotonic() - began
            write_error = None
            try:
                await waiting
            except psycopg.OperationalError as exc:
                write_error = exc
            closed = saver.conn.closed
            sessions = await _pids_gone_within(db_name, 3.0)
        return late_error, refused_in, interrupt_took, write_error, closed, sessions

    try:
        with caplog.at_level(logging.WARNING, logger="audit.execution.checkpoint"):
            late_error, refused_in, interrupt_took, write_error, closed, sessions = asyncio.run(scenario())
    finally:
        _allow_connections(db_name, True)
    assert "could not be ended" in caplog.text, "the session was ended after all: the case is not the one tested"
    assert isinstance(late_error, CheckpointerClosed) and refused_in < 0.5, (late_error, refused_in)
    assert write_error is not None, "the interrupted State write returned as if written"
    assert closed and interrupt_took < 5.0, (closed, interrupt_took)
    assert sessions == [], "the checkpointer's server session outlived interrupt()"
    time.sleep(0.5)
    assert _writes_of(db_name, thread_id, "waiting") == 0, "the interrupted State write committed once the lock went"
    assert _writes_of(db_name, thread_id, "late") == 0, "a write made after interrupt() reached the database"


def test_a_checkpointer_closed_by_a_cancelled_drive_leaves_no_connection_R_RUN_6(db_name):
    """The run's drive ends (a takeover) and closes its checkpointer while
    its State write waits on a lock and the database refuses connections;
    the drive is then cancelled in the middle of that close (the keeper
    found the lease gone). The close goes on: the connection is cut and
    closed, not left open until garbage collection — nor its server
    session waiting to commit the State of an ended run once the lock
    goes."""
    import time

    conninfo = postgres_conninfo()
    connection.close()
    thread_id = str(uuid.uuid4())

    async def scenario():
        async with _write_waiting_while_connections_refused(db_name, conninfo, thread_id) as (saver, _, _, _):
            closing = asyncio.create_task(saver.aclose())
            await asyncio.sleep(0.5)
            closing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await closing
            for _ in range(100):
                if saver.conn.closed:
                    break
                await asyncio.sleep(0.05)
            closed_under_the_lock = saver.conn.closed
            sessions_under_the_lock = await _pids_gone_within(db_name, 3.0)
        return closed_under_the_lock, sessions_under_the_lock

    try:
        closed, sessions = asyncio.run(scenario())
    finally:
        _allow_connections(db_name, True)
    assert closed, "the connection stayed open after the cancelled close"
    assert sessions == [], "the server session of the closed connection still waited on the lock"
    time.sleep(0.5)
    assert _writes_of(db_name, thread_id, "waiting") == 0, "the State of an ended run committed once the lock went"


def test_a_run_that_ends_while_its_checkpointer_closes_leaves_no_connection_R_RUN_6(db_name):
    """The worker's event loop ends (``asyncio.run`` returns: the run is
    over) while the checkpointer's close still waits for a State write that
    holds the connection, the database refusing connections: the loop's
    end cancels the close, which must still cut and close the connection
    before it goes."""
    import time

    conninfo = postgres_conninfo()
    connection.close()
    thread_id = str(uuid.uuid4())
    holder = psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres")
    savers = []

    async def scenario():
        async with open_checkpointer(conninfo) as saver:
            savers.append(saver)
            saved = await saver.aput(_config(thread_id), empty_checkpoint(), {"step": 0}, {})
            await asyncio.to_thread(holder.execute, "LOCK TABLE checkpoint_writes IN ACCESS EXCLUSIVE MODE")
            asyncio.create_task(saver.aput_writes(saved, [("waiting", 1)], task_id="waiting"))  # noqa: RUF006
            while not await asyncio.to_thread(_waiting_on_a_lock, db_name):
                await asyncio.sleep(0.01)
            await asyncio.to_thread(_allow_connections, db_name, False)
            asyncio.create_task(saver.interrupt())  # noqa: RUF006 - left to the loop's end on purpose
            await asyncio.sleep(0.3)
            # open_checkpointer's exit (aclose) is cut short too: the loop ends.
            raise asyncio.CancelledError

    try:
        with contextlib.suppress(asyncio.CancelledError):
            asyncio.run(scenario())
        closed = savers[0].conn.closed
        sessions = [pid for pid in _checkpointer_pids(db_name)]
        deadline = time.monotonic() + WAIT_SECONDS
        while sessions and time.monotonic() < deadline:
            time.sleep(0.05)
            sessions = _checkpointer_pids(db_name)
    finally:
        _allow_connections(db_name, True)
        holder.rollback()
        holder.close()
    assert closed, "the connection outlived the run's event loop"
    assert sessions == [], "the server session outlived the run's event loop"
    time.sleep(0.5)
    assert _writes_of(db_name, thread_id, "waiting") == 0, "the State of an ended run committed once the lock went"
