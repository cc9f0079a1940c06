"""Calls made inside a subagent (deepagents' ``task`` tool) are audit rows
of their own, nested under the ``task`` call that spawned them, counted
once, never the run's output nor its history, and closed like any other
row; only the root's State is final (R-SUB-1).

The streams are the recorded captures (``tests/fixtures/captures``: l is
the built-in ``researcher`` agent) fed through the recorder and the
lease-checked services into PostgreSQL, as the worker does."""

from __future__ import annotations

import asyncio
import datetime as dt
from decimal import Decimal

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.types import Interrupt

from audit import ledger
from audit.execution.recorder import LifecycleRecorder
from audit.models import AgentRun
from audit.reads.selectors import run_timeline, timeline_item
from conversations.models import Conversation, Message
from conversations.selectors import thread_history
from costs.selectors import run_cost
from dashboard.selectors import dashboard_window, tools_by_name
from tests.conftest import acquire, make_run

from .captures import load_capture

pytestmark = pytest.mark.django_db(transaction=True)

TASK_CALL = "call_task_fact_check"
SUBAGENT_TOOL_CALLS = {"call_lookup_retention", "call_lookup_exports"}


def _researcher_thread(user) -> Conversation:
    return Conversation.objects.create(user=user, agent_id="researcher", model="replay:researcher_fact_check")


def _feed(run: AgentRun, events: list[dict]) -> LifecycleRecorder:
    lease = acquire(run)
    recorder = LifecycleRecorder(lease)

    async def feed() -> None:
        for event in events:
            await recorder.handle(event)

    asyncio.run(feed())
    recorder.lease = lease  # type: ignore[attr-defined]
    return recorder


def _finish(recorder: LifecycleRecorder, status: str) -> AgentRun:
    return ledger.run_finish(
        lease=recorder.lease,  # type: ignore[attr-defined]
        status=status,
        final_state=recorder.final_state(),
        interrupts=recorder.interrupt_payloads() or None,
        partial_content=recorder.partial_contents(),
        cut_calls=recorder.cut_calls(),
        error_type="cancelled" if status == "cancelled" else "",
    )


def test_researcher_subagent_calls_nest_under_the_task_call_and_count_once_R_SUB_1(user):
    (captured,) = load_capture("l_researcher_subagent")
    thread = _researcher_thread(user)
    run = make_run(thread)
    finished = _finish(_feed(run, captured.events), "completed")
    assert finished.status == "completed"

    rows = list(Message.objects.audit().filter(run=run).order_by("sequence"))
    task = next(r for r in rows if r.operation_id == TASK_CALL)
    namespace = task.namespace
    assert task.role == "tool" and task.tool_name == "task" and namespace == [] and task.parent_operation_id is None
    # The task row holds the subagent's answer (the ToolMessage of the
    # Command it returned), not the Command, and none of its usage.
    assert task.execution_status == "completed"
    assert task.content.startswith("The documentation says records are retained for 400 days")
    assert task.usage is None and task.cost_usd is None
    assert task.metadata["raw_output"]["update"]["messages"][0]["tool_call_id"] == TASK_CALL

    children = [r for r in rows if r.parent_operation_id == TASK_CALL]
    assert {r.role for r in children} == {"assistant", "tool"}
    assert len([r for r in children if r.role == "assistant"]) == 2
    assert {r.operation_id for r in children if r.role == "tool"} == SUBAGENT_TOOL_CALLS
    (subagent_ns,) = {tuple(r.namespace) for r in children}
    assert len(subagent_ns) == 1 and subagent_ns[0].startswith("tools:")
    assert all(r.execution_status == "completed" for r in children)
    root = [r for r in rows if r.parent_operation_id is None]
    assert all(r.namespace == [] for r in root) and len(root) == 3  # two main model calls and the task
    # The run's total order: every child between the task's start and the
    # main agent's next call; the parallel pair both start before either ends.
    main_calls = [r for r in root if r.role == "assistant"]
    assert main_calls[0].sequence < task.sequence < min(r.sequence for r in children)
    assert max(r.sequence for r in children) < main_calls[1].sequence
    assert len({r.sequence for r in rows}) == len(rows)
    pair = [r for r in children if r.role == "tool"]
    assert max(r.started_at for r in pair) <= min(r.finished_at for r in pair)
    # The subagent's tool calls were declared by the subagent's model call.
    first_subagent_call = min((r for r in children if r.role == "assistant"), key=lambda r: r.sequence)
    assert {r.declared_by_id for r in pair} == {first_subagent_call.id}
    assert task.declared_by_id == main_calls[0].id

    # Usage and cost once: the run's total is the sum of its four model rows.
    model_rows = [r for r in rows if r.role == "assistant"]
    assert len(model_rows) == 4 and all(r.usage for r in model_rows)
    assert finished.usage["total_tokens"] == sum(r.usage["total_tokens"] for r in model_rows) == 690
    assert finished.usage["unknown_calls"] == 0
    cost = run_cost(run.id)
    assert cost["total_usd"] == sum((r.cost_usd for r in model_rows), Decimal(0)) and cost["total_usd"] > 0

    # The output is the main agent's last call, never a subagent's; only the
    # root's calls are proven by the root State.
    assert finished.output_message_id == main_calls[1].id
    assert all("state_reconciled" not in r.metadata for r in children)
    assert all(r.metadata.get("state_reconciled") for r in main_calls)

    # The timeline API's rows carry the nesting.
    items = [timeline_item(r, include_raw_output=True) for r in run_timeline(run_id=run.id).items]
    assert [(i["operation_id"], i["namespace"], i["parent_operation_id"]) for i in items] == [
        (r.operation_id, r.namespace, r.parent_operation_id) for r in rows
    ]

    # History: the user's message, the call that asked for the task with the
    # task's projected result only, and the answer. No subagent row.
    entries = thread_history(thread=thread).items
    assert [e.kind for e in entries] == ["user", "tool_carrier", "answer"]
    assert [t.operation_id for t in entries[1].tool_executions] == [TASK_CALL]
    shown = {e.message.id for e in entries} | {t.id for e in entries for t in e.tool_executions}
    assert not shown & {r.id for r in children}

    # Dashboard: the subagent's executions count per tool like any others.
    counts = {c["tool_name"]: c for c in tools_by_name(dashboard_window(tz="UTC"))}
    assert counts["lookup_docs"]["executions"] == 2 and counts["lookup_docs"]["successes"] == 2
    assert counts["task"]["executions"] == 1


