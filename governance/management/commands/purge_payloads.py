"""``python manage.py purge_payloads --older-than-days N [--dry-run]`` (R-GOV-1)."""

from __future__ import annotations

from django.core.management.base import CommandError

from audit.management.commands._database import DatabaseCommand
from governance.bypass import current_actor
from governance.errors import ApplicationError
from governance.services import payloads_purge


class Command(DatabaseCommand):
    help = (
        "Empty the payloads (content, tool input and output, raw output, tool call arguments, workspace files) "
        "of the audit rows of runs that finished more than N days ago, keeping ids, status, timing, usage, cost "
        "and tool names; re-seal the runs. Short batches; run it again to resume after an interruption."
    )

    def add_arguments(self, parser):
        parser.add_argument("--older-than-days", type=int, required=True, help="age in days (>= 0)")
        parser.add_argument("--dry-run", action="store_true", help="only count what would be purged")
        parser.add_argument("--batch-runs", type=int, default=50, help="runs per transaction (default 50)")

    def handle(self, *args, older_than_days, dry_run=False, batch_runs=50, **options):
        if batch_runs < 1:
            raise CommandError("--batch-runs must be at least 1")
        try:
            outcome = payloads_purge(
                older_than_days=older_than_days,
                actor=current_actor(),
                dry_run=dry_run,
                batch_runs=batch_runs,
                progress=lambda done, total: self.stderr.write(f"purged {done}/{total} runs"),
            )
        except ApplicationError as exc:
            raise CommandError(exc.message) from None
        cutoff = outcome.extra["cutoff"].isoformat(timespec="seconds")
        if dry_run:
            self.stdout.write(
                f"dry run: would purge {outcome.rows} rows of {outcome.runs} runs finished before {cutoff}"
            )
            return
        for run_id in outcome.runs_skipped:
            self.stderr.write(self.style.WARNING(f"skipped run {run_id}: its rows do not match its seal"))
        self.stdout.write(
            self.style.SUCCESS(
                f"purge #{outcome.action.pk}: {outcome.rows} rows of {outcome.runs} runs finished before {cutoff}, "
                f"{outcome.files} workspace files deleted"
            )
        )
