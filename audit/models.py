"""Agent runs: one execution attempt of a turn, with the lease that decides
which worker may write into it (SPEC §3, R-RUN-*)."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q


class AgentRunQuerySet(models.QuerySet):
    def active(self) -> AgentRunQuerySet:
        """Runs not yet terminal."""
        return self.filter(status__in=AgentRun.ACTIVE_STATUSES)

    def terminal(self) -> AgentRunQuerySet:
        return self.filter(status__in=AgentRun.TERMINAL_STATUSES)

    def visible_to(self, user) -> AgentRunQuerySet:
        """Runs a user may read over the API (R-READ-5)."""
        return self.filter(user=user)


class AgentRun(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        CANCEL_REQUESTED = "cancel_requested"
        COMPLETED = "completed"
        FAILED = "failed"
        CANCELLED = "cancelled"
        INTERRUPTED = "interrupted"

    ACTIVE_STATUSES = (Status.PENDING, Status.RUNNING, Status.CANCEL_REQUESTED)
    TERMINAL_STATUSES = (Status.COMPLETED, Status.FAILED, Status.CANCELLED, Status.INTERRUPTED)

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # The client's idempotency key (R-RUN-1).
    request_id = models.CharField(max_length=200, unique=True)
    thread = models.ForeignKey("conversations.Conversation", on_delete=models.CASCADE, related_name="runs")
    # All runs of one user input share a turn: the first run and each resume.
    turn_id = models.UUIDField(default=uuid.uuid4, db_index=True)
    resumed_from = models.OneToOneField(
        "self", on_delete=models.PROTECT, null=True, blank=True, related_name="resumed_by"
    )
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="agent_runs")
    agent_id = models.CharField(max_length=100)
    model = models.CharField(max_length=200)
    # {"text": ...} for a turn, {"decisions": [...]} for a resume.
    input = models.JSONField(default=dict)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)

    # --- lease (R-RUN-3, R-RUN-4, R-RUN-7) ---
    lease_owner = models.CharField(max_length=200, null=True, blank=True)
    # Increases at every acquisition; a write carrying an older token is
    # refused even if the owner name matches.
    fencing_token = models.BigIntegerField(default=0)
    lease_expires_at = models.DateTimeField(null=True, blank=True)

    error_type = models.CharField(max_length=100, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    # Sum over this run's model calls: {input_tokens, output_tokens,
    # total_tokens, unknown_calls}. ``unknown_calls`` counts calls cut off
    # before the provider reported usage.
    usage = models.JSONField(null=True, blank=True)
    output_message = models.OneToOneField(
        "conversations.Message", on_delete=models.SET_NULL, null=True, blank=True, related_name="output_of"
    )
    # Pending human approval while interrupted: the interrupt payloads.
    interrupts = models.JSONField(null=True, blank=True)
    trace_id = models.CharField(max_length=100, blank=True, default="")

    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = AgentRunQuerySet.as_manager()

    class Meta:
        ordering = ["created_at"]
        indexes = [
            # FIFO: the earlier non-terminal runs of a thread (R-RUN-2).
            models.Index(fields=["thread", "created_at"], name="run_thread_created_idx"),
            # Lease sweeper: running runs whose lease expired (R-RUN-7).
            models.Index(
                fields=["lease_expires_at"],
                name="run_lease_expiry_idx",
                condition=Q(status__in=["running", "cancel_requested"]),
            ),
            # Admin and dashboard: runs by status and time.
            models.Index(fields=["status", "created_at"], name="run_status_created_idx"),
            # Admin run list, newest first (ORDER BY created_at DESC LIMIT n),
            # its date filter and the dashboard's runs per day.
            models.Index(fields=["created_at"], name="run_created_idx"),
            models.Index(fields=["user", "-created_at"], name="run_user_created_idx"),
            # Run list filtered by error type, newest first (R-ADM-2).
            models.Index(
                fields=["error_type", "-created_at"], name="run_error_created_idx", condition=~Q(error_type="")
            ),
        ]

    def __str__(self) -> str:
        return f"run {self.id} ({self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in self.TERMINAL_STATUSES
