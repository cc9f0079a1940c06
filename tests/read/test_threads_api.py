"""Threads for a chat sidebar (R-API-1): rename and archive a thread
(``PATCH /api/threads/{thread_id}``), list a thread's runs, filter the
thread list."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from conversations.models import Conversation
from tests.conftest import bearer

pytestmark = pytest.mark.django_db


def patch(thread, body, *, user=None) -> object:
    return Client().patch(
        f"/api/threads/{thread.id}",
        json.dumps(body) if not isinstance(body, str) else body,
        content_type="application/json",
        headers=bearer(user or thread.user),
    )


def test_patch_renames_and_archives_only_the_fields_given_R_API_1(thread):
    thread.title = "old"
    thread.save()
    response = patch(thread, {"title": "Trip to Paris"})
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["title"], body["archived"], body["status"]) == ("Trip to Paris", False, "active")
    assert body["thread_id"] == str(thread.id)

    response = patch(thread, {"archived": True})
    assert response.status_code == 200
    assert (response.json()["title"], response.json()["archived"], response.json()["status"]) == (
        "Trip to Paris",
        True,
        "archived",
    )
    thread.refresh_from_db()
    assert (thread.title, thread.status, thread.archived) == ("Trip to Paris", "archived", True)

    response = patch(thread, {"archived": False, "title": "back"})
    assert (response.json()["title"], response.json()["archived"]) == ("back", False)
    assert Client().get(f"/api/threads/{thread.id}", headers=bearer(thread.user)).json()["archived"] is False


def test_patch_with_nothing_to_change_changes_nothing_R_API_1(thread):
    before = Conversation.objects.get(pk=thread.pk)
    response = patch(thread, {})
    assert response.status_code == 200
    assert Conversation.objects.get(pk=thread.pk).updated_at == before.updated_at


def test_patch_of_another_users_thread_is_404_and_changes_nothing_R_API_1_R_READ_5(thread, other_user):
    response = patch(thread, {"title": "mine now", "archived": True}, user=other_user)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    thread.refresh_from_db()
    assert (thread.title, thread.status) == ("", "active")


@pytest.mark.parametrize(
    "body",
    [
        {"title": ""},
        {"title": "   "},
        {"title": "x" * 201},
        {"title": None},
        {"title": 5},
        {"archived": "yes"},
        {"archived": 1},
        {"archived": None},
        {"status": "archived"},
        {"title": "ok", "agent_id": "other"},
        "[]",
        "not json",
    ],
    ids=repr,
)
def test_patch_refuses_bad_input_with_the_error_body_and_changes_nothing_R_API_1(thread, body):
    thread.title = "kept"
    thread.save()
    response = patch(thread, body)
    assert response.status_code == 422, response.content
    assert response.json()["error"]["code"] == "invalid_input"
    thread.refresh_from_db()
    assert (thread.title, thread.status, thread.agent_id) == ("kept", "active", "assistant")


def test_patch_keeps_the_longest_title_a_client_may_send_R_API_1(thread):
    response = patch(thread, {"title": "é" * 200})
    assert response.status_code == 200 and response.json()["title"] == "é" * 200


def test_patch_is_typed_in_the_openapi_document_R_API_1():
    from yuxi_project.api import api

    document = api.get_openapi_schema()
    operation = document["paths"]["/api/threads/{thread_id}"]["patch"]
    assert operation["operationId"] == "updateThread"
    assert {"200", "401", "403", "404", "422"} <= {str(code) for code in operation["responses"]}
    body = document["components"]["schemas"]["ThreadPatchIn"]
    assert body["additionalProperties"] is False
    assert body["properties"]["title"]["type"] == "string" and body["properties"]["title"]["minLength"] == 1
    assert body["properties"]["archived"]["type"] == "boolean"
    assert "archived" in document["components"]["schemas"]["ThreadOut"]["required"]


def test_a_session_patch_without_its_csrf_token_gets_the_documented_403_R_API_1(thread):
    client = Client(enforce_csrf_checks=True)
    client.force_login(thread.user)
    response = client.patch(f"/api/threads/{thread.id}", {"title": "x"}, content_type="application/json")
    assert response.status_code == 403 and response.json()["error"]["code"] == "csrf_failed"
    thread.refresh_from_db()
    assert thread.title == ""
