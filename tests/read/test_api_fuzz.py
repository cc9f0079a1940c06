"""Property-based fuzzing of the JSON API from its own OpenAPI schema with
schemathesis (R-READ-6): whatever an authenticated client sends, the API
answers no 5xx, only documented status codes and content types, and bodies
that match the schema. Runs in-process on the WSGI app against the test
database; a small example budget keeps it to about a minute."""

from __future__ import annotations

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import bearer

from .builders import tool_turn

schema = schemathesis.openapi.from_wsgi("/api/openapi.json", get_wsgi_application())

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture
def fuzz_headers(thread):
    # A thread with a finished run, so that list endpoints return real rows.
    tool_turn(thread)
    return bearer(thread.user)


@pytest.mark.django_db(transaction=True)
@schema.parametrize()
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_api_answers_documented_responses_only_R_READ_6(case, fuzz_headers):
    case.call_and_validate(headers={**(case.headers or {}), **fuzz_headers}, checks=CHECKS)
