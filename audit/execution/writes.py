"""The worker's audit writes: one lease-checked ledger service call, awaited
in its own short transaction and retried while the database is unreachable
(R-RUN-5, R-RUN-8, R-RUN-11).

The recorder (:mod:`audit.execution.recorder`) and the runner call
:func:`write_with_retry` with a service of :mod:`audit.ledger`; the service
builds its statement with :mod:`audit.ledger.fenced`. A write from a
lifecycle event to its SQL is thus read in three files: the recorder's
handler, the ledger service, the fenced statement. This module is the
transport between them: which thread or connection a call is made on, and
what happens when it fails.

It may import the ledger, the models, :mod:`core.db` and the
configuration; nothing of the run's execution but :mod:`.checkpoint`'s
back-off.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from asgiref.sync import sync_to_async
from django.db import DatabaseError, IntegrityError, InterfaceError, OperationalError

from core.config import get_config
from core.db import (
    NeedsThread,
    call_with_pooled_statements,
    call_with_pooled_statements_async,
    release_connection,
)

from .. import ledger
from ..errors import AuditWriteFailed, AuditWriteRejected
from .checkpoint import retry_delay

log = logging.getLogger(__name__)


class DatabaseLossWatcher(Protocol):
    """Told when an audit write meets an unreachable database, before its
    retry (the run's executor: it leaves the failure cause while its lease
    still holds, R-RUN-8)."""

    async def database_lost(self, exc: BaseException, *, retry_in: float) -> None: ...


#: The run whose audit writes this task makes (set by the run's executor;
#: its tasks and threads inherit it): a write that meets an unreachable
#: database while the run's lease runs out tells it first.
current_run: contextvars.ContextVar[DatabaseLossWatcher | None] = contextvars.ContextVar(
    "yuxi_current_run", default=None
)

#: The last database error this process met (monotonic time, text): a lease
#: that expired while the database was unreachable names that cause.
last_database_error: dict[str, Any] = {"at": float("-inf"), "text": ""}

_RETRYABLE = (OperationalError, InterfaceError, IntegrityError)


def call_then_release(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """``fn(**kwargs)``, then this thread's connection given back (unless an
    outer transaction holds it). For calls made in a thread."""
    try:
        return fn(**kwargs)
    finally:
        release_connection()


async def write_with_retry(fn: Callable[..., Any], /, **kwargs: Any) -> Any:
    """Run one audit service call in its own short transaction, awaited.

    The lifecycle writes that are one prepared statement in the usual case
    are made on the event loop's thread on a pooled connection, their round
    trip awaited without blocking the loop
    (:func:`~core.db.call_with_pooled_statements_async`); the
    terminal transaction likewise but blocking (its three round trips end
    the run; nothing else has work then). Every other call, and their paths
    that need the ORM, in a thread.

    Database errors (unreachable, conflicting insert) are retried with
    backoff up to ``AUDIT_WRITE_ATTEMPTS`` times; then
    :class:`AuditWriteFailed` is raised and the run fails (R-RUN-8).
    Lease and audit conflicts are not retried. An error that no retry can
    cure — the database refused the data (``DataError``, any other
    non-connection ``DatabaseError``, a string it cannot encode) — raises
    :class:`AuditWriteRejected` at once (R-RUN-11).
    """
    attempts = get_config().AUDIT_WRITE_ATTEMPTS
    for attempt in range(1, attempts + 1):
        try:
            atomic = _ON_LOOP.get(fn)
            if atomic is not None:
                try:
                    if atomic:
                        return call_with_pooled_statements(fn, kwargs, atomic=True)
                    return await call_with_pooled_statements_async(fn, kwargs)
                except NeedsThread:
                    pass
            return await sync_to_async(call_then_release)(fn, kwargs)
        except _RETRYABLE as exc:
            if not isinstance(exc, IntegrityError):
                last_database_error.update(at=time.monotonic(), text=f"{type(exc).__name__}: {exc}")
                watcher = current_run.get()
                if watcher is not None:
                    await watcher.database_lost(exc, retry_in=retry_delay(attempt))
            if attempt == attempts:
                raise AuditWriteFailed(
                    f"{fn.__name__} failed {attempts} times: {type(exc).__name__}: {exc}",
                    extra={"cause": type(exc).__name__},
                ) from exc
            log.warning("audit write %s failed (attempt %s/%s): %s", fn.__name__, attempt, attempts, exc)
            await asyncio.sleep(retry_delay(attempt))
        except (DatabaseError, UnicodeError) as exc:
            raise AuditWriteRejected(
                f"{fn.__name__} was refused by the database: {type(exc).__name__}: {exc}"[:2000],
                cause=type(exc).__name__,
            ) from exc
    raise AssertionError("unreachable")


# The writes made on the event loop's thread, without a thread hop (issue
# 11), each on a pooled connection (core.db): the lifecycle writes
# whose usual path is one prepared statement fenced by the lease
# (audit.ledger.fenced; a model row opens only while the budget has room,
# checked in the same statement), each in autocommit, their round trip
# awaited; and the terminal transaction, whose usual path is three round
# trips of prepared statements in one transaction (atomic: True). A call
# that reaches the ORM — a locked path, a reconcile that inserts — is made
# again in a thread.
_ON_LOOP = {
    ledger.model_call_open: False,
    ledger.model_call_start: False,
    ledger.model_call_finish: False,
    ledger.tool_call_start: False,
    ledger.tool_call_finish: False,
    ledger.tool_call_error: False,
    ledger.run_finish: True,
}
