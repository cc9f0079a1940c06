"""Property tests: generated v3 lifecycle streams with duplicates, replays,
conflicting sequences and interleaved operations go through the
LifecycleRecorder and the lease-checked services into real PostgreSQL
(R-MA-2..5, R-MA-7).

Invariants: one row per (run, role, operation); a completed row is never
reopened; rows keep the stream's sequence order; usage is counted once; a
conflicting start fails explicitly and writes nothing more."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import pytest
from django.contrib.auth import get_user_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from audit import ledger
from audit.errors import AuditConflict
from audit.execution.recorder import LifecycleRecorder
from conversations.models import Conversation, Message
from tests.conftest import acquire, make_run

pytestmark = pytest.mark.django_db(transaction=True)


@dataclass(frozen=True)
class Call:
    model_run_id: str
    namespace: tuple[str, ...]
    deltas: tuple[str, ...]
    usage: dict | None
    finishes: bool


calls_strategy = st.lists(
    st.builds(
        Call,
        model_run_id=st.uuids().map(str),
        namespace=st.sampled_from([(), ("child:1",), ("tools:abc",)]),
        deltas=st.lists(st.text(alphabet="abc xyz", min_size=1, max_size=4), max_size=4).map(tuple),
        usage=st.one_of(
            st.none(),
            st.builds(
                lambda i, o: {"input_tokens": i, "output_tokens": o, "total_tokens": i + o},
                st.integers(0, 500),
                st.integers(0, 500),
            ),
        ),
        finishes=st.booleans(),
    ),
    min_size=1,
    max_size=4,
    unique_by=lambda c: c.model_run_id,
)


def _payload_events(call: Call) -> list[dict]:
    """The protocol payloads of one call's lifecycle, in order."""
    op = f"lc_run--{call.model_run_id}"
    events = [{"event": "message-start", "role": "ai", "id": op}]
    events.append({"event": "content-block-start", "index": 0, "content": {"type": "text", "text": ""}})
    events += [
        {"event": "content-block-delta", "index": 0, "delta": {"type": "text-delta", "text": d}} for d in call.deltas
    ]
    if call.finishes:
        events.append(
            {"event": "content-block-finish", "index": 0, "content": {"type": "text", "text": "".join(call.deltas)}}
        )
        finish = {"event": "message-finish", "metadata": {"finish_reason": "stop"}}
        if call.usage is not None:
            finish["usage"] = call.usage
        events.append(finish)
    return events


@st.composite
def streams(draw):
    """Interleaved lifecycles with root ``seq`` numbering, plus replays."""
    calls = draw(calls_strategy)
    queues = [[(i, p) for p in _payload_events(c)] for i, c in enumerate(calls)]
    order: list[tuple[int, dict]] = []
    while any(queues):
        live = [q for q in queues if q]
        order.append(draw(st.sampled_from(live)).pop(0))
    events = []
    for seq, (i, payload) in enumerate(order, start=1):
        call = calls[i]
        events.append(
            {
                "type": "event",
                "method": "messages",
                "seq": seq,
                "params": {
                    "namespace": list(call.namespace),
                    "timestamp": 1_800_000_000_000 + seq,
                    "data": (payload, {"run_id": call.model_run_id, "langgraph_node": "model"}),
                },
            }
        )
    # Replays: the same event again later in the stream (a re-delivered
    # start or finish, same seq), never a new fact.
    replays = draw(
        st.lists(
            st.sampled_from(
                [e for e in events if e["params"]["data"][0]["event"] in ("message-start", "message-finish")]
            ),
            max_size=4,
        )
    )
    for event in replays:
        position = draw(st.integers(events.index(event) + 1, len(events)))
        events.insert(position, event)
    return calls, events


def _fresh_run():
    user = get_user_model().objects.create_user(username=f"p-{uuid.uuid4().hex[:10]}")
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    run = make_run(thread)
    return run, acquire(run)


