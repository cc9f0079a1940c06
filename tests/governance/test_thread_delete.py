"""Deleting a thread (R-API-1): ``DELETE /api/threads/{thread_id}`` erases
the thread's content as a user's erasure does (R-GOV-2) — none of its words
left in any column of any table or in the workspace — keeps its anonymous
facts for statistics, re-seals its runs (R-GOV-3), and leaves the owner's
other threads as they were. A thread with a run pending or running answers
409 ``run_active`` unless ``cancel=true``."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest
from django.db import connection
from django.test import Client

from audit.execution.runner import run_execute
from audit.models import AgentRun
from conversations.models import Conversation, Message, MessageFeedback
from governance.models import GovernanceAction, RunReseal
from governance.services import _LOCK_KEY, deleted_threads_erase
from tests.conftest import bearer, make_run, run_answering
from tests.waiting import WAIT_SECONDS

from .helpers import MARKER, files_with, scan, verify

pytestmark = pytest.mark.django_db(transaction=True)


def delete(thread, *, user=None, query: str = ""):
    return Client().delete(f"/api/threads/{thread.id}{query}", headers=bearer(user or thread.user))


def answered_thread(user, model: str, text: str) -> tuple[Conversation, AgentRun]:
    thread = Conversation.objects.create(user=user, agent_id="assistant", model=model, title=f"About {text}")
    run = make_run(thread, text=text)
    assert run_execute(run_id=run.id, owner="in-process") == "completed"
    run.refresh_from_db()
    return thread, run


def _params() -> dict:
    settings = connection.settings_dict
    return {
        "dbname": settings["NAME"],
        "host": settings["HOST"] or "127.0.0.1",
        "port": settings["PORT"] or 5432,
        "user": settings["USER"],
    }


def test_deleting_a_thread_erases_its_words_keeps_its_figures_and_no_other_thread_R_API_1_R_GOV_2(
    user, marker_model, tmp_path
):
    kept_words = f"keepme{uuid.uuid4().hex[:10]}"
    thread, run = answered_thread(user, marker_model, f"Tell me about {MARKER}, please.")
    other = Conversation.objects.create(user=user, agent_id="assistant", model=marker_model, title=kept_words)
    other_run = make_run(other, text=f"Something else: {kept_words}")
    AgentRun.objects.filter(pk=other_run.pk).update(status="cancelled")
    MessageFeedback.objects.create(
        message_id=run.output_message_id, user=user, rating="dislike", reason=f"It got {MARKER} wrong"
    )
    before = scan(MARKER)
    assert {"conversations_message.content", "conversations_conversation.title", "audit_agentrun.input"} <= before
    assert {p for p in before if p.startswith("checkpoint")}, before
    assert files_with(tmp_path / "workspaces", MARKER)
    figures = (
        list(Message.objects.order_by("id").values_list("id", "role", "execution_status", "usage", "cost_usd")),
        list(AgentRun.objects.order_by("id").values_list("id", "status", "usage")),
        list(MessageFeedback.objects.values_list("rating", flat=True)),
    )
    old_head = AgentRun.objects.get(pk=run.pk).seal_head

    response = delete(thread)

    assert response.status_code == 200, response.content
    assert response.json() == {"thread_id": str(thread.id), "erased": True, "cancelled_runs": []}
    assert scan(MARKER) == set()
    assert files_with(tmp_path / "workspaces", MARKER) == []
    # The owner's other thread keeps every word.
    assert {"conversations_message.content", "conversations_conversation.title", "audit_agentrun.input"} <= scan(
        kept_words
    )
    # Statistics keep their figures; the thread stays, deleted and erased.
    assert figures == (
        list(Message.objects.order_by("id").values_list("id", "role", "execution_status", "usage", "cost_usd")),
        list(AgentRun.objects.order_by("id").values_list("id", "status", "usage")),
        list(MessageFeedback.objects.values_list("rating", flat=True)),
    )
    deleted = Conversation.objects.get(pk=thread.pk)
    assert deleted.status == "deleted" and deleted.erased_at is not None and deleted.title == ""
    # Recorded by thread, re-sealed keeping the old head; the user stays.
    action = GovernanceAction.objects.get(kind="erasure")
    assert action.criterion == {"thread_id": str(thread.id)} and action.subject_user_id == user.pk
    assert action.status == "completed" and action.actor == f"api user #{user.pk}"
    reseal = RunReseal.objects.get(action=action, run_id=run.pk)
    assert reseal.previous_head == old_head != reseal.head and reseal.previous_verified
    assert not RunReseal.objects.filter(run_id=other_run.pk).exists()
    assert verify()[0] == 0
    user.refresh_from_db()
    assert user.is_active and not user.username.startswith("erased-user-")


def test_a_deleted_thread_is_gone_from_every_api_R_API_1_R_READ_5(user, replay_models):
    thread, run = answered_thread(user, "replay:tool_then_answer", "weather in Paris?")
    headers = bearer(user)
    client = Client()
    assert delete(thread).status_code == 200
    assert client.get(f"/api/threads/{thread.id}", headers=headers).status_code == 404
    assert str(thread.id) not in {t["thread_id"] for t in client.get("/api/threads", headers=headers).json()["items"]}
    for path in (f"/api/threads/{thread.id}/history", f"/api/threads/{thread.id}/runs", f"/api/runs/{run.id}"):
        assert client.get(path, headers=headers).status_code == 404, path
    submit = client.post(
        f"/api/threads/{thread.id}/runs",
        json.dumps({"request_id": uuid.uuid4().hex, "input": {"text": "again"}}),
        content_type="application/json",
        headers=headers,
    )
    assert submit.status_code == 404 and not AgentRun.objects.filter(thread=thread).exclude(pk=run.pk).exists()
    feedback = client.post(
        f"/api/messages/{run.output_message_id}/feedback",
        json.dumps({"rating": "like"}),
        content_type="application/json",
        headers=headers,
    )
    assert feedback.status_code == 404 and not MessageFeedback.objects.exists()
    rename = client.patch(
        f"/api/threads/{thread.id}", json.dumps({"title": "back"}), content_type="application/json", headers=headers
    )
    assert rename.status_code == 404
    again = delete(thread)
    assert again.status_code == 404 and again.json()["error"]["code"] == "not_found"
    assert GovernanceAction.objects.count() == 1


def test_a_thread_with_a_pending_run_is_409_run_active_and_unchanged_unless_cancel_R_API_1(thread):
    run = make_run(thread, text="still waiting")
    response = delete(thread)
    assert response.status_code == 409, response.content
    error = response.json()["error"]
    assert error["code"] == "run_active" and error["runs"] == [str(run.id)]
    thread.refresh_from_db()
    assert thread.status == "active" and Message.objects.get(run=run).content == "still waiting"
    assert not GovernanceAction.objects.exists()

    response = delete(thread, query="?cancel=true")

    assert response.status_code == 200, response.content
    assert response.json() == {"thread_id": str(thread.id), "erased": True, "cancelled_runs": [str(run.id)]}
    assert AgentRun.objects.get(pk=run.pk).status == "cancelled"
    assert "still waiting" not in (Message.objects.get(run=run).content or "")


def test_a_running_run_is_cancelled_and_the_thread_erased_once_it_ended_R_API_1_R_RUN_6(user, replay_models):
    words = f"runningwords{uuid.uuid4().hex[:8]}"
    run, worker, result = run_answering(user)
    Message.objects.filter(run=run, role="user").update(content=words)  # a word of this thread's only
    thread = run.thread

    response = delete(thread, query="?cancel=true")

    # The worker stops at its next event boundary: erased at once (200) or,
    # on a slow machine, by the sweep once the run has ended (202).
    assert response.status_code in (200, 202), response.content
    assert response.json()["cancelled_runs"] == [str(run.id)]
    assert response.json()["erased"] is (response.status_code == 200)
    worker.join(WAIT_SECONDS)
    assert result["status"] == "cancelled"
    if response.status_code == 202:
        assert deleted_threads_erase(actor="test") == [thread.id]
    assert Conversation.objects.get(pk=thread.pk).erased_at is not None
    assert scan(words) == set()
    rows = Message.objects.filter(run=run, role="assistant")
    assert rows and all(row.execution_status == "interrupted" for row in rows)


def test_another_erasure_in_progress_defers_the_erasure_to_the_sweep_R_API_1_R_GOV_2(thread):
    run = make_run(thread, text="secret words")
    AgentRun.objects.filter(pk=run.pk).update(status="cancelled")
    # Another purge or erasure holds the lock, in another session.
    with psycopg.connect(**_params(), autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", [_LOCK_KEY])
        response = delete(thread)
        assert response.status_code == 202, response.content
        assert response.json() == {"thread_id": str(thread.id), "erased": False, "cancelled_runs": []}
        assert Client().get(f"/api/threads/{thread.id}", headers=bearer(thread.user)).status_code == 404
        assert Message.objects.get(run=run).content == "secret words"
        assert deleted_threads_erase(actor="test") == []

    assert deleted_threads_erase(actor="celery-beat") == [thread.id]
    assert "secret words" not in (Message.objects.get(run=run).content or "")
    assert deleted_threads_erase(actor="celery-beat") == []
    action = GovernanceAction.objects.get()
    assert action.actor == "celery-beat" and action.status == "completed"


def test_another_users_thread_or_a_bad_cancel_changes_nothing_R_API_1_R_READ_5(thread, other_user):
    response = delete(thread, user=other_user)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    response = delete(thread, query="?cancel=maybe")
    assert response.status_code == 422
    thread.refresh_from_db()
    assert thread.status == "active" and not GovernanceAction.objects.exists()


def test_delete_is_typed_in_the_openapi_document_R_API_1():
    operation = Client().get("/api/openapi.json").json()["paths"]["/api/threads/{thread_id}"]["delete"]
    assert {"200", "202", "401", "404", "409", "422", "503"} <= set(operation["responses"])
    assert [p["name"] for p in operation["parameters"] if p["in"] == "query"] == ["cancel"]
    body = operation["responses"]["202"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/ThreadDeletedOut")
