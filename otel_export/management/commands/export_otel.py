"""``python manage.py export_otel [--once]`` (R-OTEL-1)."""

from __future__ import annotations

import time

from django.core.management.base import CommandError

from audit.management.commands._database import DatabaseCommand
from core.config import get_config
from otel_export.services import CursorMoved, ExportNotConfigured, ExportProgress, SdkDisabled, export_closed_runs
from yuxi_project.runtime import tune_gc


class Command(DatabaseCommand):
    help = (
        "Export closed agent runs as OpenTelemetry GenAI spans to OTEL_EXPORTER_OTLP_ENDPOINT, exactly once "
        "behind a durable cursor. Without --once it keeps exporting every OTEL_EXPORT_INTERVAL_SECONDS."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--once",
            action="store_true",
            help="export what is closed now and exit (status 1 if the receiver did not accept everything)",
        )

    def handle(self, *args, once: bool = False, **options):
        interval = get_config().OTEL_EXPORT_INTERVAL_SECONDS
        while True:
            try:
                result = export_closed_runs(progress=self._progress)
            except (ExportNotConfigured, CursorMoved, SdkDisabled) as exc:
                raise CommandError(str(exc)) from None
            self._summary(result)
            if once:
                if result.error or result.busy:
                    raise CommandError(result.error or "another export pass holds the export lock; try again")
                return
            # A long-lived loop: once its first pass has loaded what it uses,
            # the loaded code goes out of the collector's way (once).
            tune_gc()
            time.sleep(interval)

    def _progress(self, result: ExportProgress) -> None:
        self.stdout.write(
            f"exported {result.runs}/{result.backlog} runs ({result.spans} spans, {result.requests} requests)"
        )

    def _summary(self, result: ExportProgress) -> None:
        if result.busy:
            self.stderr.write("another export pass is running")
            return
        if result.error:
            self.stderr.write(
                f"stopped after {result.runs} runs: {result.error}; nothing lost, the next pass resends from there"
            )
        elif result.runs or result.backlog:
            self.stdout.write(self.style.SUCCESS(f"done: {result.runs} runs, {result.spans} spans"))
        else:
            self.stdout.write("nothing new to export")
        if result.waiting_for:
            self.stdout.write(f"runs finished later wait for {result.waiting_for}")
