"""Webhook deliveries (R-API-3): queue one per run end behind a durable
cursor, then POST each, signed, until the receiver accepts it.

A delivery pass (:func:`deliveries_queue`, then :func:`deliveries_send`;
the beat task ``webhooks.deliver`` and ``manage.py deliver_webhooks``):

1. **Queue.** Read the ended runs with a ``webhook`` after the
   :class:`~webhooks.models.WebhookCursor`, up to the export horizon
   (:func:`otel_export.selectors.export_horizon`: a run whose terminal
   transaction has not committed yet is never passed), and insert one
   :class:`~webhooks.models.WebhookDelivery` per run end in the
   transaction that moves the cursor: every end is queued, once. The run
   path does nothing for a webhook beyond storing its URL.
2. **Send.** Claim the oldest due delivery (``FOR UPDATE SKIP LOCKED``,
   its ``next_attempt_at`` pushed past the request's timeout: several
   deliverers share the work, one that dies leaves its claim to expire),
   build the run's body as ``GET /api/runs/{run_id}`` answers it at that
   moment, sign it (``X-Yuxi-Signature: sha256=<hex>``, HMAC-SHA256 with
   ``WEBHOOK_SECRET``) and POST it with ``X-Yuxi-Delivery: <delivery id>``.
   A 2xx answer delivers it; anything else (no answer, a timeout, a
   redirect, which is never followed, any other status) is recorded as a
   :class:`~webhooks.models.WebhookAttempt` and retried after
   ``WEBHOOK_RETRY_BASE_SECONDS`` doubled per attempt (at most
   ``WEBHOOK_RETRY_MAX_SECONDS``), ``WEBHOOK_MAX_ATTEMPTS`` times in all.
   A receiver whose attempt failed is passed over for the rest of the
   pass: one that is down or slow costs a pass one timeout.

Delivery is at least once: a receiver that answers after the timeout may
get the same delivery id again.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlsplit

import requests
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from core.config import get_config
from core.errors import InvalidInput
from ops import metrics
from otel_export.selectors import export_horizon

from .errors import WebhookNotAllowed
from .models import WebhookAttempt, WebhookCursor, WebhookDelivery
from .selectors import ended_runs_with_webhook, readable_run
from .targets import receiver_of, webhook_checked

log = logging.getLogger(__name__)

__all__ = ["deliveries_queue", "deliveries_send", "retry_delay", "signature"]

CURSOR = "runs"
# Run ends queued per transaction.
QUEUE_PAGE = 500
# A claim lasts the request's timeout plus this (seconds): time to record
# the attempt after the answer.
CLAIM_MARGIN_SECONDS = 30.0
USER_AGENT = "yuxi-webhooks/1"

Status = WebhookDelivery.Status


def signature(body: bytes, secret: str) -> str:
    """The ``X-Yuxi-Signature`` value of ``body``: ``sha256=`` and the hex
    HMAC-SHA256 of the exact bytes sent, keyed with ``secret`` (UTF-8).
    A receiver recomputes it over the raw request body and compares in
    constant time (R-API-3)."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def retry_delay(attempts: int, *, base: float, cap: float) -> float:
    """Seconds to wait after the ``attempts``-th failed attempt (1, 2, …):
    ``base`` doubled per attempt after the first, at most ``cap``."""
    return min(cap, base * 2 ** min(attempts - 1, 60))


def deliveries_queue(*, settle_seconds: float | None = None) -> int:
    """Queue a delivery for every run end after the cursor; returns how
    many. Must not run inside ``transaction.atomic()`` on PostgreSQL (the
    horizon reads other sessions). Two callers at once queue each end once:
    the cursor row is locked by the transaction that moves it.

    Args:
        settle_seconds: seconds an ended run waits before it is queued;
            default ``WEBHOOK_SETTLE_SECONDS``.
    """
    if settle_seconds is None:
        settle_seconds = get_config().WEBHOOK_SETTLE_SECONDS
    horizon, _ = export_horizon(settle_seconds=settle_seconds)
    queued = 0
    while True:
        with transaction.atomic():
            WebhookCursor.objects.get_or_create(name=CURSOR)
            cursor = WebhookCursor.objects.select_for_update().get(name=CURSOR)
            runs = list(
                ended_runs_with_webhook(after=(cursor.finished_at, cursor.run_id), horizon=horizon)[:QUEUE_PAGE]
            )
            if not runs:
                return queued
            now = timezone.now()
            WebhookDelivery.objects.bulk_create(
                [
                    WebhookDelivery(
                        run_id=run["id"],
                        run_finished_at=run["finished_at"],
                        run_status=run["status"],
                        url=run["webhook"],
                        receiver=receiver_of(run["webhook"]),
                        next_attempt_at=now,
                    )
                    for run in runs
                ],
                ignore_conflicts=True,
            )
            cursor.finished_at, cursor.run_id = runs[-1]["finished_at"], runs[-1]["id"]
            cursor.queued += len(runs)
            cursor.save()
        queued += len(runs)
        if len(runs) < QUEUE_PAGE:
            return queued


