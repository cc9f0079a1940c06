"""Audit rows as OpenTelemetry spans, following the GenAI semantic
conventions (R-OTEL-1).

One closed run becomes one trace:

* ``invoke_agent {agent}`` — the run (start: ``started_at``, or
  ``created_at`` for a run that never started; end: ``finished_at``), its
  status from the run's terminal status;
* ``chat {model}`` — one per model row, child of the run span;
* ``execute_tool {tool}`` — one per tool row, child of the run span, with a
  link to the ``chat`` span of the model call that declared it (that call
  may be in another run: a resume executes what its interrupted run
  declared);
* a subagent's ``chat`` and ``execute_tool`` spans (R-SUB-1) are children
  of the ``execute_tool task`` span that spawned them, and carry
  ``yuxi.namespace`` and ``yuxi.parent_operation_id``.

Ids are derived from the database, never drawn at random, so exporting the
same run again yields the same spans: the trace id is the run's UUID, the
run span's id and each row span's id are the first 8 bytes of a SHA-256 of
the run id or row id.

How the spans are made: with the SDK's own tracing pipeline — a private
:class:`~opentelemetry.sdk.trace.TracerProvider` (never the global one, so
an application's own tracing, e.g. Langfuse, is untouched) whose
:class:`~opentelemetry.sdk.trace.id_generator.IdGenerator` hands out the
derived ids, ``start_span(start_time=…)``/``end(end_time=…)`` with the
rows' timestamps, and a span processor that collects the finished
:class:`~opentelemetry.sdk.trace.ReadableSpan` objects for the exporter.
The SDK documents ``ReadableSpan`` as made by its tracer only; going through
the tracer also applies its attribute checks and limits.

Message content and tool payloads are attributes only when ``content`` is
on (setting ``OTEL_EXPORT_CONTENT``); every payload string longer than
``max_chars`` is cut and ends with a ``…[truncated N of M chars]`` marker.
A ``chat`` span's input messages are rebuilt from the run's rows
(:class:`_Conversation`, R-OTEL-2): the audit stores no request.

Text PostgreSQL cannot hold (a NUL, a lone surrogate, R-RUN-11) is in the
spans as the admin shows it (R-RUN-13): every span name, string attribute
(and string in a list attribute), status description, and every string
inside a JSON-valued attribute goes through :func:`span_text`, which puts
it in :func:`core.storable.visible`'s escaped form after any cut. A lone
surrogate has no UTF-8 encoding: one used to make the whole OTLP request
unencodable, so the pass failed on that run, every pass after it too, and
the cursor never moved past it.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from audit.models import AgentRun
from conversations.models import Message
from core.storable import visible

SERVICE_NAME = "yuxi-agent-audit"
SCOPE_NAME = "yuxi.audit.export"

# Attributes whose value is JSON text made by `_json`: their strings are
# already in span form, and escaping the JSON text again would escape the
# escapes.
_JSON_ATTRIBUTES = frozenset(
    {"gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.tool.call.arguments", "yuxi.run.input"}
)
# Longest span status description (characters).
STATUS_CHARS = 1000

# Run statuses and row execution statuses that end a span in error.
_RUN_ERRORS = {AgentRun.Status.FAILED, AgentRun.Status.CANCELLED}
_ROW_ERRORS = {
    Message.ExecutionStatus.FAILED,
    Message.ExecutionStatus.ABANDONED,
    Message.ExecutionStatus.REJECTED,
}


class SdkDisabled(RuntimeError):
    """``OTEL_SDK_DISABLED=true``: the SDK makes no spans."""


# --------------------------------------------------------------------------
# Deterministic ids
# --------------------------------------------------------------------------


def trace_id_of(run_id: uuid.UUID) -> int:
    """The trace id of a run: its UUID as a 128-bit integer."""
    return run_id.int or 1


def run_span_id(run_id: uuid.UUID) -> int:
    """The 64-bit span id of a run's ``invoke_agent`` span."""
    return _span_id(b"yuxi.run:" + run_id.bytes)


def row_span_id(row_id: int) -> int:
    """The 64-bit span id of an audit row's ``chat``/``execute_tool`` span."""
    return _span_id(b"yuxi.row:" + str(row_id).encode())


def _span_id(seed: bytes) -> int:
    # A span id of 0 is invalid; a digest whose first 8 bytes are zero is
    # vanishingly rare, but never emit one.
    return int.from_bytes(hashlib.sha256(seed).digest()[:8], "big") or 1


