"""Audit timestamps are the lifecycle events' times, never the time a row
was written nor the time the worker read the stream: within one namespace
a row never starts before the rows whose results it consumed, in subagents
as at the root (R-SUB-2).

The worker awaits every audit write before it reads the next stream event,
so it reads a subagent's events well after they happened; a stream
event's ``params.timestamp`` is that read (PROTOCOL.md §5). Runs of the
real agents against the replay model server check the order of every
stored row; the recorder, fed with its own clocks, checks that each stamp
is the callback's (the event's) and never the read's or the write's."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections import defaultdict

import pytest

from audit import ledger
from audit.execution.recorder import LifecycleRecorder, request_operation_id
from audit.execution.runner import run_execute
from audit.ledger.terminal import StateMessage
from audit.models import AgentRun
from conversations.models import Conversation, Message
from tests.conftest import acquire, make_run

pytestmark = pytest.mark.django_db(transaction=True)


def _execute(user, agent_id: str, model: str, text: str) -> AgentRun:
    thread = Conversation.objects.create(user=user, agent_id=agent_id, model=model)
    run = make_run(thread, text=text)
    assert run_execute(run_id=run.id, owner="in-process") == "completed"
    return run


def _assert_rows_follow_what_they_consumed(run: AgentRun) -> dict[tuple[str, ...], list[Message]]:
    """Every row of ``run`` that started: it ends at or after its start; in
    its namespace, a model row starts at or after the end of every tool row
    before it in sequence (the results it answers from), and a tool row at
    or after the end of the model row that declared it. Returns the rows by
    namespace."""
    rows = list(Message.objects.audit().filter(run=run, started_at__isnull=False).order_by("sequence"))
    by_namespace: dict[tuple[str, ...], list[Message]] = defaultdict(list)
    for row in rows:
        assert row.finished_at is not None and row.finished_at >= row.started_at, row.operation_id
        by_namespace[tuple(row.namespace)].append(row)
    by_id = {row.id: row for row in rows}
    for namespace, in_order in by_namespace.items():
        for at, row in enumerate(in_order):
            if row.role == Message.Role.ASSISTANT:
                for earlier in in_order[:at]:
                    if earlier.role == Message.Role.TOOL:
                        assert row.started_at >= earlier.finished_at, (
                            f"{namespace}: model seq {row.sequence} started {row.started_at.time()} before "
                            f"tool seq {earlier.sequence} finished {earlier.finished_at.time()}"
                        )
            elif row.declared_by_id in by_id:
                declared_by = by_id[row.declared_by_id]
                assert row.started_at >= declared_by.finished_at, (
                    f"{namespace}: tool seq {row.sequence} started before model seq {declared_by.sequence} finished"
                )
    return by_namespace


def test_a_subagents_model_call_starts_after_the_lookups_it_answers_from_R_SUB_2(user, replay_models):
    run = _execute(user, "researcher", "replay:researcher_fact_check", "Check the retention policy")
    by_namespace = _assert_rows_follow_what_they_consumed(run)
    # The root (two model calls and the task) and the subagent (two model
    # calls and the two lookups between them) were both checked.
    assert sorted(len(rows) for rows in by_namespace.values()) == [3, 4]
    (subagent,) = (rows for namespace, rows in by_namespace.items() if namespace)
    assert [row.role for row in subagent] == ["assistant", "tool", "tool", "assistant"]
    # The task row spans its subagent's calls.
    task = by_namespace[()][1]
    assert task.tool_name == "task"
    assert task.started_at <= min(row.started_at for row in subagent)
    assert task.finished_at >= max(row.finished_at for row in subagent)


@pytest.mark.parametrize(
    "scenario",
    [
        "tool_then_answer",
        "parallel_tools_then_answer",
        "two_tools_then_answer",
        "tool_error_handled",
        # A bare tool-error (its arguments did not validate) whose error
        # ToolMessage the model answers from; the terminal closes the row.
        "tool_invalid_args",
    ],
)
def test_a_root_model_call_starts_after_the_tool_calls_it_answers_from_R_SUB_2(user, replay_models, scenario):
    run = _execute(user, "assistant", f"replay:{scenario}", "weather in Paris?")
    by_namespace = _assert_rows_follow_what_they_consumed(run)
    assert list(by_namespace) == [()]
    roles = {row.role for row in by_namespace[()]}
    assert roles == {Message.Role.ASSISTANT, Message.Role.TOOL}


# -- the recorder's stamps -------------------------------------------------

T0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)


class _Clocks:
    """Both clocks of a recorder, moved by the test: ``seconds`` after T0
    on the wall clock and on the monotonic one."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wall(self) -> dt.datetime:
        return T0 + dt.timedelta(seconds=self.seconds)

    def mono(self) -> float:
        return 1000.0 + self.seconds


