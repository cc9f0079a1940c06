"""The OpenAPI document types requests as tightly as the server checks them
(R-READ-6, issue 37): each input the server refused while the schema
allowed it, and each answer the schema did not name, is a case here.
``test_api_positive.py`` generates requests from the whole document."""

from __future__ import annotations

import re
import zoneinfo
from typing import get_args

import pytest
from django.test import Client

from audit import catalogue
from audit.models import AgentRun
from audit.schemas import RunStatus
from yuxi_project.api import api

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def document() -> dict:
    return api.get_openapi_schema()


def parameter(document, method: str, path: str, name: str) -> dict:
    found = [p for p in document["paths"][path][method].get("parameters", []) if p["name"] == name]
    assert found, f"{method} {path} has no parameter {name}"
    return found[0]


def string_branch(schema: dict) -> dict:
    return next(branch for branch in schema.get("anyOf", [schema]) if branch.get("type") == "string")


def matches(pattern: str, value: str) -> bool:
    return re.search(pattern, value) is not None


def test_operation_ids_are_the_calls_names_without_python_modules(document):
    ids = [op["operationId"] for ops in document["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    assert {"listRuns", "createThread", "runEvents", "dashboardCosts"} <= set(ids)
    assert all(re.fullmatch(r"[a-z]+(?:[A-Z][a-z]*)*", op_id) for op_id in ids), ids


def test_last_event_id_is_digits(document):
    schema = parameter(document, "get", "/api/runs/{run_id}/events", "Last-Event-ID")["schema"]
    assert matches(schema["pattern"], "42")
    assert not any(matches(schema["pattern"], bad) for bad in ("", "-1", "x", "²", "1" * 19))


def test_run_status_filter_names_only_statuses(document):
    assert set(get_args(RunStatus)) == set(AgentRun.Status.values)
    for path in ("/api/audit/runs", "/api/audit/runs/export"):
        pattern = string_branch(parameter(document, "get", path, "status")["schema"])["pattern"]
        assert matches(pattern, "failed") and matches(pattern, "failed,cancelled")
        assert not any(matches(pattern, bad) for bad in ("bogus", "failed,", "failed,bogus", "0" * 200))


def test_min_cost_is_a_decimal_string(document):
    pattern = string_branch(parameter(document, "get", "/api/audit/runs", "min_cost_usd")["schema"])["pattern"]
    assert matches(pattern, "0.05") and matches(pattern, "12")
    assert not any(matches(pattern, bad) for bad in ("", "-1", "1e3", "abc", "0.0000000001"))


def test_times_and_days_are_bounded_as_the_server_bounds_them(document):
    time = string_branch(parameter(document, "get", "/api/audit/runs", "from")["schema"])
    assert matches(time["pattern"], "2026-12-06T13:10:08Z")
    assert not matches(time["pattern"], "0001-01-01T00:00:00+01:00")
    assert not matches(time["pattern"], "9999-12-31T23:00:00-02:00")
    day = string_branch(parameter(document, "get", "/api/dashboard/overview", "from")["schema"])
    assert matches(day["pattern"], "2026-12-06") and matches(day["pattern"], "9000-12-31")
    assert not matches(day["pattern"], "1969-12-31") and not matches(day["pattern"], "9001-01-01")


def test_the_366_day_window_and_the_time_order_are_described(document):
    assert "366 days" in parameter(document, "get", "/api/dashboard/overview", "from")["description"]
    assert "after `from`" in parameter(document, "get", "/api/audit/runs", "to")["description"]


def test_time_zones_and_ratings_are_enums(document):
    zones = parameter(document, "get", "/api/dashboard/models", "tz")["schema"]["enum"]
    assert set(zones) == zoneinfo.available_timezones() and "Asia/Shanghai" in zones
    rating = string_branch(parameter(document, "get", "/api/dashboard/feedback", "rating")["schema"])
    assert set(rating["enum"]) == {"like", "dislike"}


def test_a_new_threads_agent_and_model_are_enums(document):
    thread_in = document["components"]["schemas"]["ThreadIn"]["properties"]
    assert thread_in["agent_id"]["enum"] == list(catalogue.AGENTS)
    assert string_branch(thread_in["model"])["enum"] == catalogue.available_models()


def test_a_turns_text_must_hold_more_than_white_space(document):
    text = document["components"]["schemas"]["TurnInput"]["properties"]["text"]
    assert matches(text["pattern"], " hi ") and not matches(text["pattern"], " \n\t")


def test_free_text_in_a_query_string_has_no_nul(document):
    for name in ("q", "tool", "user"):
        pattern = string_branch(parameter(document, "get", "/api/audit/runs", name)["schema"])["pattern"]
        assert matches(pattern, "深度检索 calculator") and not matches(pattern, "a\x00b")


def test_every_post_names_the_csrf_403_and_the_document_names_the_405(document):
    posts = [(path, ops["post"]) for path, ops in document["paths"].items() if "post" in ops]
    assert posts
    for path, op in posts:
        assert "403" in {str(code) for code in op["responses"]}, path
    assert "method_not_allowed" in document["info"]["description"]
    assert "csrf_failed" in document["info"]["description"]


def test_a_session_post_without_its_csrf_token_gets_the_documented_403(user):
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    response = client.post("/api/threads", {"agent_id": "assistant"}, content_type="application/json")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "csrf_failed"


def test_the_dashboard_refuses_a_rating_outside_its_enum(staff_user):
    client = Client()
    client.force_login(staff_user)
    response = client.get("/api/dashboard/feedback", {"rating": ""})
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_input"
