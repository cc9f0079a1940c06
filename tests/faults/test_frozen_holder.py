"""A worker frozen (SIGSTOP) while PostgreSQL is blocked writing a large
result to it is ended and its run swept (R-RUN-14, issue 32 item 5): the
``idle_in_transaction_session_timeout`` does not cover a session that is
``active`` in wait event ``ClientWrite``; the sweeper ends every session of
the stale holder, named by its lease owner. The same states with stand-in
connections only: ``tests/audit/test_stale_holder_sessions.py``."""

from __future__ import annotations

import os
import signal
import time

import psycopg
import pytest

from core.db import AWAITED_APPLICATION_NAME, session_tag_of

from .harness import Batch, FaultStack, settle
from .test_faults import verify, wait_for_slow_lookup, wait_until, worker_pgid_of_run

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

# A result of gigabytes: PostgreSQL fills the socket long before its end and
# then waits for a client that never reads (ClientWrite).
# Far more than the socket buffers hold (8 GB), so the server blocks in
# ClientWrite within milliseconds. The series is small on purpose: a
# function scan materialises the whole series before its first row, and
# 100 million rows took minutes on a loaded machine before anything was
# written (the wait for ClientWrite then timed out).
LARGE_RESULT = b"SELECT repeat('x', 8192) FROM generate_series(1, 1000000)"


def _sessions_named(stack: FaultStack, tag: str) -> list[tuple]:
    with stack.db() as conn:
        return conn.execute(
            "SELECT pid, application_name, state FROM pg_stat_activity"
            " WHERE datname = current_database() AND split_part(application_name, ' ', 2) = %s ORDER BY pid",
            [tag],
        ).fetchall()


def _run(stack: FaultStack, run_id: str) -> tuple:
    with stack.db() as conn:
        return conn.execute(
            "SELECT status, error_type, error_message FROM audit_agentrun WHERE id = %s", [run_id]
        ).fetchone()


def test_a_worker_frozen_while_postgres_writes_to_it_is_ended_and_its_run_swept_R_RUN_14(stack):
    """A real prefork worker runs a turn (a slow tool); its sessions are
    named after the session tag its lease owner names. The worker is
    frozen; a session under its name then holds the run row, ``active`` in
    ``ClientWrite`` — the state the frozen worker's own query was found in
    when the product was attacked, which the worker cannot be made to enter
    on cue. After the lease expires the maintenance worker's sweeper ends
    every session of that name, the run ends ``lease_expired``, and after
    SIGCONT the thawed worker writes nothing into it and takes new runs."""
    batch = Batch(stack)
    thread_id = batch.new_thread("user0", "replay:slow_lookup")
    target = batch.submit(thread_id, "archive?")
    wait_for_slow_lookup(stack, target.run_id)
    with stack.db() as conn:
        owner = conn.execute("SELECT lease_owner FROM audit_agentrun WHERE id = %s", [target.run_id]).fetchone()[0]
    tag = session_tag_of(owner)
    assert tag, f"the lease owner {owner!r} names no session tag"
    worker_sessions = wait_until(lambda: _sessions_named(stack, tag), timeout=60)
    print(f"the worker {owner}: sessions {worker_sessions}")
    group = worker_pgid_of_run(stack, target.run_id)
    os.killpg(group, signal.SIGSTOP)
    frozen_at = time.monotonic()
    stand_in = psycopg.connect(
        stack.pg.url("yuxi"), application_name=f"{AWAITED_APPLICATION_NAME} {tag}", autocommit=True, connect_timeout=5
    )
    try:
        stand_in.execute("BEGIN")
        stand_in.execute("SELECT 1 FROM audit_agentrun WHERE id = %s FOR NO KEY UPDATE", [target.run_id])
        stand_in.pgconn.send_query(LARGE_RESULT)
        while stand_in.pgconn.flush():
            time.sleep(0.01)
        with stack.db() as conn:
            seen = wait_until(
                lambda: conn.execute(
                    "SELECT state, wait_event FROM pg_stat_activity WHERE pid = %s AND wait_event = 'ClientWrite'",
                    [stand_in.info.backend_pid],
                ).fetchone(),
                timeout=120,
            )
        print(f"the frozen holder's session {stand_in.info.backend_pid}: {seen}")
        # Lease TTL 8 s, sweeps every 0.5 s (FAST_SETTINGS): a generous bound.
        wait_until(lambda: _run(stack, target.run_id)[0] != "running", timeout=90)
        swept_after = time.monotonic() - frozen_at
        status, error_type, message = _run(stack, target.run_id)
        assert (status, error_type) == ("failed", "lease_expired"), (status, error_type, message)
        wait_until(lambda: not _sessions_named(stack, tag), timeout=60)
    finally:
        os.killpg(group, signal.SIGCONT)
        stand_in.close()
    print(f"frozen holder's run ended {swept_after:.1f} s after the freeze")
    settle(stack, batch, timeout=60)
    assert _run(stack, target.run_id)[:2] == ("failed", "lease_expired"), "the thawed worker wrote into the run"
    verify("worker SIGSTOP while PostgreSQL writes to it", stack, batch, swept_after)
