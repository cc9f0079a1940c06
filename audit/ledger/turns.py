"""A thread's turns in order (R-RUN-2): which runs hold the thread, and
which pending runs are at its head.

Turns are ordered by the submission of their first run — a resume run keeps
its turn's place — and turns submitted at the same instant by turn id. A
run holds its thread for the other turns while it is not terminal, and
while it is ``interrupted`` and not resumed (the thread waits for an
approval). The thread's head is the first of its turns that holds it: only
a pending run of that turn may start, and only those are handed to a worker
(R-RUN-9) — after a submission, after a run's end
(:mod:`.terminal`) and by the dispatcher (:mod:`audit.execution.dispatch`).
A turn queued behind others costs no broker message and no refused
acquisition until it reaches the head.

The acquisition (:mod:`.runs`), the handovers and the dispatcher read the
rules from here, as ORM expressions, so none is typed twice.
"""

from __future__ import annotations

from django.db.models import Count, Min, OuterRef, Q, QuerySet, Subquery

from conversations.models import Conversation

from ..models import AgentRun

Status = AgentRun.Status


def holding() -> Q:
    """The runs that hold their thread for the other turns: not terminal,
    or interrupted and not resumed."""
    return Q(status__in=AgentRun.ACTIVE_STATUSES) | Q(status=Status.INTERRUPTED, resumed_by__isnull=True)


def holding_runs(thread_id, turn_id) -> QuerySet[AgentRun]:
    """The runs of the thread's other turns that hold it (:func:`holding`).
    ``thread_id`` and ``turn_id``: values or ``OuterRef``\\ s."""
    return AgentRun.objects.filter(thread_id=thread_id).exclude(turn_id=turn_id).filter(holding())


def head_turn(thread_id) -> QuerySet:
    """The thread's head: the ``turn_id`` of its first turn (by its first
    run's submission, then turn id) that holds it; empty when no run holds
    it. ``thread_id``: a value or an ``OuterRef``. One scan of the thread's
    runs (index ``run_thread_created_idx``)."""
    return (
        AgentRun.objects.filter(thread_id=thread_id)
        .order_by()
        .values("turn_id")
        .annotate(first=Min("created_at"), holders=Count("pk", filter=holding()))
        .filter(holders__gt=0)
        .order_by("first", "turn_id")
        .values("turn_id")[:1]
    )


def at_head() -> Q:
    """The runs that may start now: pending, in their thread's head turn."""
    return Q(status=Status.PENDING, turn_id=Subquery(head_turn(OuterRef("thread_id"))))


def heads_of_threads(runs: QuerySet[AgentRun]) -> QuerySet:
    """The head turn ids (:func:`head_turn`) of the threads that ``runs``
    belong to, each thread's head computed once, in a subquery that does
    not depend on the outer row: ``turn_id__in=heads_of_threads(...)``
    selects the runs at their thread's head without reading the thread's
    runs again for each of them (a turn id belongs to one thread). For the
    dispatcher, whose candidates may be thousands of queued turns of one
    thread: :func:`at_head` on each would scan the thread once per
    candidate."""
    return (
        Conversation.objects.filter(pk__in=runs.order_by().values("thread_id"))
        .annotate(head=Subquery(head_turn(OuterRef("pk"))))
        .values("head")
    )
