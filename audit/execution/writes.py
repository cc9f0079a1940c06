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

It may import the ledger, the models, :mod:`core.db`, the metrics and the
configuration; of the run's execution only :mod:`.checkpoint`'s back-off
and :mod:`.worker_loop`'s connections.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from asgiref.sync import sync_to_async
from django.core.exceptions import SynchronousOnlyOperation
from django.db import DatabaseError, IntegrityError, InterfaceError, OperationalError

from core.config import get_config
from core.db import NeedsThread, call_with_pooled_statements, release_connection
from ops import metrics

from .. import ledger
from ..errors import AuditWriteFailed, AuditWriteRejected
from .checkpoint import retry_delay
from .worker_loop import awaited_connections

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

    The lifecycle writes — services whose usual path is one prepared
    statement (:func:`~audit.ledger.fenced.fenced_service`) — are made on
    the event loop's thread: the service's steps run there and each write
    they yield is awaited on the worker loop's own connections
    (:class:`~core.db.AwaitedConnections`), so the loop runs the run's other
    tasks meanwhile. The terminal transaction is made on the loop too, on a
    pooled connection, its round trips blocking (they end the run; nothing
    else has work then). Every other call, and any of these that reaches
    the ORM (a write's locked path) or finds no connection at hand, is
    made in a thread — again from its start, which these services allow:
    a write that wrote nothing, or wrote and then reached the ORM, changes
    nothing when repeated (R-RUN-3).

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
            try:
                if fn in _ON_LOOP_BLOCKING:
                    return call_with_pooled_statements(fn, kwargs, atomic=True)
                if hasattr(fn, "steps"):
                    return await _awaited(fn, kwargs)
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


# The calls made on the event loop's thread with their round trips
# blocking it: the terminal transaction, whose usual path is three round
# trips of prepared statements in one transaction on a pooled connection
# (core.db.call_with_pooled_statements). A call that reaches the ORM — a
# reconcile that inserts — is made again in a thread.
_ON_LOOP_BLOCKING = frozenset({ledger.run_finish})


async def _awaited(service: Any, kwargs: dict[str, Any]) -> Any:
    """The lifecycle write ``service`` (a :func:`~audit.ledger.fenced.fenced_service`)
    made on the event loop: its steps run here, each write they yield is
    awaited on the worker loop's connections and its result sent back.

    Raises :class:`NeedsThread` — before anything was written, or after a
    write whose statement wrote nothing — where the rest must be made in a
    thread: outside a worker loop, when no connection is at hand, or when
    the steps reach the ORM (Django's ``SynchronousOnlyOperation``: a
    locked path, a read the statement needs first)."""
    connections = awaited_connections()
    if connections is None:
        raise NeedsThread("not on a worker loop")
    with metrics.audit_write_observed(service.kind):
        steps = service.steps(**kwargs)
        try:
            write = next(steps)
            while True:
                found = await connections.execute_prepared(write.sql, write.params)
                write = steps.send(write.result(found))
        except StopIteration as done:
            return done.value
        except SynchronousOnlyOperation as exc:
            raise NeedsThread(str(exc)) from exc
        finally:
            steps.close()
