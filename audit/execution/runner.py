"""Executing one run in a worker: lease, agent stream, audit, terminal state.

:func:`run_execute` is the one service the Celery task calls. It acquires
the lease (R-RUN-3), drives the agent with ``astream_events(version="v3")``,
feeds every event to the :class:`~audit.execution.recorder.LifecycleRecorder` whose
writes go through the lease-checking services in short transactions
(R-RUN-4, R-RUN-5), renews the lease while it works, stops at the next
event boundary when cancellation is requested (R-RUN-6), and ends the run
in one terminal transaction (R-MA-6..8).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django.db import InterfaceError, OperationalError
from django.db.models import Exists, Max, OuterRef
from langchain_core.messages import HumanMessage, RemoveMessage
from langgraph.graph.message import REMOVE_ALL_MESSAGES
from langgraph.types import Command

from conversations.models import Message
from conversations.selectors import thread_memory_messages
from core.config import get_config
from core.db import release_connection, worker_connection_wait, worker_session_tag
from core.errors import ApplicationError, NotFound
from core.redis_client import redis_client
from ops import logcontext

from .. import ledger
from ..agents.assistant import build_agent
from ..agents.models import model_http_client
from ..agents.tools import AgentContext
from ..errors import (
    AuditWriteFailed,
    AuditWriteRejected,
    DatabaseUnavailable,
    LeaseError,
    LeaseExpired,
    LeaseLost,
    RunNotStartable,
)
from ..ledger.cancellation import CancelSignalListener
from ..ledger.causes import failure_cause_clear, failure_cause_send
from ..ledger.lease import Lease
from ..ledger.runs import run_acquire_with_row
from ..ledger.trace import run_set_trace
from ..models import AgentRun, RunCancelRequest, RunRollback
from .checkpoint import ReconnectingPostgresSaver, open_checkpointer, postgres_conninfo
from .effects import EffectLedgerGuard
from .events import RunEventPublisher
from .model_requests import ModelRequestAudit
from .recorder import LifecycleRecorder
from .replay_plans import replay_plan_of
from .shutdown import handover_requested
from .tracing import start_run_trace
from .worker_loop import LoopRedis, run_in_worker_loop, worker_redis
from .writes import call_then_release, current_run, last_database_error, write_with_retry

log = logging.getLogger(__name__)

# Every v3 stream warns that the protocol is experimental. The versions are
# pinned in pyproject.toml and the shape is held by the capture replay tests.
warnings.filterwarnings("ignore", message="The v3 streaming protocol on Pregel is experimental")

Status = AgentRun.Status

#: Seconds a stopped run's drive may take to end before its checkpointer's
#: session, a State write of which holds it, is ended.
STOP_GRACE_SECONDS = 2.0


def worker_identity() -> str:
    """A lease owner name unique to this process and call:
    ``host:pid:tag:random``, where ``tag`` is the process's session tag
    (:func:`core.db.worker_session_tag`), which its database sessions'
    ``application_name`` ends with: the sweeper ends the sessions of an
    owner whose lease expired by it (R-RUN-14)."""
    return f"{socket.gethostname()}:{os.getpid()}:{worker_session_tag()}:{uuid.uuid4().hex[:8]}"


def run_execute(*, run_id: str | uuid.UUID, owner: str | None = None) -> str:
    """Execute a pending run to its end in this process.

    Returns the final status, or ``"skipped"`` when the run could not be
    acquired (not pending, already owned, or waiting behind an earlier run
    of its thread — R-RUN-2, R-RUN-3), or ``"lease_lost"`` when another
    owner took the run over mid-way, or ``"handed_over"`` when this
    process was stopping and put the run back to ``pending`` for another
    worker (R-RUN-15, :mod:`audit.execution.shutdown`).

    Raises:
        DatabaseUnavailable: PostgreSQL could not be reached at pickup; the
            run is untouched (still ``pending``) and the task retries
            (R-RUN-9).
    """
    config = get_config()
    owner = owner or worker_identity()
    try:
        lease, run = run_acquire_with_row(
            run_id=uuid.UUID(str(run_id)), owner=owner, ttl_seconds=config.LEASE_TTL_SECONDS
        )
    except (RunNotStartable, NotFound) as exc:
        log.info("run %s not started: %s", run_id, exc)
        return "skipped"
    except (OperationalError, InterfaceError) as exc:
        # Not "done": the run stays pending and the task is retried (and the
        # dispatcher hands it over again in any case). A lease taken just
        # before the connection broke expires and is swept.
        raise DatabaseUnavailable(f"run {run_id} not picked up: {type(exc).__name__}: {exc}") from exc
    finally:
        release_connection()
    return run_execute_acquired(lease=lease, run=run, owner=owner)


def run_execute_acquired(*, lease: Lease, run: AgentRun, owner: str) -> str:
    """Execute ``run``, whose lease ``lease`` this process took as
    ``owner`` (``run_acquire_with_row``), to its end in this process; the
    outcomes of :func:`run_execute`. A replay takes the lease of the run it
    creates in the same transaction (R-REPLAY-2), so no worker can start
    it first."""
    config = get_config()
    logcontext.bind(run_id=lease.run_id, thread_id=lease.thread_id, worker=owner)
    # On this thread's worker loop, with its Redis connections: no loop,
    # client or subscription made per run (issue 11).
    shared = worker_redis(config.REDIS_URL) if config.REDIS_URL else None
    executor = RunExecutor(lease=lease, run=run, conninfo=postgres_conninfo(), shared_redis=shared)
    return run_in_worker_loop(executor.execute())


#: The outcome of a run its stopping worker hands over (R-RUN-15): not a
#: status of the run, which goes back to ``pending``.
HANDED_OVER = "handed_over"


@dataclass
class _Outcome:
    status: str | None  # None: the lease is gone, nothing may be written
    error_type: str = ""
    error_message: str = ""


class RunExecutor:
    """Drives one run's agent stream while keeping its lease."""

    def __init__(self, *, lease: Lease, run: AgentRun, conninfo: str | None, shared_redis: LoopRedis | None = None):
        """``shared_redis``: the worker loop's Redis connections
        (:func:`~audit.execution.worker_loop.worker_redis`), when :meth:`execute`
        runs on that loop; without it the run makes its own client (closed
        at its end) and subscription."""
        self.lease = lease
        self.run = run
        self.conninfo = conninfo
        self.config = get_config()
        # One Redis client for the run's events and its cancel listener's
        # key check (the subscription has a connection of its own).
        redis_url = self.config.REDIS_URL or None
        self._shared_redis = shared_redis if redis_url else None
        if self._shared_redis is not None:
            self.redis = self._shared_redis.client
        else:
            self.redis = redis_client(redis_url) if redis_url else None
        self.publisher = RunEventPublisher(run.id, redis_url, client=self.redis)
        self.recorder = LifecycleRecorder(lease, budget_user_id=run.user_id, publish=self.publisher.publish)
        self.prior_message_ids: set[str] = set()
        self.seed_messages: list = []
        # What a replayed run does differently (R-REPLAY-2); None for the
        # runs a worker executes.
        self.replay = replay_plan_of(run.id)
        if self.replay is not None and self.replay.cancel_watch is not None:
            self.recorder.text_watch = self._cancel_where_recorded
        # Whether this attempt goes on from a checkpoint an earlier attempt
        # of the run wrote (R-RUN-15).
        self.continuing = False
        self._stop: _Outcome | None = None
        self._drive_task: asyncio.Task | None = None
        # The run's checkpointer while the drive has one open, and whether
        # its session was ended to stop the drive.
        self._saver: Any = None
        self._interrupted = False
        # Set once the drive has ended: the run is being finished (since).
        self._ending = False
        self._finish_began = math.inf
        # Monotonic time until which the lease is known to hold.
        self.lease_deadline = time.monotonic() + self.config.LEASE_TTL_SECONDS
        # When this process was first seen stopping (monotonic), while the
        # run waits for a running tool before handing itself over.
        self._handover_since: float | None = None
        # Whether a failure cause waits in Redis for the sweeper.
        self._cause_left = False
        self._cause_lock = asyncio.Lock()

    async def execute(self) -> str:
        current_run.set(self)
        await self.publisher.publish("run.status", {"status": Status.RUNNING})
        keeper = None
        try:
            self._drive_task = asyncio.create_task(self._drive())
            keeper = asyncio.create_task(self._keep_lease())
            try:
                outcome = await self._drive_task
                if self._interrupted:
                    # It failed because it was stopped: the stop's reason.
                    outcome = self._stop
            except asyncio.CancelledError:
                if self._stop is None:
                    raise
                outcome = self._stop
            # The keeper renews the lease until the terminal write is done,
            # and acts on nothing it reads any more.
            self._ending = True
            return await self._finish(outcome)
        finally:
            # The keeper's end (its subscription left) and the last batch of
            # events (the terminal one, published by _finish after its
            # transaction committed, last) go out together.
            await asyncio.gather(self._stop_keeper(keeper), self.publisher.close())
            if self.redis is not None and self._shared_redis is None:
                with contextlib.suppress(Exception):
                    await self.redis.aclose()

    @staticmethod
    async def _stop_keeper(keeper: asyncio.Task | None) -> None:
        if keeper is not None:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await keeper

    async def _drive(self) -> _Outcome:
        try:
            async with open_checkpointer(self.conninfo) as saver, model_http_client() as http_client:
                self._saver = saver
                graph = build_agent(
                    self.run.agent_id,
                    model=self.run.model,
                    checkpointer=saver,
                    http_async_client=http_client,
                    # No tool call of the turn executed twice (R-EFF-1).
                    tool_guard=EffectLedgerGuard(self),
                    replay_url=self.replay.model_url if self.replay is not None else None,
                )
                # The model request callback checks the budget and opens each
                # model row before its request is sent (R-COST-3, R-MA-10),
                # and counts retries (R-RUN-12).
                graph_config = {
                    "configurable": {"thread_id": str(self.run.thread_id)},
                    # Every checkpoint this run writes names it: a later
                    # attempt knows where the run got to (R-RUN-15).
                    "metadata": {"run_id": str(self.run.id)},
                    "recursion_limit": 40,
                    "callbacks": [ModelRequestAudit(self.recorder)],
                }
                trace = start_run_trace(self.run.id)
                if trace.trace_id:
                    await write_with_retry(run_set_trace, lease=self.lease, trace_id=trace.trace_id)
                    graph_config["callbacks"] += list(trace.callbacks)
                # Only runs write a thread's checkpoints, each while it runs
                # (acquired once), and a thread's runs are never deleted
                # (R-GOV-3): the thread's first run finds none to read, and
                # no history to rebuild (the lease acquisition told).
                first_run = not getattr(self.run, "thread_has_earlier_run", True)
                snapshot = None
                if not first_run or self.run.attempt > 1:
                    snapshot = await graph.aget_state(graph_config)
                    self.prior_message_ids = _message_ids(snapshot)
                    if self.run.attempt > 1:
                        self.recorder.sequence_base = await sync_to_async(call_then_release)(
                            _last_sequence, {"run_id": self.run.id}
                        )
                    if self.run.attempt > 1 and (snapshot.metadata or {}).get("run_id") == str(self.run.id):
                        # An earlier attempt of this run got this far: go on
                        # from its last checkpoint, its input already in the
                        # State (R-RUN-15). What came before it is prior.
                        self.continuing = True
                        self.prior_message_ids = await _message_ids_before(graph, graph_config, self.run.id)
                stream_config = graph_config
                # Almost no thread has a rolled-back run; the lease
                # acquisition told whether this one has (R-API-2), and
                # without one no rollback is read here.
                has_rollback = getattr(self.run, "thread_has_rollback", True)
                if snapshot is not None and has_rollback and not self.continuing and not self.run.resumed_from_id:
                    # A turn rolled back by this one (R-API-2): start from
                    # the State before it.
                    stream_config, snapshot = await _rolled_back_start(graph, graph_config, snapshot)
                    self.prior_message_ids = _message_ids(snapshot)
                if self.replay is not None and first_run and not self.run.resumed_from_id:
                    # A replay starts from the recorded turn's history
                    # (R-REPLAY-2); those messages are prior (R-MA-9).
                    self.seed_messages = self.replay.history_messages()
                    self.prior_message_ids = {m.id for m in self.seed_messages if m.id}
                elif (
                    not self.prior_message_ids
                    and not self.run.resumed_from_id
                    and not first_run
                    and not self.continuing
                ):
                    # The checkpointer lost the thread (pruned, migrated):
                    # rebuild the history from the audit tables, by the same
                    # rules as the memory API (R-READ-2). Its ids are prior
                    # messages, never this run's (R-MA-9).
                    self.seed_messages = await sync_to_async(call_then_release)(
                        thread_memory_messages,
                        {"thread_id": self.run.thread_id, "include_tools": True, "before_run": self.run},
                    )
                    self.prior_message_ids = {m.id for m in self.seed_messages if m.id}
                stream = await graph.astream_events(
                    None if self.continuing else self._graph_input(),
                    stream_config,
                    version="v3",
                    context=self._context(),
                )
                try:
                    async for event in stream:
                        await self.recorder.handle(event)
                    if self.continuing and self.recorder.last_values is None and snapshot is not None:
                        # The earlier attempt had ended the graph (its last
                        # checkpoint is final) but not the run: that
                        # checkpoint is the final State.
                        self.recorder.last_values = snapshot.values
                except asyncio.CancelledError:
                    # Async cancellation really stops the model call
                    # (PROTOCOL.md §8); abort finalises the stream.
                    with contextlib.suppress(Exception):
                        await asyncio.shield(stream.abort())
                    raise
        except asyncio.CancelledError:
            raise
        except LeaseError as exc:
            log.warning("run %s stopped: %s", self.run.id, exc)
            return _Outcome(None, exc.code, str(exc))
        except ApplicationError as exc:
            return _Outcome(Status.FAILED, exc.code, exc.message)
        except Exception as exc:  # the agent, the model or a tool failed
            log.info("run %s failed: %r", self.run.id, exc)
            attempts = getattr(exc, "model_attempts", None)
            after = f" (after {len(attempts)} attempts)" if attempts and len(attempts) > 1 else ""
            return _Outcome(Status.FAILED, _error_type(exc), f"{type(exc).__name__}: {exc}{after}"[:4000])
        if self.recorder.interrupts:
            return _Outcome(Status.INTERRUPTED)
        return _Outcome(Status.COMPLETED)

    async def _cancel_where_recorded(self, operation_id: str, chars: int) -> None:
        """A replay's root model call ``operation_id`` has streamed
        ``chars`` characters: where its recorded turn was cancelled, ask
        for this run's cancel, as a user would (R-REPLAY-2, R-RUN-6)."""
        watch = self.replay.cancel_watch if self.replay is not None else None
        if watch is not None and watch.due(operation_id, chars):
            await self.request_own_cancel()

    async def request_own_cancel(self) -> None:
        """Ask for this run's cancel through the cancel service (the request
        recorded, the worker signalled): a replay reproducing a recorded
        cancel (R-REPLAY-2)."""
        await sync_to_async(call_then_release)(
            ledger.run_request_cancel, {"user": self.run.user_id, "run_id": self.run.id}
        )

    def _graph_input(self) -> Any:
        if self.run.resumed_from_id:
            return Command(resume={"decisions": self.run.input.get("decisions", [])})
        return {
            "messages": [
                *self.seed_messages,
                HumanMessage(content=self.run.input.get("text", ""), id=f"human-{self.run.id}"),
            ]
        }

    def _context(self) -> AgentContext:
        workspace = Path(self.config.WORKSPACE_ROOT) / str(self.run.thread_id)
        workspace.mkdir(parents=True, exist_ok=True)
        return AgentContext(thread_id=str(self.run.thread_id), run_id=str(self.run.id), workspace=str(workspace))

    async def _keep_lease(self) -> None:
        """Renew the lease every third of its TTL and check the run's status
        in the database about once a second, or at once when the Redis
        cancel signal arrives (R-RUN-6; the database is the source of
        truth, the signal only wakes this loop). Stops the drive task —
        which aborts the model stream — when the run is to be cancelled,
        the lease is gone (R-RUN-4) or the database keeps failing (R-RUN-8).
        Then, and once the drive has ended, it goes on renewing the lease
        until it is cancelled after the terminal write
        (:meth:`_hold_lease`)."""
        ttl = self.config.LEASE_TTL_SECONDS
        poll = min(1.0, ttl / 3)
        renewed_at = time.monotonic()
        listener = CancelSignalListener(self.lease.run_id, client=self.redis, shared=self._shared_redis)
        try:
            while self._stop is None and not self._ending:
                signalled = await listener.wait(poll)
                if self._ending:
                    break
                try:
                    if time.monotonic() - renewed_at >= ttl / 3:
                        status = await write_with_retry(ledger.lease_renew, lease=self.lease, ttl_seconds=ttl)
                        renewed_at = await self._renewed()
                    else:
                        status = await write_with_retry(_run_status, lease=self.lease)
                    if self._ending:
                        break  # the drive ended meanwhile: its outcome stands
                except LeaseError as exc:
                    self._stop = _Outcome(None, exc.code, str(exc))
                except (AuditWriteFailed, AuditWriteRejected) as exc:
                    self._stop = _Outcome(Status.FAILED, exc.code, exc.message)
                else:
                    if status == Status.CANCEL_REQUESTED:
                        self._stop = _Outcome(Status.CANCELLED, "cancelled", "cancelled on request")
                        await self.publisher.publish("run.status", {"status": Status.CANCEL_REQUESTED})
                    elif signalled:
                        log.info("run %s: cancel signal without cancel_requested in the database", self.run.id)
                    if self._stop is None and self._hand_over_now():
                        self._stop = _Outcome(HANDED_OVER, HANDED_OVER, "its worker is shutting down")
        finally:
            await listener.close()
        if self._stop is not None and self._drive_task is not None:
            self._drive_task.cancel()
            await asyncio.gather(self._interrupt_if_stuck(), self._hold_lease(renewed_at))
        else:
            await self._hold_lease(renewed_at)

    def _hand_over_now(self) -> bool:
        """Whether the run is to stop now and hand itself over: its worker
        is stopping (:func:`~audit.execution.shutdown.handover_requested`),
        ``RUN_RECOVERY`` is ``resume`` and the run has an attempt left, and
        no tool is running — a running tool is waited for, up to one lease
        TTL, so that its outcome is known and it never runs twice
        (R-RUN-15, R-EFF-1)."""
        if not handover_requested():
            return False
        config = self.config
        if config.RUN_RECOVERY != "resume" or self.run.attempt > config.RUN_RECOVERY_ATTEMPTS:
            return False  # as before: the run goes on until it ends
        now = time.monotonic()
        if self._handover_since is None:
            self._handover_since = now
            log.info("run %s: its worker is shutting down; handing it over", self.run.id)
        return not self.recorder.tools_in_flight() or now - self._handover_since >= config.LEASE_TTL_SECONDS

    async def _hand_over(self) -> str:
        """Put the run back to ``pending`` as its next attempt for another
        worker (:func:`~audit.ledger.terminal.run_hand_over`). Returns
        ``"handed_over"``, or ``"lease_lost"`` when the lease is gone or the
        write keeps failing (the lease then expires, and the sweeper hands
        the run over)."""
        try:
            run = await write_with_retry(
                ledger.run_hand_over,
                lease=self.lease,
                reason=f"its worker {self.lease.owner} is shutting down",
                partial_content=self.recorder.partial_contents(),
                cut_calls=self.recorder.cut_calls(),
            )
        except (LeaseError, AuditWriteFailed, AuditWriteRejected) as exc:
            log.warning("run %s could not be handed over: %s", self.run.id, exc)
            return "lease_lost"
        await self.publisher.publish("run.status", {"status": Status.PENDING, "attempt": run.attempt})
        return HANDED_OVER

    async def _hold_lease(self, renewed_at: float) -> None:
        """Renew the lease every third of its TTL while the run ends — its
        drive winding down after a stop, its terminal write (retried while
        the lease lasts) — so that it does not lapse meanwhile and leave the
        run to the sweeper, without its final State (R-RUN-7). Ends at the
        first failure: a lease that is gone (the terminal transaction
        released it, or another owner holds it) or a database that does not
        answer, which the terminal write's own retries then meet."""
        if self._stop is not None and self._stop.status is None:
            return  # the lease is gone
        ttl = self.config.LEASE_TTL_SECONDS
        # A stopped drive that does not end (held by something no interrupt
        # frees) must not keep the run from ending: the lease is then left
        # to expire, and the sweeper ends the run.
        wind_down_until = time.monotonic() + STOP_GRACE_SECONDS + ttl
        while True:
            await asyncio.sleep(max(0.0, renewed_at + ttl / 3 - time.monotonic()))
            if not self._ending and time.monotonic() > wind_down_until:
                log.error("run %s: its drive did not end after the stop; its lease is left to expire", self.run.id)
                return
            try:
                await write_with_retry(ledger.lease_renew, lease=self.lease, ttl_seconds=ttl)
            except (LeaseError, AuditWriteFailed, AuditWriteRejected) as exc:
                log.info("run %s: lease no longer renewed while it ends: %s", self.run.id, exc)
                return
            renewed_at = await self._renewed()

    async def _renewed(self) -> float:
        """After a successful renewal: the lease's new deadline, and the
        failure cause left during an outage taken back — the database came
        back in time, so a later expiry (this worker killed) is not the
        outage's. Returns the renewal's time (monotonic)."""
        renewed_at = time.monotonic()
        self.lease_deadline = renewed_at + self.config.LEASE_TTL_SECONDS
        if self._cause_left:
            async with self._cause_lock:
                await asyncio.to_thread(failure_cause_clear, run_id=self.run.id)
                self._cause_left = False
        return renewed_at

    async def _interrupt_if_stuck(self) -> None:
        """The drive was cancelled (R-RUN-6) or lost its lease; a statement
        of its checkpointer can still hold it, a State write waiting on a
        lock of the checkpoint tables (a VACUUM FULL, a migration): after
        :data:`STOP_GRACE_SECONDS` the checkpointer's session is ended
        (:meth:`ReconnectingPostgresSaver.interrupt`), so the run ends now,
        not when the lock is released (the worker's slot would stay taken
        until then)."""
        done, _ = await asyncio.wait({self._drive_task}, timeout=STOP_GRACE_SECONDS)
        if done or not isinstance(self._saver, ReconnectingPostgresSaver):
            return
        log.warning("run %s: still waiting on its checkpointer after the stop; ending its session", self.run.id)
        self._interrupted = True
        await self._saver.interrupt()

    async def database_lost(self, exc: BaseException, *, retry_in: float) -> None:
        """An audit write of this run failed on a database error that is
        retried (unreachable, a lock timeout), in ``retry_in`` seconds. When the lease may run out before
        that retry can end (it waits up to one connection wait), leave the
        cause now, while the run still holds its lease: the database may be
        back and the sweeper first once it has expired, and it would then
        say ``lease_expired`` (R-RUN-8). Taken back if a renewal succeeds."""
        horizon = retry_in + worker_connection_wait(self.config) + 1.0
        if self._cause_left or time.monotonic() + horizon < self.lease_deadline:
            return
        # One at a time with the taking back (:meth:`_renewed`): a cause sent
        # after it was taken back would stay.
        async with self._cause_lock:
            await asyncio.to_thread(
                failure_cause_send,
                run_id=self.run.id,
                error_type=AuditWriteFailed.code,
                message=f"audit writes were failing while the lease ran out: {type(exc).__name__}: {exc}",
            )
            self._cause_left = True

    def _leave_cause_if_database_was_lost(self, code: str) -> None:
        """The lease expired while the database was unreachable: leave the
        cause for the sweeper, which would otherwise say ``lease_expired``
        (R-RUN-8)."""
        recent = time.monotonic() - last_database_error["at"] <= 2 * self.config.LEASE_TTL_SECONDS
        if code == LeaseExpired.code and recent:
            failure_cause_send(
                run_id=self.run.id,
                error_type=AuditWriteFailed.code,
                message=f"the database was unreachable until the lease expired: {last_database_error['text']}",
            )

    def _terminal_retries_over(self) -> bool:
        """Whether a failed terminal write may not be tried again: the lease
        ends within a second, or one lease TTL has passed since the first
        try (the keeper renews the lease meanwhile, so the lease alone would
        not bound a write that keeps failing while the database answers)."""
        return time.monotonic() + 1.0 >= min(self.lease_deadline, self._finish_began + self.config.LEASE_TTL_SECONDS)

    async def _finish(self, outcome: _Outcome) -> str:
        self._finish_began = time.monotonic()
        if outcome.status is None:
            self._leave_cause_if_database_was_lost(outcome.error_type)
            return "lease_lost"
        if outcome.status == HANDED_OVER:
            return await self._hand_over()
        terminal = {
            "lease": self.lease,
            "status": outcome.status,
            "final_state": self.recorder.final_state(),
            "prior_message_ids": self.prior_message_ids,
            "interrupts": self.recorder.interrupt_payloads() or None,
            "error_type": outcome.error_type,
            "error_message": outcome.error_message,
            "partial_content": self.recorder.partial_contents(),
            "cut_calls": self.recorder.cut_calls(),
        }
        while True:
            try:
                run = await write_with_retry(ledger.run_finish, **terminal)
                break
            except LeaseError as exc:
                log.warning("run %s could not be finished: %s", self.run.id, exc)
                self._leave_cause_if_database_was_lost(exc.code)
                return "lease_lost"
            except AuditWriteFailed as exc:
                # The terminal write is the one that must not be lost: keep
                # trying while the lease lasts (bounded), then leave the run
                # to the lease sweeper (R-RUN-7, R-RUN-8).
                if self._terminal_retries_over():
                    log.error("run %s terminal write failed; the lease sweeper will end it: %s", self.run.id, exc)
                    # The sweeper names this cause, not lease_expired.
                    failure_cause_send(run_id=self.run.id, error_type=exc.code, message=exc.message)
                    return "lease_lost"
                log.warning("run %s terminal write failed, retrying while the lease lasts: %s", self.run.id, exc)
                await asyncio.sleep(0.5)
            except Exception as exc:
                # The database refused the terminal write itself (or it
                # could not be built): retrying the same payload cannot
                # help, and the sweeper would only find the run much later
                # under a wrong cause. End it now without the payload.
                run = await self._finish_without_payload(outcome, exc)
                if run is None:
                    return "lease_lost"
                break
        await self.publisher.publish(
            "run.finished",
            {
                "status": run.status,
                "error_type": run.error_type,
                "output_message_id": run.output_message_id,
                # The pending approval's action requests (R-TA-5, R-EVT-1).
                "interrupts": run.interrupts if run.status == Status.INTERRUPTED else None,
            },
        )
        return run.status

    async def _finish_without_payload(self, outcome: _Outcome, exc: Exception) -> AgentRun | None:
        """The fallback terminal transaction (R-RUN-11): ``failed`` with the
        error type ``audit_write_rejected:<cause>``, running rows closed,
        lease released, and nothing from the State. Returns the run, or
        ``None`` when the lease is gone or the database stays unreachable
        while the lease lasts (then the sweeper ends the run)."""
        if not isinstance(exc, AuditWriteRejected):
            exc = AuditWriteRejected(f"run_finish failed: {type(exc).__name__}: {exc}"[:2000], cause=type(exc).__name__)
        log.error("run %s: terminal write refused, ending it without its payload: %s", self.run.id, exc.message)
        message = f"the terminal write was refused ({exc.message}); the run ended without reconciling its State"
        if outcome.error_type:
            message += f"; it was ending as {outcome.status} with {outcome.error_type}: {outcome.error_message}"
        # ASCII only: this write must not be refused for its own content.
        message = message.encode("ascii", "backslashreplace").decode()[:4000]
        while True:
            try:
                return await write_with_retry(
                    ledger.run_finish_fallback, lease=self.lease, error_type=exc.code, error_message=message
                )
            except LeaseError as lease_exc:
                log.warning("run %s could not be finished: %s", self.run.id, lease_exc)
                return None
            except AuditWriteRejected as refused:
                # Nothing of the run's content is in this write; if even it
                # is refused, only the sweeper can end the run.
                log.error("run %s fallback write refused; the sweeper will end it: %s", self.run.id, refused)
                return None
            except AuditWriteFailed as write_exc:
                if self._terminal_retries_over():
                    log.error("run %s fallback write failed; the sweeper will end it: %s", self.run.id, write_exc)
                    return None
                await asyncio.sleep(0.5)


