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


def test_white_space_is_the_same_for_the_schema_and_the_server_R_READ_6():
    """Found by schemathesis: "\\u00a0\\u0085" passed the schema's ``\\S``
    (JavaScript's white space has no U+0085) and the server, which strips
    it, refused it."""
    from audit.schemas import NOT_ONLY_WHITE_SPACE

    pattern = re.compile(NOT_ONLY_WHITE_SPACE)
    for code in range(0x110000):
        char = chr(code)
        assert (pattern.search(char) is None) == (char.strip() == ""), hex(code)
    schema = Client().get("/api/openapi.json").json()["components"]["schemas"]["TurnInput"]
    assert schema["properties"]["text"]["pattern"] == NOT_ONLY_WHITE_SPACE


@pytest.mark.parametrize(("text", "status"), [("\u00a0\u0085", 422), ("\x1c \u3000", 422), ("\ufeff", 202)])
def test_a_turn_of_white_space_is_refused_and_what_the_schema_allows_is_taken_R_READ_6(thread, text, status):
    import json
    import uuid

    body = {"request_id": uuid.uuid4().hex, "input": {"text": text}}
    response = Client().post(
        f"/api/threads/{thread.id}/runs", json.dumps(body), content_type="application/json", headers=bearer(thread.user)
    )
    assert response.status_code == status, response.content
    schema = Client().get("/api/openapi.json").json()["components"]["schemas"]["TurnInput"]
    assert (re.search(schema["properties"]["text"]["pattern"], text) is not None) == (status == 202)
