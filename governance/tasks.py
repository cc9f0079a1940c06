"""Celery task of the periodic purge (R-GOV-1): thin, like ``audit.tasks``."""

from __future__ import annotations

import logging

from celery import shared_task

log = logging.getLogger(__name__)


@shared_task(name="governance.purge_payloads", acks_late=False, ignore_result=True)
def purge_payloads() -> int:
    """One purge pass with ``RETENTION_DAYS``, scheduled by Celery beat every
    ``RETENTION_PURGE_INTERVAL_SECONDS`` on the maintenance queue when
    ``RETENTION_DAYS`` is set. Returns the number of rows purged; another
    purge in progress skips this pass."""
    from core.config import get_config

    from .errors import GovernanceBusy
    from .services import payloads_purge

    days = get_config().RETENTION_DAYS
    if days is None:
        return 0
    try:
        outcome = payloads_purge(older_than_days=days, actor="celery-beat")
    except GovernanceBusy:
        log.info("periodic purge skipped: another purge or erasure is running")
        return 0
    if outcome.rows:
        log.info("periodic purge #%s: %d rows of %d runs", outcome.action.pk, outcome.rows, outcome.runs)
    return outcome.rows


@shared_task(name="governance.publish_digests", acks_late=False, ignore_result=True)
def publish_digests() -> int:
    """Publish the signed digests that are due (R-GOV-5), scheduled by
    Celery beat every minute on the maintenance queue when a digest key is
    set. Returns how many were published."""
    from .digests import publish_digests as publish

    made = publish()
    if made:
        log.info("published audit digest(s) #%d-#%d", made[0].sequence, made[-1].sequence)
    return len(made)


@shared_task(name="governance.erase_deleted_threads", acks_late=False, ignore_result=True)
def erase_deleted_threads() -> int:
    """Erase the deleted threads whose runs have ended (R-API-1), scheduled
    by Celery beat every minute on the maintenance queue: those a deletion
    could not erase at once. Returns how many were erased."""
    from .services import deleted_threads_erase

    erased = deleted_threads_erase(actor="celery-beat")
    if erased:
        log.info("erased %d deleted thread(s)", len(erased))
    return len(erased)
