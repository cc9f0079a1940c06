"""Model calls are audited from the moment their request is sent (R-MA-10):
the row opens at LangChain's chat-model start under ``lc_run--<model run
id>``, message-start finds it (R-MA-5), and a call cut before its first
chunk keeps its row, closed with usage unknown.

The operation ids are checked against the recorded protocol captures and a
real ``ChatOpenAI`` stream against the replay model server."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
import uuid
from typing import Any

import pytest
from django.db import connection
from langchain_core.callbacks import AsyncCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import MessagesState, StateGraph

from audit import ledger
from audit.agents.models import chat_model
from audit.errors import AuditConflict
from audit.execution.model_requests import ModelRequestAudit
from audit.execution.recorder import LifecycleRecorder, namespace_of_checkpoint, request_operation_id
from audit.execution.runner import run_execute
from audit.models import AgentRun
from conversations.models import Conversation, Message
from tests.conftest import acquire, make_run
from tests.waiting import WAIT_SECONDS

from .captures import CAPTURES, capture_names, load_capture

pytestmark = pytest.mark.django_db(transaction=True)

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
needs_captures = pytest.mark.skipif(not CAPTURES.is_dir(), reason=f"protocol captures not found at {CAPTURES}")


# --- the operation id: captures and a real ChatOpenAI stream --------------------


@needs_captures
@pytest.mark.parametrize("name", capture_names())
def test_every_captured_message_start_id_is_the_request_start_key_of_its_model_run_R_MA_10(name):
    for captured in load_capture(name):
        for event in captured.starts():
            payload, meta = event["params"]["data"]
            assert payload["id"] == request_operation_id(meta["run_id"]), (name, payload["id"])
            assert list(event["params"]["namespace"]) == namespace_of_checkpoint(meta["langgraph_checkpoint_ns"])


@needs_captures
@pytest.mark.parametrize("name", capture_names())
def test_captures_with_rows_opened_at_request_start_give_one_row_per_call_R_MA_10_R_MA_5(name, user):
    """Each capture replayed as the worker sees it live: the chat-model start
    callback opens a row before the model run's first event. message-start
    (or a non-streaming model's whole message) finds that row: one row per
    call, at the stream's sequence, never a second one."""
    for captured in load_capture(name):
        thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
        run = make_run(thread)
        lease = acquire(run)
        recorder = LifecycleRecorder(lease)
        expected: dict[str, int] = {}

        async def feed(captured=captured, recorder=recorder, expected=expected) -> None:
            opened: set[str] = set()
            for event in captured.events:
                if event["method"] == "messages":
                    payload, meta = event["params"]["data"]
                    # A whole message may come without a run id (capture h):
                    # its model run is known from on_llm_end, as live.
                    model_run_id = meta.get("run_id") or f"whole-{payload.id}"
                    if model_run_id not in opened:
                        opened.add(model_run_id)
                        await recorder.model_request(model_run_id=model_run_id, metadata=meta)
                    if isinstance(payload, AIMessage):
                        recorder.model_end(model_run_id=model_run_id, message_id=payload.id)
                    op = payload.id if isinstance(payload, AIMessage) else payload.get("id")
                    if isinstance(payload, AIMessage) or payload.get("event") == "message-start":
                        expected[op or meta["run_id"]] = event["seq"]
                await recorder.handle(event)

        asyncio.run(feed())
        rows = {r.operation_id: r for r in Message.objects.filter(run=run, role="assistant")}
        assert {op: r.sequence for op, r in rows.items()} == expected, (name, captured.label)
        assert not any(r.metadata.get("awaiting_first_chunk") for r in rows.values())
        assert all(r.metadata["attempts"] == 1 for r in rows.values())


class _StartIds(AsyncCallbackHandler):
    def __init__(self):
        self.run_ids: list[str] = []

    async def on_chat_model_start(self, serialized, messages, *, run_id, **kwargs):
        self.run_ids.append(str(run_id))


def _v3_message_start_ids(model, handler) -> list[str]:
    graph = StateGraph(MessagesState)

    async def call_model(state):
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph.add_node("model", call_model)
    graph.set_entry_point("model")
    compiled = graph.compile()

    async def run() -> list[str]:
        stream = await compiled.astream_events(
            {"messages": [HumanMessage("Weather in Paris?")]}, {"callbacks": [handler]}, version="v3"
        )
        ids = []
        async for event in stream:
            if event["method"] == "messages":
                payload = event["params"]["data"][0]
                if isinstance(payload, dict) and payload.get("event") == "message-start":
                    ids.append(payload["id"])
        return ids

    return asyncio.run(run())


@pytest.mark.parametrize("kind", ["ChatOpenAI", "configured"])
def test_a_real_chatopenai_stream_starts_under_the_id_its_request_callback_gives_R_MA_10(replay_models, kind):
    """langchain-openai against the replay server, driven by a v3 stream:
    the chat-model start callback's run id, prefixed, is message-start's id
    — for plain ``ChatOpenAI`` and for the model the worker builds."""
    if kind == "ChatOpenAI":
        model = ChatOpenAI(model="tool_then_answer", base_url=replay_models, api_key="x", stream_usage=True)
    else:
        model = chat_model("replay:tool_then_answer")
    handler = _StartIds()
    ids = _v3_message_start_ids(model, handler)
    assert len(ids) == 1 and ids == [request_operation_id(run_id) for run_id in handler.run_ids]


def test_a_worker_run_opens_each_model_row_at_request_start_and_message_start_finds_it_R_MA_10(user, replay_models):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:tool_then_answer")
    run = make_run(thread)
    assert run_execute(run_id=run.id) == "completed"
    rows = list(Message.objects.model_calls().filter(run=run).order_by("sequence"))
    assert len(rows) == 2, "one row per model call, never a second one"
    tool = Message.objects.get(run=run, role="tool")
    assert rows[0].sequence < tool.sequence < rows[1].sequence
    for row in rows:
        assert row.operation_id == request_operation_id(row.metadata["model_run_id"])
        assert row.metadata["attempts"] == 1 and "awaiting_first_chunk" not in row.metadata
        assert row.execution_status == "completed" and row.usage and row.duration_ms is not None


# --- a call cut before its first chunk ------------------------------------------------


def test_cancel_before_the_first_chunk_keeps_the_call_interrupted_with_usage_unknown_R_MA_10_R_RUN_6(
    user, replay_models
):
    """Issue 10 finding 1, in process: turn 0 a fast tool call, turn 1 an
    answer whose first chunk takes 2 s; cancel 1 s after the tool finished."""
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:tool_then_slow_answer")
    run = make_run(thread)
    result: dict[str, Any] = {}

    def work():
        try:
            result["status"] = run_execute(run_id=run.id)
        finally:
            connection.close()

    worker = threading.Thread(target=work)
    worker.start()
    deadline = time.monotonic() + WAIT_SECONDS
    while not Message.objects.filter(run=run, role="tool", execution_status="completed").exists():
        assert time.monotonic() < deadline and worker.is_alive(), result
        time.sleep(0.02)
    time.sleep(1.0)
    ledger.run_request_cancel(user=user, run_id=run.id)
    worker.join(30)
    assert result["status"] == "cancelled"

    run.refresh_from_db()
    first, second = Message.objects.model_calls().filter(run=run).order_by("sequence")
    tool = Message.objects.get(run=run, role="tool")
    assert first.execution_status == "completed" and first.usage
    assert second.execution_status == "interrupted"
    assert second.usage is None and second.metadata["usage_unknown"] is True
    assert second.metadata["awaiting_first_chunk"] is True, "it never streamed"
    assert second.sequence > tool.sequence, "it keeps its place in the run's order"
    assert second.started_at is not None and second.finished_at is not None
    assert second.duration_ms is not None and second.duration_ms >= 900
    assert run.usage["unknown_calls"] == 1
    assert run.usage["total_tokens"] == first.usage["total_tokens"]


def test_a_call_cut_mid_stream_gets_its_duration_R_MA_10_R_MA_4(user, replay_models):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:model_error_midstream")
    run = make_run(thread)
    assert run_execute(run_id=run.id) == "failed"
    (row,) = Message.objects.model_calls().filter(run=run)
    assert row.execution_status == "failed" and row.content and row.metadata["content_partial"] is True
    assert row.duration_ms is not None and row.finished_at is not None
    assert row.metadata["error"].startswith("model_stream_broken:")


# --- the services ------------------------------------------------------------------------


def _open(lease, op="lc_run--a", sequence=3):
    return ledger.model_call_open(
        lease=lease, operation_id=op, sequence=sequence, started_at=T0, metadata={"namespace": []}
    )


def test_message_start_gives_an_opened_row_its_sequence_once_and_never_reopens_it_R_MA_10_R_MA_3_R_MA_5(thread):
    lease = acquire(make_run(thread))
    row = _open(lease)
    assert (row.execution_status, row.sequence, row.metadata["awaiting_first_chunk"]) == ("running", 3, True)
    assert _open(lease, sequence=9).pk == row.pk, "opening again changes nothing"

    started = ledger.model_call_start(
        lease=lease, operation_id="lc_run--a", sequence=5, started_at=T0 + dt.timedelta(seconds=2), metadata={}
    )
    assert started.pk == row.pk and started.sequence == 5 and "awaiting_first_chunk" not in started.metadata
    assert started.started_at == T0, "the request time stays"
    with pytest.raises(AuditConflict):
        ledger.model_call_start(lease=lease, operation_id="lc_run--a", sequence=6, started_at=T0, metadata={})
    ledger.model_call_finish(
        lease=lease,
        operation_id="lc_run--a",
        content="hi",
        tool_calls=[],
        usage={"input_tokens": 1, "output_tokens": 1, "total_tokens": 2},
        finished_at=T0,
        duration_ms=5,
    )
    again = ledger.model_call_start(lease=lease, operation_id="lc_run--a", sequence=5, started_at=T0, metadata={})
    assert again.execution_status == "completed", "never reopened"
    assert Message.objects.model_calls().filter(run_id=lease.run_id).count() == 1


def test_a_whole_message_rekeys_the_row_opened_at_request_start_once_R_MA_10_R_MA_2(thread):
    lease = acquire(make_run(thread))
    _open(lease, op="lc_run--b")
    row = ledger.model_call_start(
        lease=lease, operation_id="provider-id-1", sequence=4, started_at=T0, metadata={}, opened_as="lc_run--b"
    )
    assert row.operation_id == "provider-id-1" and row.sequence == 4
    assert list(Message.objects.model_calls().filter(run_id=lease.run_id).values_list("operation_id", flat=True)) == [
        "provider-id-1"
    ]


def test_retries_are_counted_on_the_row_only_before_its_first_chunk_R_RUN_12(thread):
    lease = acquire(make_run(thread))
    _open(lease)
    failure = {"attempt": 1, "error": "OpenAIConnectionError: Connection error.", "connected": False}
    ledger.model_call_retry(lease=lease, operation_id="lc_run--a", failure=failure)
    row = ledger.model_call_retry(lease=lease, operation_id="lc_run--a", failure=failure)
    assert row.metadata["attempts"] == 2 and row.metadata["attempt_errors"] == [failure], "the same attempt once"
    ledger.model_call_start(lease=lease, operation_id="lc_run--a", sequence=3, started_at=T0, metadata={})
    with pytest.raises(AuditConflict):
        ledger.model_call_retry(lease=lease, operation_id="lc_run--a", failure={**failure, "attempt": 2})
    with pytest.raises(AuditConflict):
        ledger.model_call_retry(lease=lease, operation_id="lc_run--zz", failure=failure)


@pytest.mark.parametrize(
    ("status", "closed_as"), [("cancelled", "interrupted"), ("failed", "failed"), ("completed", "abandoned")]
)
def test_the_terminal_closes_a_call_cut_before_its_first_chunk_with_usage_unknown_R_MA_10_R_MA_7(
    thread, status, closed_as
):
    run = make_run(thread)
    lease = acquire(run)
    _open(lease)
    finished = ledger.run_finish(
        lease=lease, status=status, cut_calls={"lc_run--a": {"duration_ms": 1234, "error": None}}
    )
    row = Message.objects.get(run=run, operation_id="lc_run--a")
    assert (row.execution_status, row.duration_ms, row.usage) == (closed_as, 1234, None)
    assert row.metadata["usage_unknown"] is True
    assert finished.usage["unknown_calls"] == 1


def test_a_model_error_closes_its_call_failed_even_in_a_completed_run_R_MA_10_R_RUN_12(thread):
    run = make_run(thread)
    lease = acquire(run)
    _open(lease)
    ledger.run_finish(
        lease=lease,
        status=AgentRun.Status.COMPLETED,
        cut_calls={"lc_run--a": {"duration_ms": 10, "error": "model_unreachable: OpenAIConnectionError: x"}},
    )
    row = Message.objects.get(run=run, operation_id="lc_run--a")
    assert row.execution_status == "failed" and row.metadata["error"].startswith("model_unreachable")


def test_the_callback_handler_feeds_the_recorder_and_ignores_foreign_retries_R_MA_10(thread):
    lease = acquire(make_run(thread))
    recorder = LifecycleRecorder(lease)
    handler = ModelRequestAudit(recorder)
    run_id = uuid.uuid4()
    meta = {"langgraph_checkpoint_ns": "tools:abc|model:def", "langgraph_node": "model"}

    async def drive():
        await handler.on_chat_model_start({}, [[]], run_id=run_id, metadata=meta)
        await handler.on_chat_model_start({}, [[]], run_id=run_id, metadata=meta)  # again: nothing new
        await handler.on_retry(object(), run_id=run_id)  # not a model attempt
        await handler.on_retry(object(), run_id=run_id, attempt_failure={"attempt": 1, "error": "x"})
        await handler.on_llm_error(asyncio.CancelledError(), run_id=run_id)

    asyncio.run(drive())
    (row,) = Message.objects.model_calls().filter(run_id=lease.run_id)
    assert row.operation_id == f"lc_run--{run_id}" and row.metadata["namespace"] == ["tools:abc"]
    assert row.metadata["attempts"] == 2
    cut = recorder.cut_calls()[row.operation_id]
    assert cut["error"] is None, "a cancellation is not an error"


def test_each_run_gets_its_own_model_client_on_one_shared_tls_context():
    """Building a TLS context loads the CA bundle (tens of ms): every run's
    HTTP client shares the process's one context, which still verifies
    certificates and host names as httpx's default does."""
    import asyncio
    import ssl

    from audit.agents.models import model_http_client

    async def two_clients():
        async with model_http_client() as first, model_http_client() as second:
            assert first is not second
            return [client._transport._pool._ssl_context for client in (first, second)]

    first, second = asyncio.run(two_clients())
    assert first is second
    assert first.verify_mode == ssl.CERT_REQUIRED and first.check_hostname
