"""Threads for a chat sidebar (R-API-1): rename and archive a thread
(``PATCH /api/threads/{thread_id}``), list a thread's runs, filter the
thread list."""

from __future__ import annotations

import json
import uuid

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from audit.models import AgentRun
from conversations.models import Conversation
from tests.admin.test_rough_edges import EMAIL_ARGS, INTERRUPT
from tests.conftest import bearer, make_run

from .builders import RunDriver, resume_run_of, tool_turn

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
        {"title": "\u3000\ufeff\x85\u2028"},
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


def test_a_refused_value_is_explained_in_words_not_as_its_pattern_R_API_1_R_READ_6(thread):
    response = patch(thread, {"title": " \u3000 "})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["message"] == "the request is malformed: title: must not be blank (only white space)"
    assert error["details"][0]["msg"] == "must not be blank (only white space)"
    assert error["details"][0]["loc"] == ["body", "payload", "title"]
    assert "should match pattern" not in response.content.decode()

    response = Client().post(
        f"/api/threads/{thread.id}/runs",
        json.dumps({"request_id": "a b", "input": {"text": "hi"}, "webhook": "ftp://x"}),
        content_type="application/json",
        headers=bearer(thread.user),
    )
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["message"] == (
        "the request is malformed: request_id: may hold only letters A-Z a-z, digits and . _ : - (and 1 more in details)"
    )
    assert [d["msg"] for d in error["details"]] == [
        "may hold only letters A-Z a-z, digits and . _ : -",
        "must be an http:// or https:// URL: a host, an optional port, no user name",
    ]
    # Errors without a pattern keep pydantic's words, with the field named.
    response = Client().get("/api/threads?limit=0", headers=bearer(thread.user))
    assert response.json()["error"]["message"] == (
        "the request is malformed: limit: Input should be greater than or equal to 1"
    )


def test_every_pattern_the_server_checks_is_explained_in_words_R_READ_6():
    """The kind: a pattern pydantic checks on a request schema has words
    for its 422 (``api_types.explained``); a new one without them fails."""
    import pydantic

    from yuxi_project.api import api
    from yuxi_project.api_types import PATTERN_MEANINGS

    seen = set()

    def walk(model):
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            for meta in field.metadata:
                pattern = getattr(meta, "pattern", None)
                if pattern is not None:
                    assert pattern in PATTERN_MEANINGS, f"{model.__name__}.{name}: pattern without words"
            for inner in _models_in(field.annotation):
                walk(inner)

    def _models_in(annotation):
        if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
            yield annotation
        for arg in getattr(annotation, "__args__", ()) or ():
            yield from _models_in(arg)

    for router in api._routers:
        for path_view in router[1].path_operations.values():
            for operation in path_view.operations:
                for model in operation.models:
                    walk(model)
    assert len(seen) > 10 and PATTERN_MEANINGS


@pytest.mark.parametrize(
    ("title", "status"),
    [
        (" ", 422),
        ("\x85", 422),  # blank to pydantic's and Python's "\\s", not to ECMA's
        ("\ufeff", 422),  # blank to ECMA's "\\s", not to Python's nor pydantic's
        ("\u00a0\u2000\u3000", 422),
        ("\x1c", 200),  # blank to Python's "\\s" only
        ("\u200b", 200),
        (" a ", 200),
        ("\x00", 200),
    ],
)
def test_the_title_pattern_of_the_openapi_document_is_the_servers_rule_R_API_1_R_READ_6(thread, title, status):
    """JSON Schema (ECMA), pydantic (Rust) and Python each read "\\s" their
    own way; the document's pattern names the blank characters instead, so
    that a client and the server agree on every title."""
    import re

    from yuxi_project.api import api

    pattern = api.get_openapi_schema()["components"]["schemas"]["ThreadPatchIn"]["properties"]["title"]["pattern"]
    assert "\\s" not in pattern.lower()
    assert bool(re.search(pattern, title)) is (status == 200)
    response = patch(thread, {"title": title})
    assert response.status_code == status, response.content


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