def _feed(recorder: LifecycleRecorder, events: list[dict], after_each=None) -> None:
    async def feed():
        for event in events:
            await recorder.handle(event)
            if after_each is not None:
                await after_each()

    asyncio.run(feed())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_generated_lifecycles_keep_the_audit_invariants_R_MA_3_R_MA_4_R_MA_5(generated):
    calls, events = generated
    run, lease = _fresh_run()
    recorder = LifecycleRecorder(lease)
    completed_seen: set[str] = set()

    from asgiref.sync import sync_to_async

    def check_no_reopen():
        rows = dict(Message.objects.filter(run=run, role="assistant").values_list("operation_id", "execution_status"))
        for op in completed_seen:
            assert rows[op] == "completed", f"{op} went back to {rows[op]}"
        completed_seen.update(op for op, status in rows.items() if status == "completed")

    _feed(recorder, events, after_each=sync_to_async(check_no_reopen))

    rows = list(Message.objects.filter(run=run, role="assistant").order_by("sequence"))
    by_op = {r.operation_id: r for r in rows}
    # One row per (run, role, operation).
    assert len(rows) == len(by_op) == len(calls)
    first_start = {}
    for event in events:
        payload = event["params"]["data"][0]
        if payload["event"] == "message-start":
            first_start.setdefault(payload["id"], event["seq"])
    # Sequence order is the stream's start order.
    assert [r.operation_id for r in rows] == sorted(first_start, key=first_start.get)
    for call in calls:
        row = by_op[f"lc_run--{call.model_run_id}"]
        assert row.sequence == first_start[row.operation_id]
        assert row.metadata["namespace"] == list(call.namespace)
        if call.finishes:
            assert row.execution_status == "completed"
            assert row.content == "".join(call.deltas), "a replayed start keeps the aggregated content"
            assert row.usage == call.usage
        else:
            assert row.execution_status == "running" and row.usage is None

    finished = ledger.run_finish(lease=lease, status="failed", error_type="agent_error")
    assert not Message.objects.filter(run=run, execution_status="running").exists()
    reported = [c.usage for c in calls if c.finishes and c.usage]
    assert finished.usage["total_tokens"] == sum(u["total_tokens"] for u in reported), "usage counted once"
    assert finished.usage["unknown_calls"] == len(calls) - len(reported)
    for call in calls:
        row = Message.objects.get(run=run, operation_id=f"lc_run--{call.model_run_id}")
        if not call.finishes:
            assert row.execution_status == "failed" and row.metadata["usage_unknown"] is True


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.data())
def test_a_conflicting_start_fails_explicitly_and_changes_nothing_R_MA_3(generated, data):
    calls, events = generated
    starts = [e for e in events if e["params"]["data"][0]["event"] == "message-start"]
    victim = data.draw(st.sampled_from(starts))
    payload, meta = victim["params"]["data"]
    kind = data.draw(st.sampled_from(["other_sequence", "key_changed"]))
    if kind == "other_sequence":
        bad_payload, bad_seq = payload, max(e["seq"] for e in events) + 1
    else:
        bad_payload, bad_seq = {**payload, "id": payload["id"] + "-other"}, victim["seq"]
    bad = {**victim, "seq": bad_seq, "params": {**victim["params"], "data": (bad_payload, meta)}}
    position = data.draw(st.integers(events.index(victim) + 1, len(events)))

    run, lease = _fresh_run()
    recorder = LifecycleRecorder(lease)
    _feed(recorder, events[:position])
    before = list(Message.objects.filter(run=run).order_by("id").values())
    with pytest.raises(AuditConflict) as raised:
        _feed(recorder, [bad])
    assert raised.value.extra["reason"] in ("sequence_conflict", "operation_key_changed")
    assert list(Message.objects.filter(run=run).order_by("id").values()) == before


def test_the_service_refuses_the_same_key_at_another_sequence_even_from_a_new_recorder_R_MA_3(thread):
    """A second process replaying under the same lease cannot move a call to
    another sequence: the database row decides, not the recorder's memory."""
    run = make_run(thread)
    lease = acquire(run)
    ledger.model_call_start(lease=lease, operation_id="lc_run--x", sequence=3, started_at=run.created_at)
    with pytest.raises(AuditConflict):
        ledger.model_call_start(lease=lease, operation_id="lc_run--x", sequence=4, started_at=run.created_at)
    assert Message.objects.get(run=run, operation_id="lc_run--x").sequence == 3
