"""Erasure (R-GOV-2): erase_user leaves none of the user's words anywhere —
every text, JSON and binary column of every table of the database, and the
workspace — keeps the anonymous facts for statistics, records the erasure
and re-seals the runs (R-GOV-3). A real run (the in-process runner, the
replay model server, the PostgreSQL checkpointer) carries a unique marker
into every place a user's words can reach."""

from __future__ import annotations

import io

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError

from audit.execution.rerun import load_source, replay
from audit.execution.runner import run_execute
from audit.models import AgentRun, RunReplay
from conversations.models import Conversation, Message, MessageFeedback
from governance.models import GovernanceAction, RunReseal
from tests.conftest import make_run

from .helpers import MARKER, files_with, scan, verify

pytestmark = pytest.mark.django_db(transaction=True)


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
