"""The lifecycle recorder: turns LangGraph v3 protocol events into audit
writes (one component, fed by the stream; see shared/protocol/PROTOCOL.md).

It keeps per-call state in memory (aggregated text, monotonic start) and
calls an :class:`AuditSink` at the lifecycle boundaries only —
message-start, message-finish, tool-started, tool-finished, tool-error —
never per token (R-MA-4, R-RUN-5). Every sink call is awaited before the
next event is consumed: no fire-and-forget writes.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from langchain_core.messages import BaseMessage

from .errors import AuditConflict
from .jsonable import message_text, to_jsonable
from .services.terminal import StateMessage


class AuditSink(Protocol):
    """Where the recorder's facts go. The worker's sink writes them through
    the lease-checking services (``audit.runner``)."""

    async def model_start(
        self, *, operation_id: str, sequence: int, started_at: dt.datetime, metadata: dict
    ) -> None: ...

    async def model_finish(
        self,
        *,
        operation_id: str,
        content: str,
        tool_calls: list[dict],
        usage: dict | None,
        finished_at: dt.datetime,
        duration_ms: int,
        metadata: dict,
    ) -> None: ...

    async def tool_start(
        self,
        *,
        tool_call_id: str,
        tool_name: str,
        tool_input: Any,
        sequence: int,
        started_at: dt.datetime,
        declared_by_operation_id: str | None,
        metadata: dict,
    ) -> None: ...

    async def tool_finish(
        self,
        *,
        tool_call_id: str,
        status: str,
        content: str,
        raw_output: dict | None,
        finished_at: dt.datetime,
        duration_ms: int,
    ) -> None: ...

    async def tool_error(self, *, tool_call_id: str, error: str) -> None: ...


Publish = Callable[[str, dict], Awaitable[None]]


@dataclass
class _ModelCall:
    operation_id: str
    sequence: int
    started_mono: float
    namespace: list[str]
    text_deltas: dict[int, list[str]] = field(default_factory=dict)
    finished_blocks: dict[int, dict] = field(default_factory=dict)
    finished: bool = False


def event_time(event: dict) -> dt.datetime:
    """The event's wall clock (``params.timestamp``, ms) as an aware datetime.
    It is pull time, for display only; ``seq`` orders (PROTOCOL.md §5)."""
    millis = event.get("params", {}).get("timestamp")
    if millis is None:
        return dt.datetime.now(dt.UTC)
    return dt.datetime.fromtimestamp(millis / 1000, tz=dt.UTC)


class LifecycleRecorder:
    """Feed it every raw v3 event with :meth:`handle`, in stream order.

    After the stream ends, :attr:`last_values` is the last root ``values``
    payload (the final State) and :attr:`interrupts` its interrupts.

    Raises :class:`AuditConflict` from :meth:`handle` when the stream
    contradicts itself (a key change inside one lifecycle, the same key at
    another sequence: R-MA-3); whatever the sink raises passes through.
    """

    def __init__(self, sink: AuditSink, *, publish: Publish | None = None, clock: Callable[[], float] = time.monotonic):
        self._sink = sink
        self._publish = publish
        self._clock = clock
        self._calls: dict[str, _ModelCall] = {}  # by LangChain model run id
        self._declared_by: dict[str, str] = {}  # tool_call_id -> model operation id
        self._tool_started: dict[str, float] = {}
        self.last_values: dict | None = None
        self.interrupts: tuple = ()
        self.model_calls = 0
        self.tool_calls = 0

    async def handle(self, event: dict) -> None:
        method = event.get("method")
        params = event.get("params") or {}
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
            self.last_values = params.get("data")
            self.interrupts = tuple(params.get("interrupts") or ())

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
                if self._publish and not namespace:
                    await self._publish(
                        "model.delta", {"operation_id": call.operation_id, "text": delta.get("text") or ""}
                    )
        elif kind == "content-block-finish":
            call.finished_blocks[payload.get("index", 0)] = payload.get("content") or {}
        elif kind == "message-finish":
            await self._finish(event, call, payload)

    async def _start(self, event: dict, operation_id: str, model_run_id: str, namespace: list[str], meta: dict) -> None:
        sequence = event["seq"]
        # One lifecycle is one LangChain model run; a payload without a run
        # id (a whole message from a model that does not stream) is its own
        # lifecycle under its operation id.
        lifecycle = model_run_id or operation_id
        known = self._calls.get(lifecycle)
        if known is not None:
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
            # original monotonic start; the database write is idempotent.
        else:
            self._calls[lifecycle] = _ModelCall(operation_id, sequence, self._clock(), namespace)
            self.model_calls += 1
        metadata = {"namespace": namespace, "model_run_id": model_run_id}
        if meta.get("langgraph_node"):
            metadata["node"] = meta["langgraph_node"]
        if meta.get("lc_agent_name"):
            metadata["agent_name"] = meta["lc_agent_name"]
        await self._sink.model_start(
            operation_id=operation_id, sequence=sequence, started_at=event_time(event), metadata=metadata
        )
        if self._publish and not namespace:
            await self._publish("model.started", {"operation_id": operation_id})

    async def _finish(self, event: dict, call: _ModelCall, payload: dict) -> None:
        content, tool_calls = _content_of(call)
        for tool_call in tool_calls:
            if tool_call.get("id"):
                self._declared_by[tool_call["id"]] = call.operation_id
        metadata = {k: v for k, v in (payload.get("metadata") or {}).items() if k in _FINISH_METADATA}
        await self._sink.model_finish(
            operation_id=call.operation_id,
            content=content,
            tool_calls=tool_calls,
            usage=to_jsonable(payload.get("usage")) if payload.get("usage") else None,
            finished_at=event_time(event),
            duration_ms=round((self._clock() - call.started_mono) * 1000),
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
        model_run_id = str(meta.get("run_id") or "")
        operation_id = message.id or model_run_id
        if not operation_id:
            raise AuditConflict(
                "a whole model message carries neither a message id nor a model run id",
                extra={"reason": "no_operation_key"},
            )
        lifecycle = model_run_id or operation_id
        if lifecycle in self._calls and self._calls[lifecycle].finished:
            return
        await self._start(event, operation_id, model_run_id, namespace, meta)
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
            self._tool_started.setdefault(tool_call_id, self._clock())
            self.tool_calls += 1
            await self._sink.tool_start(
                tool_call_id=tool_call_id,
                tool_name=data.get("tool_name") or "",
                tool_input=to_jsonable(data.get("input")),
                sequence=event["seq"],
                started_at=event_time(event),
                declared_by_operation_id=self._declared_by.get(tool_call_id),
                metadata={"namespace": namespace},
            )
            if self._publish and not namespace:
                await self._publish("tool.started", {"tool_call_id": tool_call_id, "tool_name": data.get("tool_name")})
        elif kind == "tool-finished":
            output = data.get("output")
            status = "failed" if getattr(output, "status", None) == "error" else "completed"
            content = message_text(getattr(output, "content", output if isinstance(output, str) else ""))
            started = self._tool_started.get(tool_call_id, self._clock())
            await self._sink.tool_finish(
                tool_call_id=tool_call_id,
                status=status,
                content=content,
                raw_output=to_jsonable(output) if output is not None else None,
                finished_at=event_time(event),
                duration_ms=round((self._clock() - started) * 1000),
            )
            if self._publish and not namespace:
                await self._publish("tool.finished", {"tool_call_id": tool_call_id, "status": status})
        elif kind == "tool-error":
            await self._sink.tool_error(tool_call_id=tool_call_id, error=str(data.get("message") or ""))
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

    def interrupt_payloads(self) -> list[dict]:
        return [to_jsonable(i) for i in self.interrupts]


_FINISH_METADATA = {"finish_reason", "model_name", "model_provider", "system_fingerprint"}


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
