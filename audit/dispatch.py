"""Dispatch from PostgreSQL (R-RUN-9): handing runs to workers so that a
lost broker message never leaves a run ``pending`` forever.

The broker is only a doorbell. The run rows are the truth: a run is handed
to the broker (:func:`enqueue_run`) after its submission commits and after
the previous run of its thread ends, and ``AgentRun.dispatched_at`` records
when. :func:`runs_dispatch`, run by Celery beat every
``DISPATCH_INTERVAL_SECONDS`` on the maintenance queue, hands over again
every pending run that waits at the head of its thread's queue and was not
acquired within ``DISPATCH_GRACE_SECONDS`` — the message was lost to a
Redis restart, dropped by a worker, or never sent because the broker was
down — and applies cancel requests that were recorded while a worker held
the run row (R-RUN-10). Duplicate deliveries are harmless: acquisition is
fenced (R-RUN-3), a second message of a running run starts nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta

from celery import current_app
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from ops import metrics
from yuxi_project.config import get_config

from .models import AgentRun, RunCancelRequest

# The worker's task (audit.tasks.execute_run), sent by name: dispatch sits
# below the Celery tasks that call into it (docs/architecture.md#layers).
EXECUTE_RUN_TASK = "audit.execute_run"

log = logging.getLogger(__name__)

Status = AgentRun.Status


# Set by :func:`dispatch_held`: this process hands no run over.
_held = threading.Event()


@contextlib.contextmanager
def dispatch_held() -> Iterator[None]:
    """Within the block this process hands no run to a worker: submitted
    runs stay ``pending`` in PostgreSQL for whoever submitted them to start
    itself. For the benchmarks, which start their own runs in process: a
    worker of a running deployment (or the embedded worker thread) must not
    take them first. A run left pending is handed over by the dispatcher
    later, as any run whose message was lost (R-RUN-9)."""
    _held.set()
    try:
        yield
    finally:
        _held.clear()


def enqueue_run(run_id: uuid.UUID) -> bool:
    """Hand the run to a worker. With a broker: the Celery task. Embedded:
    the same task body in a background thread of this process. Inside
    :func:`dispatch_held`: nothing (returns False).

    Never raises: when the broker is unreachable the run stays ``pending``
    in PostgreSQL and the dispatcher hands it over once the broker is back
    (R-RUN-9), so a submission that committed still answers 202. Returns
    whether the broker took the message."""
    if _held.is_set():
        log.debug("run %s not handed over: dispatch is held in this process", run_id)
        return False
    if getattr(settings, "CELERY_TASK_ALWAYS_EAGER", False):
        task = current_app.tasks[EXECUTE_RUN_TASK]
        thread = threading.Thread(target=task.apply, args=((str(run_id),),), name=f"run-{run_id}", daemon=True)
        thread.start()
        return True
    try:
        current_app.send_task(EXECUTE_RUN_TASK, args=(str(run_id),))
    except Exception as exc:  # kombu OperationalError, redis errors, timeouts
        log.warning("run %s not enqueued (the dispatcher will hand it over): %s: %s", run_id, type(exc).__name__, exc)
        return False
    return True


def head_of_thread(run: AgentRun) -> bool:
    """Whether a pending ``run`` may start now: no run of an earlier turn of
    its thread holds the thread (R-RUN-2)."""
    from .services.runs import _earlier_blocking_run

    return _earlier_blocking_run(run) is None


def runs_dispatch(*, now: datetime | None = None, limit: int = 200) -> dict[str, int]:
    """Hand over again the runs whose broker message may be lost, and apply
    recorded cancel requests (R-RUN-9, R-RUN-10).

    A run is handed over when it is ``pending``, its ``dispatched_at`` is
    older than ``DISPATCH_GRACE_SECONDS`` and it is at the head of its
    thread (a resume run keeps its turn's place). ``dispatched_at`` is set
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
        # Index run_pending_dispatch_idx serves this query.
        waiting = list(
            AgentRun.objects.select_for_update(no_key=True, skip_locked=True, of=("self",))
            .filter(status=Status.PENDING, dispatched_at__lte=cutoff)
            .order_by("dispatched_at")[:limit]
        )
        due = [run for run in waiting if head_of_thread(run)]
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
    from .services.runs import cancel_request_apply

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
