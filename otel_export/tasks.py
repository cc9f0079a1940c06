"""Celery task of the OpenTelemetry export (R-OTEL-1): thin, like
``audit.tasks``."""

from __future__ import annotations

import logging

from celery import shared_task

log = logging.getLogger(__name__)


@shared_task(name="otel_export.export", acks_late=False, ignore_result=True)
def export() -> int:
    """One export pass, scheduled by Celery beat every
    ``OTEL_EXPORT_INTERVAL_SECONDS`` on the queue ``OTEL_EXPORT_QUEUE``; it
    stops after that many seconds so passes do not pile up. Returns the
    number of runs the receiver accepted; a receiver failure is logged and
    the next pass tries again (the cursor did not move)."""
    from core.config import get_config

    from .services import export_closed_runs

    result = export_closed_runs(max_seconds=get_config().OTEL_EXPORT_INTERVAL_SECONDS)
    if result.runs or result.error:
        log.info(
            "OpenTelemetry export: %d runs, %d spans%s",
            result.runs,
            result.spans,
            f"; stopped: {result.error}" if result.error else "",
        )
    return result.runs
