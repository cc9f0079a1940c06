"""Runs with many audit rows for the admin and browser tests (R-ADM-1),
written with ``bulk_create``: the point is the reader on big tables, not
the write path (which ``tests/read`` and ``tests/e2e`` drive for real)."""

from __future__ import annotations

import datetime as dt
import uuid

from audit.models import AgentRun
from conversations.models import Message

STATUSES = ["completed", "running", "failed", "interrupted", "abandoned", "rejected"]


def big_run(
    thread, *, rows: int, status: str = AgentRun.Status.COMPLETED, start: dt.datetime | None = None
) -> AgentRun:
    """A run of ``thread`` with ``rows`` audit rows alternating model call /
    tool execution, cycling through the six execution statuses (``rejected``
    only on tool rows, which then never started). Sequence numbers are
    1..rows; the newest row has the highest sequence."""
    start = start or dt.datetime.now(dt.UTC) - dt.timedelta(minutes=10)
    terminal = status in AgentRun.TERMINAL_STATUSES
    run = AgentRun.objects.create(
        request_id=f"big-{uuid.uuid4().hex}",
        thread=thread,
        user=thread.user,
        agent_id=thread.agent_id,
        model=thread.model,
        status=status,
        started_at=start,
        finished_at=start + dt.timedelta(seconds=rows) if terminal else None,
        usage={"input_tokens": 10 * rows, "output_tokens": 5 * rows, "total_tokens": 15 * rows, "unknown_calls": 0},
        lease_owner=None if terminal else "worker-browser",
    )
    batch = []
    last_model: str | None = None
    for i in range(1, rows + 1):
        exec_status = STATUSES[(i // 2) % len(STATUSES)]
        is_tool = i % 2 == 0
        started = start + dt.timedelta(milliseconds=500 * i)
        if is_tool:
            op = f"call_{i}"
            never_started = exec_status == "rejected"
            closed = exec_status not in ("running", "rejected")
            batch.append(
                Message(
                    thread=thread,
                    run=run,
                    role=Message.Role.TOOL,
                    message_type=Message.Type.TOOL_AUDIT,
                    operation_id=op,
                    sequence=i,
                    execution_status=exec_status,
                    started_at=None if never_started else started,
                    finished_at=started + dt.timedelta(milliseconds=120) if closed else None,
                    duration_ms=120 if closed else None,
                    tool_name="get_weather",
                    tool_input={"city": f"City {i}"},
                    content=f"tool result {i}",
                    metadata={"raw_output": {"type": "tool", "tool_call_id": op, "content": f"raw envelope {i}"}}
                    | ({"source": "approval_rejected"} if never_started else {}),
                )
            )
        else:
            exec_status = "completed" if exec_status == "rejected" else exec_status
            closed = exec_status != "running"
            last_model = f"lc_run--{i}"
            batch.append(
                Message(
                    thread=thread,
                    run=run,
                    role=Message.Role.ASSISTANT,
                    message_type=Message.Type.MODEL_AUDIT,
                    operation_id=last_model,
                    sequence=i,
                    execution_status=exec_status,
                    started_at=started,
                    finished_at=started + dt.timedelta(milliseconds=400) if closed else None,
                    duration_ms=400 if closed else None,
                    usage={"input_tokens": 10, "output_tokens": 5, "total_tokens": 15} if closed else None,
                    content=f"model says {i}: " + "lorem ipsum " * 20,
                    tool_calls=[{"id": f"call_{i + 1}", "name": "get_weather", "args": {"city": f"City {i + 1}"}}],
                    metadata={"model_name": "replay-model"},
                )
            )
    Message.objects.bulk_create(batch, batch_size=2000)
    return run


# Text PostgreSQL cannot hold as given (R-RUN-11, R-RUN-13): a NUL, a lone
# surrogate, and a literal backslash escape that the stored form must tell
# apart from them.
AWKWARD = "Par\x00is \ud800 C:\\u0000 end"
# How the admin, the CSV and the OpenTelemetry spans show it
# (core.storable.visible).
AWKWARD_VISIBLE = "Par\\u0000is \\ud800 C:\\u005cu0000 end"


def awkward_run(thread, *, start: dt.datetime | None = None) -> AgentRun:
    """A completed run of ``thread`` whose title, input, tool input, tool
    output (and raw output envelope), tool error and model answer all hold
    :data:`AWKWARD`: a model call declaring ``lookup``, the call, a failed
    second call, and the final answer (the run's output message)."""
    start = start or dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    thread.title = AWKWARD
    thread.save(update_fields=["title"])
    run = AgentRun.objects.create(
        request_id=f"awkward-{uuid.uuid4().hex}",
        thread=thread,
        user=thread.user,
        agent_id=thread.agent_id,
        model=thread.model,
        input={"text": AWKWARD},
        status=AgentRun.Status.COMPLETED,
        started_at=start,
        finished_at=start + dt.timedelta(seconds=4),
        usage={"input_tokens": 20, "output_tokens": 10, "total_tokens": 30, "unknown_calls": 0},
    )

    def at(seconds: float) -> dt.datetime:
        return start + dt.timedelta(seconds=seconds)

    common = {"thread": thread, "run": run, "execution_status": Message.ExecutionStatus.COMPLETED}
    model = Message.objects.create(
        **common,
        role=Message.Role.ASSISTANT,
        message_type=Message.Type.MODEL_AUDIT,
        operation_id="lc_run--awkward-1",
        sequence=1,
        started_at=at(0.1),
        finished_at=at(0.5),
        duration_ms=400,
        usage={"input_tokens": 10, "output_tokens": 5, "total_tokens": 15},
        content=AWKWARD,
        tool_calls=[
            {"id": "call_awkward_1", "name": "lookup", "args": {"query": AWKWARD}},
            {"id": "call_awkward_2", "name": "lookup", "args": {"query": AWKWARD}},
        ],
        metadata={"model_name": "replay-model"},
    )
    tool = {**common, "role": Message.Role.TOOL, "message_type": Message.Type.TOOL_AUDIT, "declared_by": model}
    Message.objects.create(
        **tool,
        operation_id="call_awkward_1",
        sequence=2,
        started_at=at(1),
        finished_at=at(1.2),
        duration_ms=200,
        tool_name="lookup",
        tool_input={"query": AWKWARD},
        content=AWKWARD,
        metadata={"raw_output": {"type": "tool", "tool_call_id": "call_awkward_1", "content": AWKWARD}},
    )
    Message.objects.create(
        **(tool | {"execution_status": Message.ExecutionStatus.FAILED}),
        operation_id="call_awkward_2",
        sequence=3,
        started_at=at(1.5),
        finished_at=at(1.6),
        duration_ms=100,
        tool_name="lookup",
        tool_input={"query": AWKWARD},
        content=AWKWARD,
        metadata={"error_type": "tool_error", "tool_error": AWKWARD},
    )
    answer = Message.objects.create(
        **common,
        role=Message.Role.ASSISTANT,
        message_type=Message.Type.MODEL_AUDIT,
        operation_id="lc_run--awkward-2",
        sequence=4,
        started_at=at(2),
        finished_at=at(3),
        duration_ms=1000,
        usage={"input_tokens": 10, "output_tokens": 5, "total_tokens": 15},
        content=AWKWARD,
        metadata={"model_name": "replay-model", "finish_reason": "stop"},
    )
    AgentRun.objects.filter(pk=run.pk).update(output_message=answer)
    run.output_message = answer
    return run


BIG_RESULT = 1_000_000


def big_result_run(thread, *, results: int = 1) -> tuple[AgentRun, list[Message]]:
    """A completed run whose ``results`` tool calls each returned a
    1,000,000-character result (kept twice: content and raw output)."""
    start = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    run = AgentRun.objects.create(
        request_id=f"big-result-{uuid.uuid4().hex}",
        thread=thread,
        user=thread.user,
        agent_id=thread.agent_id,
        model=thread.model,
        status=AgentRun.Status.COMPLETED,
        started_at=start,
        finished_at=start + dt.timedelta(seconds=10),
    )
    rows = []
    for i in range(results):
        text = f"result {i} <&> " + "x" * (BIG_RESULT - 20) + "THE END"
        op = f"call_big_{i}"
        rows.append(
            Message.objects.create(
                thread=thread,
                run=run,
                role=Message.Role.TOOL,
                message_type=Message.Type.TOOL_AUDIT,
                operation_id=op,
                sequence=i + 1,
                execution_status=Message.ExecutionStatus.COMPLETED,
                started_at=start + dt.timedelta(seconds=i),
                finished_at=start + dt.timedelta(seconds=i, milliseconds=500),
                duration_ms=500,
                tool_name="fetch_page",
                tool_input={"url": "https://example.com/" + "p" * 3000},
                content=text,
                metadata={"raw_output": {"type": "tool", "tool_call_id": op, "content": text}},
            )
        )
    return run, rows
