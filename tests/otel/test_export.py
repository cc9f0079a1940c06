"""OpenTelemetry export of real runs to a real OTLP/HTTP receiver (R-OTEL-1):
span shapes and ids, exactly-once behind the cursor while the receiver
fails, the horizon that waits for open terminal transactions, the command
and the beat task. The end-to-end proof against Arize Phoenix is
``test_phoenix.py``."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from audit import ledger
from audit.execution.runner import run_execute
from audit.models import AgentRun
from conversations.models import Conversation, Message
from otel_export.models import ExportCursor
from otel_export.services import OtlpReceiver as Exporter
from otel_export.services import export_closed_runs
from otel_export.spans import row_span_id, run_span_id
from tests.admin.builders import AWKWARD, AWKWARD_VISIBLE, awkward_run
from tests.conftest import make_run, sent_requests

from .receiver import OtlpReceiver

pytestmark = pytest.mark.django_db(transaction=True)

OK, ERROR, UNSET = 1, 2, 0  # OTLP status codes


@pytest.fixture
def export_config(monkeypatch):
    """Export settings of this process: no settle time (the tests' runs
    are committed before they export), small requests, the default payload
    cut (restored after a test that sets its own)."""
    from core.config import get_config

    config = get_config()
    monkeypatch.setattr(config, "OTEL_EXPORT_SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(config, "OTEL_EXPORT_BATCH_SPANS", 512)
    monkeypatch.setattr(config, "OTEL_EXPORT_CONTENT", False)
    monkeypatch.setattr(config, "OTEL_EXPORT_MAX_PAYLOAD_CHARS", 4000)
    return config


@pytest.fixture
def receiver():
    server = OtlpReceiver()
    yield server
    server.stop()


def exporter(receiver: OtlpReceiver, timeout: float = 3.0) -> Exporter:
    return Exporter(endpoint=receiver.endpoint, timeout=timeout)


def execute(user, scenario: str, text: str = "hello") -> AgentRun:
    thread = Conversation.objects.create(user=user, agent_id="assistant", model=f"replay:{scenario}")
    run = make_run(thread, text=text)
    run_execute(run_id=run.id, owner="in-process")
    run.refresh_from_db()
    return run


def world(user) -> dict[str, AgentRun]:
    """A tool run, an approval interrupt and its approved resume, a failed
    run and a run cancelled before it started."""
    runs = {"tool": execute(user, "tool_then_answer", "Weather in Paris?")}
    runs["interrupted"] = execute(user, "approval_send_email", "Mail Bob")
    resume, _ = ledger.run_resume(
        user=user, run_id=runs["interrupted"].id, request_id=uuid.uuid4().hex, decisions=[{"type": "approve"}]
    )
    run_execute(run_id=resume.id, owner="in-process")
    runs["resume"] = AgentRun.objects.get(pk=resume.pk)
    runs["failed"] = execute(user, "model_http_error")
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    pending = make_run(thread)
    runs["cancelled"] = ledger.run_request_cancel(user=user, run_id=pending.id)
    runs["cancelled"].refresh_from_db()
    assert {k: r.status for k, r in runs.items()} == {
        "tool": "completed",
        "interrupted": "interrupted",
        "resume": "completed",
        "failed": "failed",
        "cancelled": "cancelled",
    }
    return runs


def expected_span_ids(runs) -> set[str]:
    ids = set()
    for run in runs:
        ids.add(f"{run_span_id(run.id):016x}")
        ids.update(
            f"{row_span_id(pk):016x}" for pk in Message.objects.audit().filter(run=run).values_list("pk", flat=True)
        )
    return ids


def test_closed_runs_become_genai_spans_with_ids_from_the_database_R_OTEL_1(
    user, replay_models, export_config, receiver
):
    runs = world(user)
    result = export_closed_runs(receiver=exporter(receiver))
    assert result.error == "" and result.caught_up and result.runs == 5

    spans = receiver.unique()
    assert set(spans) == expected_span_ids(runs.values())
    assert not [s for s, n in receiver.duplicates().items() if n > 1]

    for run in runs.values():
        root = spans[f"{run_span_id(run.id):016x}"]
        assert root.trace_id == run.id.hex and root.parent_span_id == ""
        assert root.name == "invoke_agent assistant"
        attrs = root.attributes
        assert attrs["gen_ai.operation.name"] == "invoke_agent"
        assert attrs["gen_ai.provider.name"] == "replay"
        assert attrs["gen_ai.conversation.id"] == str(run.thread_id)
        assert attrs["yuxi.run_id"] == str(run.id) and attrs["yuxi.thread_id"] == str(run.thread_id)
        assert attrs["yuxi.run.status"] == run.status
        assert root.start_ns == int((run.started_at or run.created_at).timestamp() * 1e6) * 1000
        assert root.end_ns == int(run.finished_at.timestamp() * 1e6) * 1000
        if run.status in ("failed", "cancelled"):
            assert root.status_code == ERROR and attrs["error.type"] == run.error_type
        else:
            assert root.status_code == OK and "error.type" not in attrs
        usage = run.usage or {}
        assert attrs.get("gen_ai.usage.input_tokens", 0) == usage.get("input_tokens", 0)
        assert attrs.get("gen_ai.usage.output_tokens", 0) == usage.get("output_tokens", 0)

        for row in Message.objects.audit().filter(run=run):
            span = spans[f"{row_span_id(row.pk):016x}"]
            assert span.trace_id == run.id.hex and span.parent_span_id == f"{run_span_id(run.id):016x}"
            assert span.attributes["yuxi.sequence"] == row.sequence
            assert span.attributes["yuxi.operation_id"] == row.operation_id
            assert span.start_ns == int((row.started_at or row.finished_at).timestamp() * 1e6) * 1000
            if row.role == Message.Role.ASSISTANT:
                assert span.name.startswith("chat ") and span.attributes["gen_ai.operation.name"] == "chat"
                if row.usage:
                    assert span.attributes["gen_ai.usage.input_tokens"] == row.usage["input_tokens"]
                    assert span.attributes["gen_ai.usage.output_tokens"] == row.usage["output_tokens"]
                else:
                    # A call that failed before its first chunk keeps its row
                    # (R-MA-10): usage unknown, never exported as 0.
                    assert "gen_ai.usage.input_tokens" not in span.attributes
            else:
                assert span.name == f"execute_tool {row.tool_name}"
                assert span.attributes["gen_ai.tool.name"] == row.tool_name
                assert span.attributes["gen_ai.tool.call.id"] == row.operation_id
                # Linked to the model call that declared it, in its own run.
                declaring = row.declared_by
                assert span.links == [
                    (declaring.run_id.hex, f"{row_span_id(declaring.pk):016x}", {"yuxi.link": "declared_by"})
                ]
            assert span.status_code == (OK if row.execution_status == "completed" else ERROR)

    # The resume's tool was declared by the interrupted run's model call.
    (send_email,) = Message.objects.tool_executions().filter(run=runs["resume"])
    assert send_email.declared_by.run_id == runs["interrupted"].id
    resume_root = spans[f"{run_span_id(runs['resume'].id):016x}"]
    assert resume_root.links == [
        (runs["interrupted"].id.hex, f"{run_span_id(runs['interrupted'].id):016x}", {"yuxi.link": "resumes"})
    ]
    # Content is off by default: no messages, no tool payloads.
    assert not any(
        key.startswith(
            ("gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.tool.call.arguments", "gen_ai.tool.call.result")
        )
        for span in spans.values()
        for key in span.attributes
    )

    cursor = ExportCursor.objects.get()
    assert cursor.exported_runs == 5 and cursor.exported_spans == len(spans)
    requests = receiver.requests
    again = export_closed_runs(receiver=exporter(receiver))
    assert again.runs == 0 and again.caught_up and receiver.requests == requests


def test_content_only_when_enabled_and_large_payloads_truncated_R_OTEL_1(user, replay_models, export_config, receiver):
    export_config.OTEL_EXPORT_CONTENT = True
    export_config.OTEL_EXPORT_MAX_PAYLOAD_CHARS = 50
    run = execute(user, "large_lookup", "Look up the docs")
    assert export_closed_runs(receiver=exporter(receiver)).runs == 1
    spans = receiver.unique()
    root = spans[f"{run_span_id(run.id):016x}"]
    assert '"content": "Look up the docs"' in root.attributes["gen_ai.input.messages"]
    (tool_row,) = Message.objects.tool_executions().filter(run=run)
    tool = spans[f"{row_span_id(tool_row.pk):016x}"]
    assert len(tool_row.content) > 50
    result = tool.attributes["gen_ai.tool.call.result"]
    assert result.startswith(tool_row.content[:50])
    assert result.endswith(f"…[truncated {len(tool_row.content) - 50} of {len(tool_row.content)} chars]")
    assert "gen_ai.tool.call.arguments" in tool.attributes
    model_rows = Message.objects.model_calls().filter(run=run)
    assert all("gen_ai.output.messages" in spans[f"{row_span_id(r.pk):016x}"].attributes for r in model_rows)


def test_text_postgresql_cannot_hold_never_blocks_the_export_R_OTEL_1_R_RUN_13(
    user, thread, replay_models, export_config, receiver
):
    """A run with a NUL and a lone surrogate in its input, tool input and
    output, tool error and answer is exported with that text in the admin's
    form (``visible``), cut before it is escaped; a run that finished after
    it is exported too. The lone surrogate used to make the OTLP protobuf
    unencodable: every pass failed on that run and the cursor never moved."""
    export_config.OTEL_EXPORT_CONTENT = True
    awkward = awkward_run(thread)
    after = execute(user, "plain_answer")
    result = export_closed_runs(receiver=exporter(receiver))
    assert result.error == "" and result.caught_up and result.runs == 2
    assert ExportCursor.objects.get().run_id == after.id
    spans = receiver.unique()
    assert set(spans) == expected_span_ids([awkward, after])

    root = spans[f"{run_span_id(awkward.id):016x}"]
    (message,) = json.loads(root.attributes["gen_ai.input.messages"])
    assert message["parts"][0]["content"] == AWKWARD_VISIBLE
    (answer,) = json.loads(root.attributes["gen_ai.output.messages"])
    assert answer["parts"][0]["content"] == AWKWARD_VISIBLE
    rows = {row.sequence: row for row in Message.objects.audit().filter(run=awkward)}
    declaring = json.loads(spans[f"{row_span_id(rows[1].pk):016x}"].attributes["gen_ai.output.messages"])[0]
    assert declaring["parts"][0]["content"] == AWKWARD_VISIBLE
    assert [part["arguments"] for part in declaring["parts"][1:]] == [{"query": AWKWARD_VISIBLE}] * 2
    for sequence in (2, 3):
        tool = spans[f"{row_span_id(rows[sequence].pk):016x}"]
        assert tool.attributes["gen_ai.tool.call.result"] == AWKWARD_VISIBLE
        assert json.loads(tool.attributes["gen_ai.tool.call.arguments"]) == {"query": AWKWARD_VISIBLE}
    failed = spans[f"{row_span_id(rows[3].pk):016x}"]
    assert failed.status_code == ERROR and failed.status_message == AWKWARD_VISIBLE

    # Cut to 16 characters: the NUL and the lone surrogate count as one each
    # and are escaped after the cut, so the cut never splits an escape (and
    # the literal \u000 left of the cut needs none).
    export_config.OTEL_EXPORT_MAX_PAYLOAD_CHARS = 16
    assert export_closed_runs(receiver=exporter(receiver), cursor_name="short").runs == 2
    short = receiver.unique()[f"{row_span_id(rows[2].pk):016x}"]
    cut = f"…[truncated {len(AWKWARD) - 16} of {len(AWKWARD)} chars]"
    assert short.attributes["gen_ai.tool.call.result"] == "Par\\u0000is \\ud800 C:\\u000" + cut


def test_receiver_failing_mid_export_loses_and_duplicates_nothing_R_OTEL_1(
    user, replay_models, export_config, receiver
):
    export_config.OTEL_EXPORT_BATCH_SPANS = 2
    runs = [execute(user, "tool_then_answer", f"Weather {i}?") for i in range(4)]  # 4 spans each
    expected = expected_span_ids(runs)
    assert len(expected) == 16

    # Two requests accepted, the third stored but answered 503 (the exporter
    # cannot know the receiver kept it), then the receiver refuses.
    receiver.script = ["ok", "ok", "store-503"]
    receiver.default = "503"
    first = export_closed_runs(receiver=exporter(receiver, timeout=1.5))
    assert first.error and "503" in first.error and not first.caught_up
    assert first.runs == 1  # the first run's 4 spans went in requests 1 and 2
    cursor = ExportCursor.objects.get()
    assert (cursor.finished_at, cursor.run_id) == (runs[0].finished_at, runs[0].id)

    # The receiver dies: the pass fails at once, the cursor stays.
    receiver.stop()
    dead = export_closed_runs(receiver=exporter(receiver, timeout=1.0))
    assert dead.error and "no answer" in dead.error and dead.runs == 0
    assert ExportCursor.objects.get().run_id == runs[0].id

    # Back again: everything arrives; what it got twice is the same span.
    receiver.restart()
    receiver.default = "ok"
    last = export_closed_runs(receiver=exporter(receiver))
    assert last.error == "" and last.caught_up and last.runs == 3
    assert set(receiver.unique()) == expected
    twice = [span_id for span_id, n in receiver.duplicates().items() if n > 1]
    assert twice  # the request answered 503 was sent again...
    for span_id in twice:  # ...as the very same spans
        copies = [s for s in receiver.spans if s.span_id == span_id]
        assert all(c == copies[0] for c in copies)
    assert ExportCursor.objects.get().exported_runs == 4
    assert export_closed_runs(receiver=exporter(receiver)).runs == 0


def test_a_request_ending_inside_a_run_does_not_move_the_cursor_past_it_R_OTEL_1(
    user, replay_models, export_config, receiver
):
    """Issue 35: a run marked exported before its spans were queued
    survived the fast suite, whose requests all ended on a run boundary.
    Requests of 3 spans, runs of 4: the first request ends inside the first
    run and is accepted, the second (its last span and the next run's
    first) is refused. No run is wholly accepted, so the cursor stays."""
    export_config.OTEL_EXPORT_BATCH_SPANS = 3
    runs = [execute(user, "tool_then_answer", f"Weather {i}?") for i in range(2)]  # 4 spans each
    receiver.script = ["ok"]
    receiver.default = "503"
    first = export_closed_runs(receiver=exporter(receiver, timeout=1.5))
    assert first.error and first.runs == 0 and receiver.requests >= 2
    assert ExportCursor.objects.get().run_id is None
    sent_first = {span.span_id for span in receiver.spans}
    assert len(sent_first) == 3

    receiver.default = "ok"
    again = export_closed_runs(receiver=exporter(receiver))
    assert again.error == "" and again.caught_up and again.runs == 2
    assert set(receiver.unique()) == expected_span_ids(runs)
    # Sent again only what the first pass could not count as a whole run.
    assert {span_id for span_id, n in receiver.duplicates().items() if n > 1} == sent_first
    assert max(receiver.duplicates().values()) == 2


@pytest.mark.parametrize("redirect", ["302", "307"])
def test_a_redirect_is_not_an_acceptance_R_OTEL_1(user, replay_models, export_config, receiver, redirect):
    """Issue 35: the SDK counts any status below 400 as success; a 3xx
    counted as accepted survived the suite. The receiver stored nothing,
    so the cursor stays and the next pass sends the run."""
    run = execute(user, "plain_answer")
    receiver.default = redirect
    refused = export_closed_runs(receiver=exporter(receiver))
    assert f"HTTP {redirect}" in refused.error and not refused.caught_up and refused.runs == 0
    assert receiver.requests == 1 and receiver.spans == []
    assert ExportCursor.objects.get().run_id is None
    receiver.default = "ok"
    assert export_closed_runs(receiver=exporter(receiver)).runs == 1
    assert set(receiver.unique()) == expected_span_ids([run])


def test_an_open_terminal_transaction_holds_the_cursor_back_R_OTEL_1(
    user, replay_models, export_config, receiver, db_name
):
    early = execute(user, "plain_answer")
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    slow = make_run(thread)
    settings = connection.settings_dict
    other = psycopg.connect(
        host=settings["HOST"] or "127.0.0.1", port=settings["PORT"] or 5432, user=settings["USER"], dbname=db_name
    )
    try:
        # A terminal transaction that has set finished_at but not committed.
        other.execute(
            "UPDATE audit_agentrun SET status = 'failed', error_type = 'slow', finished_at = clock_timestamp() WHERE id = %s",
            [slow.id],
        )
        late = execute(user, "plain_answer")  # finishes and commits after it
        first = export_closed_runs(receiver=exporter(receiver))
        assert first.runs == 1 and "open since" in first.waiting_for
        assert {s.trace_id for s in receiver.spans} == {early.id.hex}
        other.commit()
    finally:
        other.close()
    second = export_closed_runs(receiver=exporter(receiver))
    assert second.runs == 2 and second.waiting_for == ""
    assert {s.trace_id for s in receiver.spans} == {early.id.hex, slow.id.hex, late.id.hex}


def test_export_otel_command_and_beat_task_run_the_same_export_R_OTEL_1(
    user, replay_models, export_config, receiver, capsys
):
    from otel_export.tasks import export

    first = execute(user, "tool_then_answer")
    export_config.OTEL_EXPORTER_OTLP_ENDPOINT = ""
    with pytest.raises(CommandError, match="OTEL_EXPORTER_OTLP_ENDPOINT is not set"):
        call_command("export_otel", "--once")

    export_config.OTEL_EXPORTER_OTLP_ENDPOINT = receiver.endpoint
    receiver.default = "503"
    export_config.OTEL_EXPORTER_OTLP_TIMEOUT = 1.0
    with pytest.raises(CommandError, match="503"):
        call_command("export_otel", "--once")
    assert ExportCursor.objects.get().run_id is None

    receiver.default = "ok"
    call_command("export_otel", "--once")
    out = capsys.readouterr().out
    assert "exported 1/1 runs (4 spans, 1 requests)" in out and "done: 1 runs, 4 spans" in out
    call_command("export_otel", "--once")
    assert "nothing new to export" in capsys.readouterr().out

    second = execute(user, "plain_answer")
    assert export() == 1
    assert {s.trace_id for s in receiver.spans} == {first.id.hex, second.id.hex}


def test_interrupted_run_cancelled_later_is_exported_again_with_the_same_ids_R_OTEL_1(
    user, replay_models, export_config, receiver
):
    run = execute(user, "approval_send_email", "Mail Bob")
    assert run.status == "interrupted"
    assert export_closed_runs(receiver=exporter(receiver)).runs == 1
    first = receiver.unique()
    root_id = f"{run_span_id(run.id):016x}"
    assert first[root_id].status_code == OK

    ledger.run_request_cancel(user=user, run_id=run.id)  # gives the approval up
    again = export_closed_runs(receiver=exporter(receiver))
    assert again.runs == 1
    latest = receiver.unique()
    assert set(latest) == set(first)  # the same spans, by id
    assert latest[root_id].status_code == ERROR and latest[root_id].attributes["yuxi.run.status"] == "cancelled"
    assert export_closed_runs(receiver=exporter(receiver)).runs == 0


def test_one_export_pass_at_a_time_R_OTEL_1(user, replay_models, export_config, receiver, db_name):
    from otel_export.services import DEFAULT_CURSOR, exporter_lock_key

    run = execute(user, "plain_answer")
    settings = connection.settings_dict
    other = psycopg.connect(
        host=settings["HOST"] or "127.0.0.1", port=settings["PORT"] or 5432, user=settings["USER"], dbname=db_name
    )
    other.autocommit = True
    key = exporter_lock_key(DEFAULT_CURSOR)
    try:
        other.execute("SELECT pg_advisory_lock(%s)", [key])
        busy = export_closed_runs(receiver=exporter(receiver))
        assert busy.busy and busy.runs == 0 and receiver.requests == 0
        export_config.OTEL_EXPORTER_OTLP_ENDPOINT = receiver.endpoint
        with pytest.raises(CommandError, match="another export pass"):
            call_command("export_otel", "--once")
        other.execute("SELECT pg_advisory_unlock(%s)", [key])
    finally:
        other.close()
    assert export_closed_runs(receiver=exporter(receiver)).runs == 1
    assert {s.trace_id for s in receiver.spans} == {run.id.hex}


def test_the_applications_sampler_and_limits_do_not_thin_the_export_R_OTEL_1(
    user, replay_models, export_config, receiver, monkeypatch
):
    run = execute(user, "tool_then_answer")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "2")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    export_config.OTEL_EXPORTER_OTLP_ENDPOINT = receiver.endpoint
    with pytest.raises(CommandError, match="OTEL_SDK_DISABLED"):
        call_command("export_otel", "--once")
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    assert export_closed_runs(receiver=exporter(receiver)).runs == 1
    spans = receiver.unique()
    assert set(spans) == expected_span_ids([run])
    assert all(len(span.attributes) > 2 for span in spans.values())


def test_a_subagents_calls_are_children_of_the_task_call_that_spawned_it_R_OTEL_1_R_SUB_1(
    user, replay_models, export_config, receiver
):
    thread = Conversation.objects.create(user=user, agent_id="researcher", model="replay:researcher_fact_check")
    run = make_run(thread, text="Check the retention policy")
    run_execute(run_id=run.id, owner="in-process")
    assert AgentRun.objects.get(pk=run.pk).status == "completed"
    assert export_closed_runs(receiver=exporter(receiver)).runs == 1
    spans = receiver.unique()

    rows = list(Message.objects.audit().filter(run=run))
    task = next(r for r in rows if r.tool_name == "task")
    children = [r for r in rows if r.parent_operation_id]
    assert children and {r.parent_operation_id for r in children} == {task.operation_id}
    for row in rows:
        span = spans[f"{row_span_id(row.pk):016x}"]
        if row.parent_operation_id:
            assert span.parent_span_id == f"{row_span_id(task.pk):016x}"
            assert span.attributes["yuxi.namespace"] == row.namespace
            assert span.attributes["yuxi.parent_operation_id"] == task.operation_id
        else:
            assert span.parent_span_id == f"{run_span_id(run.id):016x}"
            assert "yuxi.namespace" not in span.attributes


def _spans_of(receiver: OtlpReceiver, run: AgentRun) -> dict[str, object]:
    """``{operation_id or "run": span}`` of one exported run."""
    spans = receiver.unique()
    found = {"run": spans[f"{run_span_id(run.id):016x}"]}
    for row in Message.objects.audit().filter(run=run):
        found[row.operation_id] = spans[f"{row_span_id(row.pk):016x}"]
    return found


def test_spans_follow_the_current_genai_conventions_R_OTEL_2(user, replay_models, export_config, receiver):
    usage_run = execute(user, "usage_final_details")
    handled = execute(user, "tool_error_handled", "Weather in Atlantis?")
    unhandled = execute(user, "tool_error_unhandled", "1/0?")
    http_error = execute(user, "model_http_error")
    broken = execute(user, "model_error_midstream")
    assert export_closed_runs(receiver=exporter(receiver)).error == ""

    # Reasoning tokens under the conventions' name, and the provider's id of
    # each answer (the replay server's chatcmpl-… ids, as OpenAI sends them).
    (call,) = Message.objects.model_calls().filter(run=usage_run)
    chat = _spans_of(receiver, usage_run)[call.operation_id].attributes
    assert chat["gen_ai.usage.reasoning.output_tokens"] == 2 and chat["gen_ai.usage.output_tokens"] == 7
    assert not [name for name in chat if name.startswith("yuxi.usage.reasoning")]
    assert call.metadata["response_id"].startswith("chatcmpl-replay-")
    assert chat["gen_ai.response.id"] == call.metadata["response_id"]

    # error.type is the error's type, never a row status.
    def tool_error_type(run: AgentRun) -> str:
        (row,) = Message.objects.audit().filter(run=run, role=Message.Role.TOOL)
        assert row.execution_status == "failed"
        return _spans_of(receiver, run)[row.operation_id].attributes["error.type"]

    # The tool raised: its exception's class. The tool answered with an
    # error of its own (a ToolException it handled): the class of that.
    assert tool_error_type(unhandled) == "ZeroDivisionError"
    assert tool_error_type(handled) == "tool_error"
    for run, expected in ((http_error, "model_http_error"), (broken, "model_stream_broken")):
        (row,) = Message.objects.model_calls().filter(run=run)
        assert row.execution_status == "failed"
        span = _spans_of(receiver, run)
        assert span[row.operation_id].attributes["error.type"] == expected
        assert span["run"].attributes["error.type"] == run.error_type != "failed"


@pytest.mark.parametrize("content", [False, True])
def test_a_page_of_runs_costs_the_queries_of_one_run_R_OTEL_1(user, replay_models, export_config, receiver, content):
    """Issue 38: each run's rows were read by a query (a named cursor) of
    their own, 15 times slower than reading them in one. The rows of a page
    of runs are one query, with only the columns the spans need: a column
    the spans read but the query left out would cost a query per row."""
    from django.test.utils import CaptureQueriesContext

    export_config.OTEL_EXPORT_CONTENT = content

    def queries_of_a_pass(cursor_name: str, runs: int) -> int:
        with CaptureQueriesContext(connection) as queries:
            result = export_closed_runs(receiver=exporter(receiver), cursor_name=cursor_name)
        assert result.runs == runs and result.requests == 1
        return len(queries)

    execute(user, "tool_then_answer", "Weather 0?")
    one = queries_of_a_pass("one", 1)
    for i in (1, 2):
        execute(user, "tool_then_answer", f"Weather {i}?")
    assert queries_of_a_pass("three", 3) == one


def test_the_cursor_moves_without_waiting_for_the_disk_R_OTEL_1(user, replay_models, export_config, receiver):
    """Each accepted request moves the cursor in a transaction of its own
    whose commit does not wait for the WAL flush (a loaded machine spent 50
    ms per move): a move lost to a crash of PostgreSQL sends its runs again
    with the same ids, as a crash of the exporter does."""
    from django.test.utils import CaptureQueriesContext

    execute(user, "tool_then_answer", "Weather?")
    with CaptureQueriesContext(connection) as queries:
        result = export_closed_runs(receiver=exporter(receiver), cursor_name="relaxed")
    assert result.runs == 1
    statements = [q["sql"] for q in queries.captured_queries]
    move = next(i for i, sql in enumerate(statements) if sql.startswith('UPDATE "otel_export_exportcursor"'))
    assert statements[move - 1] == "SET LOCAL synchronous_commit TO OFF"
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "on", "only that transaction"


def test_without_server_side_cursors_the_rows_are_read_with_an_ordinary_cursor_R_OTEL_1(
    user, replay_models, export_config, receiver, monkeypatch
):
    """Behind PgBouncer (DISABLE_SERVER_SIDE_CURSORS, docs/scaling.md) a
    cursor that lives across fetches would fail: the export reads its rows
    with an ordinary one."""

    def no_server_side_cursor():
        raise AssertionError("a server-side cursor was opened")

    execute(user, "tool_then_answer", "Weather?")
    monkeypatch.setitem(connection.settings_dict, "DISABLE_SERVER_SIDE_CURSORS", True)
    monkeypatch.setattr(connection, "chunked_cursor", no_server_side_cursor)
    result = export_closed_runs(receiver=exporter(receiver), cursor_name="pooled")
    assert result.runs == 1 and result.spans == len(receiver.unique()) > 1


def _comparable_sent(message: dict) -> tuple:
    """An OpenAI chat message as the GenAI shape below compares it."""
    if message["role"] == "tool":
        return ("tool", message["tool_call_id"], message["content"])
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "".join(block.get("text", "") for block in content)
    calls = tuple(
        (call["id"], call["function"]["name"], json.loads(call["function"]["arguments"]))
        for call in message.get("tool_calls") or []
    )
    return (message["role"], content, calls)


def _comparable_span(message: dict) -> tuple:
    parts = message["parts"]
    if message["role"] == "tool":
        (part,) = parts
        assert part["type"] == "tool_call_response"
        return ("tool", part["id"], part["response"])
    text = "".join(p["content"] for p in parts if p["type"] == "text")
    calls = tuple((p["id"], p["name"], p["arguments"]) for p in parts if p["type"] == "tool_call")
    return (message["role"], text, calls)


def test_chat_spans_carry_the_input_messages_rebuilt_from_the_rows_R_OTEL_2(
    user, replay_models, export_config, receiver, monkeypatch
):
    """Issue 37: a chat span carried its answer but not what the model was
    sent. The audit keeps no request (only its fingerprint): the turn's
    input and the run's earlier answers and tool results are rebuilt from
    the rows; what they cannot give (the system prompt, the thread's earlier
    turns) is named in ``yuxi.input.messages.omitted``. Checked against the
    requests the model server really received."""
    export_config.OTEL_EXPORT_CONTENT = True
    sent = sent_requests(monkeypatch)
    first = execute(user, "two_tools_then_answer", "Weather in Paris, in Fahrenheit?")
    second = make_run(Conversation.objects.get(pk=first.thread_id), text="And in Kelvin?")
    run_execute(run_id=second.id, owner="in-process")
    second.refresh_from_db()
    assert (first.status, second.status) == ("completed", "completed")
    assert export_closed_runs(receiver=exporter(receiver)).runs == 2

    calls = [
        (run, row)
        for run in (first, second)
        for row in Message.objects.model_calls().filter(run=run).order_by("sequence")
    ]
    assert len(calls) == len(sent) == 6
    for (run, row), request in zip(calls, sent, strict=True):
        span = _spans_of(receiver, run)[row.operation_id]
        rebuilt = json.loads(span.attributes["gen_ai.input.messages"])
        conversation = [m for m in request if m["role"] != "system"]
        # What was sent, but for the earlier turn of the thread: exactly the rebuilt messages.
        assert [_comparable_span(m) for m in rebuilt] == [
            _comparable_sent(m) for m in conversation[len(conversation) - len(rebuilt) :]
        ]
        assert rebuilt[0]["role"] == "user" and rebuilt[0]["parts"][0]["content"] == run.input["text"]
        omitted = span.attributes["yuxi.input.messages.omitted"]
        if run == first:
            assert len(rebuilt) == len(conversation)  # nothing of this turn left out
            assert omitted == ["system_instructions"]
        else:
            assert len(rebuilt) < len(conversation)  # the first turn was sent too
            assert omitted == ["system_instructions", "earlier_runs"]
        assert "yuxi.input.messages.dropped" not in span.attributes

    # Bounded as the output messages are: every payload cut at the limit,
    # the oldest messages of the run dropped (and counted) past 4 times it;
    # the turn's input always first.
    export_config.OTEL_EXPORT_MAX_PAYLOAD_CHARS = 10
    assert export_closed_runs(receiver=exporter(receiver), cursor_name="short").runs == 2
    last = calls[2][1]
    span = _spans_of(receiver, first)[last.operation_id]
    rebuilt = json.loads(span.attributes["gen_ai.input.messages"])
    assert rebuilt[0]["parts"][0]["content"] == "Weather in…[truncated 22 of 32 chars]"
    assert span.attributes["yuxi.input.messages.dropped"] + len(rebuilt) == 5
    assert span.attributes["yuxi.input.messages.dropped"] > 0
    for message in rebuilt:
        for part in message["parts"]:
            text = part.get("content") or part.get("response") or ""
            assert len(text.partition("…[truncated")[0]) <= 10


def test_chat_spans_carry_no_input_messages_with_content_off_R_OTEL_2(user, replay_models, export_config, receiver):
    run = execute(user, "tool_then_answer")
    assert export_closed_runs(receiver=exporter(receiver)).runs == 1
    for span in _spans_of(receiver, run).values():
        assert not [key for key in span.attributes if key.startswith(("gen_ai.input", "yuxi.input"))]


def test_a_subagents_chat_spans_start_from_its_task_R_OTEL_2_R_SUB_1(
    user, replay_models, export_config, receiver, monkeypatch
):
    """A subagent is sent its task (the ``task`` call's description) and
    its own earlier answers and tool results, nothing of the run's turn:
    checked against the requests the model server received."""
    export_config.OTEL_EXPORT_CONTENT = True
    sent = sent_requests(monkeypatch)
    thread = Conversation.objects.create(user=user, agent_id="researcher", model="replay:researcher_fact_check")
    run = make_run(thread, text="Check the retention policy")
    run_execute(run_id=run.id, owner="in-process")
    assert AgentRun.objects.get(pk=run.pk).status == "completed"
    assert export_closed_runs(receiver=exporter(receiver)).runs == 1

    spans = _spans_of(receiver, run)
    calls = list(Message.objects.model_calls().filter(run=run).order_by("sequence"))
    assert len(calls) == len(sent) and any(row.namespace for row in calls)
    for row, request in zip(calls, sent, strict=True):
        span = spans[row.operation_id]
        rebuilt = json.loads(span.attributes["gen_ai.input.messages"])
        assert [_comparable_span(m) for m in rebuilt] == [_comparable_sent(m) for m in request if m["role"] != "system"]
        assert span.attributes["yuxi.input.messages.omitted"] == ["system_instructions"]


def test_a_resumes_chat_spans_name_the_interrupted_run_as_left_out_R_OTEL_2(
    user, replay_models, export_config, receiver, monkeypatch
):
    """A resume has no turn input of its own: its calls were sent the
    interrupted run's messages, then its own rows. The rebuilt input is the
    resume's rows, the tail of what was sent, and names ``earlier_runs``."""
    export_config.OTEL_EXPORT_CONTENT = True
    sent = sent_requests(monkeypatch)
    interrupted = execute(user, "approval_send_email", "Mail Bob")
    resume, _ = ledger.run_resume(
        user=user, run_id=interrupted.id, request_id=uuid.uuid4().hex, decisions=[{"type": "approve"}]
    )
    run_execute(run_id=resume.id, owner="in-process")
    assert export_closed_runs(receiver=exporter(receiver)).runs == 2

    calls = [
        (run, row)
        for run in (interrupted, resume)
        for row in Message.objects.model_calls().filter(run=run).order_by("sequence")
    ]
    assert len(calls) == len(sent) and calls[-1][0] == resume
    for (run, row), request in zip(calls, sent, strict=True):
        span = _spans_of(receiver, run)[row.operation_id]
        rebuilt = json.loads(span.attributes["gen_ai.input.messages"])
        conversation = [_comparable_sent(m) for m in request if m["role"] != "system"]
        assert rebuilt and [_comparable_span(m) for m in rebuilt] == conversation[len(conversation) - len(rebuilt) :]
        if run == resume:
            assert rebuilt[0]["role"] == "tool" and len(rebuilt) < len(conversation)
            assert span.attributes["yuxi.input.messages.omitted"] == ["system_instructions", "earlier_runs"]
