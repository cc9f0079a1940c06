"""The one lease helper: every write into a run goes through :func:`lock_run`.

A lease is the right of one worker to write into one run. It lives in the
``AgentRun`` row (owner, fencing token, expiry) and is checked under the row
lock, so a stale worker can never write after another owner took over or
after the run ended (R-RUN-3, R-RUN-4, R-RUN-7).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from .errors import LeaseExpired, LeaseLost, RunIdentityMismatch, RunTerminal
from .models import AgentRun


@dataclass(frozen=True)
class Lease:
    """What a worker holds after acquiring a run: identity plus fencing token."""

    run_id: uuid.UUID
    request_id: str
    thread_id: uuid.UUID
    owner: str
    fencing_token: int


def lock_run(lease: Lease, *, now: datetime | None = None) -> AgentRun:
    """Lock the run row and prove the caller still owns it.

    Must be called inside ``transaction.atomic()``: the lock is
    ``SELECT … FOR NO KEY UPDATE`` on the ``AgentRun`` row (only that row,
    so concurrent inserts of its messages are not blocked) and is held until
    the caller's transaction ends. Checks, in order: the run exists and its
    request id and thread id equal the lease's; the owner and fencing token
    are the lease's; the lease has not expired; the run is not terminal.

    Raises:
        RunIdentityMismatch: no such run, or request/thread id differ.
        LeaseLost: another owner or a newer fencing token holds the run.
        LeaseExpired: the lease expired (the sweeper will fail the run).
        RunTerminal: the run already ended.

    Implements R-RUN-4.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("lock_run must be called inside transaction.atomic()")
    run = AgentRun.objects.select_for_update(no_key=True, of=("self",)).filter(pk=lease.run_id).first()
    if run is None or run.request_id != lease.request_id or run.thread_id != lease.thread_id:
        raise RunIdentityMismatch(f"run {lease.run_id} does not match the lease identity")
    if run.lease_owner != lease.owner or run.fencing_token != lease.fencing_token:
        raise LeaseLost(
            f"run {run.id} is held by {run.lease_owner!r} with token {run.fencing_token}, "
            f"not {lease.owner!r} with token {lease.fencing_token}"
        )
    if run.is_terminal:
        raise RunTerminal(f"run {run.id} is already {run.status}")
    now = now or timezone.now()
    if run.lease_expires_at is None or run.lease_expires_at <= now:
        raise LeaseExpired(f"lease on run {run.id} expired at {run.lease_expires_at}")
    return run
