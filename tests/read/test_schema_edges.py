"""Where the OpenAPI document and the server must agree on an edge value
(found by schemathesis from a clean clone): an empty paging cursor is
malformed for both."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from tests.conftest import bearer

from .builders import tool_turn

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    "path",
    [
        "/api/threads/{thread_id}/history",
        "/api/threads/{thread_id}/runs",
        "/api/audit/runs/{run_id}/timeline",
        "/api/audit/threads/{thread_id}/timeline",
    ],
)
def test_an_empty_cursor_is_malformed_for_the_schema_and_the_server_R_READ_6(path, thread, staff_user):
    run = tool_turn(thread)
    user = staff_user if path.startswith("/api/audit/") else thread.user
    response = Client().get(path.format(thread_id=thread.id, run_id=run.id) + "?before=", headers=bearer(user))
    assert response.status_code == 422 and response.json()["error"]["reason"] == "bad_cursor"
    schema = Client().get("/api/openapi.json").json()["paths"][path]["get"]
    [before] = [p for p in schema["parameters"] if p["name"] == "before"]
    [text] = [s for s in before["schema"].get("anyOf", [before["schema"]]) if s["type"] == "string"]
    assert not re.search(text["pattern"], "") and text["minLength"] == 1