# --------------------------------------------------------------------------
# GET /api/threads/{thread_id}/runs
# --------------------------------------------------------------------------


def runs_of(thread, *, user=None, **query):
    return Client().get(f"/api/threads/{thread.id}/runs", query, headers=bearer(user or thread.user))


def test_a_threads_runs_newest_first_each_the_run_body_paged_by_cursor_R_API_1(thread):
    made = [tool_turn(thread, prefix=p) for p in "abc"] + [make_run(thread, text="still pending")]
    first = runs_of(thread, limit=3)
    assert first.status_code == 200, first.content
    body = first.json()
    assert [item["run_id"] for item in body["items"]] == [str(r.id) for r in made[::-1][:3]]
    assert body["has_more"] is True and body["next_before"]
    owner = bearer(thread.user)
    for item in body["items"]:
        assert item == Client().get(f"/api/runs/{item['run_id']}", headers=owner).json()
    assert body["items"][0]["status"] == "pending" and body["items"][1]["cost"]["unknown_cost_calls"] == 0
    rest = runs_of(thread, limit=3, before=body["next_before"]).json()
    assert [item["run_id"] for item in rest["items"]] == [str(made[0].id)]
    assert rest["has_more"] is False and rest["next_before"] is None


def test_runs_created_in_the_same_instant_page_without_loss_or_repeat_R_API_1(thread):
    runs = [make_run(thread, text=f"turn {i}") for i in range(5)]
    AgentRun.objects.filter(thread=thread).update(created_at=runs[0].created_at)
    seen, before = [], None
    while True:
        query = {"limit": 2} | ({"before": before} if before else {})
        page = runs_of(thread, **query).json()
        seen += [item["run_id"] for item in page["items"]]
        if not page["has_more"]:
            break
        before = page["next_before"]
    assert seen == sorted((str(r.id) for r in runs), key=uuid.UUID, reverse=True)


def test_a_thread_without_runs_lists_none_R_API_1(thread):
    assert runs_of(thread).json() == {"items": [], "has_more": False, "next_before": None}


def test_another_users_thread_runs_are_404_R_API_1_R_READ_5(thread, other_user):
    tool_turn(thread)
    response = runs_of(thread, user=other_user)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("query", [{"limit": 0}, {"limit": 101}, {"limit": "x"}, {"before": "bm90LWEtY3Vyc29y"}])
def test_thread_runs_refuse_a_bad_limit_or_cursor_R_API_1(thread, query):
    tool_turn(thread)
    response = runs_of(thread, **query)
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_input"


def test_a_page_of_runs_reads_its_costs_in_one_query_R_API_1(thread, django_assert_max_num_queries):
    for p in "abcdef":
        tool_turn(thread, prefix=p)
    headers = bearer(thread.user)
    # Token, thread, page of runs, their costs (and the token's last use).
    with django_assert_max_num_queries(6):
        response = Client().get(f"/api/threads/{thread.id}/runs", {"limit": 6}, headers=headers)
    assert len(response.json()["items"]) == 6


def approvals_asked(thread, n: int) -> list[AgentRun]:
    """``n`` runs of one turn that each stopped for approval of send_email,
    each answered by the next (a resume run with its decisions); the last
    one's approval is pending."""
    runs = []
    d = RunDriver(thread, text="email ops")
    for i in range(n):
        if runs:
            d = RunDriver(thread, run=resume_run_of(runs[-1], decisions=[{"type": "approve"}]))
        d.model(f"lc_run--ask{i}", tool_calls=[{"id": f"call_email_{i}", "name": "send_email", "args": EMAIL_ARGS}])
        runs.append(d.finish("interrupted", interrupts=INTERRUPT))
    return runs


