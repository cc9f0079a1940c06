"""Agent runs: one execution attempt of a turn, with the lease that decides
which worker may write into it (SPEC §3, R-RUN-*)."""

from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from conversations.triggers import RUN_REPLAY_TRIGGERS
from core.storable import StorableCharField, StorableJSONField, StorableTextField
from governance.triggers import ROLLBACK_TRIGGERS, RUN_TRIGGERS


class AgentRunQuerySet(models.QuerySet):
    def active(self) -> AgentRunQuerySet:
        """Runs not yet terminal."""
        return self.filter(status__in=AgentRun.ACTIVE_STATUSES)

    def terminal(self) -> AgentRunQuerySet:
        return self.filter(status__in=AgentRun.TERMINAL_STATUSES)

    def counted(self) -> AgentRunQuerySet:
        """Runs whose facts are figures: every run but a replay (issue 34).
        The dashboard, its rollups and the cost statistics count these only;
        SQL twin: :func:`counted_runs_sql`."""
        return self.filter(replay_of="")

    def visible_to(self, user) -> AgentRunQuerySet:
        """Runs a user may read over the API (R-READ-5): not those of a
        thread they deleted (R-API-1)."""
        return self.filter(user=user).exclude(thread__status="deleted")


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
    # The client's idempotency key, unique per user across turns and
    # resumes (R-RUN-1, R-IDEM-1; constraint run_request_id_user_uniq).
    request_id = models.CharField(max_length=200)
    # SHA-256 (hex) of the request's kind, target and input, to tell a retry
    # from another request under the same key; empty on runs created before
    # it was stored (see audit.ledger.idempotency).
    request_fingerprint = models.CharField(max_length=64, blank=True, default="")
    # Not indexed alone: run_thread_created_idx (thread, created_at) serves
    # every lookup by thread, and each index costs every run row's writes.
    thread = models.ForeignKey(
        "conversations.Conversation", on_delete=models.CASCADE, related_name="runs", db_index=False
    )
    # All runs of one user input share a turn: the first run and each resume.
    turn_id = models.UUIDField(default=uuid.uuid4, db_index=True)
    resumed_from = models.OneToOneField(
        "self", on_delete=models.PROTECT, null=True, blank=True, related_name="resumed_by"
    )
    # Not indexed alone: run_user_created_idx (user, -created_at) serves it.
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="agent_runs", db_index=False
    )
    agent_id = models.CharField(max_length=100)
    model = models.CharField(max_length=200)
    # {"text": ...} for a turn, {"decisions": [...]} for a resume.
    input = StorableJSONField(default=dict)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)
    # Which execution of this run: 1, then one more each time another
    # worker continues it after its worker died (R-RUN-15). Every audit row
    # records the attempt that wrote it (``Message.attempt``).
    attempt = models.PositiveSmallIntegerField(default=1, db_default=1)

    # --- lease (R-RUN-3, R-RUN-4, R-RUN-7) ---
    lease_owner = models.CharField(max_length=200, null=True, blank=True)
    # Increases at every acquisition; a write carrying an older token is
    # refused even if the owner name matches.
    fencing_token = models.BigIntegerField(default=0)
    lease_expires_at = models.DateTimeField(null=True, blank=True)

    error_type = StorableCharField(max_length=100, blank=True, default="")
    error_message = StorableTextField(blank=True, default="")
    # Sum over this run's model calls: {input_tokens, output_tokens,
    # total_tokens, unknown_calls}. ``unknown_calls`` counts calls cut off
    # before the provider reported usage.
    usage = StorableJSONField(null=True, blank=True)
    output_message = models.OneToOneField(
        "conversations.Message", on_delete=models.SET_NULL, null=True, blank=True, related_name="output_of"
    )
    # Pending human approval while interrupted: the interrupt payloads.
    interrupts = StorableJSONField(null=True, blank=True)
    trace_id = models.CharField(max_length=100, blank=True, default="")

    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    # Set in the terminal transaction when the run's figures were added to
    # the dashboard rollups (dashboard.rollups): never twice; runs without
    # it are counted from their rows (R-DASH-1).
    rolled_up_at = models.DateTimeField(null=True, blank=True, editable=False)
    # When the run was last handed to the broker (submission, its thread's
    # previous run ending, the dispatcher): a pending run at the head of its
    # thread not acquired within DISPATCH_GRACE_SECONDS of it is handed over
    # again (R-RUN-9).
    dispatched_at = models.DateTimeField(null=True, blank=True, default=timezone.now)

    # --- seal (R-GOV-3, governance.seal): written once by the terminal
    # transaction, again only by a purge or an erasure; null on runs that
    # ended before sealing existed (reported as unsealed). ---
    seal_head = models.CharField(max_length=64, blank=True, default="", db_default="")
    seal_row_count = models.PositiveIntegerField(null=True, blank=True)
    # [[row id, first 16 hex digits of the row's digest], ...] in timeline
    # order: lets a verification name every row that differs (R-GOV-4).
    seal_rows = models.JSONField(null=True, blank=True)
    # The encoding the seal was made under (governance.seal.SEAL_VERSION);
    # null on runs sealed before it was stored, which are version 1 (R-GOV-4).
    seal_version = models.PositiveSmallIntegerField(null=True, blank=True)
    sealed_at = models.DateTimeField(null=True, blank=True)
    # What a replayed run replays (R-REPLAY-2, issue 34): the recorded run's
    # id or the scenario file's path; empty on every other run. Set by the
    # transaction that creates the run, append-only once the run is sealed
    # (governance.triggers). Replays are audit runs like any other but no
    # figure counts them (``counted()``). ``db_default``: rows inserted by
    # raw SQL are ordinary runs.
    replay_of = models.CharField(max_length=500, blank=True, default="", db_default="")
    # Where the run's end is announced (R-API-3, webhooks): the submit's or
    # resume's ``webhook``, on a host of WEBHOOK_ALLOWED_HOSTS; empty for
    # none. Delivery bookkeeping, not a sealed fact.
    webhook = models.CharField(max_length=2000, blank=True, default="", db_default="")

    objects = AgentRunQuerySet.as_manager()

    class Meta:
        ordering = ["created_at"]
        # Append-only once sealed; no DELETE (R-GOV-3, governance.triggers).
        # A replayed run marks its thread (holds_replay, conversations.triggers).
        triggers = [*RUN_TRIGGERS, *RUN_REPLAY_TRIGGERS]
        constraints = [
            # request_id first: the index also serves the admin's exact
            # search by request id alone.
            models.UniqueConstraint(fields=["request_id", "user"], name="run_request_id_user_uniq"),
        ]
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
            # Dashboard: the runs not yet in the rollups (active ones) are
            # counted live from their rows.
            models.Index(fields=["created_at"], name="run_not_rolled_up_idx", condition=Q(rolled_up_at__isnull=True)),
            models.Index(fields=["user", "-created_at"], name="run_user_created_idx"),
            # The webhook cursor's scan of ended runs (webhooks.services).
            models.Index(fields=["finished_at", "id"], name="run_webhook_finished_idx", condition=~Q(webhook="")),
            # Dispatcher: pending runs handed over longest ago (R-RUN-9).
            models.Index(fields=["dispatched_at"], name="run_pending_dispatch_idx", condition=Q(status="pending")),
            # OpenTelemetry export cursor: closed runs after (finished_at, id)
            # in that order (R-OTEL-1).
            models.Index(
                fields=["finished_at", "id"],
                name="run_finished_idx",
                condition=Q(finished_at__isnull=False),
            ),
            # Dashboard: conversation counts leave out the scratch threads of
            # replays (threads holding a replayed run): the few replayed runs
            # by thread, where the anti-join read the whole run table.
            models.Index(fields=["thread"], name="run_replay_thread_idx", condition=~Q(replay_of="")),
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


