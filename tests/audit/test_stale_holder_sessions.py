"""The sweeper ends a stale lease holder's database sessions in any state
(R-RUN-14), on real PostgreSQL with real connections standing in for a
frozen worker's: idle in a transaction holding the run row, waiting on a
lock while holding it, and blocked writing a large result to a client that
never reads it (``ClientWrite``). None of these test connections has an
``idle_in_transaction_session_timeout``, so only the sweeper can free the
row. The same on a real worker process: ``tests/faults``."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Callable

import psycopg
import pytest
from django.db import connection, transaction
from django.utils import timezone

from audit import ledger
from audit.errors import RunTerminal
from audit.execution.runner import worker_identity
from audit.ledger.lease import lock_run
from audit.models import AgentRun
from conversations.models import Conversation
from core.db import (
    AWAITED_APPLICATION_NAME,
    WORKER_APPLICATION_NAME,
    session_application_name,
    session_tag_of,
    worker_session_tag,
)
from tests.conftest import acquire, make_run

pytestmark = pytest.mark.django_db(transaction=True)

RUNS = AgentRun._meta.db_table
# A query whose result (gigabytes) fills the socket long before it ends:
# a client that never reads leaves its session in wait event ClientWrite.
LARGE_RESULT = b"SELECT repeat('x', 8192) FROM generate_series(1, 100000000)"


def _wait_until(check: Callable[[], object], *, timeout: float = 60, what: str = "") -> object:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what or check}"
        time.sleep(0.05)


def _session(application_name: str) -> psycopg.Connection:
    """A new connection to the test database, named ``application_name``,
    in autocommit (transactions begin with an explicit BEGIN), without the
    worker's session timeouts: only the sweeper may end it."""
    params = connection.get_connection_params()
    for key in ("cursor_factory", "pool", "server_side_binding", "assume_role", "prepare_threshold", "options"):
        params.pop(key, None)
    return psycopg.connect(**{**params, "application_name": application_name}, autocommit=True)


def _activity(pid: int) -> tuple | None:
    """``state, wait_event_type, wait_event`` of the session ``pid``, None
    once it is gone (read afresh on a connection of its own)."""
    with _session("test-observer") as observer:
        return observer.execute(
            "SELECT state, wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %s", [pid]
        ).fetchone()


def _lock_row(conn: psycopg.Connection, run_id: uuid.UUID) -> None:
    conn.execute("BEGIN")
    conn.execute(f"SELECT 1 FROM {RUNS} WHERE id = %s FOR NO KEY UPDATE", [run_id])


def _expire(run_id: uuid.UUID) -> None:
    AgentRun.objects.filter(pk=run_id).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))


def _idle_in_transaction(holder: psycopg.Connection, run_id: uuid.UUID, _bystander: psycopg.Connection) -> None:
    _lock_row(holder, run_id)


def _waiting_on_a_lock(holder: psycopg.Connection, run_id: uuid.UUID, bystander: psycopg.Connection) -> None:
    """The holder locked the run row, then waits for a lock another
    worker's session holds."""
    key = uuid.uuid4().int % 2**62
    bystander.execute("SELECT pg_advisory_xact_lock(%s)", [key])
    _lock_row(holder, run_id)
    holder.pgconn.send_query(f"SELECT pg_advisory_xact_lock({key})".encode())
    while holder.pgconn.flush():
        time.sleep(0.01)


def _blocked_writing_to_its_client(
    holder: psycopg.Connection, run_id: uuid.UUID, _bystander: psycopg.Connection
) -> None:
    """The holder locked the run row, then asked for a large result and
    never reads it (a process frozen while PostgreSQL sends it)."""
    _lock_row(holder, run_id)
    holder.pgconn.send_query(LARGE_RESULT)
    while holder.pgconn.flush():
        time.sleep(0.01)