def test_only_the_root_values_are_the_final_state_and_its_interrupts_R_SUB_1(user):
    """A root ``values`` event, then a subagent's (namespaced) one with its
    own messages and an interrupt: the final State and the interrupts stay
    the root's."""
    root_ai = AIMessage(content="root answer", id="lc_run--root")
    sub_ai = AIMessage(content="subagent answer", id="lc_run--sub")
    pending = Interrupt(value={"action_requests": [{"name": "send_email", "args": {}}]}, id="sub-interrupt")

    def values(seq: int, namespace: list[str], messages: list, interrupts: tuple) -> dict:
        params = {"namespace": namespace, "timestamp": 1_800_000_000_000, "data": {"messages": messages}}
        return {"type": "event", "method": "values", "seq": seq, "params": {**params, "interrupts": interrupts}}

    events = [
        values(1, [], [HumanMessage("hi", id="human-1"), root_ai], ()),
        values(2, ["tools:abc"], [HumanMessage("check", id="sub-human"), sub_ai], (pending,)),
    ]
    run = make_run(Conversation.objects.create(user=user, agent_id="researcher", model="replay:plain_answer"))
    recorder = _feed(run, events)
    assert [m.id for m in recorder.final_state()] == ["human-1", "lc_run--root"]
    assert recorder.interrupts == () and recorder.interrupt_payloads() == []


@pytest.mark.parametrize(
    ("name", "cut_after_seq"),
    [
        # After the child graph's values holding its AIMessage (seq 10), before the root's.
        ("g_subgraph_namespaces", 10),
        # After the subagent's last values (its answer), before task's tool-finished.
        ("l_researcher_subagent", None),
    ],
)
def test_a_stream_cut_off_after_a_subgraph_values_then_cancelled_proves_no_subgraph_row_R_SUB_1(
    name, cut_after_seq, user
):
    (captured,) = load_capture(name)
    if cut_after_seq is None:
        cut_after_seq = max(e["seq"] for e in captured.events if e["method"] == "values" and e["params"]["namespace"])
    events = [e for e in captured.events if e["seq"] <= cut_after_seq]
    assert events[-1]["method"] == "values" and events[-1]["params"]["namespace"]
    run = make_run(Conversation.objects.create(user=user, agent_id="researcher", model="replay:plain_answer"))
    recorder = _feed(run, events)
    finished = _finish(recorder, "cancelled")

    assert finished.status == "cancelled" and finished.output_message_id is None
    rows = list(Message.objects.audit().filter(run=run))
    assert not [r for r in rows if r.execution_status == "running"]
    nested = [r for r in rows if r.namespace]
    assert nested, "the cut stream holds calls made inside the subgraph"
    assert not [r for r in nested if r.metadata.get("state_reconciled")], "a subgraph's values is no State"
    root_state_ids = {m.id for m in recorder.final_state()}
    for row in rows:
        # A row is proven only by the root's last values, whatever came after.
        assert bool(row.metadata.get("state_reconciled")) == (row.operation_id in root_state_ids)
    if name == "l_researcher_subagent":
        task = next(r for r in rows if r.operation_id == TASK_CALL)
        assert task.execution_status == "interrupted", "the task call was cut off with its subagent"
        assert all(r.execution_status == "completed" for r in nested), "finished subagent calls stay finished"
        assert {r.parent_operation_id for r in nested} == {TASK_CALL}


