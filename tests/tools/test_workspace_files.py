"""Workspace files are per tool execution (R-TA-7): a tool call id that a
later run of the thread reuses (providers that number calls per response do
this) never overwrites an earlier run's file, each run's State names its own
file, and memory, history and the staff timeline name the same one. Runs go
through the real runner and the replay model server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from django.test import Client
from django.urls import reverse

from audit import ledger
from audit.execution.checkpoint import postgres_conninfo
from audit.execution.runner import run_execute
from conversations.models import Conversation, Message
from conversations.selectors import thread_history, thread_memory
from core.config import get_config
from core.workspace import (
    execution_file_name,
    large_result_path,
    legacy_large_result_path,
    outbox_path,
)
from tests.conftest import bearer, make_run

pytestmark = pytest.mark.django_db(transaction=True)

_PATH = re.compile(r"saved to the workspace file (\S+)\. Preview")


@pytest.fixture
def workspace_root(tmp_path, monkeypatch):
    monkeypatch.setattr(get_config(), "WORKSPACE_ROOT", tmp_path)
    return tmp_path


def _turn(thread: Conversation, scenario: str, text: str):
    """One turn of ``thread`` played by ``replay:<scenario>``: the replay
    server answers turn by turn, so the scenario is switched per run."""
    Conversation.objects.filter(pk=thread.pk).update(model=f"replay:{scenario}")
    thread.refresh_from_db()
    run = make_run(thread, text=text)
    status = run_execute(run_id=run.id, owner="in-process")
    run.refresh_from_db()
    return run, status


def _state_tool_messages(thread: Conversation) -> list:
    from langgraph.checkpoint.postgres import PostgresSaver

    with PostgresSaver.from_conn_string(postgres_conninfo()) as saver:
        checkpoint = saver.get_tuple({"configurable": {"thread_id": str(thread.id)}})
    return [m for m in checkpoint.checkpoint["channel_values"]["messages"] if m.type == "tool"]


def test_a_reused_tool_call_id_gets_one_large_result_file_per_run_R_TA_7(
    user, staff_user, replay_models, workspace_root
):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    run_a, status_a = _turn(thread, "reused_call_id_lookup_alpha", "look up alpha")
    state_after_a = [m.content for m in _state_tool_messages(thread)]
    run_b, status_b = _turn(thread, "reused_call_id_lookup_beta", "look up beta")
    assert (status_a, status_b) == ("completed", "completed")

    workspace = workspace_root / str(thread.id)
    expected = {
        run_a.id: large_result_path(run_id=str(run_a.id), tool_call_id="call_0"),
        run_b.id: large_result_path(run_id=str(run_b.id), tool_call_id="call_0"),
    }
    assert expected[run_a.id] != expected[run_b.id]
    assert (workspace / expected[run_a.id]).read_text().startswith("Results for 'alpha'")
    assert (workspace / expected[run_b.id]).read_text().startswith("Results for 'beta'")
    assert len((workspace / expected[run_a.id]).read_text()) == 5000

    # The State: run A's ToolMessage still names run A's file, run B's its own.
    tool_messages = _state_tool_messages(thread)
    assert [m.tool_call_id for m in tool_messages] == ["call_0", "call_0"]
    paths = [_PATH.search(m.content).group(1) for m in tool_messages]
    assert paths == [expected[run_a.id].as_posix(), expected[run_b.id].as_posix()]
    assert tool_messages[0].content == state_after_a[0]
    for message, query in zip(tool_messages, ("alpha", "beta"), strict=True):
        assert f"Preview:\nResults for '{query}'" in message.content
        assert (workspace / _PATH.search(message.content).group(1)).read_text().startswith(f"Results for '{query}'")

    # Memory and history show the same projection as the State; the staff
    # timeline names the same file.
    memory = [m for m in thread_memory(thread_id=thread.id, include_tools=True) if m["type"] == "tool"]
    assert [m["content"] for m in memory] == [m.content for m in tool_messages]
    history = [t for item in thread_history(thread=thread).items for t in item.tool_executions]
    assert {row.run_id for row in history} == {run_a.id, run_b.id}
    response = Client().get(f"/api/threads/{thread.id}/history", headers=bearer(user))
    executions = [t for item in response.json()["items"] for t in item["tool_executions"]]
    assert [t["content"] for t in executions] == [m.content for m in tool_messages]
    assert [t["workspace_path"] for t in executions] == [p for p in paths]
    assert [t["size_chars"] for t in executions] == [5000, 5000]
    timeline = [selectors_item for selectors_item in _timeline_tool_items(thread)]
    assert [t["workspace_path"] for t in timeline] == paths

    # The admin: each run's timeline and each tool row's page name its own file.
    admin = Client()
    admin.force_login(staff_user)
    for run, path in ((run_a, paths[0]), (run_b, paths[1])):
        page = admin.get(reverse("admin:audit_agentrun_change", args=[run.id])).content.decode()
        assert path in page and paths[1 - paths.index(path)] not in page
        row = Message.objects.get(run=run, role=Message.Role.TOOL)
        assert path in admin.get(reverse("admin:conversations_message_change", args=[row.id])).content.decode()


def _timeline_tool_items(thread):
    from audit.reads.selectors import thread_timeline, timeline_item

    page = thread_timeline(thread_id=thread.id)
    return [timeline_item(row, include_raw_output=True) for row in page.items if row.role == Message.Role.TOOL]


def test_two_approved_emails_with_one_call_id_leave_two_outbox_records_R_TA_7(user, replay_models, workspace_root):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    resumes = []
    for query in ("alpha", "beta"):
        run, status = _turn(thread, f"reused_call_id_email_{query}", f"email {query}")
        assert status == "interrupted", (run.error_type, run.error_message)
        resume, _ = ledger.run_resume(
            user=user, run_id=run.id, request_id=f"approve-{query}", decisions=[{"type": "approve"}]
        )
        assert run_execute(run_id=resume.id, owner="in-process") == "completed"
        resumes.append(resume)

    outbox = workspace_root / str(thread.id) / "outbox"
    records = sorted(outbox.rglob("*.json"))
    assert len(records) == 2
    for resume, query in zip(resumes, ("alpha", "beta"), strict=True):
        path = workspace_root / str(thread.id) / outbox_path(run_id=str(resume.id), tool_call_id="call_0")
        assert json.loads(path.read_text())["to"] == f"{query}@example.com"
        row = Message.objects.get(run=resume, role=Message.Role.TOOL, operation_id="call_0")
        assert row.execution_status == "completed"
        assert outbox_path(run_id=str(resume.id), tool_call_id="call_0").as_posix() in row.content


def test_a_large_result_written_before_per_execution_naming_keeps_its_path_R_TA_7(user, workspace_root):
    """Fallback for files of the old layout: a row whose result exists only
    at ``outputs/large_tool_results/<tool call id>`` (where its run's State
    points) is shown with that path; once the per-execution file exists,
    that one."""
    import datetime as dt

    from tests.conftest import acquire

    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:large_lookup")
    run = make_run(thread)
    lease = acquire(run)
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    call = {"id": "call_lookup_1", "name": "lookup_docs", "args": {"query": "q", "size": 9000}}
    ledger.model_call_start(lease=lease, operation_id="lc_run--m1", sequence=1, started_at=t0)
    ledger.model_call_finish(
        lease=lease, operation_id="lc_run--m1", content="", tool_calls=[call], usage=None, finished_at=t0, duration_ms=1
    )
    ledger.tool_call_start(
        lease=lease,
        tool_call_id="call_lookup_1",
        tool_name="lookup_docs",
        tool_input=call["args"],
        sequence=2,
        started_at=t0,
        declared_by_operation_id="lc_run--m1",
    )
    full = "y" * 9000
    ledger.tool_call_finish(
        lease=lease,
        tool_call_id="call_lookup_1",
        status="completed",
        content=full,
        raw_output={"content": full},
        finished_at=t0,
        duration_ms=1,
    )
    state = [
        ledger.StateMessage(kind="ai", id="lc_run--m1", tool_calls=[call]),
        ledger.StateMessage(kind="ai", id="lc_run--m2", content="done"),
    ]
    ledger.run_finish(lease=lease, status="completed", final_state=state)
    workspace = workspace_root / str(thread.id)
    legacy = workspace / legacy_large_result_path("call_lookup_1")
    legacy.parent.mkdir(parents=True)
    legacy.write_text(full)

    def shown() -> str:
        (tool,) = [m for m in thread_memory(thread_id=thread.id, include_tools=True) if m["type"] == "tool"]
        return _PATH.search(tool["content"]).group(1)

    assert shown() == "outputs/large_tool_results/call_lookup_1"
    current = workspace / large_result_path(run_id=str(run.id), tool_call_id="call_lookup_1")
    current.parent.mkdir(parents=True)
    current.write_text(full)
    assert shown() == f"outputs/large_tool_results/{run.id}/call_lookup_1"


@pytest.mark.parametrize(
    "tool_call_id",
    ["call_0", "../../etc/passwd", "a/b", "a_b", ".hidden", "..", "", "x" * 500, "日本", "\udcff"],
)
def test_execution_file_names_stay_in_their_folder_and_never_collide(tool_call_id):
    name = execution_file_name(tool_call_id)
    assert name and len(name) <= 120
    assert re.fullmatch(r"[A-Za-z0-9_-]+", name)
    path = large_result_path(run_id="r1", tool_call_id=tool_call_id)
    assert path.parent == Path("outputs/large_tool_results/r1")


def test_distinct_call_ids_get_distinct_file_names():
    ids = ["call_0", "a/b", "a_b", "a:b", "a b", "..", "_.", "x" * 500, "x" * 501, "日本", "日本語"]
    assert len({execution_file_name(i) for i in ids}) == len(ids)
