"""The Celery application that runs agent runs (see ``audit.tasks``)."""

import os

from celery import Celery
from celery.signals import worker_init, worker_process_init, worker_shutting_down

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "yuxi_project.settings")

app = Celery("yuxi")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


# The worker of this (main) process, for its pool processes' pids at shutdown.
_worker = None


@worker_init.connect
def refuse_mismatched_schema(sender=None, **_kwargs) -> None:
    """Configure the worker's database connections, then stop the worker before it consumes anything when the settings are
    unsafe for production (R-SEC-1) or the database schema does not match the code (R-SCH-1). Celery logs and swallows exceptions
    of signal handlers, so the refusal is a ``SystemExit``. Last, the loaded code is moved out of the garbage collector's
    way (:func:`yuxi_project.runtime.tune_gc`)."""

    import django

    global _worker
    _worker = sender
    django.setup()
    from django.db import connections

    from core.config import get_config
    from core.db import configure_worker_database
    from yuxi_project.deploy_guard import ensure_safe_settings, start_or_exit
    from yuxi_project.schema_guard import ensure_schema_matches

    start_or_exit(ensure_safe_settings)  # R-SEC-1

    # Before the first connection: worker connections get bounded waits
    # (R-RUN-10) and a pool wait that fits inside the lease (R-RUN-8).
    configure_worker_database(connections["default"].settings_dict, get_config())
    try:
        start_or_exit(ensure_schema_matches)  # R-SCH-1
    finally:
        # The pool the check opened must not be inherited by the forked
        # pool processes (they would share its sockets): each opens its own.
        close_pool = getattr(connections["default"], "close_pool", None)
        if close_pool is not None:
            close_pool()
    # The run's code loaded, then out of the collector's way, before the
    # pool forks: each pool process inherits the frozen heap (and shares
    # its pages) and the raised threshold.
    import audit.tasks  # noqa: F401
    from yuxi_project.runtime import tune_gc

    tune_gc()


@worker_process_init.connect
def name_forked_worker_sessions(**_kwargs) -> None:
    """A forked pool process names its database sessions after its own
    session tag, not its parent's, before its first connection: the sweeper
    ends the sessions of a process whose lease expired by that name
    (R-RUN-14)."""
    from django.db import connections

    from audit.execution.shutdown import install_handover_handler
    from core.db import name_worker_sessions

    name_worker_sessions(connections["default"].settings_dict)
    # Told by the main process that the worker is stopping, its runs hand
    # themselves over to another worker (R-RUN-15).
    install_handover_handler()


@worker_shutting_down.connect
def hand_runs_over(how: str = "", **_kwargs) -> None:
    """A warm shutdown (the first SIGTERM: a deploy) asks the runs of every
    pool process to hand themselves over at once instead of keeping the
    worker until they end (R-RUN-15); a solo or threads pool runs them in
    this process. Runs in the main process's signal handler."""
    if how != "Warm":
        return
    from audit.execution.shutdown import request_handover, signal_pool_processes

    pool = getattr(getattr(_worker, "pool", None), "_pool", None)
    processes = getattr(pool, "_pool", None)
    if processes is None:
        request_handover()
        return
    signal_pool_processes(process.pid for process in processes if process.pid)
