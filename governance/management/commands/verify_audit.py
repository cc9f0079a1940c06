"""``python manage.py verify_audit [--run ID] [--since DATE] [--digests DIR --public-key FILE]``
(R-GOV-3, R-GOV-4, R-GOV-5)."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path

from django.core.management.base import CommandError
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from audit.management.commands._database import DatabaseCommand
from audit.models import AgentRun
from governance.digests import INTACT, DigestKeyError, load_public_key, verify_digests
from governance.seal import verify_runs

# Exit statuses, as governance/digest_check.py has them: 0 intact, 1 the
# audit differs from its seals or digests, 2 the command could not check
# (bad arguments, a key or folder that is not there).
DIFFERS, CANNOT_CHECK = 1, 2


def _usage(message: str) -> CommandError:
    return CommandError(message, returncode=CANNOT_CHECK)


def _since(value: str) -> dt.datetime:
    parsed = parse_datetime(value)
    if parsed is None:
        day = parse_date(value)
        if day is None:
            raise _usage(f"--since: {value!r} is not a date (YYYY-MM-DD) or an ISO 8601 time")
        parsed = dt.datetime.combine(day, dt.time())
    return parsed if timezone.is_aware(parsed) else parsed.replace(tzinfo=dt.UTC)


class Command(DatabaseCommand):
    help = (
        "Recompute the seal of every terminal run (or one run, or the runs finished since a date) and report "
        "every audit row changed, removed, added or moved in sequence after sealing, run by run; with --digests, "
        "check too that no run was removed, slipped in or re-sealed since it was signed. Exit status 0 intact, "
        "1 if anything differs, 2 if it could not check (bad arguments, no such key or folder). Runs that ended "
        "before sealing existed are reported as unsealed."
    )

    refusal_returncode = CANNOT_CHECK

    def add_arguments(self, parser):
        parser.add_argument("--run", help="only this run id")
        parser.add_argument("--since", help="only runs finished at or after this date (YYYY-MM-DD, UTC) or time")
        parser.add_argument("--batch-size", type=int, default=200, help="runs per batch (default 200)")
        parser.add_argument(
            "--digests",
            help="also check the audit against the signed digests in this folder (with --public-key, R-GOV-5)",
        )
        parser.add_argument("--public-key", help="the Ed25519 public key (PEM) the digests were signed with")

    def handle(self, *args, run=None, since=None, batch_size=200, digests=None, public_key=None, **options):
        if bool(digests) != bool(public_key):
            raise _usage("--digests and --public-key go together")
        runs = self._runs(run, since, batch_size)
        digest_report = None
        if digests:
            try:
                key = load_public_key(public_key)
            except DigestKeyError as exc:
                raise _usage(str(exc)) from None
            if not Path(digests).is_dir():
                raise _usage(f"--digests: {digests} is not a folder (the digests are in AUDIT_DIGEST_DIR)")
            digest_report = verify_digests(digests, key)
            for problem in digest_report.problems:
                self.stdout.write(self.style.ERROR(problem))
            for pending in digest_report.pending:
                self.stdout.write(pending)
            self.stdout.write(digest_report.summary)
            if digest_report.ok:
                self.stdout.write(self.style.SUCCESS(INTACT))
        report = self._verify_seals(runs, batch_size)
        failures = []
        if report is not None and report.findings:
            failures.append(f"{report.changed} run(s) changed after sealing ({len(report.findings)} finding(s))")
        if digest_report is not None and not digest_report.ok:
            failures.append(f"the audit does not match its signed digests ({len(digest_report.problems)} problem(s))")
        if failures:
            raise CommandError("; ".join(failures), returncode=DIFFERS)
        if digest_report is not None:
            self.stdout.write(self.style.SUCCESS("the audit matches its seals and its signed digests"))

    def _runs(self, run, since, batch_size):
        """The terminal runs to check; raises a usage error (exit 2) for a
        bad argument."""
        runs = AgentRun.objects.terminal()
        if run:
            try:
                run_id = uuid.UUID(run)
            except ValueError:
                raise _usage(f"--run: {run!r} is not a run id") from None
            if not AgentRun.objects.filter(pk=run_id).exists():
                raise _usage(f"--run: no run {run_id}")
            runs = runs.filter(pk=run_id)
        if since:
            runs = runs.filter(finished_at__gte=_since(since))
        if batch_size < 1:
            raise _usage("--batch-size must be at least 1")
        return runs

    def _verify_seals(self, runs, batch_size):
        total = runs.count()
        reported = 0
        report = None
        for report, _batch in verify_runs(runs, batch_size=batch_size):
            for finding in report.findings[reported:]:
                self.stdout.write(self.style.ERROR(str(finding)))
            reported = len(report.findings)
            self.stderr.write(f"checked {report.checked}/{total} runs")
        if report is None:
            self.stdout.write("no terminal runs to verify")
            return None
        self.stdout.write(
            f"{report.checked} run{'' if report.checked == 1 else 's'}: {report.sealed} sealed, {report.unsealed} unsealed "
            f"(ended before sealing existed), {report.changed} changed after sealing"
        )
        if not report.findings:
            self.stdout.write(self.style.SUCCESS("every sealed run matches its seal"))
        return report
