"""The agent runtime rebuilds a thread's history from the memory selector
when the checkpointer no longer has it (R-READ-2), without binding or
duplicating the old messages into the new run (R-MA-9)."""

from __future__ import annotations

import asyncio

import pytest
from django.db import connection

from audit.agents.assistant import build_agent
from audit.execution.checkpoint import open_checkpointer, postgres_conninfo
from audit.execution.runner import run_execute
from conversations.models import Conversation, Message
from tests.conftest import make_run

pytestmark = pytest.mark.django_db(transaction=True)


def checkpoint_messages(thread) -> list:
    async def read():
        async with open_checkpointer(postgres_conninfo()) as saver:
            graph = build_agent("assistant", model=thread.model, checkpointer=saver)
            snapshot = await graph.aget_state({"configurable": {"thread_id": str(thread.id)}})
            return list((snapshot.values or {}).get("messages", []))

    return asyncio.run(read())


def test_lost_checkpoint_is_rebuilt_from_memory_R_READ_2_R_MA_9(user, replay_models):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:tool_then_answer")
    first = make_run(thread, text="weather in Paris?")
    assert run_execute(run_id=first.id, owner="w1") == "completed"
    first.refresh_from_db()
    with connection.cursor() as cursor:
        for table in ("checkpoint_writes", "checkpoint_blobs", "checkpoints"):
            cursor.execute(f"DELETE FROM {table} WHERE thread_id = %s", [str(thread.id)])
    assert checkpoint_messages(thread) == []

    second = make_run(thread, text="and tomorrow?")
    assert run_execute(run_id=second.id, owner="w2") == "completed"
    second.refresh_from_db()

    messages = checkpoint_messages(thread)
    kinds = [(m.type, m.content if m.type != "tool" else m.tool_call_id) for m in messages]
    assert kinds[:4] == [
        ("human", "weather in Paris?"),
        ("ai", Message.objects.get(run=first, operation_id__startswith="lc_run", message_type="model_audit").content),
        ("tool", "call_weather_paris"),
        ("ai", first.output_message.content),
    ]
    assert kinds[4] == ("human", "and tomorrow?")
    # The old calls stay the first run's: the second run has its own rows
    # only, and its output is its own answer.
    second_rows = Message.objects.filter(run=second).exclude(role="user")
    assert not second_rows.filter(operation_id__in=[m.id for m in messages[:4]]).exists()
    assert second.output_message.run_id == second.id


def test_a_threads_first_run_rebuilds_no_history_R_READ_2(user, replay_models, monkeypatch):
    # Nothing to rebuild: the lease acquisition already told that the run
    # has no earlier run in its thread, and no memory query is made. The
    # next turn with a lost checkpoint rebuilds it (test above).
    import audit.execution.runner

    calls = []
    monkeypatch.setattr(audit.execution.runner, "thread_memory_messages", lambda **kwargs: calls.append(kwargs) or [])
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:tool_then_answer")
    first = make_run(thread, text="weather in Paris?")
    assert run_execute(run_id=first.id, owner="w1") == "completed"
    assert calls == []
    with connection.cursor() as cursor:
        for table in ("checkpoint_writes", "checkpoint_blobs", "checkpoints"):
            cursor.execute(f"DELETE FROM {table} WHERE thread_id = %s", [str(thread.id)])
    second = make_run(thread, text="and tomorrow?")
    assert run_execute(run_id=second.id, owner="w2") == "completed"
    assert [call["before_run"].id for call in calls] == [second.id]
