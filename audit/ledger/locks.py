"""Bounded lock waits for web requests (R-RUN-10).

A web request that must lock a run or thread row (submit, resume) waits at
most ``WEB_LOCK_TIMEOUT_MS`` for it, then answers 503 ``run_busy`` — so a
worker frozen while it holds a row, or a burst of requests queued behind
one, can never hold the web process's database connections for long.
Worker connections carry their own session limits (see
:func:`core.db.worker_session_options`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import OperationalError

from core.config import get_config
from core.db import local_setting

from ..errors import RunBusy


def lock_timed_out(exc: BaseException) -> bool:
    """Whether a database error is PostgreSQL's ``lock_timeout`` (55P03)."""
    cause = exc.__cause__
    return getattr(cause, "sqlstate", None) == "55P03"


@contextmanager
def web_lock_wait(timeout_ms: int | None = None) -> Iterator[None]:
    """Open a transaction (``transaction.atomic()``) whose lock waits give
    up after ``timeout_ms`` milliseconds (default ``WEB_LOCK_TIMEOUT_MS``;
    :func:`~core.db.local_setting`: it ends with the transaction, or
    with the block inside an outer one).

    Raises:
        RunBusy: a lock was not granted in time (HTTP 503, nothing changed).
    """
    timeout_ms = timeout_ms or get_config().WEB_LOCK_TIMEOUT_MS
    try:
        with local_setting("lock_timeout", f"{int(timeout_ms)}ms"):
            yield
    except OperationalError as exc:
        if lock_timed_out(exc):
            raise RunBusy(
                f"the run or thread is being written by a worker; nothing was changed, retry in a moment "
                f"(waited {timeout_ms} ms)",
                extra={"retry_after_seconds": 1},
            ) from exc
        raise
