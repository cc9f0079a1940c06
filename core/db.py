"""Database connection handling shared by the worker and the event stream.

Three ways a statement goes out, all with Django's error translation and
query log:

- :func:`execute_prepared` (and its pipeline): on this thread's Django
  connection, or a pooled call's;
- :func:`call_with_pooled_statements`: a synchronous call on an event
  loop's thread whose statements block the loop, on one connection of
  Django's pool (the terminal transaction);
- :class:`AwaitedConnections`: one prepared statement awaited on the event
  loop's own connection (the worker's lifecycle writes, driven by
  :func:`audit.ledger.fenced.fenced_service`'s steps).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Any

from django.core.exceptions import SynchronousOnlyOperation
from django.db import connection, transaction


def release_connection() -> None:
    """Give this thread's database connection back (to the pool) after a
    short transaction or read, unless the caller is inside an outer atomic
    block. The worker calls it after every audit write (R-RUN-5); the event
    stream calls it so that it holds no connection while it waits (R-EVT-1)."""
    if not connection.in_atomic_block:
        connection.close()


def execute_prepared(sql: str, params: Sequence[Any] | Mapping[str, Any]) -> tuple | None:
    """Run one statement on this thread's Django connection (its transaction,
    its adapters; errors translated as Django's are) with server-side
    binding, prepared once per connection, and return its first row.

    For hot statements whose text never changes (audit writes, the run's
    rollup): PostgreSQL then plans them once, not on every call — for a
    statement of several CTEs the planning costs more than the execution.
    Placeholders are psycopg's (``%s`` or ``%(name)s``). Without prepared
    statements (``DB_PREPARED_STATEMENTS=false``, or not PostgreSQL) the
    statement is only sent with server-side binding."""
    return _prepared(sql, params, lambda cursor: cursor.fetchone())


def execute_prepared_all(sql: str, params: Sequence[Any] | Mapping[str, Any]) -> list[tuple]:
    """:func:`execute_prepared`, returning every row."""
    return _prepared(sql, params, lambda cursor: cursor.fetchall())


def _prepared(sql: str, params: Sequence[Any] | Mapping[str, Any], fetch: Callable[[Any], Any]) -> Any:
    import psycopg

    pooled = _pooled_call.get()
    if pooled is not None:
        begins = pooled.begins()
        conn = pooled.connection()
        with _logged((sql, params)), connection.wrap_database_errors, psycopg.Cursor(conn) as cursor:
            if begins:
                # The pooled transaction's BEGIN, in the same round trip.
                with conn.pipeline():
                    conn.execute("BEGIN")
                    cursor.execute(sql, params, prepare=True)
            else:
                cursor.execute(sql, params, prepare=True)
            return fetch(cursor)
    connection.ensure_connection()
    if connection.vendor != "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return fetch(cursor)
    with _logged((sql, params)), connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(sql, params, prepare=True)
        return fetch(cursor)


@contextmanager
def _logged(*statements: tuple[str, Any]) -> Iterator[None]:
    """Record ``statements`` (``(sql, params)``) in Django's query log when
    it keeps one (``DEBUG``, or a test's ``CaptureQueriesContext``), as its
    debug cursor records what goes through it — statements sent past
    Django's cursor then still count in the query-count guards. The entry
    keeps the statement as sent (psycopg placeholders) and its ``params``."""
    if not connection.queries_logged:
        yield
        return
    started = time.monotonic()
    try:
        yield
    finally:
        took = f"{time.monotonic() - started:.3f}"
        connection.queries_log.extend({"sql": sql, "params": params, "time": took} for sql, params in statements)


def execute_prepared_in_pipeline(statements: Sequence[tuple[str, Sequence[Any]]]) -> list[list[tuple]]:
    """Run ``statements`` — ``(sql, params)`` pairs whose parameters do not
    depend on each other's results — each prepared, in one round trip (a
    psycopg pipeline) on this thread's connection (Django's, or the pooled
    call's), in its transaction: a transaction that has yet to begin begins
    in the same round trip. They run in order, each seeing what the ones
    before it did (and waiting for the locks they wait for). Returns each
    statement's rows, in order.

    Raises the first statement's error, translated as Django translates it;
    the statements after it do not run."""
    import psycopg

    pooled = _pooled_call.get()
    begins = pooled is not None and pooled.begins()
    if pooled is not None:
        raw = pooled.connection()
    else:
        connection.ensure_connection()
        if connection.vendor != "postgresql":
            return [execute_prepared_all(sql, params) for sql, params in statements]
        raw = connection.connection
    cursors = [psycopg.Cursor(raw) for _ in statements]
    try:
        with _logged(*statements), connection.wrap_database_errors:
            with raw.pipeline():
                if begins:
                    raw.execute("BEGIN")
                for cursor, (sql, params) in zip(cursors, statements, strict=True):
                    cursor.execute(sql, params, prepare=True)
            # Fetched once the pipeline ended: a fetch inside it asks the
            # server for the results first, a round trip before the Sync's.
            return [cursor.fetchall() for cursor in cursors]
    finally:
        for cursor in cursors:
            cursor.close()


def raw_connection() -> Any:
    """The psycopg connection this thread's statements go to: the pooled
    call's (:func:`call_with_pooled_statements`), else Django's (opened if
    needed). For statements sent past Django's cursor (a pipeline)."""
    pooled = _pooled_call.get()
    if pooled is not None:
        return pooled.connection()
    connection.ensure_connection()
    return connection.connection


