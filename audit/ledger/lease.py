"""The one lease helper: every write into a run is fenced by the lease.

A lease is the right of one worker to write into one run. It lives in the
``AgentRun`` row (owner, fencing token, expiry) and is checked under the row
lock, so a stale worker can never write after another owner took over or
after the run ended (R-RUN-3, R-RUN-4, R-RUN-7).

Two forms of the same lock and the same checks:

* :func:`lock_run` locks the row inside the caller's transaction and checks
  it in Python — for writes made of several statements (the terminal
  transaction, renewal, the rare paths of the audit writes);
* :func:`audit.ledger.fenced.leased_run_sql` is the lock and the checks as
  one SQL query that a write puts in front of its own statement (``WITH
  leased_run AS (…) INSERT … SELECT … FROM leased_run``), so lock, check
  and write are one round trip; it lives beside the statements that use
  it, so a lifecycle write's whole SQL is read in one file. When such a
  write touched nothing, :func:`lease_check` reads the row and raises the
  error that names why (R-RUN-4).
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass
from datetime import datetime

from django.db import connection, transaction
from django.utils import timezone

from core.db import (
    execute_prepared,
    execute_prepared_in_pipeline,
    field_converters,
    in_transaction,
    model_from_values,
)

from ..errors import LeaseError, LeaseExpired, LeaseLost, RunIdentityMismatch, RunTerminal
from ..models import AgentRun


@dataclass(frozen=True)
class Lease:
    """What a worker holds after acquiring a run: identity plus fencing
    token, the run's configured model (it never changes; model rows are
    priced with it, R-COST-1 — empty on a hand-built lease: then it is read)
    and the run's turn id (it never changes either; tool rows' effect keys
    are made of it, R-EFF-1 — None on a hand-built lease: then it is read)."""

    run_id: uuid.UUID
    request_id: str
    thread_id: uuid.UUID
    owner: str
    fencing_token: int
    model: str = ""
    turn_id: uuid.UUID | None = None


# The run columns the checks read, in the order of :func:`lease_refusal`.
_LEASE_COLUMNS = ("request_id", "thread_id", "lease_owner", "fencing_token", "status", "lease_expires_at")


def lease_refusal(lease: Lease, facts: tuple | None, *, now: datetime) -> LeaseError | None:
    """The error that refuses a write under ``lease``, or None when the lease
    holds. ``facts`` are the run row's ``request_id, thread_id, lease_owner,
    fencing_token, status, lease_expires_at`` (None: no such run).

    Checks, in order: the run exists and its request id and thread id equal
    the lease's (:class:`RunIdentityMismatch`); the owner and fencing token
    are the lease's (:class:`LeaseLost`); the run is not terminal
    (:class:`RunTerminal`); the lease has not expired at ``now``
    (:class:`LeaseExpired`). Implements R-RUN-4.
    """
    if facts is None or facts[0] != lease.request_id or facts[1] != lease.thread_id:
        return RunIdentityMismatch(f"run {lease.run_id} does not match the lease identity")
    _, _, owner, token, status, expires_at = facts
    if owner != lease.owner or token != lease.fencing_token:
        return LeaseLost(
            f"run {lease.run_id} is held by {owner!r} with token {token}, "
            f"not {lease.owner!r} with token {lease.fencing_token}"
        )
    if status in AgentRun.TERMINAL_STATUSES:
        return RunTerminal(f"run {lease.run_id} is already {status}")
    if expires_at is None or expires_at <= now:
        return LeaseExpired(f"lease on run {lease.run_id} expired at {expires_at}")
    return None


def lock_run(lease: Lease, *, now: datetime | None = None, only: tuple[str, ...] | None = None) -> AgentRun:
    """Lock the run row and prove the caller still owns it.

    Must be called inside ``transaction.atomic()``: the lock is
    ``SELECT … FOR NO KEY UPDATE`` on the ``AgentRun`` row (only that row,
    so concurrent inserts of its messages are not blocked) and is held until
    the caller's transaction ends. ``only``: the fields to read (the lease
    checks' are added; the others load on access), else every field. Checks, in order: the run exists and its
    request id and thread id equal the lease's; the owner and fencing token
    are the lease's; the run is not terminal; the lease has not expired.

    Raises:
        RunIdentityMismatch: no such run, or request/thread id differ.
        LeaseLost: another owner or a newer fencing token holds the run.
        LeaseExpired: the lease expired (the sweeper will fail the run).
        RunTerminal: the run already ended.

    Implements R-RUN-4.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("lock_run must be called inside transaction.atomic()")
    if only is None:
        run = AgentRun.objects.select_for_update(no_key=True, of=("self",)).filter(pk=lease.run_id).first()
    else:
        run = _lock_only(lease.run_id, tuple(dict.fromkeys((*_LEASE_COLUMNS, *only))))
    return _proved(lease, run, now=now)


