"""Celery tasks: thin interfaces that take ids and call one service."""

from __future__ import annotations

from celery import shared_task

from .runner import run_execute


@shared_task(name="audit.execute_run", acks_late=True)
def execute_run(run_id: str) -> str:
    """Execute one agent run under a lease (R-RUN-3). A second delivery of
    the same run does nothing."""
    return run_execute(run_id=run_id)
