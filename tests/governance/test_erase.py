"""Erasure (R-GOV-2): erase_user leaves none of the user's words anywhere —
every text, JSON and binary column of every table of the database, and the
workspace — keeps the anonymous facts for statistics, records the erasure
and re-seals the runs (R-GOV-3). A real run (the in-process runner, the
replay model server, the PostgreSQL checkpointer) carries a unique marker
into every place a user's words can reach."""

from __future__ import annotations

import io
import json
import threading
import time
import uuid

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from audit.execution.rerun import load_source, replay
from audit.execution.runner import run_execute
from audit.models import AgentRun, RunReplay
from audit.replay.scenarios import load_scenarios
from audit.replay.server import make_server
from conversations.models import Conversation, Message, MessageFeedback
from core.config import get_config
from governance.models import GovernanceAction, RunReseal
from tests.conftest import make_run
from tests.waiting import WAIT_SECONDS

from .helpers import verify

pytestmark = pytest.mark.django_db(transaction=True)

MARKER = f"zqxmarker{uuid.uuid4().hex[:12]}"


@pytest.fixture
def marker_model(tmp_path, monkeypatch):
    """A replay model that echoes the marker: in its first answer, in the
    arguments of a large lookup (whose result quotes them), and in its final
    answer."""
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    (scenarios / "gov_marker.json").write_text(
        json.dumps(
            {
                "description": "echoes the erasure marker everywhere",
                "turns": [
                    {
                        "text": f"Looking up {MARKER}.",
                        "tool_calls": [
                            {
                                "id": "call_marker",
                                "name": "lookup_docs",
                                "arguments": {"query": MARKER, "size": 6000},
                            }
                        ],
                        "usage": {"prompt_tokens": 40, "completion_tokens": 12},
                    },
                    {"text": f"The answer about {MARKER}.", "usage": {"prompt_tokens": 90, "completion_tokens": 8}},
                ],
            }
        )
    )
    server = make_server(load_scenarios(scenarios), "127.0.0.1", 0)
    thread = threading.Thread(target=server.run, name="replay-marker", daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_SECONDS
    while server.base_url is None:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    monkeypatch.setattr(get_config(), "REPLAY_MODEL_URL", server.base_url)
    monkeypatch.setattr(get_config(), "WORKSPACE_ROOT", tmp_path / "workspaces")
    yield "replay:gov_marker"
    server.should_exit = True
    thread.join(timeout=5)


def scan(marker: str) -> set[str]:
    """``table.column`` of every text, JSON, tsvector and bytea column of
    the public schema that holds ``marker`` (case-insensitive: the search
    vector lower-cases)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT table_name, column_name, data_type FROM information_schema.columns
               JOIN information_schema.tables USING (table_schema, table_name)
               WHERE table_schema = 'public' AND table_type = 'BASE TABLE'
                 AND data_type IN ('text', 'character varying', 'character', 'json', 'jsonb', 'tsvector', 'bytea')"""
        )
        columns = cursor.fetchall()
        found = set()
        for table, column, data_type in columns:
            if data_type == "bytea":
                condition = f"position(convert_to(%s, 'UTF8') in \"{column}\") > 0"
                value = marker
            else:
                condition = f'"{column}"::text ILIKE %s'
                value = f"%{marker}%"
            cursor.execute(f'SELECT EXISTS (SELECT 1 FROM "{table}" WHERE {condition})', [value])
            if cursor.fetchone()[0]:
                found.add(f"{table}.{column}")
    return found


def files_with(root, marker: str) -> list[str]:
    return [str(path) for path in root.rglob("*") if path.is_file() and marker.encode() in path.read_bytes()] + [
        str(path) for path in root.rglob("*") if marker in path.name
    ]


