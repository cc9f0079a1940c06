"""Celery tasks: thin interfaces that take ids, call one service and apply
the retry policy."""

from __future__ import annotations

from celery import shared_task
from celery.signals import worker_process_shutdown

from ops import logcontext

from .errors import DatabaseUnavailable
from .execution.runner import run_execute
from .execution.worker_loop import close_kept_connections

# Pickup retries while PostgreSQL is unreachable: 1, 2, 4 … 30 s apart, for
# about ten minutes; the dispatcher hands the run over again after that
# in any case (R-RUN-9).
PICKUP_RETRY_MAX = 25


@worker_process_shutdown.connect
def _close_kept_connections(**_: object) -> None:
    """A worker process that ends closes the connection its worker loop
    kept for a next run (audit.execution.checkpoint.open_checkpointer)."""
    close_kept_connections()


@shared_task(name="audit.execute_run", bind=True, acks_late=True, max_retries=PICKUP_RETRY_MAX)
def execute_run(self, run_id: str) -> str:
    """Execute one agent run under a lease (R-RUN-3). A second delivery of
    the same run does nothing. When PostgreSQL cannot be reached at pickup
    the task is retried with backoff instead of being acked as done
    (R-RUN-9)."""
    try:
        with logcontext.scope(run_id=run_id):
            return run_execute(run_id=run_id)
    except DatabaseUnavailable as exc:
        raise self.retry(exc=exc, countdown=min(30, 2 ** min(self.request.retries, 5))) from None


@shared_task(name="audit.replay_run", acks_late=True, ignore_result=True)
def replay_run(replay_id: str) -> str:
    """Run a replay asked for from the admin and store its report
    (R-REPLAY-2); a second delivery does nothing."""
    from .execution.rerun import replay_requested_run

    with logcontext.scope(replay_id=replay_id):
        return replay_requested_run(replay_id)


@shared_task(name="audit.sweep_expired_leases", acks_late=False, ignore_result=True)
def sweep_expired_leases() -> int:
    """End the runs whose lease expired (R-RUN-7); scheduled by Celery beat
    every ``LEASE_SWEEP_INTERVAL_SECONDS`` on the maintenance queue.
    Returns how many it ended."""
    from .ledger import run_sweep_expired_leases

    return len(run_sweep_expired_leases())


@shared_task(name="audit.dispatch_runs", acks_late=False, ignore_result=True)
def dispatch_runs() -> dict[str, int]:
    """Hand over again the pending runs whose broker message may be lost,
    apply recorded cancel requests (R-RUN-9, R-RUN-10) and roll up the ended
    runs whose terminal transaction could not (R-DASH-1); scheduled by
    Celery beat every ``DISPATCH_INTERVAL_SECONDS`` on the maintenance
    queue."""
    from dashboard.rollups import rollups_catch_up

    from .execution.dispatch import runs_dispatch

    return {**runs_dispatch(), "rolled_up": rollups_catch_up()}
