"""Handing a run to a worker (R-RUN-9): the broker's message that starts it.

:func:`enqueue_run` is the one place a run is handed over, only when it
is at its thread's head (``audit.ledger.turns``): after its submission
commits (``audit.ledger.runs``), after the previous run of its thread ends
(``audit.ledger.terminal``) and again by the dispatcher
(``audit.execution.dispatch``) when the message may be lost. It sends the worker's
task by name, so this module sits below the Celery tasks and the run
execution that they call (docs/architecture.md#layers): it may import only
Django, Celery's app and the foundation.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Iterator

from celery import current_app
from django.conf import settings

log = logging.getLogger(__name__)

# The worker's task (audit.tasks.execute_run), sent by name: this module
# sits below the Celery tasks that call into it (docs/architecture.md#layers).
EXECUTE_RUN_TASK = "audit.execute_run"


def execute_run_task():
    """The worker's task object, found by its name (for the embedded worker,
    which runs it in this process). Where nothing imported the apps' task
    modules yet (a web process), Celery's loader imports them, as a worker
    does at start-up (``autodiscover_tasks``). Raises ``KeyError`` when no
    task of that name exists."""
    if EXECUTE_RUN_TASK not in current_app.tasks:
        current_app.loader.import_default_modules()
    return current_app.tasks[EXECUTE_RUN_TASK]


# Set by :func:`dispatch_held`: this process hands no run over.
_held = threading.Event()


@contextlib.contextmanager
def dispatch_held() -> Iterator[None]:
    """Within the block this process hands no run to a worker: submitted
    runs stay ``pending`` in PostgreSQL for whoever submitted them to start
    itself. For the benchmarks, which start their own runs in process: a
    worker of a running deployment (or the embedded worker thread) must not
    take them first. A run left pending is handed over by the dispatcher
    later, as any run whose message was lost (R-RUN-9)."""
    _held.set()
    try:
        yield
    finally:
        _held.clear()


def enqueue_run(run_id: uuid.UUID) -> bool:
    """Hand the run to a worker. With a broker: the Celery task. Embedded:
    the same task body in a background thread of this process. Inside
    :func:`dispatch_held`: nothing (returns False).

    Never raises: when the broker is unreachable the run stays ``pending``
    in PostgreSQL and the dispatcher hands it over once the broker is back
    (R-RUN-9), so a submission that committed still answers 202. Returns
    whether the broker took the message."""
    if _held.is_set():
        log.debug("run %s not handed over: dispatch is held in this process", run_id)
        return False
    if getattr(settings, "CELERY_TASK_ALWAYS_EAGER", False):
        task = execute_run_task()
        thread = threading.Thread(target=task.apply, args=((str(run_id),),), name=f"run-{run_id}", daemon=True)
        thread.start()
        return True
    try:
        current_app.send_task(EXECUTE_RUN_TASK, args=(str(run_id),))
    except Exception as exc:  # kombu OperationalError, redis errors, timeouts
        log.warning("run %s not enqueued (the dispatcher will hand it over): %s: %s", run_id, type(exc).__name__, exc)
        return False
    return True