#: ``application_name`` of the connections whose statements an event loop
#: awaits (:class:`AwaitedConnections`): an operator tells them from the
#: pool's and the checkpointer's in ``pg_stat_activity``.
AWAITED_APPLICATION_NAME = "yuxi-awaited-writes"

#: ``application_name`` of a worker process's Django connections (its pool).
WORKER_APPLICATION_NAME = "yuxi-worker"

# A worker process's session tag, made once per process: (pid, tag), so a
# forked child makes its own instead of using its parent's.
_session_tag: tuple[int, str] | None = None
# Whether this process names its sessions after its tag (a worker's do).
_sessions_named = False
_SESSION_TAG = re.compile(r"(?:^|[: ])(yw[0-9a-f]{16})(?=$|[: ])")


def worker_session_tag() -> str:
    """This process's session tag: ``yw`` and 16 random hex digits, made
    once per process (a forked child makes its own). A worker's lease owner
    names it (:func:`audit.execution.runner.worker_identity`) and so do its
    database sessions' ``application_name`` (:func:`session_application_name`),
    so the sweeper can end the sessions of a holder whose lease expired
    (R-RUN-14)."""
    global _session_tag
    if _session_tag is None or _session_tag[0] != os.getpid():
        _session_tag = (os.getpid(), f"yw{secrets.token_hex(8)}")
    return _session_tag[1]


def session_tag_of(owner: str | None) -> str | None:
    """The session tag (:func:`worker_session_tag`) a lease owner names, or
    None when it names none (an owner given by hand, an older worker's).
    Implements R-RUN-14."""
    found = _SESSION_TAG.search(owner or "")
    return found.group(1) if found else None


def session_application_name(role: str) -> str:
    """The ``application_name`` of a connection of ``role`` (such as
    :data:`AWAITED_APPLICATION_NAME`): in a worker process that names its
    sessions (:func:`name_worker_sessions`) ``"<role> <session tag>"`` —
    at most 36 characters for the project's roles, under PostgreSQL's 63 —
    elsewhere ``role`` alone. R-RUN-14."""
    return f"{role} {worker_session_tag()}" if _sessions_named else role


def name_worker_sessions(settings_dict: dict) -> None:
    """Name every database session this process opens from now on after
    its session tag: Django's connections (``OPTIONS`` of ``settings_dict``,
    read when the pool is made: call before this process's first
    connection), the awaited connections and the checkpointer's
    (:func:`session_application_name`). Called in each worker process —
    a forked child again, for its own tag. Implements R-RUN-14."""
    global _sessions_named
    _sessions_named = True
    options = settings_dict.setdefault("OPTIONS", {})
    if "pool" in options:  # PostgreSQL
        options["application_name"] = session_application_name(WORKER_APPLICATION_NAME)


