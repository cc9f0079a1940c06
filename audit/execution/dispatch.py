"""Dispatch from PostgreSQL (R-RUN-9): handing runs to workers so that a
lost broker message never leaves a run ``pending`` forever.

The broker is only a doorbell. The run rows are the truth: a run is handed
to the broker (:func:`audit.ledger.handover.enqueue_run`) after its
submission commits when it is at its thread's head, else after the run
before it ends (:mod:`audit.ledger.turns`), and ``AgentRun.dispatched_at``
records when. :func:`runs_dispatch`, run by Celery beat every
``DISPATCH_INTERVAL_SECONDS`` on the maintenance queue, hands over again
every pending run that waits at the head of its thread's queue and was not
acquired within ``DISPATCH_GRACE_SECONDS`` — the message was lost to a
Redis restart, dropped by a worker, or never sent because the broker was
down — and applies cancel requests that were recorded while a worker held
the run row (R-RUN-10). Duplicate deliveries are harmless: acquisition is
fenced (R-RUN-3), a second message of a running run starts nothing.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from core.config import get_config
from ops import metrics

from ..ledger.handover import enqueue_run
from ..ledger.turns import heads_of_threads
from ..models import AgentRun, RunCancelRequest

log = logging.getLogger(__name__)

Status = AgentRun.Status


def runs_dispatch(*, now: datetime | None = None, limit: int = 200) -> dict[str, int]:
    """Hand over again the runs whose broker message may be lost, and apply
    recorded cancel requests (R-RUN-9, R-RUN-10).

    A run is handed over when it is ``pending``, its ``dispatched_at`` is
    older than ``DISPATCH_GRACE_SECONDS`` and it is at the head of its
    thread (:func:`~audit.ledger.turns.heads_of_threads`: a resume run keeps its
    turn's place). The head is part of the query, before its ``LIMIT``:
    runs queued behind other turns, however many, never take the place
    of another thread's lost run. ``dispatched_at`` is set
    to ``now`` first, in a short transaction that claims the rows with
    ``SKIP LOCKED`` (several dispatchers never hand one run over twice in one
    round, and none waits on a row a worker holds); the messages are sent
    after commit. At most ``limit`` runs per round.

    Returns ``{"dispatched": n, "cancels_applied": m}``. Raises the
    database's ``OperationalError`` when PostgreSQL is unreachable (the next
    round tries again).
    """
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=get_config().DISPATCH_GRACE_SECONDS)
    with transaction.atomic():
        # Index run_pending_dispatch_idx serves this query; the head of each
        # candidate thread is one scan of that thread's runs, once per
        # thread however many of its turns wait.
        stale = AgentRun.objects.filter(status=Status.PENDING, dispatched_at__lte=cutoff)
        due = list(
            stale.select_for_update(no_key=True, skip_locked=True, of=("self",))
            .filter(turn_id__in=heads_of_threads(stale))
            .order_by("dispatched_at")[:limit]
        )
        AgentRun.objects.filter(pk__in=[run.pk for run in due]).update(dispatched_at=now)
    for run in due:
        log.info(
            "dispatcher: run %s waited at the head of its thread since %s; handing it over", run.id, run.dispatched_at
        )
        enqueue_run(run.id)
        metrics.record_reenqueue("stale")
    applied = cancel_requests_apply(limit=limit)
    return {"dispatched": len(due), "cancels_applied": applied}


def cancel_requests_apply(*, limit: int = 200) -> int:
    """Apply the cancel requests not applied yet, each to a run row that is
    free now (``SKIP LOCKED``: a row a worker holds is left for the next
    round, or for the worker itself). Returns how many were applied."""
    from ..ledger.runs import cancel_request_apply

    pending = list(
        RunCancelRequest.objects.filter(applied_at__isnull=True)
        .order_by("requested_at")
        .values_list("run_id", flat=True)[:limit]
    )
    applied = 0
    for run_id in pending:
        if cancel_request_apply(run_id=run_id) is not None:
            applied += 1
    return applied