@dataclass
class SendProgress:
    """What one :func:`deliveries_send` did: attempts made, and how they
    ended (``retrying``: failed, another attempt is scheduled)."""

    attempts: int = 0
    delivered: int = 0
    retrying: int = 0
    failed: int = 0
    skipped: int = 0
    caught_up: bool = False


def deliveries_send(
    *, render: Callable[[object], bytes], max_seconds: float | None = None, session: requests.Session | None = None
) -> SendProgress:
    """Send the deliveries due when the pass starts, oldest due first,
    until none is left or ``max_seconds`` (seconds, checked between
    deliveries) ran out: each is tried at most once per pass, and a
    receiver (scheme, host and port) whose attempt failed is not tried
    again in the pass, so one that is down or slow costs a pass one
    timeout, not one per delivery (``caught_up`` is then false).

    Args:
        render: the body of a run (an :class:`~audit.models.AgentRun`), as
            bytes of JSON: ``webhooks.body.run_body``.
        max_seconds: time budget of the pass; None: until none is due.
        session: the HTTP session to send with (a new one by default).

    Returns the pass's :class:`SendProgress`. A receiver's failure is
    recorded on its delivery, never raised.
    """
    config = get_config()
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    result = SendProgress()
    due_by = timezone.now()
    own_session = session is None
    session = session or requests.Session()
    failing: set[str] = set()
    try:
        while deadline is None or time.monotonic() < deadline:
            delivery = _claim_next(
                due_by=due_by,
                claim_seconds=config.WEBHOOK_TIMEOUT_SECONDS + CLAIM_MARGIN_SECONDS,
                passed_over=failing,
            )
            if delivery is None:
                result.caught_up = not failing
                break
            outcome = _attempt(delivery, render=render, session=session)
            if outcome == Status.SKIPPED:
                result.skipped += 1
                metrics.webhook_skipped()
                continue
            if outcome != Status.DELIVERED:
                # A receiver that failed (down, slow past the timeout, an
                # error status) is not tried again in this pass: its other
                # deliveries wait for the next one, and the receivers
                # behind it are not held up by its timeouts.
                failing.add(delivery.receiver)
            result.attempts += 1
            counter = "retrying" if outcome == Status.PENDING else str(outcome)
            setattr(result, counter, getattr(result, counter) + 1)
            metrics.webhook_attempted(counter)
    finally:
        if own_session:
            session.close()
    return result


def _claim_next(*, due_by: datetime, claim_seconds: float, passed_over: set[str]) -> WebhookDelivery | None:
    """The oldest pending delivery due by ``due_by`` whose receiver is not
    in ``passed_over``, claimed: its attempt counted and its
    ``next_attempt_at`` moved ``claim_seconds`` on, in a transaction of its
    own (no lock is held during the request). None when none is due."""
    now = timezone.now()
    with transaction.atomic():
        delivery = (
            WebhookDelivery.objects.select_for_update(skip_locked=True)
            .filter(status=Status.PENDING, next_attempt_at__lte=due_by)
            .exclude(receiver__in=passed_over)
            .order_by("next_attempt_at")
            .first()
        )
        if delivery is None:
            return None
        delivery.attempts += 1
        delivery.next_attempt_at = now + timedelta(seconds=claim_seconds)
        delivery.save(update_fields=["attempts", "next_attempt_at"])
    return delivery