def _rolled_back_runs(*, thread_id: uuid.UUID) -> set[str]:
    """The ids (text) of the thread's runs whose turn was rolled back (R-API-2)."""
    return {str(pk) for pk in RunRollback.objects.filter(run__thread_id=thread_id).values_list("run_id", flat=True)}


async def _rolled_back_start(graph: Any, graph_config: dict, snapshot: Any) -> tuple[dict, Any]:
    """Where a run starts when the thread's newest checkpoint is a rolled
    back run's (R-API-2): ``(the config to stream with, the State it starts
    from)``. From the newest checkpoint another run wrote, as a fork (the
    rolled-back checkpoints stay, off the thread's line); when every
    checkpoint is a rolled-back run's, from a State whose messages are
    cleared. Otherwise ``(graph_config, snapshot)`` unchanged."""
    rolled = await sync_to_async(call_then_release)(
        _rolled_back_runs, {"thread_id": graph_config["configurable"]["thread_id"]}
    )
    if (snapshot.metadata or {}).get("run_id") not in rolled:
        return graph_config, snapshot
    async for state in graph.aget_state_history(graph_config):
        if (state.metadata or {}).get("run_id") not in rolled:
            fork = {**graph_config, "configurable": {**graph_config["configurable"], **state.config["configurable"]}}
            return fork, state
    # Written without this run's metadata: a later attempt of the run must
    # not take it for its own progress (R-RUN-15).
    clear = {"configurable": graph_config["configurable"]}
    await graph.aupdate_state(clear, {"messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES)]})
    return graph_config, await graph.aget_state(graph_config)


def _last_sequence(*, run_id: uuid.UUID) -> int:
    """The highest sequence of the run's audit rows (0 without any)."""
    return Message.objects.filter(run_id=run_id).aggregate(last=Max("sequence"))["last"] or 0


def _message_ids(snapshot: Any) -> set[str]:
    """The ids of the messages in a State snapshot."""
    return {m.id for m in (snapshot.values or {}).get("messages", []) if getattr(m, "id", None)}


async def _message_ids_before(graph: Any, graph_config: dict, run_id: uuid.UUID) -> set[str]:
    """The ids of the messages the thread's State held before ``run_id``
    first wrote to it: those of its newest checkpoint that another run (or
    none) wrote, walking back from the head past this run's own
    (R-RUN-15, R-MA-9). Empty when every checkpoint is this run's."""
    async for state in graph.aget_state_history(graph_config):
        if (state.metadata or {}).get("run_id") != str(run_id):
            return _message_ids(state)
    return set()


def _run_status(*, lease: Lease) -> str:
    """The run's status, read without a lock; raises :class:`LeaseLost` when
    another owner or fencing token holds the run, so a worker notices a
    takeover within one poll even while no audit write is due (R-RUN-4)."""
    status, owner, token, cancel = (
        AgentRun.objects.annotate(
            cancel=Exists(RunCancelRequest.objects.filter(run_id=OuterRef("pk"), applied_at__isnull=True))
        )
        .values_list("status", "lease_owner", "fencing_token", "cancel")
        .get(pk=lease.run_id)
    )
    if owner != lease.owner or token != lease.fencing_token:
        raise LeaseLost(f"run {lease.run_id} is now held by {owner!r} with token {token}")
    # A cancel request recorded while a lock was held counts at once; the
    # next renewal applies it to the row (R-RUN-10).
    return Status.CANCEL_REQUESTED if cancel and status == Status.RUNNING else status


def _error_type(exc: BaseException) -> str:
    """A stable error type naming the cause of a failed run. The chat model
    names provider faults itself (``audit_error_type``: ``model_unreachable``,
    ``model_http_error``, ``model_request_failed``, ``model_stream_broken``,
    R-RUN-12); a database error in the graph is its checkpointer's
    (``checkpoint_error:<type>``); the rest by the exception's type."""
    import openai

    named = getattr(exc, "audit_error_type", None)
    if isinstance(named, str) and named:
        return named
    if isinstance(exc, openai.APIStatusError):
        return "model_http_error"
    if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError)):
        return "model_unreachable"
    name = type(exc).__name__
    module = type(exc).__module__
    if module.startswith(("httpx", "httpcore")):
        return "model_stream_error"
    if module.startswith("psycopg"):
        # The graph's own database work is its checkpointer's (LangGraph's
        # AsyncPostgresSaver, one connection per run): a database fault,
        # not the agent's.
        return f"checkpoint_error:{name}"
    return "agent_error" if name == "Exception" else f"agent_error:{name}"