def holder_sessions_end(tags: Sequence[str], *, wait_seconds: float = 1.0) -> list[int]:
    """End every database session of the worker processes named by
    ``tags`` (session tags, :func:`session_tag_of`), whatever its state —
    idle in a transaction, active and blocked writing to its client
    (``ClientWrite``), waiting on a lock — with ``pg_terminate_backend``,
    then wait up to ``wait_seconds`` (s) for them to be gone, so the row
    locks they held are released. Sessions of this database only, never
    this connection's nor those of this process's own tag. Returns the
    backend pids signalled (empty when ``tags`` is). Raises Django's
    ``DatabaseError`` (``permission denied`` when the sweeper's role may
    not signal the holder's). Implements R-RUN-14."""
    tags = sorted(set(tags) - {worker_session_tag()})
    if not tags:
        return []
    with connection.cursor() as cursor:
        # The sessions are chosen in a materialised CTE and signalled in the
        # select list, never in the WHERE clause of pg_stat_activity: the
        # planner orders a filter's conditions by cost, and would call
        # pg_terminate_backend on every session of the server before the
        # conditions that choose the holder's.
        cursor.execute(
            "WITH holder AS MATERIALIZED ("
            " SELECT pid FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND application_name LIKE 'yuxi-%%' AND split_part(application_name, ' ', 2) = ANY(%s))"
            " SELECT pid, pg_terminate_backend(pid) FROM holder",
            [tags],
        )
        pids = [pid for pid, signalled in cursor.fetchall() if signalled]
        deadline = time.monotonic() + wait_seconds
        while pids:
            # Inside a transaction pg_stat_activity is read once: read afresh.
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", [pids])
            if not cursor.fetchone()[0] or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
    return pids


class AwaitedConnections:
    """The connections of one event loop (a worker thread's, kept from run
    to run) on which it awaits prepared statements
    (:meth:`execute_prepared`): the worker's lifecycle writes, whose round
    trips then leave the loop free for the run's other tasks — the model's
    stream, LangGraph's checkpoint writes — instead of blocking it
    (R-RUN-5, issue 11).

    psycopg ``AsyncConnection`` objects in autocommit (each statement its
    own transaction), opened as Django opens its own — the same database,
    options (a worker's ``lock_timeout``, ``statement_timeout``,
    ``idle_in_transaction_session_timeout``, ``plan_cache_mode``), adapters
    and ``prepare_threshold``, so statements are prepared once per
    connection or, with ``DB_PREPARED_STATEMENTS=false``, never — plus
    :data:`AWAITED_APPLICATION_NAME`. One is taken per statement and given
    back idle; at most :attr:`KEPT` wait idle for the next, at most
    :attr:`MOST` are in use at once. They belong to the loop that opened
    them: :meth:`close` closes them from anywhere (their sockets only).
    """

    #: Idle connections kept for the next statements.
    KEPT = 2
    #: Statements in flight at once; one more raises :class:`NeedsThread`.
    MOST = 4

    def __init__(self) -> None:
        self._idle: list[Any] = []
        self._in_use = 0

    async def execute_prepared(self, sql: str, params: Sequence[Any] | Mapping[str, Any]) -> tuple | None:
        """:func:`execute_prepared` awaited: the statement, prepared, on one
        of this loop's connections, and its first row.

        A statement that was sent is waited for to its end even when the
        caller is cancelled (bounded by the session's
        ``statement_timeout``): the row is written or not before the
        cancellation goes on, and the connection goes back idle. Errors are
        translated as Django translates them (``OperationalError``,
        ``IntegrityError``, ``DataError``…); a connection that failed is
        closed, not kept.

        Raises :class:`NeedsThread` before anything is sent where the
        statement must not be awaited here: an ORM transaction is open in
        this thread (it would not see the transaction's writes), Django's
        safety net is off (``DJANGO_ALLOW_ASYNC_UNSAFE``), the database is
        not PostgreSQL, or :attr:`MOST` statements are in flight."""
        import asyncio

        _awaitable_here()
        if self._in_use >= self.MOST:
            raise NeedsThread("every awaited connection of this loop is in use")
        self._in_use += 1
        conn = None
        try:
            with _logged((sql, params)), connection.wrap_database_errors:
                conn = await self._take()
                task = asyncio.ensure_future(_run_prepared(conn, sql, params))
                try:
                    return await asyncio.shield(task)
                except asyncio.CancelledError:
                    await _to_its_end(task)
                    raise
        finally:
            self._in_use -= 1
            if conn is not None:
                self._give_back(conn)

    async def _take(self) -> Any:
        """An idle connection that is still sound, else a new one."""
        from .pool import has_input

        while self._idle:
            conn = self._idle.pop()
            if not (conn.closed or conn.broken or has_input(conn)):
                return conn
            _close_socket(conn)  # ended by the server while it waited
        return await _connect_awaited()

    def _give_back(self, conn: Any) -> None:
        from psycopg.pq import TransactionStatus

        idle = not (conn.closed or conn.broken) and conn.info.transaction_status == TransactionStatus.IDLE
        if idle and len(self._idle) < self.KEPT:
            self._idle.append(conn)
        else:
            _close_socket(conn)

    def close(self) -> None:
        """Close the idle connections (their sockets: no round trip, no
        loop needed). Never raises."""
        while self._idle:
            _close_socket(self._idle.pop())


