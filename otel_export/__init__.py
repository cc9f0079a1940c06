"""OpenTelemetry GenAI export of the audit (R-OTEL-1).

Closed runs are read from PostgreSQL behind a durable cursor
(:mod:`otel_export.models`), turned into OpenTelemetry spans that follow the
GenAI semantic conventions (:mod:`otel_export.spans`) and sent over OTLP/HTTP
by the OpenTelemetry SDK's exporter (:mod:`otel_export.services`). The
management command ``export_otel`` and the beat task ``otel_export.export``
run the same code. Nothing here is on the run path: the exporter only reads
rows that are already terminal.
"""
