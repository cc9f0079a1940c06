"""The Celery application that runs agent runs (see ``audit.tasks``)."""

import os

from celery import Celery
from celery.signals import worker_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "yuxi_project.settings")

app = Celery("yuxi")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_init.connect
def refuse_mismatched_schema(**_kwargs) -> None:
    """Stop the worker before it consumes anything when the database schema
    does not match the code (R-SCH-1). Celery logs and swallows exceptions
    of signal handlers, so the refusal is a ``SystemExit``."""
    import sys

    import django

    django.setup()
    from yuxi_project.schema_guard import SchemaMismatch, ensure_schema_matches

    try:
        ensure_schema_matches()
    except SchemaMismatch as exc:
        print(str(exc), file=sys.stderr, flush=True)
        raise SystemExit(1) from None
