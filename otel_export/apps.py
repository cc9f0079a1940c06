from django.apps import AppConfig


class OtelExportConfig(AppConfig):
    """OpenTelemetry export of the audit (R-OTEL-1)."""

    name = "otel_export"
    verbose_name = "OpenTelemetry export"
