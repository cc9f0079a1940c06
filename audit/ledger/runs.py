"""Run submission, lease acquisition and renewal, cancellation (R-RUN-1..3, R-RUN-6)."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import uuid
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models import Case, Exists, Max, OuterRef, Subquery, When
from django.utils import timezone

from conversations.models import Conversation, Message
from core.config import get_config
from core.db import (
    execute_prepared,
    field_converters,
    holder_sessions_end,
    model_from_values,
    session_tag_of,
    stand_ins_bound,
    stand_ins_checked,
)
from core.errors import InvalidInput, NotFound
from costs.budgets import budget_admit
from ops import metrics
from webhooks.targets import webhook_checked

from ..errors import RunNotCancellable, RunNotResumable, RunNotStartable, ThreadBusy, ThreadInterrupted
from ..models import AgentRun, RunCancelRequest, RunRollback, pending_action_requests
from .cancellation import cancel_signal_send
from .handover import enqueue_run
from .idempotency import existing_request, resume_fingerprint, turn_fingerprint
from .lease import Lease, lock_run
from .locks import web_lock_wait
from .terminal import _terminate, run_requeue_attempt
from .turns import at_head, head_turn, holding, holding_runs

log = logging.getLogger(__name__)

Status = AgentRun.Status
ExecStatus = Message.ExecutionStatus

# --------------------------------------------------------------------------
# Submission (R-RUN-1)
# --------------------------------------------------------------------------


# What a new turn does to a thread's runs still pending or running
# (R-API-2, "double texting").
MULTITASK_STRATEGIES = ("enqueue", "reject", "interrupt", "rollback")


def run_submit(
    *,
    user,
    thread_id: uuid.UUID,
    request_id: str,
    text: str,
    multitask_strategy: str = "enqueue",
    webhook: str = "",
) -> tuple[AgentRun, bool]:
    """Submit one user turn to a thread.

    Args:
        user: the thread's owner.
        thread_id: the conversation; another user's thread is not found.
        request_id: the client's idempotency key (1–200 characters).
        text: the user's input (non-empty).
        multitask_strategy: what happens to the thread's runs still pending
            or running (R-API-2): ``enqueue`` (the new turn runs after them,
            in order), ``reject`` (refused while there is one), or
            ``interrupt`` (they are cancelled, R-RUN-6: a running one stops
            at its next event boundary, ``cancelled`` with its open rows
            ``interrupted``; the cancel requests commit with the new run,
            which runs once they have ended), or ``rollback`` (as
            ``interrupt``; and the turns of those runs, earlier runs of the
            turn included, leave the history and the memory: their audit
            rows stay, marked by a :class:`~audit.models.RunRollback`, and
            the new run starts from the agent's State before them). A
            repeat of the same request returns its run and cancels nothing.
        webhook: a URL to announce the run's end to (R-API-3,
            :mod:`webhooks`), or ``""``; a repeat of the same request
            keeps the first request's.

    An untitled thread takes its title from ``text`` with the run
    (:meth:`~conversations.models.Conversation.name_after`, R-API-1).

    Returns ``(run, created)``. The same request again (same user, key,
    thread and text — also when both arrive at once) returns the existing
    run with ``created=False`` and enqueues nothing.

    Raises:
        NotFound: no such thread for this user.
        RequestIdReused: the user used ``request_id`` for a different
            request (another thread or text, or a resume); 409.
        ThreadInterrupted: the thread waits for an approval (409
            ``thread_interrupted``, ``run_id`` the run to resume or cancel),
            whatever the strategy.
        ThreadBusy: ``reject`` and a run of the thread is pending or
            running (409 ``thread_busy``, ``runs``: their ids).
        BudgetExceeded: the user's budget has no room for another run
            (402, R-COST-3; checked in the same transaction).
        InvalidInput: empty text or an unknown strategy (422).
        WebhookNotAllowed: a ``webhook`` the product will not call (422
            ``webhook_not_allowed``, :func:`webhooks.targets.webhook_checked`).

    Implements R-RUN-1, R-IDEM-1, R-API-2 and R-API-3; the run is enqueued only
    after commit.
    """
    if not text.strip():
        raise InvalidInput("input.text must not be empty")
    if multitask_strategy not in MULTITASK_STRATEGIES:
        raise InvalidInput(
            f"multitask_strategy must be one of {', '.join(MULTITASK_STRATEGIES)}",
            extra={"reason": "bad_multitask_strategy"},
        )
    if webhook:
        webhook_checked(webhook)
    fingerprint = turn_fingerprint(thread_id=thread_id, text=text)
    existing = existing_request(user=user, request_id=request_id, fingerprint=fingerprint)
    if existing is not None:
        return existing, False
    try:
        with web_lock_wait():
            # Serialises submissions of one thread, so the interrupt check
            # and FIFO order see every earlier run.
            thread = _lock_thread(user=user, thread_id=thread_id)
            # A retry that waited for the lock finds the run its twin created.
            existing = existing_request(user=user, request_id=request_id, fingerprint=fingerprint)
            if existing is not None:
                return existing, False
            held = _held_unless_interrupted(thread)
            # The thread row is locked: no run of it starts or is submitted
            # meanwhile, so these are all the runs the new turn meets.
            active = (
                []
                if multitask_strategy == "enqueue"
                else [str(pk) for pk in AgentRun.objects.filter(thread=thread).active().values_list("pk", flat=True)]
            )
            if active and multitask_strategy == "reject":
                raise ThreadBusy(
                    f"the thread has {len(active)} run(s) pending or running; wait for them, or submit with "
                    "multitask_strategy enqueue, interrupt or rollback",
                    extra={"runs": active},
                )
            budget_admit(user=user)  # R-COST-3: 402 and nothing created
            if thread.name_after(text):
                # An untitled thread takes its first turn's words, whoever
                # created it (the API, the chat page): a list can tell it apart.
                thread.save(update_fields=["title", "updated_at"])
            run = AgentRun.objects.create(
                request_id=request_id,
                request_fingerprint=fingerprint,
                thread=thread,
                user=user,
                agent_id=thread.agent_id,
                model=thread.model,
                input={"text": text},
                webhook=webhook,
            )
            Message.objects.create(thread=thread, run=run, role=Message.Role.USER, content=text)
            if active:
                # Recorded with the new run: a worker applies them at its next
                # lease check even if this process stops right after commit.
                _cancel_requests_record(active, at=timezone.now())
                if multitask_strategy == "rollback":
                    _rollbacks_record(thread, active, by_run=run)
            _enqueue_on_commit(run.id, held=held)
    except IntegrityError:
        # A concurrent request of another thread with the same key won the
        # insert: the same request is a retry, any other a reuse.
        existing = existing_request(user=user, request_id=request_id, fingerprint=fingerprint)
        if existing is None:
            raise
        return existing, False
    for run_id in active:
        # Wake the workers and cancel the pending ones now (R-RUN-6).
        with contextlib.suppress(RunNotCancellable):  # it ended meanwhile
            run_request_cancel(user=user, run_id=run_id)
    return run, True


def _lock_thread(*, user, thread_id: uuid.UUID) -> Conversation:
    # NO KEY UPDATE: a worker's message insert holds KEY SHARE on the thread
    # row (its foreign key) until its transaction ends; submissions must not
    # queue behind it (R-RUN-10), only behind each other.
    thread = Conversation.objects.select_for_update(no_key=True).visible_to(user).filter(pk=thread_id).first()
    if thread is None:
        raise NotFound("thread not found")
    return thread


def _held_unless_interrupted(thread: Conversation) -> bool:
    """Whether a run of the (locked) thread holds it
    (:func:`~audit.ledger.turns.holding`), in one read that also refuses
    the submission when any of them waits for an approval (interrupted,
    not resumed) — not only the newest run: a turn submitted while the
    earlier one was still running does not open the thread.

    Raises:
        ThreadInterrupted: the earliest such run is named (409
            ``thread_interrupted``)."""
    first = (
        AgentRun.objects.filter(thread=thread)
        .filter(holding())
        .order_by(Case(When(status=Status.INTERRUPTED, then=0), default=1), "created_at")
        .values_list("pk", "status")
        .first()
    )
    if first is not None and first[1] == Status.INTERRUPTED:
        raise ThreadInterrupted(
            f"the thread waits for an approval: resume or cancel run {first[0]} first",
            extra={"reason": "thread_interrupted", "run_id": str(first[0])},
        )
    return first is not None


def _enqueue_on_commit(run_id: uuid.UUID, *, held: bool = True) -> None:
    """After commit, hand the new run to a worker if it is at its thread's
    head (:mod:`.turns`, R-RUN-9); a run queued behind another turn is
    handed over when the run before it ends (:mod:`.terminal`).

    ``held=False``: the submission's transaction, with the thread row
    locked, saw no run holding the thread, so the new run is its head (a
    turn submitted later queues behind it) and is handed over without a
    read. Otherwise the head is read after the commit, in a snapshot of its
    own: a run ending meanwhile either committed before this read (it is
    seen ended, the new run is at the head) or reads the thread's head
    after this commit (it sees the new run and hands it over). Either way
    the run is handed over at least once; the dispatcher covers a lost
    message, and a failed read (never raised: the submission has
    committed)."""
    if not held:
        transaction.on_commit(lambda: enqueue_run(run_id))
        return

    def hand_over() -> None:
        try:
            at_front = AgentRun.objects.filter(pk=run_id).filter(at_head()).exists()
        except DatabaseError as exc:
            # The submission has committed and answers as such; the
            # dispatcher hands a head run over after its grace (R-RUN-9).
            log.warning("run %s not handed over (the dispatcher will): %s: %s", run_id, type(exc).__name__, exc)
            return
        if at_front:
            enqueue_run(run_id)
        else:
            log.debug("run %s waits behind an earlier turn of its thread", run_id)

    transaction.on_commit(hand_over)


# --------------------------------------------------------------------------
# Lease (R-RUN-2, R-RUN-3, R-RUN-7)
# --------------------------------------------------------------------------


def run_acquire(*, run_id: uuid.UUID, owner: str, ttl_seconds: float, now: datetime | None = None) -> Lease:
    """Take the lease on a pending run.

    Locks the run row (the usual run: by the ``UPDATE … RETURNING`` that
    takes it; any other: ``SELECT … FOR NO KEY UPDATE`` first), checks that
    the run is ``pending`` and that no run of an earlier turn of its thread
    holds the thread (FIFO, see :func:`_earlier_blocking_run`),
    then moves it to ``running``, sets the owner, increments the fencing
    token and sets the expiry ``now + ttl_seconds``.

    Raises:
        NotFound: no such run.
        RunNotStartable: the run is not pending (a second delivery, or it
            was cancelled) or an earlier run of its thread is active; the
            caller does nothing — the earlier run's end enqueues this one.

    Implements R-RUN-2 and R-RUN-3.
    """
    return run_acquire_with_row(run_id=run_id, owner=owner, ttl_seconds=ttl_seconds, now=now)[0]


def run_acquire_with_row(
    *, run_id: uuid.UUID, owner: str, ttl_seconds: float, now: datetime | None = None
) -> tuple[Lease, AgentRun]:
    """:func:`run_acquire`, returning the acquired run row as well (the
    worker needs it to start the run: no second read). Same errors.

    The row carries ``thread_has_earlier_run``: False when no other run of
    its thread was created before it (its thread's first run: there is no
    history to rebuild, R-READ-2); and ``thread_has_rollback``: False when
    no run of its thread was rolled back (R-API-2; the run then starts from
    the thread's newest checkpoint without reading the rollbacks).

    The usual run — pending, and no run of another turn holds its thread —
    is acquired by one statement (:func:`_acquire_unheld`); any other goes
    through the full check, which names the reason it cannot start."""
    now = now or timezone.now()
    expires_at = now + timedelta(seconds=ttl_seconds)
    run = _acquire_unheld(run_id=run_id, owner=owner, expires_at=expires_at, now=now)
    if run is None:
        run = _acquire_checked(run_id=run_id, owner=owner, expires_at=expires_at, now=now)
    return Lease(
        run_id=run.id,
        request_id=run.request_id,
        thread_id=run.thread_id,
        owner=owner,
        fencing_token=run.fencing_token,
        model=run.model,
        turn_id=run.turn_id,
    ), run


def _acquire_unheld(*, run_id: uuid.UUID, owner: str, expires_at: datetime, now: datetime) -> AgentRun | None:
    """Acquire the run in one statement (its own transaction, or the
    caller's) when it is pending and no run of another turn of its thread
    holds the thread (:func:`~audit.ledger.turns.holding_runs`: then no earlier turn can block
    it, R-RUN-2); the row comes back with ``thread_has_earlier_run`` and
    ``thread_has_rollback``. None, changing nothing, otherwise.

    The row lock is the UPDATE's own. The holding check reads the snapshot
    of the statement's start even when it waited for the lock, which errs
    only towards "held": runs of other turns join the holding set only as
    later turns (a resume run joins it in the transaction that releases its
    interrupted run), and a later turn makes this path give way to the full
    check."""
    sql, candidate_params, fields, converters = _acquire_unheld_sql()
    params = [Status.RUNNING, owner, expires_at, now, timezone.now()]
    params += stand_ins_bound(candidate_params, {_RUN_STANDIN: run_id})
    # Prepared: planning this statement (its subqueries on the thread's
    # runs) took ten times its execution, at every run's start (issue 11).
    found = execute_prepared(sql, [*params, Status.PENDING])
    if found is None:
        return None
    *values, has_earlier, has_rollback = found
    run = model_from_values(AgentRun, fields, converters, values)
    run.thread_has_earlier_run = has_earlier
    run.thread_has_rollback = has_rollback
    metrics.lease_acquired(run)
    return run


# Compiled into the fast path's statement in place of the run id, found
# again by identity and replaced at each call.
_RUN_STANDIN = uuid.UUID(int=0x5EED)


@functools.cache
def _acquire_unheld_sql() -> tuple[str, tuple, list, list]:
    """The fast path's statement, its parameters between the SET values
    and the pending status, and the run's fields it returns (before
    ``thread_has_earlier_run`` and ``thread_has_rollback``) with their
    converters. The run it may take, with the thread's holding runs
    (:func:`~audit.ledger.turns.holding_runs`), ``thread_has_earlier_run``
    (:func:`_earlier_run_exists`) and ``thread_has_rollback``
    (:func:`_rollback_exists`), is the ORM's own query, compiled once, so
    no rule is typed twice; the status is checked on the updated row
    itself, so a run another worker took meanwhile is never taken again."""
    candidate = (
        AgentRun.objects.filter(pk=_RUN_STANDIN)
        .filter(~Exists(holding_runs(OuterRef("thread_id"), OuterRef("turn_id"))))
        .annotate(
            thread_has_earlier_run=_earlier_run_exists(),
            thread_has_rollback=_rollback_exists(),
            others_finished=_other_turns_finished(),
        )
        .order_by()
        .values("pk", "thread_has_earlier_run", "thread_has_rollback", "others_finished")
    )
    candidate_sql, candidate_params = candidate.query.get_compiler(using=connection.alias).as_sql()
    candidate_params = stand_ins_checked(candidate_params, _RUN_STANDIN)
    q = connection.ops.quote_name
    table = q(AgentRun._meta.db_table)
    fields = list(AgentRun._meta.concrete_fields)
    columns = ", ".join(f"r.{q(f.column)}" for f in fields)
    sql = (
        f"UPDATE {table} AS r SET status = %s, lease_owner = %s, fencing_token = r.fencing_token + 1, "
        "lease_expires_at = %s, started_at = COALESCE(r.started_at, GREATEST(%s, c.others_finished)), "
        "updated_at = %s "
        f"FROM ({candidate_sql}) c(id, thread_has_earlier_run, thread_has_rollback, others_finished) "
        "WHERE r.id = c.id AND r.status = %s "
        f"RETURNING {columns}, c.thread_has_earlier_run, c.thread_has_rollback"
    )
    return sql, candidate_params, fields, field_converters(fields, AgentRun._meta.db_table, connection)


def _earlier_run_exists() -> Exists:
    """Whether another run of the outer run's thread was created before it
    (or at the same instant): false for a thread's first run."""
    return Exists(
        AgentRun.objects.filter(thread_id=OuterRef("thread_id"), created_at__lte=OuterRef("created_at"))
        .exclude(pk=OuterRef("pk"))
        .values("pk")
    )


def _rollback_exists() -> Exists:
    """Whether a run of the outer run's thread was rolled back (R-API-2):
    false for almost every thread, and then the run's start reads no
    rollback. The thread's runs (its ``thread_id`` index) are looked up in
    the rollbacks by their primary key (``run_id``): a few pages."""
    return Exists(RunRollback.objects.filter(run__thread_id=OuterRef("thread_id")).values("pk"))


def _other_turns(thread_id, turn_id):
    """The runs of the thread's other turns."""
    return AgentRun.objects.filter(thread_id=thread_id).exclude(turn_id=turn_id).order_by()


def _other_turns_finished() -> Subquery:
    """When the last run of the outer run's thread's other turns ended (null
    if none has). A run's recorded start is never before it: the clock is
    read before the run row is reached (a connection, a lock may be waited
    for meanwhile), and a run it waited for may end in between; the
    recorded times then still show the thread's turns one after the other
    (R-RUN-2)."""
    return Subquery(
        _other_turns(OuterRef("thread_id"), OuterRef("turn_id"))
        .values("thread_id")
        .annotate(last=Max("finished_at"))
        .values("last")
    )


def _acquire_checked(*, run_id: uuid.UUID, owner: str, expires_at: datetime, now: datetime) -> AgentRun:
    """The full acquisition: lock the row, check it is pending and that no
    earlier turn holds the thread (R-RUN-2), take the lease. Raises
    NotFound or RunNotStartable."""
    with transaction.atomic():
        run = (
            AgentRun.objects.select_for_update(no_key=True, of=("self",))
            .annotate(thread_has_earlier_run=_earlier_run_exists(), thread_has_rollback=_rollback_exists())
            .filter(pk=run_id)
            .first()
        )
        if run is None:
            raise NotFound(f"run {run_id} not found")
        if run.status != Status.PENDING:
            raise RunNotStartable(f"run {run_id} is {run.status}, not pending")
        blocking = _earlier_blocking_run(run)
        if blocking is not None:
            raise RunNotStartable(f"run {run_id} waits for run {blocking.id} ({blocking.status}) of its thread")
        run.status = Status.RUNNING
        run.lease_owner = owner
        run.fencing_token += 1
        run.lease_expires_at = expires_at
        # Read once the row is locked: the statement that locked it saw the
        # snapshot taken before it waited for the lock, the blocking check
        # above a later one (a turn that ended meanwhile is over for it).
        others_finished = _other_turns(run.thread_id, run.turn_id).aggregate(last=Max("finished_at"))["last"]
        run.started_at = run.started_at or max(now, others_finished or now)
        run.save(
            update_fields=["status", "lease_owner", "fencing_token", "lease_expires_at", "started_at", "updated_at"]
        )
        metrics.lease_acquired(run)
    return run


def _earlier_blocking_run(run: AgentRun) -> AgentRun | None:
    """The run of an earlier turn of the same thread that ``run`` must wait
    for, or None (R-RUN-2): the first holding run of the thread's head turn
    (:func:`~audit.ledger.turns.head_turn`) when that turn is not ``run``'s
    own. ``run`` is pending, so its own turn holds the thread and the head
    is never a later turn. One statement."""
    return (
        holding_runs(run.thread_id, run.turn_id)
        .filter(turn_id=Subquery(head_turn(run.thread_id)))
        .order_by("created_at", "id")
        .first()
    )


@metrics.audit_write("lease_renew")
def lease_renew(*, lease: Lease, ttl_seconds: float, now: datetime | None = None) -> str:
    """Extend the caller's lease to ``now + ttl_seconds``.

    Returns the run's status, so the owner learns of ``cancel_requested``;
    applies a cancel request recorded while the row was held (R-RUN-10).
    Raises what :func:`lock_run` raises. Implements R-RUN-7 (the owner
    renews while it works).
    """
    now = now or timezone.now()
    with transaction.atomic():
        run = lock_run(lease, now=now)
        AgentRun.objects.filter(pk=run.pk).update(lease_expires_at=now + timedelta(seconds=ttl_seconds))
        metrics.lease_renewed()
        # The holder applies a cancel request recorded while it held the
        # row (R-RUN-10).
        if RunCancelRequest.objects.filter(run_id=run.pk, applied_at__isnull=True).update(applied_at=now):
            if run.status == Status.RUNNING:
                AgentRun.objects.filter(pk=run.pk).update(status=Status.CANCEL_REQUESTED, cancel_requested_at=now)
            return Status.CANCEL_REQUESTED
        return run.status


# --------------------------------------------------------------------------
# Cancellation (R-RUN-6)
# --------------------------------------------------------------------------


_PENDING_CANCEL_RETRIES = 3


def run_request_cancel(*, user, run_id: uuid.UUID) -> AgentRun:
    """Ask for a run to stop, without waiting for its row lock.

    The request is recorded first, in its own table, by an insert that
    needs no lock on the run row (:class:`~audit.models.RunCancelRequest`),
    and the worker is signalled over Redis. Then it is applied at once if
    the run row is free (``SKIP LOCKED``): a pending run is cancelled (it
    never starts); a running run becomes ``cancel_requested`` and its worker
    ends it ``cancelled`` at the next event boundary; an ``interrupted`` run
    that was not resumed is cancelled, which lets the thread take new turns
    again. When a worker holds the row, the worker (at its next lease check)
    or the dispatcher applies the request; the returned run then shows
    ``cancel_requested``. A cancelled run is returned unchanged (a cancel
    repeated is answered, not refused).

    Answers without waiting on any row lock (R-RUN-10).

    Raises:
        NotFound: no such run for this user (R-READ-5).
        RunNotCancellable: the run ended ``completed``, ``failed``, or
            ``interrupted`` and was resumed; nothing is recorded.

    Implements R-RUN-6 and R-RUN-10.
    """
    run = AgentRun.objects.filter(pk=run_id, user=user).first()
    if run is None:
        raise NotFound("run not found")
    if run.is_terminal and not _awaits_approval(run):
        if run.status == Status.CANCELLED:
            return run
        _refuse_cancel(run)
    now = timezone.now()
    _cancel_requests_record([run.id], at=now)
    if run.status in (Status.RUNNING, Status.CANCEL_REQUESTED):
        # Wake the worker now rather than at its next database poll; the
        # recorded request stays the source of truth.
        cancel_signal_send(run_id=run.id)
    applied = cancel_request_apply(run_id=run.id)
    # A worker that finds a pending run still queued behind its thread holds
    # the row for a few milliseconds: try again briefly (at most about
    # 150 ms, never waiting on the lock) before leaving the request to the
    # worker or the dispatcher.
    for _ in range(_PENDING_CANCEL_RETRIES if run.status == Status.PENDING else 0):
        if applied is not None:
            break
        time.sleep(0.05)
        applied = cancel_request_apply(run_id=run.id)
    if applied is not None:
        return applied
    # A worker holds the row: the request is recorded, it will apply it.
    if run.status in (Status.PENDING, Status.RUNNING):
        run.status = Status.CANCEL_REQUESTED
        run.cancel_requested_at = now
    return run


def _rollbacks_record(thread: Conversation, run_ids: list, *, by_run: AgentRun) -> None:
    """Mark the turns of ``run_ids`` (every run of each, resumes and the
    runs they resumed) rolled back by ``by_run`` (R-API-2)."""
    turns = AgentRun.objects.filter(pk__in=run_ids).values("turn_id")
    rolled = AgentRun.objects.filter(thread=thread, turn_id__in=turns).exclude(pk=by_run.pk)
    RunRollback.objects.bulk_create(
        [RunRollback(run_id=pk, by_run=by_run) for pk in rolled.values_list("pk", flat=True)],
        ignore_conflicts=True,
    )


def _cancel_requests_record(run_ids: list, *, at: datetime) -> None:
    """Record (or renew) a cancel request for each of ``run_ids`` (R-RUN-6)."""
    RunCancelRequest.objects.bulk_create(
        [RunCancelRequest(run_id=run_id, requested_at=at, applied_at=None) for run_id in run_ids],
        update_conflicts=True,
        unique_fields=["run"],
        update_fields=["requested_at", "applied_at"],
    )


def _refuse_cancel(run: AgentRun) -> None:
    extra: dict[str, Any] = {"status": run.status}
    resumed_by = AgentRun.objects.filter(resumed_from=run).values_list("pk", flat=True).first()
    if resumed_by is not None:
        extra["resumed_by"] = str(resumed_by)
        raise RunNotCancellable(f"run {run.pk} was resumed by run {resumed_by}: cancel that run", extra=extra)
    raise RunNotCancellable(f"run {run.pk} already ended {run.status}: nothing to cancel", extra=extra)


def _awaits_approval(run: AgentRun) -> bool:
    return run.status == Status.INTERRUPTED and not AgentRun.objects.filter(resumed_from=run).exists()


def cancel_request_apply(*, run_id: uuid.UUID) -> AgentRun | None:
    """Apply the run's cancel request if the run row is free now.

    Locks the row with ``FOR NO KEY UPDATE SKIP LOCKED``; returns None,
    changing nothing, when another transaction holds it. Otherwise: a
    pending run, or an interrupted run awaiting approval, is cancelled; a
    running run becomes ``cancel_requested`` (its worker is signalled after
    commit); then the request is marked applied. Returns the run.
    Implements R-RUN-6, R-RUN-10.
    """
    with transaction.atomic():
        # Lock before the state change: the worker's lease checks take the
        # same lock, so the status it reads next is this one.
        run = AgentRun.objects.select_for_update(no_key=True, skip_locked=True, of=("self",)).filter(pk=run_id).first()
        if run is None:
            if not AgentRun.objects.filter(pk=run_id).exists():
                RunCancelRequest.objects.filter(run_id=run_id).delete()
            return None
        now = timezone.now()
        # Giving up on a pending approval releases the thread for new turns
        # (R-TA-5); the interrupted run has no running rows left, but the
        # same terminal path would close any.
        awaits_approval = _awaits_approval(run)
        if run.status == Status.PENDING or awaits_approval:
            _terminate(
                run,
                status=Status.CANCELLED,
                now=now,
                error_type="cancelled",
                error_message="cancelled while waiting for approval"
                if awaits_approval
                else "cancelled before it started"
                if run.attempt == 1
                else f"cancelled while waiting to be continued as attempt {run.attempt}",
            )
            # A run waiting to be continued (R-RUN-15) had started: as for a
            # resume run cancelled while running, its approval was answered.
            if run.resumed_from_id is not None and not awaits_approval and run.attempt == 1:
                _give_up_approval(run.resumed_from_id)
        elif run.status == Status.RUNNING:
            run.status = Status.CANCEL_REQUESTED
            run.cancel_requested_at = now
            run.save(update_fields=["status", "cancel_requested_at", "updated_at"])
            transaction.on_commit(lambda: cancel_signal_send(run_id=run.id))
        RunCancelRequest.objects.filter(run_id=run_id, applied_at__isnull=True).update(applied_at=now)
        return run


def _give_up_approval(interrupted_run_id: uuid.UUID) -> None:
    """A resume run cancelled before it started gives the approval up: its
    interrupted run can no longer be resumed (it has a resume run), so it is
    cancelled too, instead of showing a pending approval nobody can answer.
    Must be called inside ``transaction.atomic()``."""
    origin = (
        AgentRun.objects.select_for_update(no_key=True, of=("self",))
        .filter(pk=interrupted_run_id, status=Status.INTERRUPTED)
        .first()
    )
    if origin is not None:
        _terminate(
            origin,
            status=Status.CANCELLED,
            now=timezone.now(),
            error_type="cancelled",
            error_message="its resume run was cancelled before it started",
        )


# --------------------------------------------------------------------------
# Lease expiry (R-RUN-7)
# --------------------------------------------------------------------------


def run_sweep_expired_leases(*, now: datetime | None = None, limit: int = 100) -> list[uuid.UUID]:
    """End the runs whose owner stopped renewing its lease (a crashed,
    frozen or cut-off worker).

    Each run with status ``running``/``cancel_requested`` and
    ``lease_expires_at <= now`` becomes terminal in the same transaction
    that closes its running audit rows and releases the lease: ``failed``
    with error type ``lease_expired`` — or the cause its worker reported
    before it lost the database (``audit_write_failed``, see
    :mod:`audit.ledger.causes`) — and ``cancelled`` when a cancel was requested
    (the user's request is honoured; the worker is gone).

    With ``RUN_RECOVERY=resume`` a run that would end ``lease_expired`` is
    instead put back to ``pending`` as its next attempt, for another worker
    to continue from its last checkpoint (:func:`~audit.ledger.terminal.run_requeue_attempt`),
    while its ``attempt`` is at most ``RUN_RECOVERY_ATTEMPTS``; the expiry
    after that ends it ``failed``, ``lease_expired`` (R-RUN-15). A run whose
    worker reported a cause is not continued: that worker is alive and met
    a fault (the database) that another attempt would meet too.

    First the database sessions of those runs' holders are ended
    (:func:`_end_stale_holders`, R-RUN-14): a frozen holder may hold the
    row in any state — idle in a transaction, blocked writing to its client,
    waiting on a lock — and only the first has a timeout of PostgreSQL's.
    Then rows are claimed with ``SELECT … FOR NO KEY UPDATE SKIP LOCKED``:
    a run whose row is still locked (a session slow to end) is skipped and
    looked at by a later sweep, and concurrent sweepers never wait on each
    other.

    Afterwards the old owner's writes fail :func:`~audit.ledger.lease.lock_run`
    with ``RunTerminal`` (the fencing token and status still stop a holder
    that thaws and reconnects). Returns the ids of the runs it ended (at
    most ``limit``), those continued later included. Implements R-RUN-7,
    R-RUN-10, R-RUN-14, R-RUN-15.
    """
    from .causes import failure_causes

    now = now or timezone.now()
    config = get_config()
    recovery, attempts = config.RUN_RECOVERY, config.RUN_RECOVERY_ATTEMPTS
    _end_stale_holders(now=now, limit=limit)
    with transaction.atomic():
        # Index run_lease_expiry_idx serves this query.
        expired = list(
            AgentRun.objects.select_for_update(no_key=True, skip_locked=True, of=("self",))
            .filter(status__in=(Status.RUNNING, Status.CANCEL_REQUESTED), lease_expires_at__lte=now)
            .order_by("lease_expires_at")[:limit]
        )
        cancels = set(
            RunCancelRequest.objects.filter(run_id__in=[run.pk for run in expired]).values_list("run_id", flat=True)
        )
        causes = failure_causes([run.pk for run in expired]) if expired else {}
        for run in expired:
            expiry = f"lease of {run.lease_owner} expired at {run.lease_expires_at.isoformat()}"
            if run.status == Status.CANCEL_REQUESTED or run.pk in cancels:
                status, error_type, message = Status.CANCELLED, "cancelled", f"cancelled on request; {expiry}"
            elif run.pk in causes:
                status, error_type = Status.FAILED, causes[run.pk][0]
                message = f"{causes[run.pk][1]}; {expiry}"
            elif recovery == "resume" and run.attempt <= attempts:
                run_requeue_attempt(run, now=now, reason=expiry)
                continue
            else:
                status, error_type, message = Status.FAILED, "lease_expired", expiry
                if recovery == "resume":
                    message += f"; attempt {run.attempt}, after {attempts} recoveries (RUN_RECOVERY_ATTEMPTS)"
            _terminate(run, status=status, now=now, error_type=error_type, error_message=message)
            log.warning("run %s ended %s (%s): %s", run.id, status, error_type, expiry)
            metrics.lease_expired()
        RunCancelRequest.objects.filter(run_id__in=cancels, applied_at__isnull=True).update(applied_at=now)
    return [run.id for run in expired]


def _end_stale_holders(*, now: datetime, limit: int) -> None:
    """End every database session of the holders of the (at most ``limit``)
    runs whose lease expired at ``now``: the lease owner names its worker
    process's session tag (:func:`core.db.session_tag_of`), which ends the
    ``application_name`` of each of that process's connections — Django's,
    the awaited writes', the checkpointer's. An expired lease can no longer
    be renewed (:func:`lease_renew` refuses it), so its holder is stale for
    good; the sessions of other workers and the sweeper's own are left
    alone (:func:`core.db.holder_sessions_end`). The holder process's other
    runs, if any, make their writes again on new connections (R-RUN-8).
    A failure to end them is logged, not raised: the sweep goes on.
    Implements R-RUN-14."""
    owners = (
        AgentRun.objects.filter(status__in=(Status.RUNNING, Status.CANCEL_REQUESTED), lease_expires_at__lte=now)
        .order_by("lease_expires_at")
        .values_list("lease_owner", flat=True)[:limit]
    )
    tags = sorted({tag for owner in owners if (tag := session_tag_of(owner))})
    if not tags:
        return
    try:
        with transaction.atomic():  # a savepoint inside a caller's transaction
            ended = holder_sessions_end(tags)
    except DatabaseError:
        log.exception("the sessions of stale lease holders %s could not be ended", tags)
        return
    if ended:
        log.warning("ended %d database session(s) of stale lease holders %s: pids %s", len(ended), tags, ended)


# --------------------------------------------------------------------------
# Resume after an approval interrupt (R-TA-5)
# --------------------------------------------------------------------------

DECISION_TYPES = ("approve", "edit", "reject", "retry", "skip")
# What an approval middleware's request allows when it does not say.
REVIEW_DECISIONS = ("approve", "edit", "reject")


def run_resume(
    *, user, run_id: uuid.UUID, request_id: str, decisions: list[dict[str, Any]], webhook: str = ""
) -> tuple[AgentRun, bool]:
    """Answer the pending approval of an interrupted run with a resume run.

    Args:
        user: the run's owner.
        run_id: the ``interrupted`` run.
        request_id: the client's idempotency key for the resume (1–200
            characters, unique per user across turns and resumes).
        decisions: one per pending action request, in the order of
            ``pending_approval``: ``{"type": "approve"}``,
            ``{"type": "edit", "args": {...}}`` (run the tool with these
            arguments) or ``{"type": "reject", "message"?: str}``; an
            "outcome unknown" request (a tool call cut off by a worker
            that stopped, R-RUN-15) takes ``{"type": "retry"}`` (execute
            it again) or ``{"type": "skip"}`` (go on without it).
        webhook: a URL to announce the resume run's end to (R-API-3), or
            ``""``.

    Creates a ``pending`` run in the same turn with ``resumed_from`` set and
    ``input = {"decisions": [...]}`` in the approval middleware's shape, and
    enqueues it after commit; the worker resumes the thread's checkpoint
    with ``Command(resume={"decisions": ...})``. Returns ``(run, created)``;
    the same request again (same key, run and decisions — also when both
    arrive at once) returns the same resume run with ``created=False``.

    Raises:
        NotFound: no such run for this user (R-READ-5).
        RunNotResumable: the run is not ``interrupted``
            (``reason: not_interrupted``) or was already resumed by another
            request (``reason: already_resumed``); 409.
        InvalidInput: the decisions do not answer the pending action
            requests one to one, or use a type the request does not allow
            (``allowed_decisions``).
        RequestIdReused: the user used ``request_id`` for a different
            request (another run or decisions, or a turn); 409.
        BudgetExceeded: the user's budget has no room for another run
            (402, R-COST-3).
        WebhookNotAllowed: a ``webhook`` the product will not call (422).

    Implements R-TA-5, R-RUN-15, R-IDEM-1 and R-API-3.
    """
    if webhook:
        webhook_checked(webhook)
    fingerprint = resume_fingerprint(run_id=run_id, decisions=decisions)
    existing = existing_request(user=user, request_id=request_id, fingerprint=fingerprint)
    if existing is not None:
        return existing, False
    try:
        with web_lock_wait():
            # Lock order as in run_submit (thread, then run): a new turn and
            # a resume of the same thread are serialised.
            interrupted = AgentRun.objects.visible_to(user).filter(pk=run_id).only("thread_id").first()
            if interrupted is None:
                raise NotFound("run not found")
            Conversation.objects.select_for_update(no_key=True).filter(pk=interrupted.thread_id).first()
            # A retry that waited for the lock finds the resume run its twin
            # created, before the one-to-one check would call it a rival.
            existing = existing_request(user=user, request_id=request_id, fingerprint=fingerprint)
            if existing is not None:
                return existing, False
            interrupted = AgentRun.objects.select_for_update(no_key=True, of=("self",)).get(pk=run_id)
            if interrupted.status != Status.INTERRUPTED:
                raise RunNotResumable(
                    f"run {run_id} is {interrupted.status}, not interrupted", extra={"reason": "not_interrupted"}
                )
            _refuse_if_resumed(run_id)
            budget_admit(user=user)  # R-COST-3: 402 and nothing created
            resume = AgentRun.objects.create(
                request_id=request_id,
                request_fingerprint=fingerprint,
                thread_id=interrupted.thread_id,
                turn_id=interrupted.turn_id,
                resumed_from=interrupted,
                user=user,
                agent_id=interrupted.agent_id,
                model=interrupted.model,
                input={"decisions": _graph_decisions(interrupted, decisions)},
                webhook=webhook,
            )
            _enqueue_on_commit(resume.id)
    except IntegrityError:
        # A concurrent request won: with the same key it is a retry (or a
        # reuse, raised here); with another key it took the one-to-one
        # resume of this run.
        existing = existing_request(user=user, request_id=request_id, fingerprint=fingerprint)
        if existing is not None:
            return existing, False
        _refuse_if_resumed(run_id)
        raise RunNotResumable(f"run {run_id} was already resumed", extra={"reason": "already_resumed"}) from None
    return resume, True


def _refuse_if_resumed(run_id: uuid.UUID) -> None:
    """Raise :class:`RunNotResumable` (``reason: already_resumed``, and the
    ``resumed_by`` run, as a refused cancel names it) when ``run_id`` was
    already resumed (R-TA-5)."""
    resumed_by = AgentRun.objects.filter(resumed_from_id=run_id).values_list("id", flat=True).first()
    if resumed_by is not None:
        raise RunNotResumable(
            f"run {run_id} was already resumed by run {resumed_by}",
            extra={"reason": "already_resumed", "resumed_by": str(resumed_by)},
        )


def _graph_decisions(interrupted: AgentRun, decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check the API decisions against the pending action requests and turn
    them into the approval middleware's decisions. Raises InvalidInput."""
    actions = pending_action_requests(interrupted.interrupts)
    allowed = _allowed_decisions(interrupted.interrupts)
    if len(decisions) != len(actions):
        raise InvalidInput(
            f"{len(actions)} action request(s) wait for a decision, got {len(decisions)}",
            extra={"field": "decisions", "expected": len(actions)},
        )
    result = []
    for index, (action, decision) in enumerate(zip(actions, decisions, strict=True)):
        kind = decision.get("type")
        if kind not in DECISION_TYPES or kind not in allowed.get(index, REVIEW_DECISIONS):
            raise InvalidInput(
                f"decision {index} ({kind!r}) is not allowed for {action.get('name')}",
                extra={"field": f"decisions.{index}.type", "allowed": list(allowed.get(index, REVIEW_DECISIONS))},
            )
        if kind in ("retry", "skip"):
            # The replay guard matches it to the cut-off execution it
            # answers (audit.execution.effects).
            cut = action.get("outcome_unknown") or {}
            result.append({"type": kind, "tool_call_id": action.get("tool_call_id"), "row_id": cut.get("row_id")})
        elif kind == "approve":
            result.append({"type": "approve"})
        elif kind == "edit":
            if not isinstance(decision.get("args"), dict):
                raise InvalidInput(
                    f"decision {index}: edit needs args (an object)", extra={"field": f"decisions.{index}.args"}
                )
            result.append({"type": "edit", "edited_action": {"name": action.get("name"), "args": decision["args"]}})
        else:
            entry: dict[str, Any] = {"type": "reject"}
            if decision.get("message"):
                entry["message"] = str(decision["message"])
            result.append(entry)
    return result


def _allowed_decisions(interrupts: list[dict[str, Any]] | None) -> dict[int, tuple[str, ...]]:
    allowed: dict[int, tuple[str, ...]] = {}
    index = 0
    for item in interrupts or []:
        value = item.get("value") if isinstance(item, dict) else None
        for config in (value or {}).get("review_configs") or []:
            allowed[index] = tuple(config.get("allowed_decisions") or REVIEW_DECISIONS)
            index += 1
    return allowed