def test_a_subagent_call_opened_at_request_start_is_nested_before_its_first_chunk_R_SUB_1_R_MA_10(user):
    """The tool start callback names the task call before its subagent's
    first model request, so the row opened at request start (R-MA-10) is
    nested already; a cancel then closes it ``interrupted`` with usage
    unknown, and it counts as an unknown call, once."""
    run = make_run(Conversation.objects.create(user=user, agent_id="researcher", model="replay:plain_answer"))
    recorder = _feed(run, [])
    model_run_id = "0000aaaa-0000-0000-0000-000000000001"

    async def drive() -> None:
        recorder.tool_request(tool_call_id="call_task_x", metadata={"langgraph_checkpoint_ns": "tools:abc"})
        await recorder.model_request(
            model_run_id=model_run_id,
            metadata={"langgraph_checkpoint_ns": "tools:abc|model:def", "lc_agent_name": "fact_checker"},
            started_at=dt.datetime.now(dt.UTC),
        )

    asyncio.run(drive())
    (row,) = Message.objects.model_calls().filter(run=run)
    assert row.namespace == ["tools:abc"] and row.parent_operation_id == "call_task_x"
    assert row.metadata["awaiting_first_chunk"] is True and row.metadata["agent_name"] == "fact_checker"
    finished = _finish(recorder, "cancelled")
    row.refresh_from_db()
    assert row.execution_status == "interrupted" and row.usage is None and row.metadata["usage_unknown"] is True
    assert finished.usage == {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "unknown_calls": 1}


@pytest.mark.usefixtures("recovery_fail")
def test_a_swept_run_closes_its_subagent_rows_R_SUB_1_R_RUN_7(user):
    """Lease loss inside the subagent: the sweeper's terminal transaction
    closes the subagent's running rows like any other."""
    (captured,) = load_capture("l_researcher_subagent")
    # Cut while the subagent's parallel pair runs (both started, none finished).
    second_start = max(
        e["seq"] for e in captured.events if e["method"] == "tools" and e["params"]["data"]["event"] == "tool-started"
    )
    run = make_run(_researcher_thread(user))
    _feed(run, [e for e in captured.events if e["seq"] <= second_start])
    running = Message.objects.filter(run=run, execution_status="running")
    assert {r.operation_id for r in running} == {TASK_CALL, *SUBAGENT_TOOL_CALLS}
    AgentRun.objects.filter(pk=run.pk).update(lease_expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=5))
    ledger.run_sweep_expired_leases()
    run.refresh_from_db()
    assert (run.status, run.error_type) == ("failed", "lease_expired")
    rows = Message.objects.filter(run=run, operation_id__in=[TASK_CALL, *SUBAGENT_TOOL_CALLS])
    assert {(r.operation_id, r.execution_status) for r in rows} == {
        (TASK_CALL, "failed"),
        *((op, "failed") for op in SUBAGENT_TOOL_CALLS),
    }
    assert {r.parent_operation_id for r in rows if r.operation_id != TASK_CALL} == {TASK_CALL}


def test_the_innermost_spawning_tool_call_is_the_parent_R_SUB_1(user):
    """A subagent started inside a subagent belongs to the inner task call;
    a plain subgraph inside a subagent to the task call around it; a
    subgraph no tool call started to none."""
    run = make_run(Conversation.objects.create(user=user, agent_id="researcher", model="replay:plain_answer"))
    recorder = _feed(run, [])
    recorder.tool_request(tool_call_id="call_outer", metadata={"langgraph_checkpoint_ns": "tools:a"})
    recorder.tool_request(tool_call_id="call_inner", metadata={"langgraph_checkpoint_ns": "tools:a|tools:b"})
    assert recorder.parent_operation([]) is None
    assert recorder.parent_operation(["tools:a"]) == "call_outer"
    assert recorder.parent_operation(["tools:a", "tools:b"]) == "call_inner"
    assert recorder.parent_operation(["tools:a", "child_graph:c"]) == "call_outer"
    assert recorder.parent_operation(["child_graph:c"]) is None