def test_no_word_of_an_erased_user_is_left_anywhere_R_GOV_2(user, marker_model, tmp_path):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model=marker_model, title=f"About {MARKER}")
    run = make_run(thread, text=f"Tell me about {MARKER}, please.")
    assert run_execute(run_id=run.id, owner="in-process") == "completed"
    run.refresh_from_db()
    MessageFeedback.objects.create(
        message_id=run.output_message_id, user=user, rating="dislike", reason=f"It got {MARKER} wrong"
    )
    # A replay copies the turn onto a scratch thread of the replay user, and
    # a replay report may quote it (R-REPLAY-2): erased with the user.
    replayed = replay(load_source(str(run.id)))
    assert replayed.identical, replayed.text()
    RunReplay.objects.create(run=run, status="diverged", report=f"step 2: text\n  expected: The answer about {MARKER}.")
    workspace = tmp_path / "workspaces"
    before = scan(MARKER)
    # The marker reached every place: the scan can see each of them.
    for place in (
        "conversations_message.content",
        "conversations_message.tool_calls",
        "conversations_message.tool_input",
        "conversations_message.metadata",
        "conversations_message.search_vector",
        "conversations_conversation.title",
        "conversations_messagefeedback.reason",
        "audit_agentrun.input",
        "audit_runreplay.report",
    ):
        assert place in before, place
    assert {p for p in before if p.startswith("checkpoint")}, before
    replay_rows = Message.objects.filter(run_id__in=replayed.run_ids)
    assert any(MARKER in (row.content or "") for row in replay_rows), "the replay holds the marker"
    assert files_with(workspace, MARKER), "the large result file holds the marker"
    stats = (
        list(Message.objects.order_by("id").values_list("id", "role", "execution_status", "usage", "cost_usd")),
        list(AgentRun.objects.values_list("id", "status", "usage")),
        list(MessageFeedback.objects.values_list("rating", flat=True)),
    )
    old_head = AgentRun.objects.get(pk=run.pk).seal_head

    out = io.StringIO()
    call_command("erase_user", user.username, stdout=out, stderr=io.StringIO())

    assert scan(MARKER) == set()
    assert files_with(workspace, MARKER) == []
    # Anonymous facts stay for statistics.
    assert stats == (
        list(Message.objects.order_by("id").values_list("id", "role", "execution_status", "usage", "cost_usd")),
        list(AgentRun.objects.values_list("id", "status", "usage")),
        list(MessageFeedback.objects.values_list("rating", flat=True)),
    )
    assert set(Message.objects.filter(role="tool").values_list("tool_name", flat=True)) == {"lookup_docs"}
    # Recorded, by user id only, and re-sealed keeping the old head.
    action = GovernanceAction.objects.get(kind="erasure")
    assert action.subject_user_id == user.pk and action.status == "completed" and action.rows_changed >= 4
    reseal = RunReseal.objects.get(action=action, run_id=run.pk)
    assert reseal.previous_head == old_head != reseal.head and reseal.previous_verified
    assert verify()[0] == 0
    account = get_user_model().objects.get(pk=user.pk)
    assert account.username == f"erased-user-{user.pk}" and not account.is_active
    assert f"erasure #{action.pk}" in out.getvalue()


def test_bad_input_changes_nothing_R_GOV_2(user, thread):
    with pytest.raises(CommandError, match="no user named 'nobody-here'"):
        call_command("erase_user", "nobody-here", stdout=io.StringIO(), stderr=io.StringIO())
    run = make_run(thread, text="still waiting")
    with pytest.raises(CommandError, match="not yet terminal"):
        call_command("erase_user", user.username, stdout=io.StringIO(), stderr=io.StringIO())
    out = io.StringIO()
    AgentRun.objects.filter(pk=run.pk).update(status="cancelled")
    call_command("erase_user", user.username, "--dry-run", stdout=out, stderr=io.StringIO())
    assert "would erase 1 messages in 1 threads, 1 runs" in out.getvalue()
    assert not GovernanceAction.objects.exists()
    assert Message.objects.get(run=run).content == "still waiting"
    assert get_user_model().objects.get(pk=user.pk).username == user.username