def _attempt(delivery: WebhookDelivery, *, render: Callable[[object], bytes], session: requests.Session) -> str:
    """One attempt of a claimed delivery; returns the delivery's status
    after it (``pending`` when another attempt is scheduled)."""
    config = get_config()
    run = readable_run(delivery.run_id)
    if run is None:
        return _skip(delivery, "the run's thread was deleted: nothing is sent")
    try:
        webhook_checked(delivery.url)
    except (WebhookNotAllowed, InvalidInput) as refused:  # hosts changed, or the URL was erased
        return _skip(delivery, f"not sent: {refused.message}")
    started_at = timezone.now()
    began = time.monotonic()
    status_code: int | None = None
    try:
        body = render(run)
        headers = {
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            "X-Yuxi-Delivery": str(delivery.id),
            "X-Yuxi-Signature": signature(body, config.WEBHOOK_SECRET),
        }
        with session.post(
            delivery.url,
            data=body,
            headers=headers,
            timeout=config.WEBHOOK_TIMEOUT_SECONDS,
            allow_redirects=False,
            stream=True,  # the receiver's body is never read
        ) as response:
            status_code = response.status_code
        error = "" if 200 <= status_code < 300 else f"HTTP {status_code}"
        if 300 <= status_code < 400:
            error += " (redirects are not followed)"
    except requests.RequestException as exc:
        error = f"{type(exc).__name__}: {_without_path(str(exc), delivery.url)}"
    except Exception as exc:  # the body could not be built: retried like a failed request
        log.exception("webhook delivery %s: the run's body could not be built", delivery.id)
        error = f"body not built: {type(exc).__name__}: {exc}"
    duration_ms = (time.monotonic() - began) * 1000
    return _record(delivery, started_at=started_at, duration_ms=duration_ms, status_code=status_code, error=error)


def _without_path(text: str, url: str) -> str:
    """``text`` (an error message of requests, which quotes the URL) with
    the URL's path and query replaced by ``<path>``: they may name the user,
    and an erasure blanks the URL but keeps the attempts (R-GOV-2)."""
    parts = urlsplit(url)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    for quoted in sorted({url, path, parts.path, parts.query}, key=len, reverse=True):
        if quoted and quoted != "/":
            text = text.replace(quoted, "<path>")
    return text


def _record(
    delivery: WebhookDelivery, *, started_at: datetime, duration_ms: float, status_code: int | None, error: str
) -> str:
    """Record an attempt and its outcome. A success delivers the delivery
    whatever happened meanwhile; a failure reschedules it only if no later
    claim took it over (its ``attempts`` still this attempt's number)."""
    config = get_config()
    error = error[:500]
    now = timezone.now()
    with transaction.atomic():
        WebhookAttempt.objects.create(
            delivery=delivery,
            number=delivery.attempts,
            started_at=started_at,
            duration_ms=duration_ms,
            status_code=status_code,
            error=error,
        )
        if not error:
            WebhookDelivery.objects.filter(pk=delivery.pk).update(
                status=Status.DELIVERED, last_status_code=status_code, last_error="", delivered_at=now
            )
            return Status.DELIVERED
        tried = delivery.attempts - delivery.resent_after
        given_up = tried >= config.WEBHOOK_MAX_ATTEMPTS
        delay = retry_delay(tried, base=config.WEBHOOK_RETRY_BASE_SECONDS, cap=config.WEBHOOK_RETRY_MAX_SECONDS)
        WebhookDelivery.objects.filter(pk=delivery.pk, status=Status.PENDING, attempts=delivery.attempts).update(
            status=Status.FAILED if given_up else Status.PENDING,
            last_status_code=status_code,
            last_error=error,
            next_attempt_at=now + timedelta(seconds=delay),
        )
    log.warning(
        "webhook delivery %s of run %s, attempt %d: %s%s",
        delivery.id,
        delivery.run_id,
        delivery.attempts,
        error,
        "; given up" if given_up else f"; next attempt in {delay:.0f} s",
    )
    return Status.FAILED if given_up else Status.PENDING


def _skip(delivery: WebhookDelivery, reason: str) -> str:
    """Skip a claimed delivery without a request: its claim's count is
    given back, so ``attempts`` stays the number of requests sent (one
    :class:`~webhooks.models.WebhookAttempt` each). A later claim that took
    it over (``attempts`` moved on) is left alone."""
    WebhookDelivery.objects.filter(pk=delivery.pk, status=Status.PENDING, attempts=delivery.attempts).update(
        status=Status.SKIPPED, attempts=F("attempts") - 1, last_error=reason[:500]
    )
    return Status.SKIPPED