def _event(seq: int, method: str, data, namespace: list[str], *, pulled_at: float) -> dict:
    """A raw v3 event the worker pulled ``pulled_at`` seconds after T0."""
    millis = round((T0 + dt.timedelta(seconds=pulled_at)).timestamp() * 1000)
    return {"seq": seq, "method": method, "params": {"namespace": namespace, "timestamp": millis, "data": data}}


def _model_events(seq: int, model_run_id: str, namespace: list[str], *, pulled_at: float, tool_call: str | None):
    meta = {"run_id": model_run_id}
    blocks = (
        [
            {
                "event": "content-block-finish",
                "index": 0,
                "content": {"type": "tool_call", "id": tool_call, "name": "lookup_docs", "args": {}},
            }
        ]
        if tool_call
        else [{"event": "content-block-finish", "index": 0, "content": {"type": "text", "text": "done"}}]
    )
    payloads = [
        {"event": "message-start", "role": "ai", "id": request_operation_id(model_run_id)},
        *blocks,
        {"event": "message-finish"},
    ]
    return [
        _event(seq + i, "messages", (payload, meta), namespace, pulled_at=pulled_at + i)
        for i, payload in enumerate(payloads)
    ]


@pytest.mark.parametrize("namespace", [[], ["tools:sub-1"]], ids=["root", "subagent"])
def test_rows_take_the_callbacks_times_not_the_pull_nor_the_write_time_R_SUB_2(user, thread, namespace):
    """Everything happens between 0 s and 6 s (the callbacks); the worker
    reads it all from 100 s on, and each of its writes takes 10 s more."""
    clocks = _Clocks()
    lease = acquire(make_run(thread))
    recorder = LifecycleRecorder(lease, clock=clocks.mono, wall_clock=clocks.wall)
    checkpoint_ns = "|".join([*namespace, "model:1"])
    tool_ns = "|".join([*namespace, "tools:1"])

    async def happen() -> None:
        clocks.seconds = 1.0
        await recorder.model_request(model_run_id="m1", metadata={"langgraph_checkpoint_ns": checkpoint_ns})
        clocks.seconds = 2.0
        recorder.model_end(model_run_id="m1", message_id=None)
        clocks.seconds = 3.0
        recorder.tool_request(tool_call_id="call_1", metadata={"langgraph_checkpoint_ns": tool_ns}, tool_run_id="t1")
        clocks.seconds = 4.0
        recorder.tool_end(tool_run_id="t1")
        clocks.seconds = 5.0
        await recorder.model_request(model_run_id="m2", metadata={"langgraph_checkpoint_ns": checkpoint_ns})
        clocks.seconds = 6.0
        recorder.model_end(model_run_id="m2", message_id=None)

    async def read_late() -> None:
        events = [
            *_model_events(1, "m1", namespace, pulled_at=100, tool_call="call_1"),
            _event(
                4,
                "tools",
                {"event": "tool-started", "tool_call_id": "call_1", "tool_name": "lookup_docs", "input": {}},
                namespace,
                pulled_at=110,
            ),
            _event(
                5,
                "tools",
                {"event": "tool-finished", "tool_call_id": "call_1", "output": "found"},
                namespace,
                pulled_at=111,
            ),
            *_model_events(6, "m2", namespace, pulled_at=120, tool_call=None),
        ]
        clocks.seconds = 100.0
        for event in events:
            await recorder.handle(event)
            clocks.seconds += 10.0  # the write took long

    asyncio.run(happen())
    # The tool returned but its row is not closed: a hand-over now would
    # close it as interrupted (R-RUN-15), so it is still in flight.
    assert recorder.tools_in_flight()
    asyncio.run(read_late())
    assert not recorder.tools_in_flight()

    rows = {r.operation_id: r for r in Message.objects.audit().filter(run=lease.run_id)}
    first, tool, second = rows[request_operation_id("m1")], rows["call_1"], rows[request_operation_id("m2")]
    at = lambda seconds: T0 + dt.timedelta(seconds=seconds)  # noqa: E731
    assert (first.started_at, first.finished_at, first.duration_ms) == (at(1), at(2), 1000)
    assert (tool.started_at, tool.finished_at, tool.duration_ms) == (at(3), at(4), 1000)
    assert (second.started_at, second.finished_at, second.duration_ms) == (at(5), at(6), 1000)
    assert first.sequence < tool.sequence < second.sequence
    assert {tuple(r.namespace) for r in rows.values()} == {tuple(namespace)}


