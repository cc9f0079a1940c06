"""A run is handed to the broker by the task's name (R-RUN-9): dispatch
sits below the Celery tasks in the layers (docs/architecture.md#layers), so
it sends ``audit.execute_run`` without importing the task. The message
lands on the run queue of the real Redis broker, as a worker reads it."""

from __future__ import annotations

import json
import uuid

import pytest
import redis
from celery import current_app
from django.conf import settings

from audit.ledger.handover import EXECUTE_RUN_TASK, enqueue_run
from audit.tasks import execute_run


def test_the_task_name_dispatch_sends_is_the_workers_task():
    assert execute_run.name == EXECUTE_RUN_TASK
    assert current_app.tasks[EXECUTE_RUN_TASK] is execute_run._get_current_object()


@pytest.mark.skipif(not settings.CELERY_BROKER_URL.startswith("redis"), reason="needs the Redis broker")
def test_enqueue_run_puts_the_named_task_with_the_run_id_on_the_run_queue_R_RUN_9():
    # The tests' run queue, which no worker consumes (bin/test's CELERY_QUEUE).
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    run_id = uuid.uuid4()
    assert enqueue_run(run_id) is True
    ours = [raw for raw in client.lrange(queue, 0, -1) if str(run_id) in raw.decode()]
    for raw in ours:
        client.lrem(queue, 1, raw)
    assert len(ours) == 1
    message = json.loads(ours[0])
    assert message["headers"]["task"] == EXECUTE_RUN_TASK
    assert message["headers"]["argsrepr"] == repr((str(run_id),))


def test_the_embedded_worker_runs_the_named_task_in_a_thread_R_RUN_9(settings, monkeypatch):
    """Without a broker (the quick start's embedded default) the same task,
    found by its name, runs in a thread of this process."""
    import threading

    import audit.tasks

    ran: dict[str, str] = {}
    done = threading.Event()

    def run_execute(*, run_id: str) -> str:
        ran.update(run_id=run_id, thread=threading.current_thread().name)
        done.set()
        return "finished"

    monkeypatch.setattr(audit.tasks, "run_execute", run_execute)
    settings.CELERY_TASK_ALWAYS_EAGER = True
    run_id = uuid.uuid4()
    assert enqueue_run(run_id) is True
    assert done.wait(30)
    assert ran == {"run_id": str(run_id), "thread": f"run-{run_id}"}


def test_a_fresh_web_process_finds_the_task_by_name_R_RUN_9():
    """In a web process nothing has imported audit.tasks (dispatch no longer
    does): the embedded worker must still find the task by its name (a
    quick start without Redis answered 500 on every submission)."""
    import os
    import subprocess
    import sys

    from core.config import BASE_DIR

    code = (
        "import django, sys; django.setup(); "
        "assert 'audit.tasks' not in sys.modules; "
        "from audit.ledger.handover import execute_run_task; print(execute_run_task().name)"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "yuxi_project.settings", "REDIS_URL": ""}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == EXECUTE_RUN_TASK
