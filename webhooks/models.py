"""Webhook deliveries and their attempts (R-API-3).

A run submitted or resumed with a ``webhook`` (``AgentRun.webhook``) gets
one :class:`WebhookDelivery` each time it ends — twice for an interrupted
run later cancelled while it awaited approval, since its ``finished_at``
changes. The :class:`WebhookCursor` is how far the queueing has read the
ended runs; every POST is a :class:`WebhookAttempt`.
"""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q


class WebhookCursor(models.Model):
    """Durable position in the stream of ended runs with a webhook, in
    ``(finished_at, id)`` order: the last run whose delivery is queued.
    Moved only by :func:`webhooks.services.deliveries_queue`, in the
    transaction that inserts the deliveries, so a run end is queued once."""

    name = models.CharField(primary_key=True, max_length=100)
    finished_at = models.DateTimeField(null=True, blank=True)
    run_id = models.UUIDField(null=True, blank=True)
    queued = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.name} at {self.finished_at} / {self.run_id}"


class WebhookDelivery(models.Model):
    """One announcement of one run end, sent until the receiver answers 2xx
    (``delivered``), or given up after ``WEBHOOK_MAX_ATTEMPTS``
    (``failed``), or not sent because the run is no longer readable (its
    thread was deleted) or its host is no longer allowed (``skipped``).

    ``id`` is the ``X-Yuxi-Delivery`` header: the same in every attempt, so
    a receiver that got one twice (it answered too late) can drop the
    second."""

    class Status(models.TextChoices):
        PENDING = "pending"
        DELIVERED = "delivered"
        FAILED = "failed"
        SKIPPED = "skipped"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # Not indexed alone: webhook_delivery_run_end_uniq (run, run_finished_at) serves it.
    run = models.ForeignKey(
        "audit.AgentRun", on_delete=models.CASCADE, related_name="webhook_deliveries", db_index=False
    )
    # The run end announced: the run's finished_at when it was queued.
    run_finished_at = models.DateTimeField()
    # The run's status at that end (completed, failed, cancelled, interrupted).
    run_status = models.CharField(max_length=20)
    url = models.CharField(max_length=2000)
    # The URL's scheme, host and port (webhooks.targets.receiver_of): a
    # receiver that fails is not tried again in the same delivery pass.
    receiver = models.CharField(max_length=300, blank=True, default="")
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    # ``attempts`` when an admin last sent the delivery again: it gets
    # WEBHOOK_MAX_ATTEMPTS more from there.
    resent_after = models.PositiveIntegerField(default=0)
    # When the next attempt is due; while an attempt is in flight, when its
    # claim runs out (a deliverer that died leaves it to the next pass).
    next_attempt_at = models.DateTimeField()
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "webhook deliveries"
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["run", "run_finished_at"], name="webhook_delivery_run_end_uniq"),
        ]
        indexes = [
            models.Index(fields=["next_attempt_at"], name="webhook_delivery_due_idx", condition=Q(status="pending")),
            models.Index(fields=["status", "-created_at"], name="webhook_delivery_status_idx"),
        ]

    def __str__(self) -> str:
        return f"delivery {self.id} of run {self.run_id} ({self.status})"


class WebhookAttempt(models.Model):
    """One POST of a delivery: when, how long, and the receiver's answer
    (``status_code``) or why there was none (``error``). The receiver's
    body is not kept."""

    # Not indexed alone: webhook_attempt_number_uniq (delivery, number) serves it.
    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE, related_name="attempt_rows", db_index=False)
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    duration_ms = models.FloatField()
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True, default="")

    class Meta:
        ordering = ["delivery", "number"]
        constraints = [
            models.UniqueConstraint(fields=["delivery", "number"], name="webhook_attempt_number_uniq"),
        ]

    def __str__(self) -> str:
        return f"attempt {self.number} of delivery {self.delivery_id}"
