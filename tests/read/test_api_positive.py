"""Whatever the OpenAPI schema calls a valid request, the server accepts
(R-READ-6): the schema is no looser than the server's own checks, so a
client generated from it never sends a request the server refuses as
malformed. Generated from the schema with schemathesis, in positive mode
only; a request may still find nothing (404), be refused by state (409) or
by a budget (402), never be called malformed (422)."""

from __future__ import annotations

import datetime as dt

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from hypothesis import HealthCheck, settings
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from .builders import caller_headers

schema = schemathesis.openapi.from_wsgi("/api/openapi.json", get_wsgi_application())
schema.config.generation.update(modes=[GenerationMode.POSITIVE])
schema.config.checks.positive_data_acceptance.expected_statuses = ["2xx", "401", "402", "403", "404", "409"]


def breaks_the_window_rule(query: dict) -> bool:
    """Whether a dashboard query breaks the rule JSON Schema cannot state
    (its ``from``/``to`` descriptions): ``from`` after ``to``, or more than
    366 days, after the defaults (``to``: today or ``from``; ``from``: 29
    days before ``to``) are applied."""
    today = dt.datetime.now(dt.UTC).date()  # never more than a day off in the zone asked: a margin below
    first = dt.date.fromisoformat(query["from"]) if "from" in query else None
    last = dt.date.fromisoformat(query["to"]) if "to" in query else None
    last = last or (today if first is None else max(today, first))
    first = first or last - dt.timedelta(days=29)
    return first > last or (last - first).days >= 365


def breaks_the_time_order(query: dict) -> bool:
    """Whether a run filter's ``from`` is after its ``to`` (naive = UTC)."""
    if "from" not in query or "to" not in query:
        return False
    first, last = (dt.datetime.fromisoformat(query[name]) for name in ("from", "to"))
    first, last = (t if t.tzinfo else t.replace(tzinfo=dt.UTC) for t in (first, last))
    return first > last


@pytest.mark.django_db(transaction=True)
@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_every_request_the_schema_calls_valid_is_accepted_R_READ_6(case, api_world):
    params = case.path_parameters or {}
    if params:
        case.path_parameters = {name: api_world["ids"].get(name, value) for name, value in params.items()}
    query = case.query or {}
    # A cursor's shape is in the schema; its content is only what the server
    # issued (`next_before`): a made-up one is refused, rightly.
    query.pop("before", None)
    if case.path.startswith("/api/dashboard/") and breaks_the_window_rule(query):
        return
    if case.path.startswith("/api/audit/runs") and breaks_the_time_order(query):
        return
    case.call_and_validate(headers=caller_headers(case, api_world), checks=[positive_data_acceptance])
