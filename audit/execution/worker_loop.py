"""One event loop per worker thread, kept from run to run, and the Redis
connections its runs share (issue 11: share connections).

``asyncio.run`` for every run built a new loop, a new Redis client and a
new subscription connection — each a TCP connection and its handshake —
and at the end joined the loop's executor threads: 5–9 ms of CPU a run on
a two-core machine (``bench_run_overhead``). :func:`run_in_worker_loop`
runs each run's coroutine on this thread's loop instead, with what
``asyncio.run`` guarantees for one run: a context copied from the caller's,
and every task the run left behind cancelled and awaited before it
returns, so nothing of one run survives into the next. The loop's Redis
client (:func:`worker_redis`) serves every run's live events and cancel
signal; its subscription connection subscribes to one run's channel at a
time (:class:`~audit.ledger.cancellation.CancelSignalListener`). The loop also
keeps its last run's checkpointer connection, idle, for the next run
(:func:`kept_connections`, :func:`audit.execution.checkpoint.open_checkpointer`),
and the connections on which it awaits the runs' lifecycle writes
(:func:`awaited_connections`).

A loop belongs to its thread and process: a forked child, or another
thread, makes its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import threading
import weakref
from collections.abc import Coroutine
from typing import Any

from core.db import AwaitedConnections
from core.redis_client import REDIS_CLIENT_OPTIONS

_local = threading.local()


class LoopRedis:
    """The Redis client of one worker loop and its one subscription
    connection (``pubsub``), made on first use, kept across runs."""

    def __init__(self, url: str):
        from redis import asyncio as aioredis

        # Named, so that an operator tells a worker's connections apart in
        # ``CLIENT LIST`` (a client connection or two and one subscription
        # per worker thread, whatever the number of runs).
        self.client = aioredis.from_url(url, client_name=worker_client_name(), **REDIS_CLIENT_OPTIONS)
        self._pubsub: Any = None

    def pubsub(self) -> Any:
        """The loop's subscription (made at first use). A run subscribes
        its channel and unsubscribes it when it ends."""
        if self._pubsub is None:
            self._pubsub = self.client.pubsub()
        return self._pubsub

    async def discard_pubsub(self) -> None:
        """Drop the subscription after an error on it (a broken connection,
        Redis restarted): the next run makes a new one."""
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()


class _WorkerLoop:
    def __init__(self) -> None:
        self.pid = os.getpid()
        # A loop factory: the loop is not made the thread's current loop, so
        # code outside a run (asyncio.run elsewhere in the thread) is unaffected.
        self.runner = asyncio.Runner(loop_factory=asyncio.new_event_loop)
        self.redis: dict[str, LoopRedis] = {}
        # conninfo -> one idle connection kept from run to run (audit.execution.checkpoint).
        self.kept: dict[str, Any] = {}
        # The connections on which the loop awaits its runs' lifecycle writes.
        self.awaited = AwaitedConnections()

    def run[T](self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return self.runner.run(coro, context=contextvars.copy_context())
        finally:
            _cancel_leftovers(self.runner.get_loop())

    def close_kept(self) -> None:
        """Close the connections kept for the next run (their sockets only:
        no round trip, no loop needed)."""
        self.awaited.close()
        while self.kept:
            try:
                _, conn = self.kept.popitem()
            except KeyError:  # taken meanwhile by the loop's next run
                break
            with contextlib.suppress(Exception):
                conn.pgconn.finish()

    def __del__(self) -> None:
        # The thread ended: its loop goes (its sockets with the objects that
        # hold them); nothing is run on it any more.
        if self.pid == os.getpid():
            self.close_kept()
        loop = getattr(self.runner, "_loop", None)
        if self.pid == os.getpid() and loop is not None and not loop.is_running():
            with contextlib.suppress(Exception):
                loop.close()


#: Every worker loop of this process (their connections closed together).
_loops: weakref.WeakSet[_WorkerLoop] = weakref.WeakSet()


def _worker_loop() -> _WorkerLoop:
    worker = getattr(_local, "worker", None)
    if worker is None or worker.pid != os.getpid():
        worker = _local.worker = _WorkerLoop()
        _loops.add(worker)
    return worker


def run_in_worker_loop[T](coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end on this thread's worker loop and return its
    result (or raise its exception), as ``asyncio.run`` would: in a copy of
    the caller's context, with every task it left running cancelled and
    awaited before this returns. Raises ``RuntimeError`` when called from a
    running event loop (as ``asyncio.run`` does)."""
    return _worker_loop().run(coro)


def worker_redis(url: str) -> LoopRedis:
    """The Redis connections of this thread's worker loop for ``url``: for
    runs that :func:`run_in_worker_loop` runs, and only there (its
    connections belong to that loop)."""
    worker = _worker_loop()
    shared = worker.redis.get(url)
    if shared is None:
        shared = worker.redis[url] = LoopRedis(url)
    return shared


def kept_connections() -> dict[str, Any] | None:
    """Where the worker loop running the caller keeps connections from run
    to run (``{conninfo: connection}``, at most one each, idle): the
    checkpointer's (:func:`audit.execution.checkpoint.open_checkpointer`). ``None``
    outside a run of :func:`run_in_worker_loop` on this thread (a
    connection kept there would outlive its loop)."""
    worker = _running_worker()
    return worker.kept if worker is not None else None


def _running_worker() -> _WorkerLoop | None:
    """This thread's worker loop when it is the running loop, else None."""
    worker = getattr(_local, "worker", None)
    if worker is None or worker.pid != os.getpid():
        return None
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return worker if getattr(worker.runner, "_loop", None) is running else None


def awaited_connections() -> AwaitedConnections | None:
    """The connections on which the worker loop running the caller awaits
    its lifecycle writes (:class:`core.db.AwaitedConnections`), kept from
    run to run; ``None`` outside a run of :func:`run_in_worker_loop` on
    this thread (a connection kept there would outlive its loop)."""
    worker = _running_worker()
    return worker.awaited if worker is not None else None


def close_kept_connections() -> None:
    """Close the connections every worker loop of this process keeps for its
    next run (a worker's shutdown, a test's end; a thread that ended closes
    its own when its loop is collected). A kept connection is idle: one
    that a loop's next run takes meanwhile is either taken or closed, never
    both. Never raises."""
    for worker in list(_loops):
        if worker.pid == os.getpid():
            worker.close_kept()


def worker_client_name() -> str:
    """The Redis client name of this thread's worker loop:
    ``yuxi-worker:<pid>:<thread id>`` (the thread's native id)."""
    return f"yuxi-worker:{os.getpid()}:{threading.get_native_id()}"


def _cancel_leftovers(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel and await the tasks a run left on ``loop`` (what
    ``asyncio.run`` does before it closes its loop); an error one of them
    ends with goes to the loop's exception handler."""
    if loop.is_closed():
        return
    tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
    if not tasks:
        return
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler(
                {"message": "a task a run left behind failed", "exception": task.exception(), "task": task}
            )