def _awaitable_here() -> None:
    """:class:`NeedsThread` where an awaited statement may not be made (see
    :meth:`AwaitedConnections.execute_prepared`)."""
    if os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE") or connection.vendor != "postgresql":
        raise NeedsThread("Django's safety net is off, or the database is not PostgreSQL")
    if connection.in_atomic_block:
        raise NeedsThread("a statement inside a transaction of the ORM")


async def _connect_awaited() -> Any:
    """A new connection for :class:`AwaitedConnections`, with Django's
    connection parameters, tried again for as long as a write attempt waits
    for a connection (:func:`connect_waiting`)."""
    import psycopg

    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params["application_name"] = session_application_name(AWAITED_APPLICATION_NAME)
    if connection.timezone_name:  # the session time zone Django sets on its own connections
        params["options"] = f"{params.get('options', '')} -c TimeZone={connection.timezone_name}".strip()
    return await connect_waiting(
        lambda timeout: psycopg.AsyncConnection.connect(autocommit=True, **{"connect_timeout": timeout, **params})
    )


async def connect_waiting[T](connect: Callable[[int], Awaitable[T]]) -> T:
    """``await connect(timeout)`` (``timeout``: libpq's ``connect_timeout``,
    seconds), tried again every 0.1 s while psycopg's ``OperationalError``
    says the server refused or is unreachable, for as long as one attempt
    of an audit write waits for a connection (:func:`worker_connection_wait`):
    a refused connection fails at once, and without this wait a short
    outage (a restart) would cost a write all its attempts within their
    backoff alone (0.6 s with three attempts), where a write waiting for
    the pool outlasts it (R-RUN-8). Raises the last ``OperationalError``."""
    import asyncio
    import math

    import psycopg

    from .config import get_config

    wait = worker_connection_wait(get_config())
    deadline = time.monotonic() + wait
    while True:
        try:
            return await connect(max(2, math.ceil(wait)))
        except psycopg.OperationalError:
            if time.monotonic() + 0.1 >= deadline:
                raise
            await asyncio.sleep(0.1)


async def _run_prepared(conn: Any, sql: str, params: Any) -> tuple | None:
    async with conn.cursor() as cursor:
        await cursor.execute(sql, params, prepare=True)
        return await cursor.fetchone()


async def _to_its_end(task: Any) -> None:
    """Wait for ``task`` to end, whatever cancellations come meanwhile."""
    import asyncio

    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            continue
        except BaseException:  # its own error: the cancellation is what goes on
            break
    if not task.cancelled():
        task.exception()  # retrieved: the caller's cancellation is what is raised


def _close_socket(conn: Any) -> None:
    with contextlib.suppress(Exception):
        conn.pgconn.finish()


@contextmanager
def atomic() -> Iterator[None]:
    """A transaction: Django's ``transaction.atomic()``, or — inside a
    pooled call made with ``atomic=True``, whose statements are one
    transaction already — nothing more."""
    pooled = _pooled_call.get()
    if pooled is not None and pooled.atomic:
        yield
        return
    with transaction.atomic():
        yield


