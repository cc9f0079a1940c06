"""Enqueueing runs: Celery in a deployment, an in-process thread under the
embedded defaults (no Redis). Called only after commit."""

from __future__ import annotations

import logging
import threading
import uuid

from django.conf import settings

log = logging.getLogger(__name__)


def enqueue_run(run_id: uuid.UUID) -> None:
    """Hand the run to a worker. With a broker: the Celery task. Embedded:
    the same task body in a background thread of this process."""
    from .tasks import execute_run

    if getattr(settings, "CELERY_TASK_ALWAYS_EAGER", False):
        thread = threading.Thread(target=execute_run.apply, args=((str(run_id),),), name=f"run-{run_id}", daemon=True)
        thread.start()
        return
    execute_run.apply_async(args=(str(run_id),))
