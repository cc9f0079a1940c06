"""The export cursor: how far the OpenTelemetry export has got (R-OTEL-1)."""

from __future__ import annotations

from django.db import models


class ExportCursor(models.Model):
    """Durable position of one exporter in the stream of closed runs.

    Closed runs are exported in ``(finished_at, id)`` order; the cursor holds
    the last run whose spans the receiver accepted (HTTP 2xx). It is moved
    only by :func:`otel_export.services.export_closed_runs`, after the
    receiver's answer, with a compare-and-set on the old position.
    """

    name = models.CharField(primary_key=True, max_length=100)
    finished_at = models.DateTimeField(null=True, blank=True)
    run_id = models.UUIDField(null=True, blank=True)
    exported_runs = models.BigIntegerField(default=0)
    exported_spans = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.name} at {self.finished_at} / {self.run_id}"
