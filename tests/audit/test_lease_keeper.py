"""The worker's lease keeper (``RunExecutor._keep_lease``) on real
PostgreSQL and Redis: the failure cause it leaves for the sweeper while the
database does not answer, and the lease it holds while the run ends
(R-RUN-7, R-RUN-8)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import threading
import time

import pytest
from django.db import connections
from django.utils import timezone

from audit import ledger
from audit.errors import AuditWriteFailed
from audit.execution.checkpoint import postgres_conninfo
from audit.execution.runner import (
    STOP_GRACE_SECONDS,
    RunExecutor,
    _Outcome,
    run_execute,
)
from audit.execution.writes import current_run, write_with_retry
from audit.ledger.causes import failure_causes
from audit.ledger.runs import run_acquire_with_row
from audit.models import AgentRun
from core.config import get_config
from tests.conftest import make_run
from tests.e2e.stack import free_port
from tests.waiting import WAIT_SECONDS

pytestmark = pytest.mark.django_db(transaction=True)


def _unreachable_write(**_kwargs) -> None:
    """An audit write whose database does not answer: a connection to a
    port nobody listens on (Django's OperationalError, as in an outage)."""
    default = connections["default"]
    options = {k: v for k, v in default.settings_dict["OPTIONS"].items() if k != "pool"}
    dead = type(default)({**default.settings_dict, "PORT": free_port(), "OPTIONS": options}, alias="unreachable")
    try:
        dead.ensure_connection()
    finally:
        dead.close()


def test_a_write_failing_while_the_lease_runs_out_leaves_the_cause_before_it_expires_R_RUN_8(thread):
    """A short outage: the database is back after the lease expired, and the
    sweeper may reach the run before its worker's next attempt does. The
    worker left the cause while it still held the lease, so the run ends
    ``audit_write_failed``, not ``lease_expired``. A renewal that succeeds
    in time — while the run works, or while it ends — takes the cause back:
    a later expiry (the worker killed) is not this outage's."""
    run = make_run(thread)
    lease, row = run_acquire_with_row(run_id=run.id, owner="worker-a", ttl_seconds=60)
    executor = RunExecutor(lease=lease, run=row, conninfo=postgres_conninfo())
    executor.config = executor.config.model_copy(update={"LEASE_TTL_SECONDS": 0.9})

    async def failing_write(*, lease_left: float) -> None:
        current_run.set(executor)
        executor.lease_deadline = time.monotonic() + lease_left
        with pytest.raises(AuditWriteFailed):
            await write_with_retry(_unreachable_write)

    def causes_now() -> dict:
        try:
            return failure_causes([run.id])
        finally:
            connections.close_all()  # this helper thread's own connection

    async def renew_once(keeper) -> None:
        # Until a renewal took the cause back (polled: a loaded machine may
        # take longer than one TTL to renew), then stop the keeper.
        task = asyncio.create_task(keeper)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.1)
            if not await asyncio.to_thread(causes_now):
                break
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await executor.redis.aclose()

    asyncio.run(failing_write(lease_left=600))
    assert failure_causes([run.id]) == {}, "far from expiry: nothing left yet"
    asyncio.run(failing_write(lease_left=0.5))
    assert failure_causes([run.id])[run.id][0] == "audit_write_failed"
    asyncio.run(renew_once(executor._keep_lease()))
    assert failure_causes([run.id]) == {}, "renewed while the run works: the cause is taken back"
    asyncio.run(failing_write(lease_left=0.5))
    assert failure_causes([run.id]) != {}
    executor._ending = True
    asyncio.run(renew_once(executor._hold_lease(time.monotonic() - 1)))
    assert failure_causes([run.id]) == {}, "renewed while the run ends: the cause is taken back"
    asyncio.run(failing_write(lease_left=0.5))
    swept = ledger.run_sweep_expired_leases(now=timezone.now() + dt.timedelta(seconds=120))
    assert swept == [run.id]
    run.refresh_from_db()
    assert (run.status, run.error_type) == ("failed", "audit_write_failed")
    assert "failing while the lease ran out" in run.error_message


def test_a_stopped_drive_that_never_ends_leaves_its_lease_to_expire_R_RUN_7(thread, monkeypatch):
    """The keeper renews the lease while a stopped run winds down; a drive
    that never ends (held by something no interrupt of its checkpointer
    frees — here one that ignores its cancellation) must not keep the run
    from ending for ever: after the stop's grace and one lease TTL the
    lease is left to expire, and the sweeper ends the run."""
    ttl = 1.5
    monkeypatch.setattr(get_config(), "LEASE_TTL_SECONDS", ttl)
    release = threading.Event()

    async def drive_ignoring_its_cancellation(self):
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.1)
        return _Outcome(AgentRun.Status.COMPLETED)

    monkeypatch.setattr(RunExecutor, "_drive", drive_ignoring_its_cancellation)
    run = make_run(thread)
    worker = threading.Thread(target=lambda: run_execute(run_id=run.id, owner="worker-a"))
    worker.start()
    try:
        deadline = time.monotonic() + WAIT_SECONDS
        while AgentRun.objects.get(pk=run.id).status != "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ledger.run_request_cancel(user=thread.user, run_id=run.id)
        time.sleep(STOP_GRACE_SECONDS + 4 * ttl)
        assert ledger.run_sweep_expired_leases() == [run.id], "the lease is still renewed"
        run.refresh_from_db()
        assert (run.status, run.error_type) == ("cancelled", "cancelled")
    finally:
        release.set()
        worker.join(30)
