"""``python manage.py export_audit``: the audit of a run, a thread or the
runs matching filters, as JSON lines or CSV, streamed to a file or stdout
in constant memory (R-ADM-2).

    manage.py export_audit --run <run id> [--format csv] [--output run.csv]
    manage.py export_audit --thread <thread id>
    manage.py export_audit --status failed --tool send_email --from 2026-11-23 --output failed.jsonl
"""

from __future__ import annotations

import sys

from django.core.management.base import CommandError
from pydantic import ValidationError

from audit import export
from audit.models import AgentRun
from audit.reads import search
from audit.schemas import RunFilterQuery
from conversations.models import Conversation
from core.errors import ApplicationError

from ._database import DatabaseCommand

# Filter options, named as the query parameters of GET /api/audit/runs.
FILTERS = (
    "status",
    "error_type",
    "model",
    "agent",
    "user",
    "from",
    "to",
    "tool",
    "tool_status",
    "rejected",
    "min_duration_ms",
    "min_cost_usd",
    "q",
)


class Command(DatabaseCommand):
    help = "Export the audit of a run, a thread or the runs matching filters as JSON lines or CSV (streamed)."

    def add_arguments(self, parser):
        which = parser.add_mutually_exclusive_group()
        which.add_argument("--run", help="one run id")
        which.add_argument("--thread", help="one thread id: every run of it")
        parser.add_argument("--format", choices=export.FORMATS, default="jsonl")
        parser.add_argument("--output", "-o", help="a file to write (default: standard output)")
        for name in FILTERS:
            parser.add_argument(
                f"--{name.replace('_', '-')}", dest=f"filter_{name}", metavar="VALUE", help=f"filter: {name}"
            )

    def handle(self, *args, run, thread, format, output, **options):
        given = {name: options[f"filter_{name}"] for name in FILTERS if options.get(f"filter_{name}") is not None}
        if given and (run or thread):
            raise CommandError("filters select runs: give them without --run or --thread")
        try:
            rows = self._rows(run=run, thread=thread, filters=given)
            pieces = export.render(export.records(rows), format)
            self._write(pieces, output)
        except ApplicationError as exc:
            raise CommandError(exc.message) from exc

    def _rows(self, *, run, thread, filters):
        if run:
            run_id = _uuid(run, "--run")
            if not AgentRun.objects.filter(pk=run_id).exists():
                raise CommandError(f"no run {run}")
            return export.run_rows(run_id)
        if thread:
            thread_id = _uuid(thread, "--thread")
            if not Conversation.objects.filter(pk=thread_id).exists():
                raise CommandError(f"no thread {thread}")
            return export.thread_rows(thread_id)
        try:
            query = RunFilterQuery.model_validate(filters)
        except ValidationError as exc:
            error = exc.errors()[0]
            raise CommandError(f"--{'-'.join(map(str, error['loc']))}: {error['msg']}") from None
        return export.runs_rows(search.filter_runs(AgentRun.objects.all(), query.as_filters()))

    def _write(self, pieces, output):
        if not output:
            for piece in pieces:
                sys.stdout.write(piece)
            sys.stdout.flush()
            return
        count = 0
        with open(output, "w", encoding="utf-8", newline="") as handle:
            for piece in pieces:
                handle.write(piece)
                count += len(piece)
        self.stderr.write(f"wrote {count} characters to {output}")


def _uuid(value: str, option: str):
    import uuid

    try:
        return uuid.UUID(value)
    except ValueError:
        raise CommandError(f"{option}: {value!r} is not an id") from None