def test_a_page_reads_its_approvals_answers_in_one_query_R_API_1_R_TA_5(user):
    """As many queries for a page with five interrupted runs as with one,
    and each item still the body of ``GET /api/runs/{run_id}``."""
    counts, bodies = [], []
    for n in (1, 5):
        thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:tool_then_answer")
        tool_turn(thread)
        asked = approvals_asked(thread, n)
        assert [r.status for r in asked] == ["interrupted"] * n
        headers = bearer(user)
        with CaptureQueriesContext(connection) as queries:
            response = Client().get(f"/api/threads/{thread.id}/runs", {"limit": 100}, headers=headers)
        assert response.status_code == 200, response.content
        counts.append(len(queries))
        bodies.append(response.json()["items"])
    assert counts[0] == counts[1], counts
    owner = bearer(user)
    for items in bodies:
        for item in items:
            assert item == Client().get(f"/api/runs/{item['run_id']}", headers=owner).json()
    approvals = [item["approval"]["status"] for item in bodies[1] if item["approval"]]
    assert approvals == ["pending"] + ["answered"] * 4
    assert bodies[1][1]["approval"]["resume_run_id"] == bodies[1][0]["run_id"]
    assert bodies[1][1]["approval"]["decisions"] == [{"type": "approve"}]


# --------------------------------------------------------------------------
# GET /api/threads?archived=&q=
# --------------------------------------------------------------------------


def listed(user, **query) -> tuple[list[str], int]:
    body = Client().get("/api/threads", query, headers=bearer(user)).json()
    return [item["title"] for item in body["items"]], body["count"]


@pytest.fixture
def shelf(user, other_user):
    """Four threads of ``user``, oldest first, two of them archived, and one
    of another user whose title matches every search."""
    made = []
    for title, status in (
        ("Trip to Paris", "active"),
        ("paris budget", "archived"),
        ("Groceries", "active"),
        ("100%_done", "archived"),
    ):
        made.append(Conversation.objects.create(user=user, agent_id="assistant", model="m", title=title, status=status))
    Conversation.objects.create(user=other_user, agent_id="assistant", model="m", title="Paris 100%_done")
    return made


def test_threads_filter_by_archived_R_API_1(user, shelf):
    assert listed(user) == (["100%_done", "Groceries", "paris budget", "Trip to Paris"], 4)
    assert listed(user, archived="false") == (["Groceries", "Trip to Paris"], 2)
    assert listed(user, archived="true") == (["100%_done", "paris budget"], 2)


def test_threads_filter_by_title_ignoring_case_with_the_other_filters_and_paging_R_API_1(user, shelf):
    assert listed(user, q="PARIS") == (["paris budget", "Trip to Paris"], 2)
    assert listed(user, q="paris", archived="false") == (["Trip to Paris"], 1)
    assert listed(user, q="paris", limit=1, offset=1) == (["Trip to Paris"], 2)
    # LIKE's wildcards are plain characters here.
    assert listed(user, q="%_") == (["100%_done"], 1)
    assert listed(user, q="0%_d") == (["100%_done"], 1)
    assert listed(user, q="  ") == (["100%_done", "Groceries", "paris budget", "Trip to Paris"], 4)
    assert listed(user, q="nothing like it") == ([], 0)


def test_an_archived_thread_leaves_the_sidebar_and_comes_back_R_API_1(user, shelf):
    patch(shelf[2], {"archived": True})
    assert listed(user, archived="false") == (["Trip to Paris"], 1)
    patch(shelf[2], {"archived": False})
    assert listed(user, archived="false") == (["Groceries", "Trip to Paris"], 2)


@pytest.mark.parametrize("query", [{"archived": "maybe"}, {"q": "x" * 201}, {"limit": 0}, {"offset": -1}])
def test_thread_list_refuses_bad_filters_R_API_1(user, query):
    response = Client().get("/api/threads", query, headers=bearer(user))
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_input"