STATES = {
    "idle in transaction": (_idle_in_transaction, ("idle in transaction", None, None)),
    "waiting on a lock": (_waiting_on_a_lock, ("active", "Lock", "advisory")),
    "blocked writing to its client": (_blocked_writing_to_its_client, ("active", "Client", "ClientWrite")),
}


@pytest.mark.usefixtures("recovery_fail")
@pytest.mark.parametrize("state", list(STATES))
def test_the_sweeper_ends_a_stale_holders_sessions_in_any_state_and_then_the_run_R_RUN_14(state, thread, user):
    """A run whose lease expired while its holder's session holds the run
    row in ``state``: the sweeper ends every session of that holder (its
    lease owner names them), not another worker's nor its own, and ends the
    run ``lease_expired``; the holder's lease then writes nothing."""
    stale_tag, live_tag = "yw" + uuid.uuid4().hex[:16], "yw" + uuid.uuid4().hex[:16]
    run = make_run(thread)
    lease = acquire(run, owner=f"frozen-host:4242:{stale_tag}:0badf00d")
    other_thread = Conversation.objects.create(user=user, agent_id="assistant", model=thread.model)
    other = make_run(other_thread)
    acquire(other, owner=f"live-host:4343:{live_tag}:600dcafe", ttl=600)
    _expire(run.id)

    holder = _session(f"{WORKER_APPLICATION_NAME} {stale_tag}")
    idle_sibling = _session(f"{AWAITED_APPLICATION_NAME} {stale_tag}")  # the holder's other connection
    bystander = _session(f"{WORKER_APPLICATION_NAME} {live_tag}")  # another worker, its lease alive
    bystander.execute("BEGIN")
    bystander.execute(f"SELECT 1 FROM {RUNS} WHERE id = %s FOR NO KEY UPDATE", [other.id])
    setup, (expected_state, wait_type, wait_event) = STATES[state]
    setup(holder, run.id, bystander)
    holder_pid = holder.info.backend_pid
    seen = _wait_until(
        lambda: (
            (found := _activity(holder_pid))
            and found[0] == expected_state
            and (wait_type is None or (found[1], found[2]) == (wait_type, wait_event))
            and found
        ),
        what=f"the holder's session {state}",
    )
    print(f"holder session {holder_pid}: {seen}")
    sweeper_pid = connection.cursor().connection.info.backend_pid
    try:
        ended: list[uuid.UUID] = []
        _wait_until(
            lambda: ended.extend(ledger.run_sweep_expired_leases()) or run.id in ended,
            what="the sweeper to end the run",
        )
        _wait_until(lambda: _activity(holder_pid) is None, what="the holder's session to be gone")
        assert _activity(idle_sibling.info.backend_pid) is None, "every session of the holder is ended"
        # Another worker's session and the sweeper's own live on.
        assert bystander.execute("SELECT 1").fetchone() == (1,)
        assert connection.cursor().connection.info.backend_pid == sweeper_pid
        run.refresh_from_db()
        other.refresh_from_db()
        assert (run.status, run.error_type) == ("failed", "lease_expired")
        assert other.status == "running"
        # The holder, thawed and connected again, may write nothing.
        with pytest.raises(RunTerminal), transaction.atomic():
            lock_run(lease)
    finally:
        for conn in (holder, idle_sibling, bystander):
            conn.close()


def test_a_worker_lease_owner_names_its_processs_sessions_R_RUN_14():
    """The lease owner a worker takes runs under names the session tag its
    connections' ``application_name`` ends with; an owner given by hand
    names none, and a process that does not name its sessions (the web,
    this test) keeps the plain role names."""
    owner = worker_identity()
    assert session_tag_of(owner) == worker_session_tag()
    assert session_tag_of("worker-a") is None and session_tag_of(None) is None
    assert session_application_name(AWAITED_APPLICATION_NAME) == AWAITED_APPLICATION_NAME
    assert len(f"{AWAITED_APPLICATION_NAME} {worker_session_tag()}") <= 63
