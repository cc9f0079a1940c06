"""Celery task of the webhook deliveries (R-API-3): thin, like
``otel_export.tasks``."""

from __future__ import annotations

import logging

from celery import shared_task

log = logging.getLogger(__name__)


@shared_task(name="webhooks.deliver", acks_late=False, ignore_result=True)
def deliver() -> int:
    """One delivery pass, scheduled by Celery beat every
    ``WEBHOOK_INTERVAL_SECONDS`` on the queue ``WEBHOOK_QUEUE``: queue the
    runs that ended, then send what is due for at most that many seconds.
    Returns the number of deliveries the receivers accepted."""
    from core.config import get_config

    from .body import run_body
    from .services import deliveries_queue, deliveries_send

    queued = deliveries_queue()
    result = deliveries_send(render=run_body, max_seconds=get_config().WEBHOOK_INTERVAL_SECONDS)
    if queued or result.attempts or result.skipped:
        log.info(
            "webhooks: %d queued, %d delivered, %d to retry, %d given up, %d skipped",
            queued,
            result.delivered,
            result.retrying,
            result.failed,
            result.skipped,
        )
    return result.delivered