def lock_run_then_read(
    lease: Lease, *, only: tuple[str, ...], read: tuple[str, list], now: datetime | None = None
) -> tuple[AgentRun, list[tuple]]:
    """:func:`lock_run` with the fields ``only``, then the prepared
    statement ``read`` (``(sql, params)``, params known without the run) in
    the same round trip, the transaction's start included; returns the run
    and ``read``'s rows. ``read`` runs once the lock is held, so it sees
    every write committed before; when the lease does not hold, its rows
    are dropped and the lease error raised, as :func:`lock_run` raises."""
    if not in_transaction():
        raise RuntimeError("lock_run_then_read must be called inside a transaction")
    sql, fields, converters = _lock_only_sql(tuple(dict.fromkeys((*_LEASE_COLUMNS, *only))))
    locked, rows = execute_prepared_in_pipeline([(sql, [lease.run_id]), read])
    run = model_from_values(AgentRun, fields, converters, locked[0]) if locked else None
    return _proved(lease, run, now=now), rows


def _proved(lease: Lease, run: AgentRun | None, *, now: datetime | None) -> AgentRun:
    """``run`` (locked, or None when absent) if the lease holds on it, else
    the lease error of :func:`lease_refusal`."""
    facts = None if run is None else tuple(getattr(run, name) for name in _LEASE_COLUMNS)
    refusal = lease_refusal(lease, facts, now=now or timezone.now())
    if refusal is not None:
        raise refusal
    return run


def _lock_only(run_id: uuid.UUID, names: tuple[str, ...]) -> AgentRun | None:
    """The run row locked as :func:`lock_run` locks it, with the fields
    ``names`` loaded (a prepared statement per set of names)."""
    sql, fields, converters = _lock_only_sql(names)
    found = execute_prepared(sql, [run_id])
    return None if found is None else model_from_values(AgentRun, fields, converters, found)


@functools.cache
def _lock_only_sql(names: tuple[str, ...]) -> tuple[str, list, list]:
    fields = [f for f in AgentRun._meta.concrete_fields if f.primary_key or f.name in names or f.attname in names]
    converters = field_converters(fields, AgentRun._meta.db_table, connection)
    qn = connection.ops.quote_name
    sql = (
        f"SELECT {', '.join(qn(f.column) for f in fields)} FROM {qn(AgentRun._meta.db_table)} "
        "WHERE id = %s FOR NO KEY UPDATE"
    )
    return sql, fields, converters


def lease_check(lease: Lease, *, now: datetime) -> None:
    """Read the run row (no lock) and raise the error that refuses a write
    under ``lease`` at ``now`` (see :func:`lease_refusal`); return when the
    lease holds. Called after a statement fenced by :func:`leased_run_sql`
    touched nothing, to tell a lease failure from the write's own
    condition. A lease only gets worse between the two (renewal needs a
    valid lease; takeover and termination are final), so the error read
    here is the one the statement met."""
    facts = AgentRun.objects.filter(pk=lease.run_id).values_list(*_LEASE_COLUMNS).first()
    refusal = lease_refusal(lease, facts, now=now)
    if refusal is not None:
        raise refusal
