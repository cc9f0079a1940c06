"""What governance records: every purge and erasure (who, when, criterion,
how many rows), and each re-seal it made with the head it replaced
(R-GOV-1..3)."""

from __future__ import annotations

import pgtrigger
from django.db import models


class GovernanceActionQuerySet(models.QuerySet):
    def open(self) -> GovernanceActionQuerySet:
        """Actions still in progress: only these open the audited bypass."""
        return self.filter(finished_at__isnull=True)


class GovernanceAction(models.Model):
    """One purge, erasure or recorded manual intervention.

    While ``finished_at`` is null, a transaction that names the action's id
    in the session setting ``yuxi.governance_action`` may change or delete
    audit rows and runs (``governance.triggers``). Written only through
    ``governance.services``; the admin shows it read-only.
    """

    class Kind(models.TextChoices):
        PURGE = "purge"
        ERASURE = "erasure"
        # An operator's explicit, recorded intervention (the tests use it to
        # simulate a run lost behind the application's back).
        MANUAL = "manual"

    class Status(models.TextChoices):
        RUNNING = "running"
        COMPLETED = "completed"
        # Stopped before the end (interrupted, failed); a later action
        # with the same criterion goes on where it stopped.
        STOPPED = "stopped"

    kind = models.CharField(max_length=20, choices=Kind.choices)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.RUNNING)
    # Who asked: the operating-system user of a command, ``celery-beat`` for
    # the periodic purge.
    actor = models.CharField(max_length=200)
    # The erased user's id (never their name: the record must not keep what
    # it erased).
    subject_user_id = models.BigIntegerField(null=True, blank=True)
    # What was selected: {"older_than_days": N, "cutoff": iso} for a purge,
    # {"user_id": id} for an erasure, {"reason": ...} for a manual action.
    criterion = models.JSONField(default=dict)
    rows_changed = models.PositiveIntegerField(default=0)
    runs_resealed = models.PositiveIntegerField(default=0)
    files_deleted = models.PositiveIntegerField(default=0)
    # Runs left alone because their seal no longer matched their rows: a
    # purge never launders a changed run into a fresh seal.
    runs_skipped = models.PositiveIntegerField(default=0)
    started_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    note = models.TextField(blank=True, default="")

    objects = GovernanceActionQuerySet.as_manager()

    class Meta:
        ordering = ["-started_at"]
        indexes = [models.Index(fields=["-started_at"], name="gov_action_started_idx")]

    def __str__(self) -> str:
        return f"{self.kind} #{self.pk} ({self.status})"


class RunReseal(models.Model):
    """A run sealed again after a purge or erasure changed its rows: the
    head and row count it had before, and the new ones (R-GOV-3)."""

    action = models.ForeignKey(GovernanceAction, on_delete=models.PROTECT, related_name="reseals")
    # Not indexed alone: gov_reseal_run_idx (run, -created_at) serves it.
    run = models.ForeignKey(
        "audit.AgentRun", on_delete=models.DO_NOTHING, db_constraint=False, related_name="+", db_index=False
    )
    previous_head = models.CharField(max_length=64, blank=True, default="")
    previous_row_count = models.PositiveIntegerField(null=True, blank=True)
    # Whether the rows matched the previous seal before the change (an
    # erasure goes on even when not, and says so here).
    previous_verified = models.BooleanField(default=True)
    head = models.CharField(max_length=64)
    row_count = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["run", "-created_at"], name="gov_reseal_run_idx")]


class AuditDigest(models.Model):
    """One signed digest of the audit (R-GOV-5): the Merkle root of the
    seals of the runs sealed in ``[interval_start, interval_end)`` and of
    the re-seals made in it, chained to the previous digest (``previous``,
    its ``digest``; empty for the first) and signed with an Ed25519 key the
    database never holds. ``leaves`` lists what the root covers
    (``governance.digests``): the root authenticates them, so a verifier
    that trusts only the public key and the digest files can still read
    them from here. The same header is appended to ``AUDIT_DIGEST_DIR``.
    Written only by ``governance.digests.publish_digests``; never updated
    or deleted."""

    sequence = models.PositiveBigIntegerField(unique=True)
    interval_start = models.DateTimeField()
    interval_end = models.DateTimeField()
    leaf_count = models.PositiveIntegerField()
    root = models.CharField(max_length=64)
    previous = models.CharField(max_length=64, blank=True, default="")
    # SHA-256 (hex) of the signed message; the next digest's ``previous``.
    digest = models.CharField(max_length=64, unique=True)
    signature = models.CharField(max_length=200)
    # The first 16 hex digits of SHA-256 of the raw public key.
    key_id = models.CharField(max_length=16)
    leaves = models.JSONField(default=list)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["sequence"]
        triggers = [pgtrigger.Protect(name="audit_digest_append_only", operation=pgtrigger.Update | pgtrigger.Delete)]

    def __str__(self) -> str:
        return f"digest #{self.sequence} ({self.interval_start:%Y-%m-%d %H:%M} – {self.interval_end:%H:%M} UTC)"
