"""Export settings (R-OTEL-1): validated at start-up, and the beat entry
exists only with an endpoint, on the export's own queue."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from core.config import Config
from otel_export.services import traces_endpoint
from tests.e2e.stack import REPO

SHOW_BEAT = (
    "import django, json; django.setup(); from django.conf import settings; "
    "print(json.dumps(settings.CELERY_BEAT_SCHEDULE.get('export-otel'), default=str))"
)


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "grpc://127.0.0.1:4317"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:4318"},
        {"OTEL_EXPORTER_OTLP_HEADERS": "Authorization"},
        {"OTEL_EXPORTER_OTLP_HEADERS": "=value"},
        {"OTEL_EXPORTER_OTLP_TIMEOUT": "0"},
        {"OTEL_EXPORT_BATCH_SPANS": "0"},
        {"OTEL_EXPORT_MAX_PAYLOAD_CHARS": "abc"},
        {"OTEL_EXPORT_SETTLE_SECONDS": "-1"},
        {"OTEL_EXPORT_CONTENT": "perhaps"},
    ],
)
def test_bad_export_settings_are_refused_naming_the_variable_R_OTEL_1(env, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError) as caught:
        Config()
    assert next(iter(env)) in str(caught.value)


def test_good_export_settings_R_OTEL_1(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "https://cloud.langfuse.com/api/public/otel")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "Authorization=Basic cGs6c2s=,x-extra=1")
    config = Config()
    assert traces_endpoint(config.OTEL_EXPORTER_OTLP_ENDPOINT) == "https://cloud.langfuse.com/api/public/otel/v1/traces"
    assert traces_endpoint("http://127.0.0.1:4318/") == "http://127.0.0.1:4318/v1/traces"
    assert traces_endpoint("http://127.0.0.1:4318/v1/traces") == "http://127.0.0.1:4318/v1/traces"


@pytest.mark.parametrize("endpoint", ["", "http://127.0.0.1:4318"])
def test_beat_schedules_the_export_on_its_own_queue_only_with_an_endpoint_R_OTEL_1(endpoint):
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORT_INTERVAL_SECONDS": "7"}
    env["DJANGO_SETTINGS_MODULE"] = "yuxi_project.settings"
    shown = subprocess.run(
        [sys.executable, "-c", SHOW_BEAT], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    entry = json.loads(shown.stdout.strip().splitlines()[-1])
    if not endpoint:
        assert entry is None
    else:
        assert entry == {
            "task": "otel_export.export",
            "schedule": 7.0,
            "options": {"queue": "otel-export", "expires": 7.0},
        }