def in_transaction() -> bool:
    """Whether this thread's statements run in a transaction: a pooled call
    made with ``atomic=True``, or an atomic block of Django's."""
    pooled = _pooled_call.get()
    if pooled is not None:
        return pooled.atomic
    return connection.in_atomic_block


def commit_without_disk_wait() -> None:
    """Inside Django's atomic block: its commit does not wait for the
    write-ahead log to reach the disk (PostgreSQL's ``synchronous_commit``
    off, for this transaction only; nothing elsewhere). A crash of the
    database server itself, not of this process, may then lose the last
    fraction of a second of such commits, never half of one. Only for
    progress that is safe to redo: the OpenTelemetry export's cursor,
    whose runs a lost move sends again with the same ids (R-OTEL-1).
    Nothing on SQLite, and nothing inside a savepoint (an atomic block in
    another): the setting would outlive the block and relax the outer
    transaction's other writes. Raises ``TransactionManagementError``
    outside an atomic block."""
    if not connection.in_atomic_block:
        raise transaction.TransactionManagementError("commit_without_disk_wait needs an atomic block")
    if connection.vendor == "postgresql" and not connection.savepoint_ids:
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL synchronous_commit TO OFF")


def commit_in_pipeline(raw: Any) -> bool:
    """In a pooled transaction (:func:`call_with_pooled_statements` with
    ``atomic=True``), queue its ``COMMIT`` on ``raw`` — the pooled call's
    connection, inside a pipeline the caller has open — so the commit costs
    no round trip of its own, and return True; statements queued after it
    run each in its own transaction, after the commit. Anywhere else return
    False and queue nothing: Django commits when its atomic block ends."""
    pooled = _pooled_call.get()
    if pooled is None or not pooled.atomic or not pooled.began:
        return False
    raw.execute("COMMIT")
    pooled.commit_queued = True
    return True


def on_commit(fn: Callable[[], None], *, robust: bool = False) -> None:
    """Call ``fn`` once the current transaction commits: the pooled call's
    (after it committed; never when it rolls back) or Django's
    (``transaction.on_commit``); at once outside a transaction. ``robust``:
    an exception of ``fn`` is logged, not raised (as Django's)."""
    pooled = _pooled_call.get()
    if pooled is not None and pooled.atomic:
        pooled.hooks.append((fn, robust))
        return
    transaction.on_commit(fn, robust=robust)


class NeedsThread(Exception):
    """Raised by :func:`call_with_pooled_statements` and
    :meth:`AwaitedConnections.execute_prepared` when the call cannot be made
    on the event loop's thread (it reached the ORM, or no connection was at
    hand) before it changed anything; the caller then makes it in a
    thread."""