def test_an_event_no_callback_stamped_takes_its_pull_time_R_SUB_2(user, thread):
    """A stream read as it comes (no callback stamped the event yet, or a
    caller that feeds the stream alone): the event's ``params.timestamp``,
    and durations from the monotonic clock between the events."""
    clocks = _Clocks()
    lease = acquire(make_run(thread))
    recorder = LifecycleRecorder(lease, clock=clocks.mono, wall_clock=clocks.wall)
    events = [
        (
            10.0,
            _event(
                1,
                "tools",
                {"event": "tool-started", "tool_call_id": "call_1", "tool_name": "t", "input": {}},
                [],
                pulled_at=10,
            ),
        ),
        (
            12.5,
            _event(
                2, "tools", {"event": "tool-finished", "tool_call_id": "call_1", "output": "ok"}, [], pulled_at=12.5
            ),
        ),
    ]

    async def read() -> None:
        for now, event in events:
            clocks.seconds = now
            await recorder.handle(event)

    asyncio.run(read())
    row = Message.objects.audit().get(run=lease.run_id, operation_id="call_1")
    assert row.started_at == T0 + dt.timedelta(seconds=10)
    assert row.finished_at == T0 + dt.timedelta(seconds=12.5)
    assert row.duration_ms == 2500


def test_a_tool_error_and_a_model_error_keep_their_times_when_the_terminal_closes_them_R_SUB_2(user, thread):
    """A bare tool-error leaves its row running until the terminal (R-TA-3)
    and a model error is known only to the callbacks (R-MA-10): both rows
    end when the tool raised and when the model failed, not when the
    run's terminal transaction closed them."""
    clocks = _Clocks()
    lease = acquire(make_run(thread))
    recorder = LifecycleRecorder(lease, clock=clocks.mono, wall_clock=clocks.wall)

    async def happen_then_read_late() -> None:
        clocks.seconds = 1.0
        recorder.tool_request(tool_call_id="call_1", metadata={"langgraph_checkpoint_ns": "tools:1"}, tool_run_id="t1")
        clocks.seconds = 2.0
        recorder.tool_end(tool_run_id="t1")
        clocks.seconds = 3.0
        await recorder.model_request(model_run_id="m1", metadata={"langgraph_checkpoint_ns": "model:1"})
        clocks.seconds = 4.5
        recorder.model_error(model_run_id="m1", error=ConnectionError("reset"))
        clocks.seconds = 100.0
        started = {"event": "tool-started", "tool_call_id": "call_1", "tool_name": "calculator", "input": {}}
        await recorder.handle(_event(1, "tools", started, [], pulled_at=100))
        clocks.seconds = 110.0
        await recorder.handle(
            _event(
                2, "tools", {"event": "tool-error", "tool_call_id": "call_1", "message": "bad args"}, [], pulled_at=110
            )
        )
        clocks.seconds = 120.0

    asyncio.run(happen_then_read_late())
    error_message = StateMessage(
        kind="tool", id="tm-1", content="Error: bad args", tool_call_id="call_1", status="error"
    )
    ledger.run_finish(
        lease=lease,
        status="completed",
        final_state=[error_message],
        partial_content=recorder.partial_contents(),
        cut_calls=recorder.cut_calls(),
    )
    rows = {r.operation_id: r for r in Message.objects.audit().filter(run=lease.run_id)}
    tool, model = rows["call_1"], rows[request_operation_id("m1")]
    at = lambda seconds: T0 + dt.timedelta(seconds=seconds)  # noqa: E731
    assert tool.execution_status == "failed" and tool.metadata["state_reconciled"] is True
    assert (tool.started_at, tool.finished_at, tool.duration_ms) == (at(1), at(2), 1000)
    assert model.execution_status == "failed"
    assert (model.started_at, model.finished_at, model.duration_ms) == (at(3), at(4.5), 1500)
