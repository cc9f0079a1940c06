"""A worker loop keeps its last run's checkpointer connection for the next
run (issue 11: share connections), and only a sound, idle one: a connection
the server ended while it waited is replaced, one left in use or in a
transaction is closed with its run, and a saver whose run ended writes
nothing more on the connection it left."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import psycopg
import pytest
from django.db import connection
from langgraph.checkpoint.base import empty_checkpoint

from audit.execution.checkpoint import (
    CHECKPOINTER_APPLICATION_NAME,
    CheckpointerClosed,
    open_checkpointer,
    postgres_conninfo,
)
from audit.execution.worker_loop import close_kept_connections, run_in_worker_loop

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def db_name():
    return connection.settings_dict["NAME"]


def _sessions(db_name) -> list[tuple[int, str]]:
    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres", autocommit=True) as admin:
        return admin.execute(
            "SELECT pid, state FROM pg_stat_activity WHERE datname = %s AND application_name = %s ORDER BY pid",
            [db_name, CHECKPOINTER_APPLICATION_NAME],
        ).fetchall()


def _sessions_once(db_name, settled, timeout: float = 5.0) -> list[tuple[int, str]]:
    """The checkpointer's sessions once ``settled(sessions)`` holds, or as
    they are after ``timeout`` seconds (the server ends a session shortly
    after its client closed it)."""
    deadline = time.monotonic() + timeout
    while not settled(sessions := _sessions(db_name)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return sessions


def _config(thread_id: str) -> dict:
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}


async def _one_run(conninfo: str, thread_id: str, *, inside=None) -> tuple:
    """One run's use of its checkpointer: a State write; returns the saver
    and its server session (pid)."""
    async with open_checkpointer(conninfo) as saver:
        await saver.aput(_config(thread_id), empty_checkpoint(), {"step": 0}, {})
        pid = saver.conn.info.backend_pid
        if inside is not None:
            await inside(saver)
    return saver, pid


def test_the_next_run_on_a_worker_loop_takes_the_connection_the_last_one_left(db_name):
    conninfo = postgres_conninfo()
    connection.close()
    first, first_pid = run_in_worker_loop(_one_run(conninfo, str(uuid.uuid4())))
    assert not first.conn.closed, "the connection was closed with its run"
    assert _sessions(db_name) == [(first_pid, "idle")]
    second, second_pid = run_in_worker_loop(_one_run(conninfo, str(uuid.uuid4())))
    assert second_pid == first_pid and second.conn is first.conn
    assert _sessions(db_name) == [(first_pid, "idle")], "one connection for both runs"
    close_kept_connections()
    assert first.conn.closed
    _sessions_once(db_name, lambda sessions: not sessions)
    assert _sessions(db_name) == []


def test_a_run_that_ended_writes_nothing_on_the_connection_it_left(db_name):
    """The run's saver is closed for good when its run ends, though its
    connection lives on for the next run: a late State write (a background
    write of the ended run) fails, and nothing of it is stored."""
    conninfo = postgres_conninfo()
    connection.close()
    thread_id = str(uuid.uuid4())
    saver, _ = run_in_worker_loop(_one_run(conninfo, thread_id))

    async def late_write():
        config = {"configurable": {"thread_id": thread_id, "checkpoint_ns": "", "checkpoint_id": "x"}}
        with pytest.raises(CheckpointerClosed):
            await saver.aput_writes(config, [("late", 1)], task_id="late")

    run_in_worker_loop(late_write())
    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres") as admin:
        late = admin.execute("SELECT count(*) FROM checkpoint_writes WHERE thread_id = %s", [thread_id]).fetchone()[0]
    assert late == 0


def test_a_kept_connection_the_server_ended_is_replaced_R_RUN_8(db_name):
    """A restart, an administrator or an idle timeout ends the connection
    while it waits for the next run: that run connects anew and saves its
    State; the ended connection is closed, not handed out."""
    conninfo = postgres_conninfo()
    connection.close()
    first, first_pid = run_in_worker_loop(_one_run(conninfo, str(uuid.uuid4())))
    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres", autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [first_pid])
    _sessions_once(db_name, lambda sessions: not sessions)
    thread_id = str(uuid.uuid4())
    second, second_pid = run_in_worker_loop(_one_run(conninfo, thread_id))
    assert second_pid != first_pid and first.conn.closed
    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres") as admin:
        saved = admin.execute("SELECT count(*) FROM checkpoints WHERE thread_id = %s", [thread_id]).fetchone()[0]
    assert saved == 1
    assert _sessions(db_name) == [(second_pid, "idle")]


@pytest.mark.parametrize("how", ["transaction open", "interrupted"])
def test_a_connection_that_is_not_idle_when_its_run_ends_is_closed_not_kept(db_name, how):
    """Only an idle connection is kept: one in a transaction (a statement's
    transaction its run left open), or whose session its run ended
    (:meth:`interrupt`), is closed with the run, and the next run connects
    anew."""
    conninfo = postgres_conninfo()
    connection.close()

    async def leave_a_transaction_open(saver):
        await saver.conn.execute("BEGIN")
        await saver.conn.execute("SELECT 1")

    if how == "transaction open":
        first, first_pid = run_in_worker_loop(_one_run(conninfo, str(uuid.uuid4()), inside=leave_a_transaction_open))
    else:
        first, first_pid = run_in_worker_loop(
            _one_run(conninfo, str(uuid.uuid4()), inside=lambda saver: saver.interrupt())
        )
    assert first.conn.closed
    second, second_pid = run_in_worker_loop(_one_run(conninfo, str(uuid.uuid4())))
    assert second.conn is not first.conn and second_pid != first_pid


def test_outside_a_worker_loop_the_connection_ends_with_its_run(db_name):
    """``asyncio.run`` (a loop of one run) keeps nothing: a connection kept
    there would outlive its loop."""
    conninfo = postgres_conninfo()
    connection.close()
    saver, _ = asyncio.run(_one_run(conninfo, str(uuid.uuid4())))
    assert saver.conn.closed
    _sessions_once(db_name, lambda sessions: not sessions)
    assert _sessions(db_name) == []


def test_a_write_cancelled_inside_its_pipeline_leaves_no_connection_in_pipeline_mode_for_the_next_run(db_name):
    """A State write cancelled at its first wait (the run stopped) can leave
    its connection in pipeline mode with the lock released. Kept, the next
    run's last statement would never be completed: its session stayed
    active, in a transaction, holding the checkpoint tables' locks (found by
    a tester: every time, at the first attempt)."""
    conninfo = postgres_conninfo()
    connection.close()

    async def cancelled_write():
        async with open_checkpointer(conninfo) as saver:
            write = asyncio.create_task(saver.aput(_config(str(uuid.uuid4())), empty_checkpoint(), {"step": 0}, {}))
            await asyncio.sleep(0)
            write.cancel()
            with contextlib.suppress(BaseException):
                await write
        return saver

    for _ in range(5):
        saver = run_in_worker_loop(cancelled_write())
        assert saver.conn.closed or (
            saver.conn.pgconn.pipeline_status == psycopg.pq.PipelineStatus.OFF and saver.conn._pipeline is None
        ), "a connection in pipeline mode was kept"
        run_in_worker_loop(_one_run(conninfo, str(uuid.uuid4())))
        _sessions_once(db_name, lambda sessions: all(state == "idle" for _, state in sessions))
        assert all(state == "idle" for _, state in _sessions(db_name)), _sessions(db_name)


def test_a_write_that_waited_for_the_lock_while_its_run_ended_writes_nothing_R_RUN_4(db_name):
    """A State write of the run waits for the saver's lock; the lock is freed
    and the run ends (its connection kept) before that write resumes: it
    must fail, not write through the connection the next run will use."""
    conninfo = postgres_conninfo()
    connection.close()
    late_thread = str(uuid.uuid4())

    async def scenario():
        async with open_checkpointer(conninfo) as saver:
            await saver.aput(_config(str(uuid.uuid4())), empty_checkpoint(), {"step": 0}, {})
            await saver.lock.acquire()
            late = asyncio.create_task(saver.aput(_config(late_thread), empty_checkpoint(), {"step": 0}, {}))
            await asyncio.sleep(0.05)  # it waits for the lock
            saver.lock.release()
            # The run ends now: its connection is kept before the write resumes.
        kept = not saver.conn.closed
        with pytest.raises(CheckpointerClosed):
            await late
        return kept

    assert run_in_worker_loop(scenario()), "the idle connection was kept"
    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres") as admin:
        written = admin.execute("SELECT count(*) FROM checkpoints WHERE thread_id = %s", [late_thread]).fetchone()[0]
    assert written == 0
