"""The lifecycle recorder: turns LangGraph v3 protocol events into audit
writes (one component, fed by the stream; see shared/protocol/PROTOCOL.md).

It keeps per-call state in memory (aggregated text, monotonic start) and
writes at the lifecycle boundaries only — message-start, message-finish,
tool-started, tool-finished, tool-error — never per token (R-MA-4,
R-RUN-5): each boundary calls one lease-checked service of
:mod:`audit.ledger` through :func:`~audit.execution.writes.write_with_retry`,
and that service builds its statement with :mod:`audit.ledger.fenced`, so a
write is read from its event to its SQL in three files. Every write is
awaited before the next event is consumed: no fire-and-forget writes.

A second feed comes from LangChain's callbacks (``audit.execution.model_requests``):
:meth:`LifecycleRecorder.model_request` when a model request is sent (the
row opens before any chunk, R-MA-10), :meth:`~LifecycleRecorder.model_retry`
per failed attempt (R-RUN-12) and :meth:`~LifecycleRecorder.model_error`.
They run in the model's task, awaited before the request goes out.

Timestamps are the lifecycle events' times, never the time a row was
written nor the time the stream was read (R-SUB-2). The worker reads the
stream and awaits each write before the next event, so it lags behind the
graph — most behind a subagent's calls, which run on while the rows of
earlier events are written — and a stream event's ``params.timestamp`` is
when the worker pulled it (PROTOCOL.md §5). The callbacks run where the call is
made, at the event: each stamps it (:class:`Stamp`: wall
clock and monotonic clock, read once) — model request (its start), model
end, tool start, tool end or error — and the write of the stream event
takes that stamp. A stream event whose callback has not fired yet (a root
call whose events the worker reads as they come) is stamped from its pull
time, which then is its time.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import BaseMessage, ToolMessage
from langchain_core.utils.utils import LC_ID_PREFIX

from .. import ledger
from ..errors import AuditConflict
from ..jsonable import message_text, to_jsonable
from ..ledger.lease import Lease
from ..ledger.terminal import StateMessage
from .writes import write_with_retry

Publish = Callable[[str, dict], Awaitable[None]]


@dataclass(frozen=True)
class Stamp:
    """When a lifecycle event happened: ``at`` the wall clock (aware, UTC),
    stored as the row's ``started_at`` / ``finished_at``; ``mono`` the
    monotonic clock (seconds), whose differences are the row's
    ``duration_ms`` (R-MA-4, R-SUB-2)."""

    at: dt.datetime
    mono: float


def _utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass
class _ModelCall:
    operation_id: str
    sequence: int
    started: Stamp
    namespace: list[str]
    text_deltas: dict[int, list[str]] = field(default_factory=dict)
    finished_blocks: dict[int, dict] = field(default_factory=dict)
    finished: bool = False
    # False while a call opened at request start awaits its message-start:
    # its sequence is provisional until then (R-MA-10).
    streamed: bool = True
    error: str | None = None
    # The error's type: the provider classification, else the exception's
    # class (R-OTEL-2).
    error_type: str | None = None
    # When the call ended (LangChain's on_llm_end or on_llm_error).
    ended: Stamp | None = None


def event_time(event: dict) -> dt.datetime:
    """The event's wall clock (``params.timestamp``, ms) as an aware datetime.
    It is the time the worker pulled the event, not the time it happened
    (PROTOCOL.md §5): a row takes it only when no callback stamped the
    event (R-SUB-2); ``seq`` orders."""
    millis = event.get("params", {}).get("timestamp")
    if millis is None:
        return dt.datetime.now(dt.UTC)
    return dt.datetime.fromtimestamp(millis / 1000, tz=dt.UTC)


class LifecycleRecorder:
    """Feed it every raw v3 event with :meth:`handle`, in stream order.

    After the stream ends, :attr:`last_values` is the last root ``values``
    payload (the final State) and :attr:`interrupts` its interrupts: a
    namespaced (subgraph, subagent) ``values`` event is never either.

    Calls made inside a subagent (namespace ``["tools:<task id>", ...]``)
    are recorded with their namespace and the tool call id that spawned
    that namespace (R-SUB-1), learnt from the tool's start callback
    (:meth:`tool_request`, before the subagent runs) or the stream's
    ``lifecycle`` ``started`` event (its ``cause.tool_call_id``).

    Raises :class:`AuditConflict` from :meth:`handle` when the stream
    contradicts itself (a key change inside one lifecycle, the same key at
    another sequence: R-MA-3); whatever a write raises passes through
    (:class:`~audit.errors.LeaseError`, :class:`~audit.errors.AuditWriteFailed`,
    :class:`~audit.errors.AuditWriteRejected`).

    ``lease``: the run's lease, which fences every write (R-RUN-4);
    ``budget_user_id``: with it, a model row opens only while that user's
    budget has room (R-COST-3); ``publish``: the run's live events
    (``publish(kind, data)``), root-level calls only; ``clock`` (monotonic
    seconds) and ``wall_clock`` (aware datetime) are read once per
    lifecycle event, when it happens (R-SUB-2; tests give their own).
    """

    def __init__(
        self,
        lease: Lease,
        *,
        budget_user_id: int | None = None,
        publish: Publish | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], dt.datetime] = _utc_now,
    ):
        self._lease = lease
        self._budget_user_id = budget_user_id
        self._publish = publish
        self._clock = clock
        self._wall_clock = wall_clock
        self._calls: dict[str, _ModelCall] = {}  # by LangChain model run id
        self._declared_by: dict[str, str] = {}  # tool_call_id -> model operation id
        # tool_call_id -> when its tool started / ended (R-SUB-2).
        self._tool_started: dict[str, Stamp] = {}
        self._tool_ended: dict[str, Stamp] = {}
        # Tool calls whose end is being written to their row (R-RUN-15).
        self._tool_closing: set[str] = set()
        # tool_call_id -> the class of the exception its tool raised.
        self._tool_error_types: dict[str, str] = {}
        # LangChain tool run id -> tool_call_id (its end callback has no
        # tool_call_id).
        self._tool_runs: dict[str, str] = {}
        self.last_values: dict | None = None
        self.interrupts: tuple = ()
        # Added to every stream seq: the highest sequence an earlier attempt
        # of the run wrote (0 for a first attempt).
        self.sequence_base = 0
        self.model_calls = 0
        self.tool_calls = 0
        self.last_seq = 0  # the highest root seq consumed so far
        # message id -> model run id, for whole messages (a model that does
        # not stream) whose stream payload carries no run id.
        self._whole_message_runs: dict[str, str] = {}
        # namespace of a subgraph -> the tool call that spawned it (R-SUB-1).
        self._spawned_by: dict[tuple[str, ...], str] = {}
        # Told of each root model call when it is requested (0 characters)
        # and as its text streams (characters so far): a replay cancels
        # where its recorded turn was cancelled (R-REPLAY-2).
        self.text_watch: Callable[[str, int], Awaitable[None]] | None = None

    def now(self) -> Stamp:
        """The lifecycle event happening now: both clocks, read once."""
        return Stamp(self._wall_clock(), self._clock())

    def _pulled(self, event: dict) -> Stamp:
        """The stamp of a stream event no callback stamped: its pull time
        (:func:`event_time`) and the monotonic clock now."""
        return Stamp(event_time(event), self._clock())

    async def handle(self, event: dict) -> None:
        if self.sequence_base and isinstance(event.get("seq"), int):
            # A continued run's stream counts from 1 again: its rows follow
            # the earlier attempts' in the timeline (R-RUN-15).
            event = {**event, "seq": event["seq"] + self.sequence_base}
        method = event.get("method")
        params = event.get("params") or {}
        if isinstance(event.get("seq"), int):
            self.last_seq = max(self.last_seq, event["seq"])
        namespace = list(params.get("namespace") or [])
        if method == "messages":
            payload, meta = params["data"]
            if isinstance(payload, dict):
                await self._on_protocol_message(event, payload, meta or {}, namespace)
            elif isinstance(payload, BaseMessage):
                await self._on_whole_message(event, payload, meta or {}, namespace)
        elif method == "tools":
            await self._on_tool(event, params.get("data") or {}, namespace)
        elif method == "values" and not namespace:
            # Only the root's values are the run's State (and its
            # interrupts); a subagent's values are its own (R-SUB-1).
            self.last_values = params.get("data")
            self.interrupts = tuple(params.get("interrupts") or ())
        elif method == "lifecycle":
            self._on_lifecycle(params.get("data") or {})

    # -- subagents (R-SUB-1) ----------------------------------------------------

    def tool_request(self, *, tool_call_id: str, metadata: dict, tool_run_id: str | None = None) -> None:
        """A tool is about to run (LangChain's tool start callback, before
        the tool's body: a ``task`` tool's subagent has not started yet).
        Its checkpoint namespace (``metadata["langgraph_checkpoint_ns"]``,
        ``"tools:a9"`` or ``"tools:a9|tools:b1"``) is the namespace of any
        graph it runs, so calls made there belong to ``tool_call_id``
        (R-SUB-1).

        This is the tool's start: its row's ``started_at`` (R-SUB-2), written
        when the stream's tool-started comes. ``tool_run_id``: LangChain's
        run id of the tool call, which :meth:`tool_end` is given."""
        if not tool_call_id:
            return
        self._tool_started.setdefault(tool_call_id, self.now())
        if tool_run_id:
            self._tool_runs[tool_run_id] = tool_call_id
        checkpoint_ns = metadata.get("langgraph_checkpoint_ns") or ""
        namespace = tuple(part for part in checkpoint_ns.split("|") if part)
        if namespace:
            self._spawned_by.setdefault(namespace, tool_call_id)

    def tool_end(self, *, tool_run_id: str, error: BaseException | None = None) -> None:
        """The tool call LangChain runs as ``tool_run_id`` returned or raised
        ``error`` (its end or error callback): its row's ``finished_at`` and
        the end of its ``duration_ms``, written when the stream's
        tool-finished (or tool-error) comes (R-SUB-2), and the error's type
        (``metadata.error_type``, which the stream's tool-error does not
        carry). A run id :meth:`tool_request` was not given does nothing."""
        tool_call_id = self._tool_runs.pop(tool_run_id, None)
        if tool_call_id is not None:
            self._tool_ended.setdefault(tool_call_id, self.now())
            if error is not None:
                self._tool_error_types[tool_call_id] = type(error).__name__

    def tools_in_flight(self) -> bool:
        """Whether a tool's outcome is not recorded yet: it has started (its
        start callback) and not returned or raised, or it has and its row
        is not closed yet (the stream's tool-finished or tool-error not
        handled, or its write under way). A hand-over in that last window
        closed the row as interrupted although its outcome was known
        (R-RUN-15, R-EFF-1)."""
        return bool(self._tool_runs or self._tool_ended or self._tool_closing)

    def _on_lifecycle(self, data: dict) -> None:
        cause = data.get("cause") or {}
        namespace = tuple(data.get("namespace") or ())
        if data.get("event") == "started" and cause.get("type") == "toolCall" and namespace:
            if cause.get("tool_call_id"):
                self._spawned_by.setdefault(namespace, str(cause["tool_call_id"]))

    def parent_operation(self, namespace: list[str]) -> str | None:
        """The tool call id that spawned the graph running in ``namespace``
        — the innermost one, when a graph spawned by a tool call runs
        further subgraphs — or ``None`` (the root, or subgraphs no tool call
        spawned)."""
        for depth in range(len(namespace), 0, -1):
            spawner = self._spawned_by.get(tuple(namespace[:depth]))
            if spawner is not None:
                return spawner
        return None

    # -- model requests (LangChain callbacks: R-MA-10, R-RUN-12) -------------

    async def model_request(
        self,
        *,
        model_run_id: str,
        metadata: dict,
        started_at: dt.datetime | None = None,
        request: dict | None = None,
    ) -> None:
        """A model request is about to be sent (LangChain's chat-model start
        for ``model_run_id``): open its row under ``lc_run--<model run id>``,
        the id its message-start will carry, at the provisional sequence
        ``last_seq + 1`` (R-MA-10), started now (R-SUB-2). ``metadata`` is
        the callback metadata (``langgraph_checkpoint_ns`` gives the
        namespace); ``started_at`` (aware) when the request was sent, by
        default now — the callback runs when it is sent. ``request``: the
        request's fingerprint (:func:`~audit.execution.fingerprint.request_fingerprint`),
        kept on the row as ``metadata.request`` (R-REPLAY-2); None: none
        is kept. A second call for the same model run does nothing."""
        if not model_run_id or model_run_id in self._calls:
            return
        operation_id = request_operation_id(model_run_id)
        namespace = namespace_of_checkpoint(metadata.get("langgraph_checkpoint_ns") or "")
        started = self.now()
        if started_at is not None:
            started = Stamp(started_at, started.mono)
        call = _ModelCall(operation_id, self.last_seq + 1, started, namespace, streamed=False)
        self._calls[model_run_id] = call
        self.model_calls += 1
        row_metadata = {"namespace": namespace, "model_run_id": model_run_id}
        if metadata.get("langgraph_node"):
            row_metadata["node"] = metadata["langgraph_node"]
        if metadata.get("lc_agent_name"):
            row_metadata["agent_name"] = metadata["lc_agent_name"]
        if request is not None:
            row_metadata["request"] = request
        await write_with_retry(
            ledger.model_call_open,
            lease=self._lease,
            budget_user_id=self._budget_user_id,
            returning=False,
            operation_id=operation_id,
            sequence=call.sequence,
            started_at=call.started.at,
            metadata=row_metadata,
            namespace=namespace,
            parent_operation_id=self.parent_operation(namespace),
        )
        if self.text_watch is not None and not namespace:
            await self.text_watch(operation_id, 0)

    async def model_retry(self, *, model_run_id: str, failure: dict) -> None:
        """Attempt ``failure["attempt"]`` of the request failed before its
        first chunk and is sent again (R-RUN-12): count it on the row."""
        call = self._calls.get(model_run_id)
        if call is None or call.streamed:
            return
        await write_with_retry(
            ledger.model_call_retry, lease=self._lease, operation_id=call.operation_id, failure=to_jsonable(failure)
        )

    def model_end(self, *, model_run_id: str, message_id: str | None) -> None:
        """The model call returned (LangChain's ``on_llm_end``): its row's
        ``finished_at`` and the end of its ``duration_ms``, written when the
        stream's message-finish comes, unless that came first (R-SUB-2).
        When it never streamed, its whole message comes on the stream under
        ``message_id`` and maybe without a run id (PROTOCOL.md §4, capture
        h): remember whose it is, so the row opened at request start is the
        one it closes."""
        call = self._calls.get(model_run_id)
        if call is None:
            return
        if call.ended is None:
            call.ended = self.now()
        if not call.streamed and message_id:
            self._whole_message_runs[message_id] = model_run_id

    def model_error(self, *, model_run_id: str, error: BaseException) -> None:
        """The model call ended with ``error`` (before or after its first
        chunk). Kept in memory for the terminal transaction, which closes
        the row ``failed`` with it (:meth:`cut_calls`). A cancellation is
        not an error: the run's terminal closes the row ``interrupted``."""
        call = self._calls.get(model_run_id)
        if call is None or call.finished or not isinstance(error, Exception):
            return
        call.ended = self.now()
        kind = getattr(error, "audit_error_type", None)
        call.error = f"{kind + ': ' if kind else ''}{type(error).__name__}: {error}"[:2000]
        call.error_type = kind or type(error).__name__

    # -- model calls -------------------------------------------------------

    async def _on_protocol_message(self, event: dict, payload: dict, meta: dict, namespace: list[str]) -> None:
        kind = payload.get("event")
        model_run_id = str(meta.get("run_id") or "")
        if kind == "message-start":
            if payload.get("role", "ai") != "ai":
                return
            operation_id = payload.get("id") or model_run_id
            if not operation_id:
                raise AuditConflict(
                    "message-start carries neither an id nor a model run id", extra={"reason": "no_operation_key"}
                )
            await self._start(event, operation_id, model_run_id, namespace, meta)
            return
        call = self._calls.get(model_run_id)
        if call is None or call.finished:
            return
        if kind == "content-block-delta":
            delta = payload.get("delta") or {}
            if delta.get("type") == "text-delta":
                call.text_deltas.setdefault(payload.get("index", 0), []).append(delta.get("text") or "")
                if self.text_watch is not None and not namespace:
                    streamed = sum(len(text) for texts in call.text_deltas.values() for text in texts)
                    await self.text_watch(call.operation_id, streamed)
                if self._publish and not namespace:
                    await self._publish(
                        "model.delta", {"operation_id": call.operation_id, "text": delta.get("text") or ""}
                    )
        elif kind == "content-block-finish":
            call.finished_blocks[payload.get("index", 0)] = payload.get("content") or {}
        elif kind == "message-finish":
            await self._finish(event, call, payload)

    async def _start(
        self,
        event: dict,
        operation_id: str,
        model_run_id: str,
        namespace: list[str],
        meta: dict,
        *,
        whole_message: bool = False,
    ) -> None:
        sequence = event["seq"]
        # One lifecycle is one LangChain model run; a payload without a run
        # id (a whole message from a model that does not stream) is its own
        # lifecycle under its operation id.
        lifecycle = model_run_id or operation_id
        known = self._calls.get(lifecycle)
        opened_as = None
        if known is not None and not known.streamed:
            # Opened at request start (R-MA-10): this start gives the real
            # sequence. Only a whole message (a model that does not stream)
            # may carry another id than the request's: the row is re-keyed.
            if known.operation_id != operation_id:
                if not whole_message:
                    raise AuditConflict(
                        f"message-start of model call {model_run_id} carries {operation_id}, "
                        f"not the request's {known.operation_id}",
                        extra={"reason": "operation_key_changed"},
                    )
                opened_as, known.operation_id = known.operation_id, operation_id
            known.sequence, known.streamed, known.namespace = sequence, True, namespace
        elif known is not None:
            if known.operation_id != operation_id:
                raise AuditConflict(
                    f"model call {model_run_id} changed its key from {known.operation_id} to {operation_id}",
                    extra={"reason": "operation_key_changed"},
                )
            if known.sequence != sequence:
                raise AuditConflict(
                    f"operation {operation_id} started again at sequence {sequence} (first {known.sequence})",
                    extra={"reason": "sequence_conflict"},
                )
            # A replayed start: keep what this process aggregated and the
            # original start; the database write is idempotent.
        else:
            # No request callback opened it: message-start is its start.
            self._calls[lifecycle] = _ModelCall(operation_id, sequence, self._pulled(event), namespace)
            self.model_calls += 1
        metadata = {"namespace": namespace, "model_run_id": model_run_id}
        if meta.get("langgraph_node"):
            metadata["node"] = meta["langgraph_node"]
        if meta.get("lc_agent_name"):
            metadata["agent_name"] = meta["lc_agent_name"]
        await write_with_retry(
            ledger.model_call_start,
            lease=self._lease,
            returning=False,
            operation_id=operation_id,
            sequence=sequence,
            # A row opened at request start keeps its request time.
            started_at=self._calls[lifecycle].started.at,
            metadata=metadata,
            namespace=namespace,
            parent_operation_id=self.parent_operation(namespace),
            **({"opened_as": opened_as} if opened_as else {}),
        )
        if self._publish and not namespace:
            await self._publish("model.started", {"operation_id": operation_id})

    async def _finish(self, event: dict, call: _ModelCall, payload: dict) -> None:
        content, tool_calls = _content_of(call)
        # on_llm_end's stamp; the pull time when the worker read the
        # message-finish before that callback ran (it was then not lagging).
        ended = call.ended or self._pulled(event)
        for tool_call in tool_calls:
            if tool_call.get("id"):
                self._declared_by[tool_call["id"]] = call.operation_id
        response_metadata = payload.get("metadata") or {}
        metadata = {k: v for k, v in response_metadata.items() if k in _FINISH_METADATA}
        await write_with_retry(
            ledger.model_call_finish,
            lease=self._lease,
            returning=False,
            operation_id=call.operation_id,
            content=content,
            tool_calls=tool_calls,
            usage=to_jsonable(payload.get("usage")) if payload.get("usage") else None,
            # Why the usage is unknown, when the chat model knows (R-MA-12).
            usage_cause=str(response_metadata.get("usage_cause") or "") or None,
            finished_at=ended.at,
            duration_ms=round((ended.mono - call.started.mono) * 1000),
            metadata=metadata,
        )
        call.finished = True
        if self._publish and not call.namespace:
            await self._publish(
                "model.finished",
                {"operation_id": call.operation_id, "tool_calls": tool_calls, "usage": payload.get("usage")},
            )

    async def _on_whole_message(self, event: dict, message: BaseMessage, meta: dict, namespace: list[str]) -> None:
        """A model that does not stream sends the whole message, with no
        start/finish (PROTOCOL.md §4): record it as one completed row."""
        if message.type not in ("ai", "AIMessageChunk"):
            return
        model_run_id = str(meta.get("run_id") or "") or self._whole_message_runs.get(message.id or "", "")
        operation_id = message.id or model_run_id
        if not operation_id:
            raise AuditConflict(
                "a whole model message carries neither a message id nor a model run id",
                extra={"reason": "no_operation_key"},
            )
        lifecycle = model_run_id or operation_id
        if lifecycle in self._calls and self._calls[lifecycle].finished:
            return
        await self._start(event, operation_id, model_run_id, namespace, meta, whole_message=True)
        call = self._calls[lifecycle]
        call.finished_blocks = {0: {"type": "text", "text": message_text(message.content)}}
        for i, tc in enumerate(getattr(message, "tool_calls", None) or [], start=1):
            call.finished_blocks[i] = {
                "type": "tool_call",
                "id": tc.get("id"),
                "name": tc.get("name"),
                "args": tc.get("args"),
            }
        usage = getattr(message, "usage_metadata", None)
        await self._finish(
            event, call, {"usage": dict(usage) if usage else None, "metadata": message.response_metadata}
        )

    # -- tools ---------------------------------------------------------------

    async def _on_tool(self, event: dict, data: dict, namespace: list[str]) -> None:
        kind = data.get("event")
        tool_call_id = data.get("tool_call_id")
        if not tool_call_id:
            return
        if kind == "tool-started":
            # The start callback's stamp; the pull time without one.
            started = self._tool_started.get(tool_call_id)
            if started is None:
                started = self._tool_started[tool_call_id] = self._pulled(event)
            self.tool_calls += 1
            await write_with_retry(
                ledger.tool_call_start,
                lease=self._lease,
                returning=False,
                tool_call_id=tool_call_id,
                tool_name=data.get("tool_name") or "",
                tool_input=to_jsonable(data.get("input")),
                sequence=event["seq"],
                started_at=started.at,
                declared_by_operation_id=self._declared_by.get(tool_call_id),
                metadata={"namespace": namespace},
                namespace=namespace,
                parent_operation_id=self.parent_operation(namespace),
            )
            if self._publish and not namespace:
                await self._publish("tool.started", {"tool_call_id": tool_call_id, "tool_name": data.get("tool_name")})
        elif kind == "tool-finished":
            output = data.get("output")
            # A tool that returns a Command (deepagents' task: the subagent's
            # answer) puts its ToolMessage in the update: that message is
            # the projected result; the Command is the raw output.
            message = _tool_message_of(output, tool_call_id)
            status = "failed" if getattr(message, "status", None) == "error" else "completed"
            content = message_text(getattr(message, "content", message if isinstance(message, str) else ""))
            self._tool_closing.add(tool_call_id)
            ended = self._tool_ended.pop(tool_call_id, None) or self._pulled(event)
            started = self._tool_started.get(tool_call_id, ended)
            await write_with_retry(
                ledger.tool_call_finish,
                lease=self._lease,
                returning=False,
                tool_call_id=tool_call_id,
                status=status,
                content=content,
                raw_output=to_jsonable(output) if output is not None else None,
                finished_at=ended.at,
                duration_ms=round((ended.mono - started.mono) * 1000),
            )
            self._tool_closing.discard(tool_call_id)
            if self._publish and not namespace:
                await self._publish("tool.finished", {"tool_call_id": tool_call_id, "status": status})
        elif kind == "tool-error":
            # The row stays running until the terminal closes it (R-TA-3),
            # with the time the tool raised (R-SUB-2).
            self._tool_closing.add(tool_call_id)
            ended = self._tool_ended.pop(tool_call_id, None) or self._pulled(event)
            started = self._tool_started.get(tool_call_id, ended)
            await write_with_retry(
                ledger.tool_call_error,
                lease=self._lease,
                returning=False,
                tool_call_id=tool_call_id,
                error=str(data.get("message") or ""),
                error_type=self._tool_error_types.pop(tool_call_id, None),
                finished_at=ended.at,
                duration_ms=round((ended.mono - started.mono) * 1000),
            )
            self._tool_closing.discard(tool_call_id)
            if self._publish and not namespace:
                await self._publish("tool.error", {"tool_call_id": tool_call_id})

    # -- final State -----------------------------------------------------------

    def final_state(self) -> list[StateMessage]:
        """The last root values' messages as :class:`StateMessage` items."""
        messages = (self.last_values or {}).get("messages") if isinstance(self.last_values, dict) else None
        return [state_message(m) for m in messages or [] if isinstance(m, BaseMessage)]

    def partial_contents(self) -> dict[str, str]:
        """``{operation_id: text}`` streamed so far by the model calls that
        started but never finished (cut off by a cancel or an error)."""
        return {
            call.operation_id: _content_of(call)[0]
            for call in self._calls.values()
            if not call.finished and call.text_deltas
        }

    def cut_calls(self) -> dict[str, dict]:
        """``{operation_id: {"duration_ms", "error", "error_type", "finished_at"}}`` of the
        model calls that started (at request start or message-start) but
        never finished: their monotonic duration until they ended (the
        model's end or error callback), or until now (a cancel, or the run
        ended around them); ``error`` as :meth:`model_error` recorded it,
        else None (R-MA-10); ``finished_at`` when they ended (an aware
        datetime), else None (R-SUB-2)."""
        now = self._clock()
        return {
            call.operation_id: {
                "duration_ms": round(((call.ended.mono if call.ended else now) - call.started.mono) * 1000),
                "error": call.error,
                "error_type": call.error_type,
                "finished_at": call.ended.at if call.ended else None,
            }
            for call in self._calls.values()
            if not call.finished
        }

    def interrupt_payloads(self) -> list[dict]:
        return [to_jsonable(i) for i in self.interrupts]


def _tool_message_of(output: Any, tool_call_id: str) -> Any:
    """The ToolMessage a tool's output carries for ``tool_call_id``: the
    output itself, or the one in a ``Command``'s ``update["messages"]``
    (deepagents' ``task`` returns one, PROTOCOL.md §4 capture k)."""
    update = getattr(output, "update", None) if not isinstance(output, (str, BaseMessage)) else None
    if isinstance(update, dict):
        messages = update.get("messages") or []
        for message in reversed(messages if isinstance(messages, list) else []):
            if isinstance(message, ToolMessage) and message.tool_call_id == tool_call_id:
                return message
        return ""
    return output


_FINISH_METADATA = {"finish_reason", "model_name", "model_provider", "system_fingerprint", "response_id"}


def request_operation_id(model_run_id: str) -> str:
    """The operation id of a model call from its LangChain model run id:
    ``lc_run--<model run id>``, the id langchain-core gives the streamed
    message (``f"{LC_ID_PREFIX}-{run_id}"``, PROTOCOL.md §5) and hence the
    id of its message-start (R-MA-2, R-MA-10)."""
    return f"{LC_ID_PREFIX}-{model_run_id}"


def namespace_of_checkpoint(checkpoint_ns: str) -> list[str]:
    """The stream namespace of a model call from its callback metadata's
    ``langgraph_checkpoint_ns`` (``"tools:a9|model:81"`` → ``["tools:a9"]``:
    every segment but the model node's own)."""
    return [part for part in checkpoint_ns.split("|")[:-1] if part]


def _content_of(call: _ModelCall) -> tuple[str, list[dict]]:
    """Content text and tool-call declarations of a finished call: from the
    content-block-finish blocks when present, else from the text deltas."""
    if call.finished_blocks:
        text = "".join(
            str(block.get("text") or "")
            for _, block in sorted(call.finished_blocks.items())
            if block.get("type") == "text"
        )
        tool_calls = [
            {"id": block.get("id"), "name": block.get("name"), "args": to_jsonable(block.get("args") or {})}
            for _, block in sorted(call.finished_blocks.items())
            if block.get("type") == "tool_call"
        ]
        return text, tool_calls
    return "".join("".join(parts) for _, parts in sorted(call.text_deltas.items())), []


def state_message(message: BaseMessage) -> StateMessage:
    """Plain-data view of one State message for the terminal reconcile."""
    usage = getattr(message, "usage_metadata", None)
    return StateMessage(
        kind=message.type if message.type in ("ai", "tool", "human", "system") else message.type,
        id=message.id,
        content=message_text(message.content),
        tool_calls=[
            {"id": tc.get("id"), "name": tc.get("name"), "args": to_jsonable(tc.get("args") or {})}
            for tc in getattr(message, "tool_calls", None) or []
        ],
        tool_call_id=getattr(message, "tool_call_id", None),
        status=getattr(message, "status", None),
        usage=to_jsonable(dict(usage)) if usage else None,
    )
