"""The long-lived processes move their loaded code out of the garbage
collector's way once it is loaded (``yuxi_project.runtime.tune_gc``):
the web server, and the Celery worker before it starts its pool, so that
every run's allocations do not make the collector walk the whole loaded
heap (issue 38, the audit's CPU per run). Checked in processes of their
own: freezing this test process would change every test after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from django.db import connection

from core.config import BASE_DIR
from tests.e2e.stack import database_url_of
from yuxi_project.runtime import GC_THRESHOLDS

pytestmark = pytest.mark.django_db

REPORT = (
    "import gc, json, sys; print(json.dumps([gc.get_freeze_count(), gc.get_threshold(), 'langgraph' in sys.modules]))"
)


def _python(code: str) -> list:
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=BASE_DIR,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "DATABASE_URL": database_url_of(connection.settings_dict)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_celery_worker_is_tuned_with_the_runs_code_loaded_before_its_pool_starts():
    frozen, threshold, run_code_loaded = _python(
        "from yuxi_project.celery import refuse_mismatched_schema; refuse_mismatched_schema(sender=None); " + REPORT
    )
    assert frozen > 50_000 and tuple(threshold) == GC_THRESHOLDS and run_code_loaded


def test_the_web_server_is_tuned_once_its_application_is_loaded():
    frozen, threshold, _ = _python("import yuxi_project.asgi; " + REPORT)
    assert frozen > 50_000 and tuple(threshold) == GC_THRESHOLDS


def test_tune_gc_acts_once_per_process():
    """A loop (``export_otel``, ``deliver_webhooks``) calls it after each
    pass: only the first call freezes."""
    first, again = _python(
        "import gc, json; from yuxi_project.runtime import tune_gc; tune_gc(); n = gc.get_freeze_count(); "
        "kept = [[i] for i in range(10_000)]; tune_gc(); print(json.dumps([n, gc.get_freeze_count()]))"
    )
    assert first == again > 0