class _PooledCall:
    """One call's connection from Django's pool, checked out at its first
    statement and given back when the call ends (R-RUN-5); with ``atomic``,
    the call's statements are one transaction."""

    # A connection not at hand at once (the pool is exhausted, PostgreSQL
    # is unreachable) is waited for in a thread, not on the event loop.
    CHECKOUT_TIMEOUT_SECONDS = 0.05

    def __init__(self, pool: Any, *, atomic: bool = False):
        self.pool = pool
        self.conn: Any = None
        self.atomic = atomic
        # BEGIN sent; COMMIT queued in a pipeline (commit_in_pipeline).
        self.began = self.commit_queued = False
        self.hooks: list[tuple[Callable[[], None], bool]] = []

    def connection(self) -> Any:
        if connection.in_atomic_block:
            raise NeedsThread("a statement inside a transaction of the ORM")
        if self.conn is None:
            from psycopg_pool import PoolTimeout

            try:
                self.conn = self.pool.getconn(timeout=self.CHECKOUT_TIMEOUT_SECONDS)
            except PoolTimeout as exc:
                raise NeedsThread("no pooled connection at hand") from exc
            if not self.conn.autocommit:
                self.conn.autocommit = True
        return self.conn

    def begins(self) -> bool:
        """Whether the next statement must be preceded by the transaction's
        BEGIN (sent with it, in one round trip); noted as sent."""
        if self.commit_queued:
            raise RuntimeError("a statement of a pooled transaction after its commit")
        if not self.atomic or self.began:
            return False
        self.began = True
        return True

    def finish(self, *, failed: bool) -> None:
        """End the transaction — commit it (unless it committed in a
        pipeline), or roll it back when the call ``failed`` — and give the
        connection back. The commit hooks run after a commit only."""
        from psycopg.pq import TransactionStatus

        conn, self.conn = self.conn, None
        try:
            # The server's word, not ours: a COMMIT queued in a pipeline that
            # an error aborted never ran.
            status = None if conn is None or conn.broken else conn.info.transaction_status
            if status not in (None, TransactionStatus.IDLE):
                with connection.wrap_database_errors:
                    if failed or status != TransactionStatus.INTRANS:
                        conn.rollback()
                        if not failed:
                            raise RuntimeError("a pooled transaction ended in error without raising")
                    else:
                        conn.commit()
        finally:
            if conn is not None:
                self.pool.putconn(conn)
        if failed or not self.atomic:
            return
        for fn, robust in self.hooks:
            if not robust:
                fn()
                continue
            try:
                fn()
            except Exception:
                import logging

                logging.getLogger(__name__).exception("a commit hook of a pooled transaction failed")

    def close(self) -> None:
        if self.conn is not None:
            self.pool.putconn(self.conn)
            self.conn = None


_pooled_call: ContextVar[_PooledCall | None] = ContextVar("pooled_call", default=None)


def _loop_pool() -> Any:
    """Django's connection pool, for a pooled call on an event loop's
    thread; :class:`NeedsThread` where no such call may be made: an ORM
    transaction is open (its statements would not see its writes), Django's
    safety net is off (an ORM call would run on the loop instead of
    stopping), not PostgreSQL, or no open pool."""
    from django.db import DEFAULT_DB_ALIAS, connections

    db = connections[DEFAULT_DB_ALIAS]
    if os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE") or db.vendor != "postgresql" or db.in_atomic_block:
        raise NeedsThread("a transaction of the ORM is open here, or its safety net is off")
    pool = db.pool
    if pool is None or pool.closed:
        raise NeedsThread("no open connection pool")
    return pool


def call_with_pooled_statements(fn: Callable[..., Any], kwargs: Mapping[str, Any], *, atomic: bool = False) -> Any:
    """Call ``fn(**kwargs)`` on this thread — an event loop's — with its
    :func:`execute_prepared` statements on one connection from Django's
    pool, in autocommit (each statement its own transaction), given back
    when the call ends (R-RUN-5). No thread hop: an audit write that is one
    prepared statement (:mod:`audit.ledger.fenced`) costs its round trip
    only (issue 11).

    With ``atomic``, the call's statements are one transaction: BEGIN goes
    with the first statement, the commit with the last pipeline of the
    call (:func:`commit_in_pipeline`) or, failing that, when ``fn`` returns;
    the transaction is rolled back when ``fn`` raises. :func:`on_commit`
    hooks run after the commit, :func:`in_transaction` is true inside.

    Anything else that touches the database here — the ORM, a transaction
    of Django's — raises Django's ``SynchronousOnlyOperation`` on an event
    loop's thread before it does anything; this function then raises
    :class:`NeedsThread` (the call's transaction rolled back, its hooks
    dropped) and the caller makes the whole call again in a thread. The
    calls made here (the worker's audit services) are idempotent by their
    contract (R-RUN-3: a write repeated after a lost connection changes
    nothing), so a call that wrote nothing, or wrote and then reached the
    ORM, may be made again. Not used where that safety net is off
    (``DJANGO_ALLOW_ASYNC_UNSAFE``), nor without an open pool:
    :class:`NeedsThread` at once. With ``DB_PREPARED_STATEMENTS=false`` the
    pool's connections prepare nothing, as Django's own do not.

    Raises what ``fn`` raises, database errors translated as Django
    translates them (``OperationalError``, ``IntegrityError``…)."""
    call = _PooledCall(_loop_pool(), atomic=atomic)
    token = _pooled_call.set(call)
    try:
        try:
            result = fn(**kwargs)
        except SynchronousOnlyOperation as exc:
            raise NeedsThread(str(exc)) from exc
    except BaseException:
        _pooled_call.reset(token)
        call.finish(failed=True)
        raise
    _pooled_call.reset(token)
    call.finish(failed=False)
    return result