def counted_runs_sql(alias: str) -> str:
    """The SQL condition of :meth:`AgentRunQuerySet.counted` over the run
    table aliased ``alias``: the one predicate that keeps replays out of
    every figure read or written in SQL (``dashboard.facts``)."""
    return f"{alias}.replay_of = ''"


def pending_action_requests(interrupts: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The action requests ``[{name, args, description}]`` of an
    interrupted run's approval interrupts (``AgentRun.interrupts``), in
    order (R-TA-5)."""
    actions: list[dict[str, Any]] = []
    for item in interrupts or []:
        value = item.get("value") if isinstance(item, dict) else None
        if isinstance(value, dict):
            actions += [a for a in value.get("action_requests") or [] if isinstance(a, dict)]
    return actions


class RunRollback(models.Model):
    """A run rolled back by a later turn (R-API-2, ``multitask_strategy:
    rollback``): the turn leaves the chat history and the agent's memory
    (the next run starts from the State before it), and its audit rows stay,
    marked by this row. Recorded with the turn that rolls it back, without
    waiting for the run row's lock (no foreign-key constraint on ``run``,
    as :class:`RunCancelRequest`)."""

    run = models.OneToOneField(
        AgentRun, on_delete=models.CASCADE, db_constraint=False, related_name="rollback", primary_key=True
    )
    # The run of the turn that rolled it back.
    by_run = models.ForeignKey(AgentRun, on_delete=models.CASCADE, db_constraint=False, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        # Append-only once recorded (R-GOV-3): see governance.triggers.
        triggers = ROLLBACK_TRIGGERS

    def __str__(self) -> str:
        return f"run {self.run_id} rolled back by run {self.by_run_id}"


class RunCancelRequest(models.Model):
    """A cancel request recorded without waiting for the run row's lock
    (R-RUN-10). ``POST /api/runs/{id}/cancel`` inserts it and signals the
    worker over Redis; the lock holder (the worker, at its next lease check),
    the cancel request itself when the row is free, or the dispatcher applies
    it to the run and sets ``applied_at``.

    ``run`` has no foreign-key constraint on purpose: the constraint's check
    takes a share lock on the run row, which a worker frozen inside a
    transaction may hold; the insert must never wait for it. Deleting a run
    still deletes its requests (Django's cascade).
    """

    run = models.OneToOneField(
        AgentRun, on_delete=models.CASCADE, db_constraint=False, related_name="cancel_request", primary_key=True
    )
    requested_at = models.DateTimeField(default=timezone.now)
    applied_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            # Dispatcher: requests not applied yet.
            models.Index(fields=["requested_at"], name="cancel_unapplied_idx", condition=Q(applied_at__isnull=True)),
        ]

    def __str__(self) -> str:
        return f"cancel request for run {self.run_id}"


class RunReplay(models.Model):
    """A replay of a run's turn asked for from the admin (R-REPLAY-2): who
    asked and when, and once a worker ran it
    (:func:`audit.execution.rerun.replay_requested_run`), the outcome, the
    first divergence, the report text and the replayed runs. Not an audit
    row: the replayed runs are (on the replay user's scratch thread)."""

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        IDENTICAL = "identical"
        DIVERGED = "diverged"
        # The turn could not be replayed (nothing to replay, an error).
        FAILED = "failed"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # Not indexed alone: replay_run_created_idx (run, -created_at) serves it.
    run = models.ForeignKey(AgentRun, on_delete=models.CASCADE, related_name="replays", db_index=False)
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    # "<where>: <what>" of the first divergence, or why it could not run.
    first_divergence = StorableCharField(max_length=500, blank=True, default="")
    report = StorableTextField(blank=True, default="")
    replay_run_ids = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["run", "-created_at"], name="replay_run_created_idx")]

    def __str__(self) -> str:
        return f"replay of run {self.run_id} ({self.status})"