class _GivenIds(IdGenerator):
    """Hands out the ids set by :meth:`SpanFactory._span` for the next span."""

    def __init__(self) -> None:
        self.trace_id = 0
        self.span_id = 0

    def generate_trace_id(self) -> int:
        return self.trace_id

    def generate_span_id(self) -> int:
        return self.span_id


class _Collect(SpanProcessor):
    def __init__(self) -> None:
        self.finished: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.finished.append(span)


# --------------------------------------------------------------------------
# Payloads
# --------------------------------------------------------------------------


def truncate(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` characters plus a marker saying how much
    was cut; shorter text unchanged."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}…[truncated {len(text) - max_chars} of {len(text)} chars]"


def span_text(text: str, max_chars: int | None = None) -> str:
    """``text`` as a span carries it (R-RUN-13): cut to ``max_chars``
    characters by :func:`truncate` when given, then in the escaped form the
    admin shows (:func:`core.storable.visible`: each NUL and lone surrogate
    as its six-character escape, ``\\u0000``, ``\\ud800``). Cutting first
    counts each such character as the one it is and never splits an escape;
    the result is always encodable as UTF-8, so no content can make an OTLP
    request unsendable. Apply it once: the escaped form is not escaped
    again."""
    if max_chars is not None:
        text = truncate(text, max_chars)
    return visible(text)


def _json(value: Any) -> str:
    """JSON text of ``value`` for a JSON-valued attribute
    (:data:`_JSON_ATTRIBUTES`), every string and key in :func:`span_text`
    form; a payload's strings are cut before this, the JSON text after."""
    return json.dumps(visible(value), ensure_ascii=False, default=_json_default, sort_keys=True)


def _json_default(value: Any) -> str:
    return span_text(str(value))


def _attribute(value: Any) -> Any:
    """A plain attribute value in span form: strings, and the strings of a
    list, through :func:`span_text`; numbers and booleans as they are."""
    if isinstance(value, str):
        return span_text(value)
    if isinstance(value, list | tuple):
        return [span_text(item) if isinstance(item, str) else item for item in value]
    return value


def _ns(moment: datetime | None) -> int | None:
    if moment is None:
        return None
    return int(moment.timestamp() * 1_000_000) * 1_000


def provider_and_model(model: str) -> tuple[str, str]:
    """``("replay", "plain_answer")`` for ``replay:plain_answer``."""
    provider, _, name = model.partition(":")
    return (provider, name) if name else ("", model)


# --------------------------------------------------------------------------
# Spans
# --------------------------------------------------------------------------


class SpanFactory:
    """Makes the spans of closed runs.

    Args:
        content: put message content and tool payloads into attributes.
        max_chars: longest payload string (characters) before truncation.

    Not thread-safe: one factory per export pass.

    Raises:
        SdkDisabled: ``OTEL_SDK_DISABLED`` is true.
    """

    def __init__(self, *, content: bool, max_chars: int) -> None:
        self.content = content
        self.max_chars = max_chars
        self._ids = _GivenIds()
        self._collect = _Collect()
        if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            # The SDK would hand out a no-op tracer: nothing to export.
            raise SdkDisabled("OTEL_SDK_DISABLED=true turns the OpenTelemetry SDK off; the export needs it")
        provider = TracerProvider(
            resource=Resource.create({"service.name": SERVICE_NAME}),
            id_generator=self._ids,
            # Every span of a closed run is exported, whatever sampler and
            # limits OTEL_TRACES_SAMPLER / OTEL_*_LIMIT set for the
            # application's own tracing; payloads are cut by `truncate`.
            sampler=ALWAYS_ON,
            span_limits=SpanLimits(
                max_span_attributes=128,
                max_links=128,
                max_events=0,
                max_link_attributes=16,
                max_span_attribute_length=SpanLimits.UNSET,
                max_attribute_length=SpanLimits.UNSET,
            ),
        )
        provider.add_span_processor(self._collect)
        self._tracer = provider.get_tracer(SCOPE_NAME)

    def run_spans(self, run: AgentRun, rows: Iterable[Message]) -> Iterator[ReadableSpan]:
        """The ``invoke_agent`` span of ``run`` then one span per audit row.

        Args:
            run: a terminal run (``thread`` and ``output_message`` may be
                prefetched).
            rows: the run's audit rows (``Message.objects.audit()``),
                annotated with ``declared_by_run_id`` (the run of the
                declaring model row, for the tool span's link); read
                lazily, in any order.
        """
        trace_id = trace_id_of(run.id)
        root = SpanContext(trace_id, run_span_id(run.id), is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
        yield self._run_span(run, trace_id)
        # A subagent's calls are children of the tool call that spawned it
        # (R-SUB-1); its key is only known once the run's tool rows are.
        waiting: list[tuple[Message, _InputMessages | None]] = []
        tool_rows: dict[str, int] = {}
        conversation = _Conversation(run, self.max_chars) if self.content else None
        for row in rows:
            # What a model call was sent is known only from the rows before
            # it, read in sequence order here (R-OTEL-2).
            sent = conversation.record(row) if conversation is not None else None
            if row.role == Message.Role.TOOL:
                tool_rows[row.operation_id] = row.pk
            if row.parent_operation_id:
                waiting.append((row, sent))
            else:
                yield self._row_span(run, row, root, sent)
        for row, sent in waiting:
            spawner = tool_rows.get(row.parent_operation_id)
            parent = (
                SpanContext(trace_id, row_span_id(spawner), is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
                if spawner is not None
                else root
            )
            yield self._row_span(run, row, parent, sent)

    def _row_span(self, run: AgentRun, row: Message, parent: SpanContext, sent: _InputMessages | None) -> ReadableSpan:
        if row.role == Message.Role.TOOL:
            return self._tool_span(run, row, parent)
        return self._model_span(run, row, parent, sent)

    # -- one span each ------------------------------------------------------

    def _run_span(self, run: AgentRun, trace_id: int) -> ReadableSpan:
        provider, model = provider_and_model(run.model)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": run.agent_id,
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model,
            "gen_ai.conversation.id": str(run.thread_id),
            "yuxi.run_id": str(run.id),
            "yuxi.thread_id": str(run.thread_id),
            "yuxi.turn_id": str(run.turn_id),
            "yuxi.run.status": run.status,
        }
        usage = run.usage or {}
        _set_usage(attributes, usage)
        if usage.get("unknown_calls"):
            attributes["yuxi.usage.unknown_calls"] = int(usage["unknown_calls"])
        _set_cost(attributes, run)
        links = []
        if run.resumed_from_id:
            attributes["yuxi.resumed_from"] = str(run.resumed_from_id)
            links.append(
                Link(
                    SpanContext(
                        trace_id_of(run.resumed_from_id),
                        run_span_id(run.resumed_from_id),
                        is_remote=True,
                        trace_flags=TraceFlags(TraceFlags.SAMPLED),
                    ),
                    {"yuxi.link": "resumes"},
                )
            )
        if self.content:
            text = (run.input or {}).get("text")
            if isinstance(text, str):
                attributes["gen_ai.input.messages"] = _json(
                    [{"role": "user", "parts": [{"type": "text", "content": truncate(text, self.max_chars)}]}]
                )
            elif run.input:
                attributes["yuxi.run.input"] = truncate(_json(run.input), self.max_chars)
            output = run.output_message
            if output is not None:
                attributes["gen_ai.output.messages"] = _json([self._output_message(output)])
        status = Status(StatusCode.OK)
        if run.status in _RUN_ERRORS:
            error_type = run.error_type or OTHER_ERROR
            attributes["error.type"] = error_type
            status = Status(StatusCode.ERROR, run.error_message or error_type)
        start = run.started_at or run.created_at
        return self._span(
            name=f"invoke_agent {run.agent_id}",
            trace_id=trace_id,
            span_id=run_span_id(run.id),
            parent=None,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            links=links,
            status=status,
            start=start,
            end=run.finished_at or start,
        )

    def _model_span(self, run: AgentRun, row: Message, root: SpanContext, sent: _InputMessages | None) -> ReadableSpan:
        provider, model = provider_and_model(run.model)
        metadata = row.metadata or {}
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model,
            "gen_ai.conversation.id": str(run.thread_id),
            **_row_ids(run, row),
        }
        if metadata.get("model_name"):
            attributes["gen_ai.response.model"] = str(metadata["model_name"])
        if metadata.get("finish_reason"):
            attributes["gen_ai.response.finish_reasons"] = [str(metadata["finish_reason"])]
        if metadata.get("response_id"):
            attributes["gen_ai.response.id"] = str(metadata["response_id"])
        if row.usage:
            _set_usage(attributes, row.usage)
        elif row.execution_status != Message.ExecutionStatus.COMPLETED:
            attributes["yuxi.usage.unknown"] = True
        _set_cost(attributes, row)
        if self.content:
            if sent is not None:
                attributes["gen_ai.input.messages"] = _json(sent.messages)
                attributes["yuxi.input.messages.omitted"] = sent.omitted
                if sent.dropped:
                    attributes["yuxi.input.messages.dropped"] = sent.dropped
            attributes["gen_ai.output.messages"] = _json([self._output_message(row)])
        return self._span(
            name=f"chat {model}",
            trace_id=root.trace_id,
            span_id=row_span_id(row.pk),
            parent=root,
            kind=SpanKind.CLIENT,
            attributes=attributes,
            links=[],
            status=self._row_status(row, attributes),
            start=row.started_at or row.created_at,
            end=row.finished_at,
        )

    def _tool_span(self, run: AgentRun, row: Message, root: SpanContext) -> ReadableSpan:
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": row.tool_name,
            "gen_ai.tool.call.id": row.operation_id,
            "gen_ai.tool.type": "function",
            "gen_ai.conversation.id": str(run.thread_id),
            **_row_ids(run, row),
        }
        if not row.started_at:
            # A call a reviewer rejected: declared, never executed (R-TA-5).
            attributes["yuxi.tool.executed"] = False
        links = []
        declared_by_run = getattr(row, "declared_by_run_id", None)
        if row.declared_by_id and declared_by_run:
            links.append(
                Link(
                    SpanContext(
                        trace_id_of(declared_by_run),
                        row_span_id(row.declared_by_id),
                        is_remote=declared_by_run != run.id,
                        trace_flags=TraceFlags(TraceFlags.SAMPLED),
                    ),
                    {"yuxi.link": "declared_by"},
                )
            )
        if self.content:
            if row.tool_input is not None:
                attributes["gen_ai.tool.call.arguments"] = truncate(_json(row.tool_input), self.max_chars)
            attributes["gen_ai.tool.call.result"] = truncate(row.content or "", self.max_chars)
        return self._span(
            name=f"execute_tool {row.tool_name}",
            trace_id=root.trace_id,
            span_id=row_span_id(row.pk),
            parent=root,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            links=links,
            status=self._row_status(row, attributes),
            start=row.started_at or row.finished_at or row.created_at,
            end=row.finished_at,
        )

    # -- helpers --------------------------------------------------------------

    def _output_message(self, row: Message) -> dict[str, Any]:
        """A model row's answer in the GenAI ``gen_ai.output.messages`` shape."""
        return output_message(row, self.max_chars)

    def _row_status(self, row: Message, attributes: dict[str, Any]) -> Status:
        if row.execution_status in _ROW_ERRORS:
            attributes["error.type"] = row_error_type(row)
            detail = (row.metadata or {}).get("tool_error") or row.execution_status
            return Status(StatusCode.ERROR, str(detail))
        if row.execution_status == Message.ExecutionStatus.COMPLETED:
            return Status(StatusCode.OK)
        return Status(StatusCode.UNSET)

    def _span(
        self,
        *,
        name: str,
        trace_id: int,
        span_id: int,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: dict[str, Any],
        links: list[Link],
        status: Status,
        start: datetime,
        end: datetime | None,
    ) -> ReadableSpan:
        start_ns = _ns(start)
        end_ns = max(_ns(end) or start_ns, start_ns)
        self._ids.trace_id = trace_id
        self._ids.span_id = span_id
        context = trace_api.set_span_in_context(trace_api.NonRecordingSpan(parent)) if parent else None
        # Every string of the span in span form, here in one place (R-RUN-13):
        # payloads were cut by their builders, on the original text.
        span = self._tracer.start_span(
            span_text(name),
            context=context,
            kind=kind,
            attributes={
                k: v if k in _JSON_ATTRIBUTES else _attribute(v) for k, v in attributes.items() if v is not None
            },
            links=links,
            start_time=start_ns,
        )
        if status.description:
            status = Status(status.status_code, span_text(status.description, STATUS_CHARS))
        span.set_status(status)
        span.end(end_time=end_ns)
        finished = self._collect.finished.pop()
        assert finished.context.span_id == span_id and finished.context.trace_id == trace_id
        return finished


def output_message(row: Message, max_chars: int) -> dict[str, Any]:
    """A model row's answer in the GenAI ``gen_ai.output.messages`` shape:
    its text and each tool call, every payload cut at ``max_chars``."""
    parts: list[dict[str, Any]] = []
    if row.content:
        parts.append({"type": "text", "content": truncate(row.content, max_chars)})
    for call in row.tool_calls or []:
        if not isinstance(call, dict):
            continue
        arguments = call.get("args")
        # Measured and cut as the original's JSON; `_json` escapes the cut text once.
        raw = json.dumps(arguments, ensure_ascii=False, default=str, sort_keys=True)
        if len(raw) > max_chars:
            arguments = truncate(raw, max_chars)
        parts.append({"type": "tool_call", "id": call.get("id"), "name": call.get("name"), "arguments": arguments})
    finish = (row.metadata or {}).get("finish_reason") or ("tool_call" if row.tool_calls else "stop")
    return {"role": "assistant", "parts": parts, "finish_reason": str(finish)}


# --------------------------------------------------------------------------
# Input messages, rebuilt from the rows (R-OTEL-2)
# --------------------------------------------------------------------------

#: How many times ``max_chars`` the text of one chat span's input messages
#: may hold in all; older messages of the run beyond it are dropped (and
#: counted), as each payload string is cut at ``max_chars``.
INPUT_BUDGET = 4

#: What a rebuilt ``gen_ai.input.messages`` never holds, as
#: ``yuxi.input.messages.omitted`` names it.
OMITTED_SYSTEM = "system_instructions"  # the agent's system prompt: never stored
OMITTED_EARLIER_RUNS = "earlier_runs"  # the thread's earlier turns, or the run a resume continues
OMITTED_SUBAGENT_INPUT = "subagent_input"  # a subagent's task, when its spawning call has no description


@dataclass
class _InputMessages:
    messages: list[dict[str, Any]]
    omitted: list[str]
    dropped: int


class _Conversation:
    """What each model call of one run was sent, rebuilt from the run's
    audit rows (R-OTEL-2, issue 37): the audit keeps a fingerprint of each
    request (``metadata.request``), never the request. A model call at the
    root was sent the turn's input (the run's ``input.text``) and, in
    sequence order, every earlier completed model answer of the run and
    every tool result; a subagent's call (R-SUB-1) its task (the
    ``description`` argument of the ``task`` call that spawned it) and the
    earlier rows of its own namespace. What the rows cannot tell is named in
    ``omitted``: the system prompt, the thread's earlier runs at the root
    (when it has any: the ``has_earlier_runs`` annotation of
    :func:`otel_export.selectors.closed_runs`; without it they are assumed),
    a subagent's task its spawning call does not give. Each payload string is cut at ``max_chars``; when the
    messages' text exceeds :data:`INPUT_BUDGET` × ``max_chars``, the oldest
    messages of the run are dropped first (the turn's input is kept) and
    their number given as ``dropped``."""

    def __init__(self, run: AgentRun, max_chars: int) -> None:
        self.max_chars = max_chars
        self.turn: list[dict[str, Any]] = []
        text = (run.input or {}).get("text")
        if isinstance(text, str):
            self.turn.append(_text_message("user", text, max_chars))
        self.omitted = [OMITTED_SYSTEM]
        if getattr(run, "has_earlier_runs", True):
            self.omitted.append(OMITTED_EARLIER_RUNS)
        # namespace (as a tuple) -> the messages so far, each with its text size
        self.history: dict[tuple, list[tuple[dict[str, Any], int]]] = {}
        # tool call id -> the task a subagent spawned by it starts from
        self.tasks: dict[str, dict[str, Any]] = {}

    def record(self, row: Message) -> _InputMessages | None:
        """Take ``row`` (the run's rows in sequence order); for a model row,
        return what its call was sent."""
        namespace = tuple(str(part) for part in row.namespace or ())
        history = self.history.setdefault(namespace, [])
        if row.role == Message.Role.TOOL:
            task = (row.tool_input or {}).get("description") if isinstance(row.tool_input, dict) else None
            if isinstance(task, str):
                self.tasks[row.operation_id] = _text_message("user", task, self.max_chars)
            message = {
                "role": "tool",
                "parts": [
                    {
                        "type": "tool_call_response",
                        "id": row.operation_id,
                        "response": truncate(row.content or "", self.max_chars),
                    }
                ],
            }
            history.append((message, min(len(row.content or ""), self.max_chars)))
            return None
        sent = self._sent(namespace, history, self.tasks.get(row.parent_operation_id or ""))
        if row.execution_status == Message.ExecutionStatus.COMPLETED:
            # A call that failed is asked again with the same messages: its
            # answer was never sent back.
            answer = output_message(row, self.max_chars)
            answer.pop("finish_reason", None)
            history.append((answer, _text_size(answer)))
        return sent

    def _sent(
        self, namespace: tuple, history: list[tuple[dict[str, Any], int]], task: dict[str, Any] | None
    ) -> _InputMessages:
        if not namespace:
            first, omitted = self.turn, list(self.omitted)
        else:
            # A subagent starts from its task alone, with a system prompt of
            # its own: nothing of the run's turn.
            first = [task] if task else []
            omitted = [OMITTED_SYSTEM] + ([] if task else [OMITTED_SUBAGENT_INPUT])
        budget = INPUT_BUDGET * self.max_chars - sum(_text_size(m) for m in first)
        kept: list[dict[str, Any]] = []
        for message, size in reversed(history):
            if kept and size > budget:
                break
            kept.append(message)
            budget -= size
        kept.reverse()
        return _InputMessages(messages=first + kept, omitted=omitted, dropped=len(history) - len(kept))


def _text_message(role: str, text: str, max_chars: int) -> dict[str, Any]:
    return {"role": role, "parts": [{"type": "text", "content": truncate(text, max_chars)}]}


def _text_size(message: dict[str, Any]) -> int:
    """Characters of a message's payloads, as cut."""
    size = 0
    for part in message["parts"]:
        for key in ("content", "response"):
            if isinstance(part.get(key), str):
                size += len(part[key])
        if "arguments" in part:
            arguments = part["arguments"]
            size += len(arguments) if isinstance(arguments, str) else len(json.dumps(arguments, default=str))
    return size


# The conventions' ``error.type`` when nothing more precise is known.
OTHER_ERROR = "_OTHER"


def row_error_type(row: Message) -> str:
    """``error.type`` of a row that did not complete (R-OTEL-2): the error's
    type, never the row's status. ``metadata.error_type`` (the exception's
    class a tool raised, or a model call's provider classification or
    exception class); for a model row written before it was kept, the
    type that leads its ``metadata.error`` (``"<type>: …"``); a tool that
    answered with an error message without raising: ``tool_error``; a
    call a reviewer rejected: ``rejected``; a row its run left behind:
    ``abandoned``; else ``_OTHER``."""
    metadata = row.metadata or {}
    if metadata.get("error_type"):
        return str(metadata["error_type"])
    if row.execution_status == Message.ExecutionStatus.REJECTED:
        return "rejected"
    if row.execution_status == Message.ExecutionStatus.ABANDONED:
        return "abandoned"
    leading = str(metadata.get("error") or "").partition(": ")[0]
    if leading.isidentifier():
        return leading
    if row.role == Message.Role.TOOL:
        return "tool_error"
    return OTHER_ERROR


def _row_ids(run: AgentRun, row: Message) -> dict[str, Any]:
    ids: dict[str, Any] = {
        "yuxi.run_id": str(run.id),
        "yuxi.thread_id": str(run.thread_id),
        "yuxi.operation_id": row.operation_id,
        "yuxi.row_id": row.pk,
        "yuxi.execution_status": row.execution_status or "",
    }
    if row.sequence is not None:
        ids["yuxi.sequence"] = row.sequence
    if row.namespace:
        ids["yuxi.namespace"] = [str(part) for part in row.namespace]
        if row.parent_operation_id:
            ids["yuxi.parent_operation_id"] = row.parent_operation_id
    return ids


def _set_usage(attributes: dict[str, Any], usage: dict[str, Any]) -> None:
    """GenAI usage attributes from the stored ``UsageMetadata`` shape (tokens)."""
    for key, attribute in (
        ("input_tokens", "gen_ai.usage.input_tokens"),
        ("output_tokens", "gen_ai.usage.output_tokens"),
    ):
        value = usage.get(key)
        if isinstance(value, int | float):
            attributes[attribute] = int(value)
    details = usage.get("input_token_details") or {}
    if isinstance(details, dict):
        for key, attribute in (
            ("cache_read", "gen_ai.usage.cache_read.input_tokens"),
            ("cache_creation", "gen_ai.usage.cache_creation.input_tokens"),
        ):
            if isinstance(details.get(key), int | float):
                attributes[attribute] = int(details[key])
    reasoning = (usage.get("output_token_details") or {}).get("reasoning")
    if isinstance(reasoning, int | float):
        attributes["gen_ai.usage.reasoning.output_tokens"] = int(reasoning)


def _set_cost(attributes: dict[str, Any], row: object) -> None:
    """``yuxi.cost_usd`` when the row carries a cost (R-COST-1 adds
    ``cost_usd``; absent or null, no attribute)."""
    cost = getattr(row, "cost_usd", None)
    if cost is not None:
        attributes["yuxi.cost_usd"] = float(cost)