@contextmanager
def local_setting(name: str, value: str) -> Iterator[None]:
    """A transaction (``transaction.atomic()``) in which the PostgreSQL
    setting ``name`` is ``value`` (``set_config(…, true)``, so it ends with
    the transaction); inside an outer transaction it is set back to its
    previous value when the block ends (a failed block's savepoint rollback
    undoes it anyway). The previous value is read in the same round trip.
    Elsewhere than on PostgreSQL only the transaction."""
    nested = connection.in_atomic_block
    with transaction.atomic():
        if connection.vendor != "postgresql":
            yield
            return
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting(%s), set_config(%s, %s, true)", [name, name, value])
            (previous, _) = cursor.fetchone()
        yield
        if nested:
            with connection.cursor() as cursor:
                cursor.execute("SELECT set_config(%s, %s, true)", [name, previous])


def serial_plans() -> AbstractContextManager[None]:
    """A transaction in which PostgreSQL plans no parallel workers
    (:func:`local_setting` of ``max_parallel_workers_per_gather`` = 0).

    For reads whose right plan is a nested loop over the index of each step
    (a thread's runs, then each run's rows; issue 11): on a table of
    millions of rows the estimate of a long thread's runs, sampled afresh by
    every ``ANALYZE``, sometimes tips the planner into a parallel plan,
    whose worker start-up and tuple queue cost more than the walk itself
    (20–24 ms instead of 6 ms for a 1,000-turn thread's memory). One round
    trip more."""
    return local_setting("max_parallel_workers_per_gather", "0")


def update_rows(objs: list, fields: Sequence[str]) -> None:
    """Save ``fields`` of ``objs`` (instances of one model) as
    ``bulk_update`` does, in one ``UPDATE … FROM (VALUES …)`` per 500 rows.
    ``bulk_update`` writes a ``CASE WHEN`` per row and field, whose Python
    expressions cost more than the UPDATE itself: three quarters of a
    purge's time (issue 38 item 3). Each value is prepared by its field as
    a save prepares it (``get_db_prep_save``: the storable escapes, JSON;
    None is NULL) and cast to the column's type. ``auto_now`` fields are
    not touched unless named (as ``bulk_update``). Runs in the caller's
    transaction; an unknown field name raises ``FieldDoesNotExist``."""
    if not objs:
        return
    meta = type(objs[0])._meta
    pk = meta.pk
    columns = [meta.get_field(name) for name in fields]
    quote = connection.ops.quote_name
    row = "(" + ", ".join(f"%s::{field.cast_db_type(connection)}" for field in (pk, *columns)) + ")"
    sql = (
        f"UPDATE {quote(meta.db_table)} AS t SET "
        + ", ".join(f"{quote(field.column)} = v.{quote(field.column)}" for field in columns)
        + " FROM (VALUES {values}) AS v ("
        + ", ".join(quote(field.column) for field in (pk, *columns))
        + f") WHERE t.{quote(pk.column)} = v.{quote(pk.column)}"
    )
    with connection.cursor() as cursor:
        for start in range(0, len(objs), 500):
            chunk = objs[start : start + 500]
            params = [
                field.get_db_prep_save(getattr(obj, field.attname), connection)
                for obj in chunk
                for field in (pk, *columns)
            ]
            cursor.execute(sql.format(values=", ".join([row] * len(chunk))), params)


def field_converters(fields: Sequence[Any], table: str, db: Any) -> list[tuple[int, Any, list]]:
    """The converters the ORM applies to values read from ``table`` on the
    connection ``db``: ``(index, column, functions)`` for each of ``fields``
    (model fields in the order of the selected columns) that has any. For
    the readers that build model instances from raw rows; static per
    model, so callers compute it once."""
    converters = []
    for i, f in enumerate(fields):
        column = f.get_col(table)
        functions = db.ops.get_db_converters(column) + f.get_db_converters(db)
        if functions:
            converters.append((i, column, functions))
    return converters


