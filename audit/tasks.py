"""Celery tasks: thin interfaces that take ids and call one service."""

from __future__ import annotations

from celery import shared_task

from ops import logcontext

from .runner import run_execute


@shared_task(name="audit.execute_run", acks_late=True)
def execute_run(run_id: str) -> str:
    """Execute one agent run under a lease (R-RUN-3). A second delivery of
    the same run does nothing."""
    with logcontext.scope(run_id=run_id):
        return run_execute(run_id=run_id)


@shared_task(name="audit.sweep_expired_leases", acks_late=False, ignore_result=True)
def sweep_expired_leases() -> int:
    """Fail the runs whose lease expired (R-RUN-7); scheduled by Celery beat
    every ``LEASE_SWEEP_INTERVAL_SECONDS``. Returns how many it failed."""
    from .services import run_sweep_expired_leases

    return len(run_sweep_expired_leases())
