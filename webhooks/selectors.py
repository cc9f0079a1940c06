"""Reads of the webhook deliveries (R-API-3): which ended runs announce
their end."""

from __future__ import annotations

import uuid
from datetime import datetime

from django.db.models import Q, QuerySet

from audit.models import AgentRun


def ended_runs_with_webhook(*, after: tuple[datetime | None, uuid.UUID | None], horizon: datetime) -> QuerySet:
    """Ended runs with a ``webhook`` after the cursor position
    ``(finished_at, run id)`` that finished before ``horizon``, in
    ``(finished_at, id)`` order, as dicts of ``id``, ``finished_at``,
    ``status`` and ``webhook``. The partial index
    ``run_webhook_finished_idx`` serves the order and the range: runs
    without a webhook are never read."""
    finished_at, run_id = after
    runs = AgentRun.objects.exclude(webhook="").filter(
        status__in=AgentRun.TERMINAL_STATUSES, finished_at__isnull=False, finished_at__lt=horizon
    )
    if finished_at is not None:
        runs = runs.filter(Q(finished_at__gt=finished_at) | Q(finished_at=finished_at, id__gt=run_id))
    return runs.order_by("finished_at", "id").values("id", "finished_at", "status", "webhook")


def readable_run(run_id: uuid.UUID) -> AgentRun | None:
    """The run a delivery announces, or None when its owner can no longer
    read it (its thread was deleted, R-API-1): its body is not sent."""
    return AgentRun.objects.exclude(thread__status="deleted").filter(pk=run_id).first()