def model_from_values(
    model: Any, fields: Sequence[Any], converters: list[tuple[int, Any, list]], values: Sequence[Any]
):
    """An instance of ``model`` loaded (``Model.from_db``) from one raw row
    ``values`` of ``fields``, converted as the ORM converts them
    (``converters``: :func:`field_converters` of those fields)."""
    return model.from_db(connection.alias, [f.attname for f in fields], convert_values(values, converters, connection))


def stand_ins_checked(params: Sequence[Any], *stand_ins: Any) -> tuple:
    """``params`` of a statement compiled once by the ORM with ``stand_ins``
    in place of a call's own values, checked to hold each stand-in exactly
    once (the very object: a change in how the ORM passes them raises here
    instead of binding a wrong value). Raises ``RuntimeError``."""
    for stand_in in stand_ins:
        if sum(p is stand_in for p in params) != 1:
            raise RuntimeError(f"the compiled query's parameters changed shape: {params!r}")
    return tuple(params)


def stand_ins_bound(params: Sequence[Any], values: Mapping[Any, Any]) -> list:
    """``params`` with each stand-in (a key of ``values``, found by
    identity) replaced by this call's value."""
    by_identity = {id(stand_in): value for stand_in, value in values.items()}
    return [by_identity.get(id(p), p) for p in params]


def convert_values(values: Sequence[Any], converters: list[tuple[int, Any, list]], db: Any) -> list:
    """``values`` (one raw row) with :func:`field_converters`' converters
    applied, as a new list."""
    values = list(values)
    for i, column, functions in converters:
        value = values[i]
        for convert in functions:
            value = convert(value, column, db)
        values[i] = value
    return values


def worker_session_options(config) -> str:
    """The libpq ``options`` of a worker's connections (R-RUN-10):
    ``lock_timeout`` (no lock wait without bound), ``statement_timeout`` and
    ``idle_in_transaction_session_timeout`` — the last ends the transaction
    of a worker frozen while it holds a run row, so PostgreSQL releases the
    lock and the sweeper and the dispatcher get to the run."""
    return (
        f"-c lock_timeout={config.WORKER_LOCK_TIMEOUT_MS}"
        f" -c statement_timeout={config.WORKER_STATEMENT_TIMEOUT_MS}"
        f" -c idle_in_transaction_session_timeout={config.WORKER_IDLE_IN_TRANSACTION_TIMEOUT_MS}"
    )


def configure_worker_database(settings_dict: dict, config) -> None:
    """Give a Celery worker's database connections their session limits and
    a pool wait that fits inside the lease: ``AUDIT_WRITE_ATTEMPTS`` waits of
    at most a sixth of the lease each (R-RUN-8), so a run that loses the
    database fails ``audit_write_failed`` while its lease still holds.
    Its sessions are named after its session tag (:func:`name_worker_sessions`,
    R-RUN-14). Call before the process opens its first connection."""
    name_worker_sessions(settings_dict)
    options = settings_dict.setdefault("OPTIONS", {})
    if "pool" not in options:  # not PostgreSQL
        return
    existing = options.get("options", "")
    options["options"] = f"{existing} {worker_session_options(config)}".strip()
    pool = options["pool"] if isinstance(options["pool"], dict) else {}
    options["pool"] = {**pool, "timeout": worker_connection_wait(config)}


def worker_connection_wait(config) -> float:
    """Seconds one attempt of a worker's database write may wait for a
    connection: at most a sixth of the lease with the default attempts
    (``LEASE_TTL_SECONDS / (2 * AUDIT_WRITE_ATTEMPTS)``), at most
    ``DB_POOL_TIMEOUT_SECONDS``, at least 0.5. The audit writes' pool wait
    and the checkpointer's reconnection (audit.execution.checkpoint) both use it, so
    both outlast the same outage."""
    bounded = config.LEASE_TTL_SECONDS / (2 * config.AUDIT_WRITE_ATTEMPTS)
    return max(0.5, min(config.DB_POOL_TIMEOUT_SECONDS, bounded))
