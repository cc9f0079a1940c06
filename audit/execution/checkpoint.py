"""The LangGraph checkpointer: PostgreSQL (langgraph-checkpoint-postgres) on
the product's own database, or an in-process memory saver under the embedded
defaults (a quick-start process only; it forgets on restart)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psycopg
from django.db import connections
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from core.db import connect_waiting, session_application_name
from core.pool import has_input

log = logging.getLogger(__name__)


class CheckpointerClosed(psycopg.OperationalError):
    """Raised by a call of a :class:`ReconnectingPostgresSaver` that was
    closed (:meth:`~ReconnectingPostgresSaver.aclose`) or interrupted
    (:meth:`~ReconnectingPostgresSaver.interrupt`): the run is over, its
    State is written no more. A psycopg ``OperationalError``, as a call on
    a closed connection raises, so callers handle both alike (R-RUN-6)."""

    def __init__(self) -> None:
        super().__init__("the run's checkpointer is closed")


_memory_saver = InMemorySaver()


def postgres_conninfo(alias: str = "default") -> str | None:
    """libpq connection string of Django's database, or None off PostgreSQL.

    It carries the session options of Django's connections (libpq
    ``options``: ``plan_cache_mode`` in every process, as the awaited-write
    connections take it) and so, in a worker process, its session limits —
    ``lock_timeout``, ``statement_timeout`` and
    ``idle_in_transaction_session_timeout``
    (:func:`core.db.configure_worker_database`) — so a worker frozen inside
    a State write (a pipeline's implicit transaction) does not keep its
    checkpoint rows locked, nor the next run of the thread waiting on them
    without bound (R-RUN-10)."""
    connection = connections[alias]
    if connection.vendor != "postgresql":
        return None
    s = connection.settings_dict
    params = {
        "dbname": s["NAME"],
        "user": s.get("USER") or None,
        "password": s.get("PASSWORD") or None,
        "host": s.get("HOST") or None,
        "port": str(s["PORT"]) if s.get("PORT") else None,
        "options": (s.get("OPTIONS") or {}).get("options") or None,
    }
    return make_conninfo(**{k: v for k, v in params.items() if v})


@contextlib.asynccontextmanager
async def open_checkpointer(conninfo: str | None) -> AsyncIterator[object]:
    """Yield a checkpointer for one run, closed for good when the run ends.

    On PostgreSQL it is a :class:`ReconnectingPostgresSaver` (its
    connection named ``CHECKPOINTER_APPLICATION_NAME`` in
    ``pg_stat_activity``). On a worker loop
    (:func:`~audit.execution.worker_loop.run_in_worker_loop`) its connection is the
    one the loop's previous run left, when that one is still sound, and is
    left for the next run when the run ends with it idle
    (:meth:`ReconnectingPostgresSaver.keep_in`): a run pays neither the
    connection's set-up (its handshake, its session) nor its close, and
    its statements stay prepared (issue 11: share connections). Elsewhere,
    and whenever it is not idle at the end, the connection is closed with
    the run. A new connection is made with the same retries as the writes.

    Raises:
        psycopg.OperationalError: the database stayed unreachable for every
            attempt (``AUDIT_WRITE_ATTEMPTS``).
    """
    if conninfo is None:
        yield _memory_saver
        return
    from .worker_loop import kept_connections

    kept = kept_connections()
    conn = await _take_kept(kept, conninfo)
    if conn is None:
        conn = await _retried(lambda: _connect_waiting(conninfo))
    saver = ReconnectingPostgresSaver(conn, conninfo=conninfo)
    try:
        yield saver
    finally:
        if kept is None or not saver.keep_in(kept):
            await saver.aclose()


async def _take_kept(kept: dict[str, Any] | None, conninfo: str):
    """The connection kept in ``kept`` for ``conninfo`` (taken out), or
    ``None``: none is kept, or the one kept is closed, broken or was ended
    by the server while it waited (its socket is readable: an idle
    connection has nothing to read) — that one is closed. A connection
    lost without a word (a network cut) fails at its first statement,
    which the saver makes again on a new connection (R-RUN-8)."""
    conn = kept.pop(conninfo, None) if kept is not None else None
    if conn is None:
        return None
    if not (conn.closed or conn.broken or has_input(conn)):
        return conn
    with contextlib.suppress(Exception):
        await conn.close()
    return None


#: ``application_name`` of the checkpointer's connections: an operator
#: tells them from the audit's in ``pg_stat_activity``.
CHECKPOINTER_APPLICATION_NAME = "yuxi-checkpointer"


async def _connect(conninfo: str, **kwargs: Any):
    from psycopg.rows import dict_row

    # A keyword replaces the connection string's own options: keep them.
    options = conninfo_to_dict(conninfo).get("options") or ""
    # The options LangGraph's own from_conn_string uses.
    return await psycopg.AsyncConnection.connect(
        conninfo,
        autocommit=True,
        prepare_threshold=0,
        row_factory=dict_row,
        application_name=session_application_name(CHECKPOINTER_APPLICATION_NAME),
        options=f"{options} -c client_connection_check_interval={CLIENT_CHECK_INTERVAL_MS}".strip(),
        **kwargs,
    )


async def _connect_waiting(conninfo: str):
    """A new connection, tried again for as long as an audit write waits for
    one (:func:`core.db.connect_waiting`): without this wait a refused
    connection fails at once, and the checkpointer would give up on an
    outage (a restart) after its backoff alone (0.6 s with three attempts)
    where the audit writes of the same run outlast it."""
    return await connect_waiting(lambda timeout: _connect(conninfo, connect_timeout=timeout))


async def _retried[T](
    call: Callable[[], Awaitable[T]],
    *,
    before_retry: Callable[[], Awaitable[None]] | None = None,
    lost: Callable[[], bool] = lambda: True,
) -> T:
    """``await call()``, again after a connection failure (psycopg's
    ``OperationalError`` while ``lost()`` says the connection is gone), with
    the audit writes' backoff, at most ``AUDIT_WRITE_ATTEMPTS`` times;
    ``before_retry`` runs before each new attempt (a failure there counts as
    that attempt's). Any other error is raised at once."""
    from core.config import get_config

    attempts = get_config().AUDIT_WRITE_ATTEMPTS
    for attempt in range(1, attempts + 1):
        try:
            if attempt > 1 and before_retry is not None:
                await before_retry()
            return await call()
        except psycopg.OperationalError as exc:
            if attempt == attempts or not lost():
                raise
            log.warning("checkpointer: database unreachable (attempt %s/%s): %s", attempt, attempts, exc)
            await asyncio.sleep(retry_delay(attempt))
    raise AssertionError("unreachable")


def retry_delay(attempt: int) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1, 2, ...) of a
    database write before the next: 0.2, 0.4, 0.8, 1.6, then 2."""
    return min(2.0, 0.1 * 2**attempt)


#: How long closing a connection waits for the statement running on it to
#: end (seconds); its session was ended (or the statement cancelled and the
#: connection cut) first, so it ends at once unless the database is
#: unreachable. Past it the connection is cut (:func:`_cut`).
CLOSE_WAIT_SECONDS = 2.0

#: How long stopping a checkpointer's statement waits for the server, to
#: end its session or to deliver a cancel request (seconds).
STOP_CONNECT_TIMEOUT_SECONDS = 2

#: How often the server of a checkpointer connection checks, while a
#: statement runs, that its client is still there (milliseconds,
#: PostgreSQL's ``client_connection_check_interval``): a cut connection
#: (:func:`_cut`) ends the statement it waits on — a State write held by a
#: lock — within this time, uncommitted, with no new connection needed. (A
#: lock released before that check lets the statement commit, as it would
#: on a connection left open.)
CLIENT_CHECK_INTERVAL_MS = 250


def _active(conn) -> bool:
    return conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.ACTIVE


def _cut(conn) -> None:
    """Shut the connection's socket down both ways, freeing nothing. A
    fetch waiting on it wakes at once and fails as on a connection the
    server closed (libpq drops it), releasing psycopg's lock; the server
    sees its client gone at its next check (:data:`CLIENT_CHECK_INTERVAL_MS`)
    and ends the session, its statement rolled back. The way to end a
    statement whose session could not be ended (the database refusing new
    connections, so no ``pg_terminate_backend``). Never raises."""
    try:
        with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except Exception as exc:  # noqa: BLE001 - already closed, or never connected
        log.warning("checkpointer: cutting its connection failed: %s", exc)


async def _close_when_free(conn) -> None:
    """Close ``conn`` once no statement runs on it; if one still runs after
    :data:`CLOSE_WAIT_SECONDS`, cut the connection (:func:`_cut`) and close
    it then. Never raises but the caller's own cancellation.

    A connection may not be closed under a statement that waits on it:
    psycopg holds the connection's lock while it waits for results, and
    its C fetch keeps libpq's connection pointer across the wait, so
    freeing the connection (``close``) under it makes the resumed fetch
    read freed memory — the worker process dies of a segmentation fault.
    The close runs as a task of its own that the caller awaits shielded:
    a caller cancelled meanwhile (the drive stopped while it closes its
    checkpointer) does not cancel the close, and a close cancelled itself
    (``asyncio.run`` cancels what is left when its run ends) cuts the
    connection and closes it before it ends, so no connection outlives
    its run."""
    if conn.closed:
        return
    task = asyncio.get_running_loop().create_task(_close_once_free(conn))
    _closing.add(task)
    task.add_done_callback(_closing.discard)
    await asyncio.shield(task)


#: Connections being closed (a strong reference to each task, so that none
#: is collected before it ran).
_closing: set[asyncio.Task] = set()


async def _close_once_free(conn) -> None:
    cancelled = False
    if not await _acquire_within(conn.lock, CLOSE_WAIT_SECONDS):
        cancelled = asyncio.current_task().cancelling() > 0
        log.warning("checkpointer: a statement still runs on its connection; cutting the connection")
        _cut(conn)
        if not await _acquire_within(conn.lock, CLOSE_WAIT_SECONDS):
            log.error("checkpointer: its connection could not be closed: a statement still holds it")
            if cancelled or asyncio.current_task().cancelling() > 0:
                raise asyncio.CancelledError
            return
    try:
        await conn.close()
    except Exception as exc:  # noqa: BLE001 - closing a broken connection
        log.warning("checkpointer: closing its connection failed: %s", exc)
    finally:
        conn.lock.release()
    if cancelled:
        raise asyncio.CancelledError


async def _acquire_within(lock: asyncio.Lock, seconds: float) -> bool:
    """Whether ``lock`` was acquired within ``seconds``; False also when the
    wait was cancelled (the caller sees that in ``cancelling()``). The flag
    is set inside: a timeout firing just as the lock was taken must not
    report a lock held as not acquired."""
    acquired = False

    async def acquire() -> None:
        nonlocal acquired
        await lock.acquire()
        acquired = True

    with contextlib.suppress(TimeoutError, asyncio.CancelledError):
        async with asyncio.timeout(seconds):
            await acquire()
    return acquired


class ReconnectingPostgresSaver(AsyncPostgresSaver):
    """LangGraph's ``AsyncPostgresSaver`` on one connection per run that is
    replaced when it breaks: a database restart or a dropped connection in
    the middle of a run costs a retry, not the run (R-RUN-8: only a fault
    that lasts fails the run, then as ``checkpoint_error:<type>``).

    The methods a run calls — ``aget_tuple`` (reading the thread's state),
    ``aput`` and ``aput_writes`` (saving it) — are retried as the audit
    writes are (``AUDIT_WRITE_ATTEMPTS``, the same backoff), each after a
    new connection replaced a closed or broken one. Retrying is safe: a
    read changes nothing, and LangGraph's writes are upserts keyed by
    thread, namespace, checkpoint, task and index, so a write that did
    commit before its connection broke is written again unchanged. Another
    error (the connection still good) is raised at once. The other methods
    (listing, pruning, deleting) are LangGraph's own, not retried.

    Once closed or interrupted, those three raise
    :class:`CheckpointerClosed` at once, even while a statement that could
    not be ended still holds the connection; LangGraph's other methods fail
    on the closed connection.
    """

    def __init__(self, conn, *, conninfo: str, **kwargs: Any):
        super().__init__(conn, **kwargs)
        self._conninfo = conninfo
        self._closed = False

    async def aclose(self) -> None:
        """Close the connection for good (the run is over): a call that
        comes later — a background write still retrying when its run's
        checkpointer was closed — fails as on a closed connection and opens
        no new one, which nobody would close. A statement still running (a
        State write of a run that ended on its own, say on a takeover, while
        the write waits on a lock) is stopped first, as by :meth:`interrupt`.
        Never raises."""
        self._closed = True
        try:
            if not self.conn.closed and (self.conn.lock.locked() or _active(self.conn)):
                await self._stop_statements()
        finally:
            await _close_when_free(self.conn)

    def keep_in(self, kept: dict[str, Any]) -> bool:
        """Close the saver for good (as :meth:`aclose`) but leave its
        connection in ``kept`` (``{conninfo: connection}``, the worker
        loop's) for the loop's next run, when it is idle: the saver and the
        connection not in use (no statement running or queued, no pipeline),
        no transaction open, the connection neither closed nor broken, and
        no other connection kept for the same database. Returns whether it
        did; if not, nothing changed and the caller closes the saver. Any
        call on this saver later, LangGraph's own methods included, fails
        with :class:`CheckpointerClosed` before a statement is sent (its
        cursor checks under the saver's lock): nothing reaches the kept
        connection through it."""
        conn = self.conn
        idle = (
            not self._closed
            and not self.lock.locked()
            and not conn.closed
            and not conn.broken
            and not conn.lock.locked()
            and conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
            # A write cancelled inside LangGraph's pipeline block can leave
            # the connection in pipeline mode with the lock released: its
            # next statement would then never be completed (a session left
            # active, in a transaction, holding the checkpoint tables' locks).
            and conn.pgconn.pipeline_status == psycopg.pq.PipelineStatus.OFF
            and getattr(conn, "_pipeline", None) is None
            and self._conninfo not in kept
        )
        if idle:
            self._closed = True
            kept[self._conninfo] = conn
        return idle

    async def interrupt(self) -> None:
        """Stop what runs on the connection, then close it for good (the
        run was stopped, or ended, while a write of its State waits — on a
        lock say). That write fails and so do the writes queued behind it,
        at once, none made again: the run ends now instead of when the lock
        is released. Never raises.

        The connection's server session is ended (``pg_terminate_backend``
        from a connection of its own), not only its statement cancelled: a
        State write is one transaction, but LangGraph's writes of one step
        (``aput``, ``aput_writes``) queue on the connection, and the ones
        queued before the saver was closed would run once a cancel freed
        it. When the session cannot be ended (the database refuses new
        connections: a restart, a full ``max_connections``), the statement
        is cancelled (a cancel request needs no session) and the connection
        cut (:func:`_cut`), so the queued writes fail too. Under a network
        partition neither reaches the server: its statement runs on until
        the server sees the client gone."""
        self._closed = True
        try:
            if not self.conn.closed:
                await self._stop_statements()
        finally:
            await _close_when_free(self.conn)

    async def _stop_statements(self) -> None:
        if await self._end_session():
            return
        try:
            await self.conn.cancel_safe(timeout=STOP_CONNECT_TIMEOUT_SECONDS)
        except Exception as exc:  # noqa: BLE001 - unreachable: the cut still fails the client side
            log.warning("checkpointer: its statement could not be cancelled: %s", exc)
        _cut(self.conn)

    async def _end_session(self) -> bool:
        """Whether the connection's server session was ended."""
        try:
            pid = self.conn.info.backend_pid
            async with await _connect(self._conninfo, connect_timeout=STOP_CONNECT_TIMEOUT_SECONDS) as other:
                await other.execute("SELECT pg_terminate_backend(%s)", [pid])
            return True
        except Exception as exc:  # a broken connection, or the database down: nothing runs
            log.warning("checkpointer: its session could not be ended: %s", exc)
            return False

    async def _reconnect_if_broken(self) -> None:
        # Under the saver's own lock: writes of one run go out from several
        # tasks, and none may use the connection while it is replaced.
        async with self.lock:
            if self._closed or not (self.conn.closed or self.conn.broken):
                return
            new = await _connect_waiting(self._conninfo)
            if self._closed:  # closed while connecting
                await new.close()
                return
            old, self.conn = self.conn, new
        await _close_when_free(old)

    def _lost(self) -> bool:
        """Whether the last error came from a connection that is gone (and
        the run still needs one): only then is a call made again. A lock or
        statement timeout, a refused value, a call after :meth:`aclose` are
        raised as they are."""
        return not self._closed and (self.conn.closed or self.conn.broken)

    async def _again(self, call: Callable[[], Awaitable[Any]]) -> Any:
        async def unless_closed() -> Any:
            if self._closed:
                raise CheckpointerClosed
            return await call()

        return await _retried(unless_closed, before_retry=self._reconnect_if_broken, lost=self._lost)

    @contextlib.asynccontextmanager
    async def _cursor(self, *, pipeline: bool = False):
        # LangGraph's cursor, taken under the saver's lock: a write that
        # waited for the lock while the run ended (its connection kept for
        # the next run, or closed) stops here, before any statement.
        async with super()._cursor(pipeline=pipeline) as cur:
            if self._closed:
                raise CheckpointerClosed
            yield cur

    async def aget_tuple(self, config):
        return await self._again(lambda: super(ReconnectingPostgresSaver, self).aget_tuple(config))

    async def aput(self, config, checkpoint, metadata, new_versions):
        return await self._again(
            lambda: super(ReconnectingPostgresSaver, self).aput(config, checkpoint, metadata, new_versions)
        )

    async def aput_writes(self, config, writes, task_id, task_path=""):
        return await self._again(
            lambda: super(ReconnectingPostgresSaver, self).aput_writes(config, writes, task_id, task_path)
        )


def setup_postgres_checkpointer(conninfo: str) -> None:
    """Create or upgrade the checkpointer's tables (idempotent). Called by a
    Django migration so that migrations own the whole schema (R-SCH-1)."""
    from langgraph.checkpoint.postgres import PostgresSaver

    with PostgresSaver.from_conn_string(conninfo) as saver:
        saver.setup()