def test_thread_filters_and_runs_are_typed_in_the_openapi_document_R_API_1():
    from yuxi_project.api import api

    document = api.get_openapi_schema()
    params = {p["name"]: p["schema"] for p in document["paths"]["/api/threads"]["get"]["parameters"]}
    assert params["archived"]["type"] == "boolean" and params["q"]["maxLength"] == 200
    runs = document["paths"]["/api/threads/{thread_id}/runs"]["get"]
    assert runs["operationId"] == "listThreadRuns"
    assert {"200", "401", "404", "422"} <= {str(code) for code in runs["responses"]}
    assert {p["name"] for p in runs["parameters"]} == {"thread_id", "limit", "before"}


# --------------------------------------------------------------------------
# An untitled thread is named after its first turn
# --------------------------------------------------------------------------


def _new_thread(user, **body):
    response = Client().post(
        "/api/threads",
        json.dumps({"agent_id": "assistant", **body}),
        content_type="application/json",
        headers=bearer(user),
    )
    assert response.status_code == 201, response.content
    return Conversation.objects.get(pk=response.json()["thread_id"])


@pytest.mark.parametrize(
    ("text", "title"),
    [
        ("Plan a trip to Paris", "Plan a trip to Paris"),
        ("  one\n\ttwo   three ", "one two three"),
        ("a b c d e f g h i j", "a b c d e f g h…"),
        ("a b c d e f g h \n", "a b c d e f g h"),  # eight words: nothing left out
        ("深度检索的结果是什么？", "深度检索的结果是什么？"),
        ("x" * 300, "x" * 200),
        ("\x00" * 300, "\x00" * 33),  # stored escaped: six characters each
    ],
    ids=["short", "white-space", "long", "eight", "cjk", "one-long-word", "unstorable"],
)
def test_an_api_made_thread_is_named_after_its_first_turn_R_API_1(user, text, title):
    thread = _new_thread(user)
    make_run(thread, text=text)
    thread.refresh_from_db()
    assert thread.title == title
    response = Client().get(f"/api/threads/{thread.id}", headers=bearer(user))
    assert response.json()["title"] == title


def test_a_thread_keeps_its_title_through_later_turns_and_renames_R_API_1(user):
    thread = _new_thread(user)
    make_run(thread, text="first words")
    make_run(thread, text="second turn")
    thread.refresh_from_db()
    assert thread.title == "first words"
    assert patch(thread, {"title": "Renamed"}).status_code == 200
    make_run(thread, text="third turn")
    thread.refresh_from_db()
    assert thread.title == "Renamed"

    titled = _new_thread(user, title="Given")
    make_run(titled, text="anything")
    titled.refresh_from_db()
    assert titled.title == "Given"


def test_a_blank_title_at_creation_is_no_title_and_the_first_turn_names_the_thread_R_API_1(user):
    """POST took "   " as a title that PATCH would refuse, and kept it."""
    thread = _new_thread(user, title=" \u3000\ufeff ")
    assert thread.title == ""
    make_run(thread, text="\ufeff")  # words Python does not call blank, the title rule does
    thread.refresh_from_db()
    assert thread.title == ""
    make_run(thread, text="Where is the nearest station?")
    thread.refresh_from_db()
    assert thread.title == "Where is the nearest station?"


def test_a_refused_turn_leaves_the_thread_untitled_R_API_1(user):
    thread = _new_thread(user)
    first = make_run(thread, text="first")
    Conversation.objects.filter(pk=thread.pk).update(title="")
    response = Client().post(
        f"/api/threads/{thread.id}/runs",
        json.dumps({"request_id": uuid.uuid4().hex, "input": {"text": "refused"}, "multitask_strategy": "reject"}),
        content_type="application/json",
        headers=bearer(user),
    )
    assert response.status_code == 409 and first.status == "pending"
    thread.refresh_from_db()
    assert thread.title == ""
