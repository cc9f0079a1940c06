"""``python manage.py erase_user <username> [--dry-run]`` (R-GOV-2)."""

from __future__ import annotations

from django.core.management.base import CommandError

from audit.management.commands._database import DatabaseCommand
from governance.bypass import current_actor
from governance.errors import ApplicationError
from governance.services import user_erase


class Command(DatabaseCommand):
    help = (
        "Erase one user's content: messages and audit payloads, run inputs, feedback reasons, thread titles, "
        "workspace files, LangGraph checkpoints and live event streams; keep anonymous metadata for statistics; "
        "record the erasure and re-seal the runs. The account stays as erased-user-<id>, inactive."
    )

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--dry-run", action="store_true", help="only count what would be erased")

    def handle(self, *args, username, dry_run=False, **options):
        try:
            outcome = user_erase(
                username=username,
                actor=current_actor(),
                dry_run=dry_run,
                progress=lambda done, total: self.stderr.write(f"erased {done}/{total} runs"),
            )
        except ApplicationError as exc:
            raise CommandError(exc.message) from None
        threads = outcome.extra["threads"]
        if dry_run:
            self.stdout.write(
                f"dry run: would erase {outcome.rows} messages in {threads} threads, {outcome.runs} runs "
                f"and {outcome.files} workspace files of user {username!r}"
            )
            return
        self.stdout.write(
            self.style.SUCCESS(
                f"erasure #{outcome.action.pk}: {outcome.rows} rows, {outcome.runs} runs, {threads} threads, "
                f"{outcome.files} workspace files of user id {outcome.extra['user_id']}"
            )
        )
