"""Every recorded LangGraph v3 stream in ``tests/fixtures/captures`` goes
through the LifecycleRecorder and the lease-checked services into real
PostgreSQL rows, then through the terminal transaction (R-MA-2..9).

The captures are read-only test data shipped with the repository (copies
of the protocol notes' captures; provenance in their README), so nothing
outside the repository is needed and nothing is skipped."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from langchain_core.messages import AIMessage

from audit import ledger
from audit.execution.recorder import LifecycleRecorder
from audit.models import AgentRun
from conversations.models import Conversation, Message
from tests.conftest import acquire, make_run

from .captures import CAPTURES, CapturedRun, capture_names, load_capture

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_captures_ship_with_the_repository():
    """A fresh clone has every capture: none of these tests can skip."""
    assert CAPTURES.is_dir() and len(capture_names()) == 14, CAPTURES


def _replay(run: AgentRun, captured: CapturedRun) -> LifecycleRecorder:
    """Feed the captured events to a recorder whose sink is the worker's
    lease-checked sink, as the runner does."""
    lease = acquire(run)
    recorder = LifecycleRecorder(lease)

    async def feed() -> None:
        for event in captured.events:
            await recorder.handle(event)

    asyncio.run(feed())
    recorder.lease = lease  # type: ignore[attr-defined]
    return recorder


def _terminal_status(name: str, captured: CapturedRun, recorder: LifecycleRecorder) -> str:
    if name == "f_cancellation":
        return AgentRun.Status.CANCELLED
    if captured.raised:
        return AgentRun.Status.FAILED
    if recorder.interrupts:
        return AgentRun.Status.INTERRUPTED
    return AgentRun.Status.COMPLETED


def _expected_rows(captured: CapturedRun) -> dict[str, dict]:
    """operation id -> {sequence, namespace, usage} from the raw events."""
    expected: dict[str, dict] = {}
    by_model_run: dict[str, str] = {}
    for event in captured.messages_events():
        payload, meta = event["params"]["data"]
        namespace = list(event["params"]["namespace"])
        if isinstance(payload, AIMessage):
            op = payload.id or meta.get("run_id")
            expected[op] = {"sequence": event["seq"], "namespace": namespace, "usage": payload.usage_metadata}
        elif payload.get("event") == "message-start":
            op = payload.get("id") or meta["run_id"]
            by_model_run[meta["run_id"]] = op
            expected[op] = {"sequence": event["seq"], "namespace": namespace, "usage": None}
        elif payload.get("event") == "message-finish":
            expected[by_model_run[meta["run_id"]]]["usage"] = payload.get("usage")
    return expected


@pytest.mark.parametrize("name", capture_names())
def test_capture_replays_into_one_row_per_model_call_R_MA_2_R_MA_3_R_MA_4_R_MA_6_R_MA_7_R_MA_8_R_MA_9(name, user):
    runs = load_capture(name)
    assert runs, name
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    previous: AgentRun | None = None
    prior_ids: set[str] = set()
    for captured in runs:
        if name.startswith("d") and previous is not None:
            # The second run of an approval capture resumes the first.
            run = AgentRun.objects.create(
                request_id=uuid.uuid4().hex,
                thread=thread,
                user=user,
                agent_id=thread.agent_id,
                model=thread.model,
                input={"decisions": []},
                resumed_from=previous,
                turn_id=previous.turn_id,
            )
        else:
            if previous is not None:
                thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
                prior_ids = set()
            run = make_run(thread)
        recorder = _replay(run, captured)
        expected = _expected_rows(captured)

        rows = {r.operation_id: r for r in Message.objects.filter(run=run, role=Message.Role.ASSISTANT)}
        # One row per call, keyed by the message-start id, at its sequence.
        assert set(rows) == set(expected), (name, captured.label)
        for op, facts in expected.items():
            assert rows[op].sequence == facts["sequence"]
            assert rows[op].metadata["namespace"] == facts["namespace"]
            assert rows[op].namespace == facts["namespace"]
            assert rows[op].usage == facts["usage"]  # usage once, exactly as reported
            assert rows[op].execution_status == ("completed" if facts["usage"] else "running")
            if name != "h_nonstreaming_model":
                assert op.startswith("lc_run--")

        status = _terminal_status(name, captured, recorder)
        finished = ledger.run_finish(
            lease=recorder.lease,  # type: ignore[attr-defined]
            status=status,
            final_state=recorder.final_state(),
            prior_message_ids=prior_ids,
            interrupts=recorder.interrupt_payloads() or None,
            error_type="agent_error" if status == "failed" else "",
        )
        rows = {r.operation_id: r for r in Message.objects.filter(run=run, role=Message.Role.ASSISTANT)}
        assert set(rows) == set(expected), "the terminal reconcile inserted nothing new"
        assert not Message.objects.filter(run=run, execution_status="running").exists()
        for op, facts in expected.items():
            row = rows[op]
            assert row.sequence == facts["sequence"], "reconcile never overwrites the sequence"
            if facts["usage"] is None:
                closed_as = {"failed": "failed", "cancelled": "interrupted", "interrupted": "interrupted"}
                assert row.execution_status == closed_as.get(status, "abandoned")
                assert row.usage is None and row.metadata["usage_unknown"] is True
            if facts["namespace"]:
                assert finished.output_message_id != row.id, "a namespaced call is never the output"

        usages = [f["usage"] for f in expected.values()]
        assert finished.usage["total_tokens"] == sum(u["total_tokens"] for u in usages if u)
        assert finished.usage["unknown_calls"] == sum(1 for u in usages if not u)

        state_ai = [m for m in recorder.final_state() if m.kind == "ai"]
        if status == "completed" and state_ai:
            # The output is the row of the State's last AIMessage (R-MA-8).
            assert finished.output_message is not None
            assert finished.output_message.operation_id == state_ai[-1].id
            assert finished.output_message.run_id == run.id
        if status in ("failed", "cancelled"):
            assert finished.output_message_id is None
        previous = finished
        prior_ids |= {m.id for m in recorder.final_state() if m.id}


def test_nonstreaming_capture_h_is_one_completed_row_R_MA_2():
    (captured,) = load_capture("h_nonstreaming_model")
    assert not captured.starts(), "capture h has no message-start: the whole message is the lifecycle"


@pytest.mark.parametrize("name", ["g_subgraph_namespaces", "k_deepagents_subagent", "l_researcher_subagent"])
def test_namespaced_calls_are_recorded_with_namespace_and_never_output_R_MA_8(name, user):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    (captured,) = load_capture(name)
    run = make_run(thread)
    recorder = _replay(run, captured)
    finished = ledger.run_finish(
        lease=recorder.lease,  # type: ignore[attr-defined]
        status="completed",
        final_state=recorder.final_state(),
    )
    nested = list(Message.objects.filter(run=run, role="assistant", metadata__namespace__0__isnull=False))
    assert len(nested) == (2 if name == "l_researcher_subagent" else 1)
    for row in nested:
        assert row.metadata["namespace"][0].split(":")[0] in ("child_graph", "tools")
        assert row.namespace == row.metadata["namespace"] and row.execution_status == "completed"
        assert finished.output_message_id is not None and finished.output_message_id != row.id
        # Proven only by the root State: a subgraph sharing the root's
        # messages (g) is, a subagent's own calls (k, l) never are.
        in_root_state = row.operation_id in {m.id for m in recorder.final_state()}
        assert bool(row.metadata.get("state_reconciled")) == in_root_state == (name == "g_subgraph_namespaces")
    assert finished.output_message.metadata["namespace"] == [] and finished.output_message.namespace == []


def test_midstream_error_capture_c3_leaves_running_row_closed_failed_R_MA_7_R_RUN_8(user):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    (captured,) = load_capture("c3_model_error_midstream")
    assert captured.raised
    run = make_run(thread)
    recorder = _replay(run, captured)
    (row,) = Message.objects.filter(run=run, role="assistant")
    assert row.execution_status == "running" and row.usage is None
    ledger.run_finish(
        lease=recorder.lease,  # type: ignore[attr-defined]
        status="failed",
        final_state=recorder.final_state(),
        error_type="agent_error:RuntimeError",
        partial_content=recorder.partial_contents(),
    )
    row.refresh_from_db()
    assert row.execution_status == "failed"
    streamed = "".join(
        e["params"]["data"][0]["delta"]["text"]
        for e in captured.messages_events()
        if e["params"]["data"][0].get("event") == "content-block-delta"
    )
    assert streamed and row.content == streamed and row.metadata["content_partial"] is True
    assert row.usage is None and row.metadata["usage_unknown"] is True
    run.refresh_from_db()
    assert run.usage["unknown_calls"] == 1 and run.usage["total_tokens"] == 0
