"""The estimating paginator of the big admin lists (R-ADM-1): no full
``COUNT(*)`` on an unfiltered large table, a bounded count on a filtered
one."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from audit.models import AgentRun
from yuxi_project import paginator as paginator_module
from yuxi_project.paginator import EstimatingPaginator

from .builders import big_run

pytestmark = pytest.mark.django_db


@pytest.fixture
def runs(thread):
    for _ in range(30):
        big_run(thread, rows=1)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE audit_agentrun")  # fills pg_class.reltuples


def test_unfiltered_large_table_uses_the_planner_estimate_R_ADM_1(runs, monkeypatch):
    monkeypatch.setattr(paginator_module, "ESTIMATE_ABOVE", 10)
    with CaptureQueriesContext(connection) as queries:
        count = EstimatingPaginator(AgentRun.objects.order_by("-created_at"), 10).count
    assert count == 30
    assert not any("COUNT(" in q["sql"].upper() for q in queries.captured_queries)
    assert any("reltuples" in q["sql"] for q in queries.captured_queries)


def test_small_table_and_filtered_lists_count_with_a_bound_R_ADM_1(runs, monkeypatch):
    assert EstimatingPaginator(AgentRun.objects.order_by("-created_at"), 10).count == 30  # below the threshold
    monkeypatch.setattr(EstimatingPaginator, "BOUNDED_COUNT", 7)
    with CaptureQueriesContext(connection) as queries:
        count = EstimatingPaginator(AgentRun.objects.filter(status="completed").order_by("-created_at"), 5).count
    assert count == 7
    (sql,) = [q["sql"] for q in queries.captured_queries]
    assert "LIMIT 7" in sql
